"""A conversation's state, apart from how a template renders it: its messages, the
digests that name what it said, its marks (the points a resent conversation or after_mark
resumes at), where a turn's messages pick up an agent's context, and the checks on what
they say."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

from agentkv.errors import InvalidArgument, MarkNotFound, TurnsFollow
from inference_worker.tools import ToolCall


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant message's
    tool_call_id: str = ""  # a tool message's: the call it answers

    def words(self) -> str:
        """What identifies the message in a conversation's digest."""
        if not (self.tool_calls or self.tool_call_id):
            return f"{self.role}\0{self.content}"
        calls = "".join(f"\0{c.key()}" for c in self.tool_calls)
        content = self.content.strip() if self.tool_calls else self.content
        return f"{self.role}\0{content}\0{self.tool_call_id}{calls}"

    def template(self) -> dict:
        """The message as chat templates read it."""
        out: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.template() for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass(frozen=True, slots=True)
class Mark:
    """A point in an agent's conversation that a resent conversation can resume from: after
    the messages whose chain digest is `digest` (client/core.py's replies included, by the
    text the worker sent), at token `end`, the last message being `last_role`'s, and the first
    `cached` tokens in the cache (a reply's last token is not, until the next turn)."""

    digest: str
    end: int
    cached: int
    last_role: str
    reply_open: bool
    name: str = ""  # what its turn's caller named it (TurnRequest.mark_name), if anything
    calls: tuple[str, ...] = ()  # the ids of the tool calls its reply made, in order


MAX_MARKS = 64  # an agent keeps its last this many marks (one a turn): one metadata value


@dataclass(slots=True)
class ChatState:
    """Where an agent's conversation stands, besides its tokens."""

    system: str = ""  # its system prompt, kept until the first turn renders it whole
    opened: bool = True  # the first turn has rendered the conversation whole
    last_role: str = "assistant"  # of the last message in the context
    reply_open: bool = False  # the last tokens are a generated reply not yet closed
    digest: str = ""  # chain digest of every message so far, the system prompt first
    marks: tuple[Mark, ...] = ()  # where each turn ended, oldest first
    applied: str = ""  # request_id of the last turn or injection taken (a retry of it)
    tools: str = ""  # the conversation's tools (tools.canonical_tools), rendered in each part

    def marked(
        self, end: int, cached: int, name: str = "", calls: tuple[str, ...] = ()
    ) -> ChatState:
        """This state with a mark here, at token `end` (`cached` of them in the cache),
        after a reply that made `calls`."""
        mark = Mark(self.digest, end, cached, self.last_role, self.reply_open, name, calls)
        kept = tuple(m for m in self.marks if m.end < end)[-(MAX_MARKS - 1) :]
        return replace(self, marks=(*kept, mark))


def chain(digest: str, messages: Sequence[ChatMessage]) -> str:
    """The digest of a conversation `messages` longer than the one whose digest is `digest`."""
    for m in messages:
        h = hashlib.blake2b(f"{digest}\0{m.words()}".encode(), digest_size=12)
        digest = h.hexdigest()
    return digest


def tools_digest(tools: str) -> str:
    """Where a conversation's digest starts: its tools' (none: "")."""
    return chain("", [ChatMessage("tools", tools)]) if tools else ""


def start_digest(system: str, tools: str = "") -> str:
    seed = tools_digest(tools)
    return chain(seed, [ChatMessage("system", system)]) if system else seed


@dataclass(slots=True)
class Resumed:
    """Where a resent conversation picks up: the context and state to extend, the messages
    still to render, and how many cached tokens the turn may keep (`cached`, or None: those
    of a new agent's stable prefix)."""

    tokens: list[int]
    state: ChatState
    messages: list[ChatMessage]
    cached: int | None
    # Started over: the stable prefix's tokens, which the cache keeps whole or the turn
    # prefills as a turn of their own, as a new agent's are made (context._resumed).
    prefix: int = 0


def resume(
    tokens: Sequence[int], state: ChatState, messages: Sequence[ChatMessage], tools: str = ""
) -> Resumed:
    """Where a whole conversation, resent (its system prompt first, if any) with its `tools`,
    picks up this agent's: its tokens and state at the latest mark whose messages begin
    `messages`, and the messages after them. Without one (the conversation was edited before
    any mark, or has another system prompt or tools), it starts over, rendered whole as a
    new agent's first turn.
    The turn keeps only the cache a fresh agent told this conversation turn by turn would
    hold there, so that it answers exactly as that agent does: Q4 KV of tokens from an
    earlier turn is not bit for bit what a turn computes for its own."""
    if messages and messages[0].role == "system" and not messages[0].content:
        messages = messages[1:]  # no system prompt, as the agent was made: its marks chain none
    at: dict[str, int] = {}
    digest = tools_digest(tools)
    for i, message in enumerate(messages):
        digest = chain(digest, [message])
        at[digest] = i + 1
    for n, mark in enumerate(reversed(state.marks)):
        i = at.get(mark.digest)
        if i is not None and mark.end <= len(tokens):
            return _resumed_at(tokens, state, n, tools, messages[i:])
    system = messages[0].content if messages and messages[0].role == "system" else ""
    rest = list(messages[1:]) if messages and messages[0].role == "system" else list(messages)
    state = ChatState(system, opened=False, digest=start_digest(system, tools), tools=tools)
    return Resumed([], state, rest, None)


def continued(
    tokens: Sequence[int],
    state: ChatState,
    key: str,
    messages: Sequence[ChatMessage],
    last_only: bool = False,
    agent_id: str = "",
) -> Resumed:
    """Where `messages` pick up this agent's conversation when they follow its mark `key`
    (a turn's Usage.mark, or the name its turn gave it), not its end: its tokens and state
    there (the turns after it are dropped, as an edited resent conversation drops them).
    MarkNotFound when the agent keeps no such mark; TurnsFollow, with `last_only`, when
    turns follow it."""
    for n, mark in enumerate(reversed(state.marks)):
        if key not in (mark.digest, mark.name or None) or mark.end > len(tokens):
            continue
        if n and last_only:
            raise TurnsFollow(
                f"{n} turn(s) of agent {agent_id!r} follow the point {key!r}: continuing "
                "from it would drop them (fork the agent to branch there)"
            )
        return _resumed_at(tokens, state, n, state.tools, _answering(mark, messages))
    raise MarkNotFound(
        f"agent {agent_id!r} has no point {key!r} in its conversation: a later turn went "
        f"on from before it, or it is older than the agent's last {MAX_MARKS} turns"
    )


def _answering(mark: Mark, messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """The messages, their opening tool results put in the order of the calls the reply at
    `mark` made (templates pair results with calls by place); INVALID_ARGUMENT for results
    of other calls, or calls left unanswered. A mark that kept no calls takes them as given."""
    if not mark.calls:
        return list(messages)
    n = next((i for i, m in enumerate(messages) if m.role != "tool"), len(messages))
    answered = [m.tool_call_id for m in messages[:n]]
    if sorted(answered) != sorted(mark.calls):
        raise InvalidArgument(
            f"the reply at that point made the tool calls {list(mark.calls)}: tool results "
            f"answer each once, before any other message (these answer {answered[:16]})"
        )
    place = {call_id: i for i, call_id in enumerate(mark.calls)}
    return sorted(messages[:n], key=lambda m: place[m.tool_call_id]) + list(messages[n:])


def _resumed_at(
    tokens: Sequence[int], state: ChatState, n: int, tools: str, messages: Sequence[ChatMessage]
) -> Resumed:
    """The agent's conversation at its `n`th mark from the last (0: the last), with the
    `messages` that follow it there still to render."""
    kept = state.marks[: len(state.marks) - n]
    mark = kept[-1]
    resumed = ChatState(
        last_role=mark.last_role,
        reply_open=mark.reply_open,
        digest=mark.digest,
        marks=kept,
        tools=tools,
    )
    return Resumed(list(tokens[: mark.end]), resumed, list(messages), mark.cached)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def check_said(messages: Sequence[ChatMessage]) -> None:
    """Refuses an empty message among those a turn or injection adds to a context (an empty
    `say` is a caller's slip). A resent whole conversation may hold one, as OpenAI's API
    allows: an empty reply, cut at once by a stop string, comes back in the history."""
    for i, m in enumerate(messages):
        if not m.content.strip() and not m.tool_calls and m.role != "tool":
            raise InvalidArgument(f"message {i} ({m.role}) is empty")
