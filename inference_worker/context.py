"""A turn's new context: where it starts in its agent's (after the agent's last token, at
a mark, or where a resent whole conversation first differs), and the tokens and chat
state once its messages are rendered there. Computed without changing the agent."""

from __future__ import annotations

from dataclasses import replace

from agentkv.errors import InvalidArgument, TurnsFollow
from inference_worker.agents import SYSTEM_KEY, Agent, system_digest
from inference_worker.chat import ChatFormat, NotAppendOnly
from inference_worker.conversation import ChatMessage, ChatState, Resumed, continued, resume
from inference_worker.metadata import caller_metadata, check_metadata
from inference_worker.turns import TurnJob


def extended(
    chat: ChatFormat, job: TurnJob, agent: Agent, again: bool
) -> tuple[Resumed, list[int], ChatState]:
    """Where the turn starts, and the context and state after its messages. `again`: a
    retry of the call the agent took last; appended to the context, its messages are not
    added twice; after a mark, it is not refused for the turns that follow it (its own).
    A resent conversation that
    the template cannot append to from the mark it resumes at (Qwen merges tool results
    that follow one another) starts over; one with new tools must leave room for them in
    the agent's metadata."""
    reply = job.sampling.max_tokens > 0

    def extend(start: Resumed) -> tuple[Resumed, list[int], ChatState]:
        return start, *chat.extend(start.tokens, start.state, start.messages, reply)

    if job.after_mark:  # they follow that point of it (a retry: the same, again)
        _check_own_tools(agent, job.tools)
        last = job.after_mark_last and not again
        at = job.after_mark, job.messages, last, agent.agent_id
        return extend(continued(agent.tokens, agent.chat, *at))
    if not job.whole_conversation:  # they follow the context, all of whose cache it keeps
        _check_own_tools(agent, job.tools)
        return extend(Resumed(agent.tokens, agent.chat, [] if again else job.messages, None))
    if job.tools != agent.chat.tools:
        check_metadata(caller_metadata(agent.metadata), "", job.tools)
    start = _resumed(chat, agent, job.messages, job.tools, agent.chat)
    _check_named_kept(job, agent, start, again)
    try:
        return extend(start)
    except NotAppendOnly:
        if not start.tokens:
            raise
    # Not checked: a conversation the template cannot append to from its point starts over
    # wherever it goes (a branch would as well), so it drops its points here, as it did.
    return extend(_resumed(chat, agent, job.messages, job.tools, replace(agent.chat, marks=())))


def _check_named_kept(job: TurnJob, agent: Agent, start: Resumed, again: bool) -> None:
    """With keep_named_marks, refuses (TurnsFollow) a resent conversation that would drop a
    mark an earlier turn named, resuming before it or starting over: its caller branches."""
    if not job.keep_named_marks or again:
        return
    kept = {m.name for m in start.state.marks}
    dropped = [m.name for m in agent.chat.marks if m.name not in kept | {"", job.mark_name}]
    if dropped:
        raise TurnsFollow(
            f"{len(dropped)} named point(s) of agent {agent.agent_id!r}, the last "
            f"{dropped[-1]!r}, follow where this conversation leaves it (after its first "
            f"{len(job.messages) - len(start.messages)} messages): resending it would drop "
            "them (fork the agent to branch there)",
            resumed_at=len(job.messages) - len(start.messages),
        )


def _resumed(
    chat: ChatFormat, agent: Agent, messages: list[ChatMessage], tools: str, state: ChatState
) -> Resumed:
    """Where a resent whole conversation picks up the agent's (conversation.resume from `state`),
    with the cache a turn starting over may keep: a new agent's stable prefix, none of
    it when the agent was made with another system prompt or other tools."""
    start = resume(agent.tokens, state, messages, tools)
    if start.cached is None:
        system, made = start.state.system, system_digest(start.state.system, tools)
        same = agent.metadata.get(SYSTEM_KEY, made) == made
        start.prefix = len(chat.start(system, tools)[0])
        start.cached = start.prefix if same else 0
    return start


def _check_own_tools(agent: Agent, tools: str) -> None:
    """Refuses a turn that appends to the agent's context with other tools than its own."""
    if tools and tools != agent.chat.tools:
        raise InvalidArgument(
            f"agent {agent.agent_id!r} has {'other' if agent.chat.tools else 'no'} tools: a "
            "turn adding to its context names its own or none; send the whole conversation "
            "(whole_conversation) to change them"
        )
