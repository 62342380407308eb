"""Turns on agents as the gateway starts them: a call's agent made when it does not exist yet,
a spare agent for a call without identity whose agent is busy (deleted once its turn ends),
a branch of an agent for a response continued from a point that later turns follow, and a
refusal (501) of a call that the agent's worker predates."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from agentkv.client.aio import AsyncAgent, AsyncAgentMemory, AsyncReply
from agentkv.errors import (
    AgentBusy,
    AgentExists,
    AgentKVError,
    AgentLost,
    AgentNotFound,
    BucketUnreachable,
    FailedPrecondition,
    FingerprintMismatch,
    InvalidArgument,
    MarkNotFound,
    OutOfRange,
    TurnsFollow,
    Unavailable,
)
from agentkv.gateway import responses
from agentkv.gateway.config import INFO_TIMEOUT
from agentkv.gateway.errors import HTTPError
from agentkv.gateway.protocol import ChatCall
from agentkv.worker.v1 import worker_pb2 as pb

log = logging.getLogger("agentkv.gateway")
T = TypeVar("T")
INFO_REQUEST = pb.GetWorkerInfoRequest()

MAX_BRANCH_DEPTH = 3  # branches of branches a resent conversation goes down (_resent_elsewhere)
# Seconds between tries to delete a spare agent: a turn that was cancelled ends at its
# worker's next step, and the agent cannot be deleted before.
SPARE_DELETE_DELAYS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0)


@dataclass(slots=True)
class Turn:
    """A turn under way: its reply (from its first token) and what making its agent took
    (its CreateAgent usage; None when it existed)."""

    reply: AsyncReply
    created: Any = None


def say_options(call: ChatCall) -> dict[str, Any]:
    """The SDK's say() options for `call`: the whole conversation with its tools, or what
    follows a previous response's point; sampling; tool choice; the reply's form."""
    options = {"whole_conversation": call.after is None, "tools": call.tools, **call.sampling}
    options["max_tool_calls"] = call.max_tool_calls
    options["tool_call_required"] = call.tool_call_required
    options["tool_call_name"] = call.tool_call_name
    options["tool_call_forbidden"] = call.tool_call_forbidden
    options["tool_call_allowed"] = call.tool_call_allowed
    options["mark_name"] = call.mark_name
    options["after_mark"] = call.after[1] if call.after else ""
    # A resent input that would drop a point a Responses id names goes to a branch instead.
    options["keep_named_marks"] = call.after is None
    if call.output_format is not None:
        options["output_format"] = pb.OutputFormat(**call.output_format)
    return options


async def check_features(memory: AsyncAgentMemory, agent_id: str, call: ChatCall) -> None:
    """Refuses (501) a call that the agent's worker, from before a field the call needs
    (during a rolling upgrade), would misread: it would drop previous_response_id's
    after_mark and add the input at the agent's end, or allowed_tools' tool_call_allowed
    and let every tool be called."""
    needs = {"after_mark": ("previous_response_id", "previous_response_id")} if call.after else {}
    if call.tool_call_allowed:
        needs["tool_call_allowed"] = ("tool_choice", "tool_choice allowed_tools")
    if not needs:
        return

    async def ask(worker: Any) -> Any:
        """A worker that does not answer in time is one that cannot be reached: the route
        marks it down and asks the next (which the turn then goes to), as for a dead one."""
        try:
            call = worker.call("GetWorkerInfo", INFO_REQUEST)
            return await asyncio.wait_for(call, INFO_TIMEOUT)
        except TimeoutError:
            message = f"agent {agent_id!r}'s worker did not answer within {INFO_TIMEOUT:g} s"
            raise Unavailable(message) from None

    info = await memory.route(agent_id, ask)
    for feature, (param, what) in needs.items():
        if feature not in info.features:
            message = f"agent {agent_id!r}'s worker predates {what}: upgrade it"
            raise HTTPError(501, message, "server_error", param, "not_implemented")


async def delete_refused(agent: AsyncAgent) -> None:
    """Deletes an agent made for a call whose turn was refused, once: one that another
    call's turn holds meanwhile (the same conversation, sent again) is kept."""
    try:
        await agent.delete()
    except AgentKVError as exc:
        log.info(
            "an agent a refused call made was kept", extra={"agent": agent.id, "error": str(exc)}
        )


async def delete_spare(agent: AsyncAgent, creating: asyncio.Future | None) -> None:
    """Deletes a spare agent once its creation (`creating`, when under way: a stop's
    deletion would reach the worker before the agent) and its turn have ended there."""
    if creating is not None:
        await asyncio.wait({creating})
    for delay in SPARE_DELETE_DELAYS:
        await asyncio.sleep(delay)
        try:
            await agent.delete()
            return
        except FailedPrecondition:  # its turn, cancelled, has not ended yet
            continue
        except AgentKVError as exc:
            log.warning(
                "a spare agent was not deleted", extra={"agent": agent.id, "error": str(exc)}
            )
            return
    log.warning("a spare agent's turn did not end", extra={"agent": agent.id})


class Turns:
    """The turns the gateway starts, and the spare agents made for them: each spare is
    deleted once its turn ends, or at the gateway's stop. `model_key` names the workers'
    model (what tells its anonymous agents from another model's); `timeout`: how long a
    turn waits for its agent's turn under way to end."""

    def __init__(self, model_key: Callable[[], Awaitable[str]], timeout: float) -> None:
        self.model_key, self.timeout = model_key, timeout
        # Spare agents are made for one turn alone: nothing reaches them once it ends.
        self.spares: set[AsyncAgent] = set()  # made, their deletion not yet begun
        self.deletions: set[asyncio.Task] = set()  # of spare agents, under way
        # CreateAgent calls under way: a spare's deletion waits for its creation to end.
        self.creations: dict[AsyncAgent, asyncio.Future] = {}

    async def stop(self, seconds: float) -> list[str]:
        """Deletes every spare agent left, each once its creation and turn have ended, for
        at most `seconds`; returns the agents whose deletion had not ended then (a hung
        worker held the stop until each call's deadline: minutes)."""
        for agent in list(self.spares):
            self.ended(agent)
        if not self.deletions:
            return []
        _, left = await asyncio.wait(set(self.deletions), timeout=seconds)
        for deletion in left:
            deletion.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        return sorted(deletion.get_name() for deletion in left)

    async def start(
        self, memory: AsyncAgentMemory, agent_id: str, call: ChatCall, anonymous: bool
    ) -> Turn:
        """The turn, once its reply's first token is in. A call without identity whose
        agent is busy (the same conversation sent twice at once, or resent while its
        stopped turn ends) gets a spare agent, deleted once its turn ends."""
        agent = AsyncAgent(memory, agent_id)
        while True:
            try:
                return await self._say(agent, call)
            except FingerprintMismatch:  # another model's gateway made it, on the same store
                if not anonymous or agent.id != agent_id:
                    raise
                agent = AsyncAgent(memory, f"{agent_id}-{await self.model_key()}")
                continue
            except TurnsFollow as exc:  # it would drop points that responses' ids name
                return await self._resent_elsewhere(agent, call, exc.resumed_at)
            except FailedPrecondition as exc:
                if not anonymous or "in progress" not in exc.message:
                    raise
            agent = AsyncAgent(memory, f"{agent_id}-{uuid.uuid4().hex[:8]}")
            self.spares.add(agent)  # before it exists: a stop meanwhile deletes it too

    async def continued(self, memory: AsyncAgentMemory, call: ChatCall) -> Turn:
        """The turn of a call that continues a response (previous_response_id): its new
        messages after the point the response's reply ended at, on its agent, or, when
        later turns follow that point there, on a fork of it (both branches stay). The fork
        is a spare until its response's id goes out (the gateway's reply, whole or streamed)."""
        agent_id = call.after[0] if call.after else ""
        agent, options = AsyncAgent(memory, agent_id), say_options(call)
        previous = call.echo.get("previous_response_id") or ""
        try:
            await check_features(memory, agent_id, call)
            try:
                say = functools.partial(agent.say, call.messages, **options, after_mark_last=True)
                return Turn(await self._when_idle(say))
            except TurnsFollow:
                return await self._branched(agent, call, options)
        except (AgentNotFound, MarkNotFound, AgentLost) as exc:  # the last: lost there
            raise responses.not_found(previous, exc.message) from None

    async def _branched(self, agent: AsyncAgent, call: ChatCall, options: dict) -> Turn:
        """The turn on a fork of `agent`, which keeps the turns the call would drop. The
        fork is a spare until its response's id goes out (or, for a chat call, to the end)."""
        memory = agent.memory
        branch = AsyncAgent(memory, f"{agent.id[:100]}-b{uuid.uuid4().hex[:8]}")
        self.spares.add(branch)  # before it exists: deleted unless its id goes out
        try:
            await check_features(memory, branch.id, call)  # it may live on another worker
            await self._when_idle(lambda: to_the_end(agent.fork(branch.id)))
            # The branch's copies of the points are named by no id: it may drop them.
            return Turn(await branch.say(call.messages, **{**options, "keep_named_marks": False}))
        except BaseException:  # a branch that never took its turn is not kept
            self.ended(branch)
            raise

    async def _resent_elsewhere(
        self, agent: AsyncAgent, call: ChatCall, resumed_at: int, depth: int = 0
    ) -> Turn:
        """The turn of a resent conversation that would drop points of `agent` that
        responses' ids name (another conversation that opens alike went on there, or this
        one was edited or its call sent twice), on a branch that keeps them. Where the call
        holds a reply past the point it leaves the agent at, the branch is named by the
        messages through that reply (at `depth`, through the depth+1th), so that the
        conversation's next calls, resent whole, find it again and read their past from its
        cache; else the call gets a branch of its own (a spare until its response's id goes
        out). A branch found is held to its own points as the agent was (conversations
        alike through that reply, then apart), down to MAX_BRANCH_DEPTH branches."""
        messages = call.messages
        replies = [
            i for i in range(resumed_at, len(messages)) if messages[i]["role"] == "assistant"
        ]
        if len(replies) <= depth or depth >= MAX_BRANCH_DEPTH:
            return await self._branched(agent, call, say_options(call))
        branch = AsyncAgent(agent.memory, branch_id(agent.id, call, replies[depth]))
        await check_features(agent.memory, branch.id, call)
        try:
            return Turn(await self._say_on(branch, call, keep=True))
        except AgentNotFound:
            pass
        except AgentLost as exc:  # lost in the store: forked anew, as _say makes an agent anew
            log.warning(
                "branch lost in the store: forked anew from its agent",
                extra={"agent": branch.id, "error": exc.message},
            )
            await branch.delete()
        except TurnsFollow as exc:  # points of the branch's own that ids name: a branch of it
            return await self._resent_elsewhere(branch, call, exc.resumed_at, depth + 1)
        for again in (False, True):
            made = await self._fork_branch(agent, branch)
            try:  # made here: its copies of the agent's points are named by no id: it drops them
                return Turn(await self._say_on(branch, call, keep=not made))
            except AgentNotFound:  # another call's fork, deleted as its first turn never ran
                if made or again:
                    raise
            except TurnsFollow as exc:
                return await self._resent_elsewhere(branch, call, exc.resumed_at, depth + 1)
            except BaseException:
                if made:  # a fork whose first turn never ran is no conversation's: not kept
                    self._deleting(delete_refused(branch), branch.id)
                raise
        raise AssertionError("unreachable: the second try returns or raises")

    async def _fork_branch(self, agent: AsyncAgent, branch: AsyncAgent) -> bool:
        """Forks `branch` off `agent`; whether this call made it (not: another call of a
        conversation alike made it meanwhile). Its worker makes it even once the call is
        cancelled (its client gone): it is then deleted, made for no one."""
        forked: list[bool] = []

        async def fork() -> None:
            await agent.fork(branch.id)
            forked.append(True)

        try:
            await self._when_idle(lambda: to_the_end(fork()))
        except AgentExists:
            return False
        except BaseException:
            if forked:
                self._deleting(delete_refused(branch), branch.id)
            raise
        return True

    async def _say_on(self, branch: AsyncAgent, call: ChatCall, keep: bool) -> AsyncReply:
        options = {**say_options(call), "keep_named_marks": keep}
        return await self._when_idle(functools.partial(branch.say, call.messages, **options))

    async def _when_idle(self, step: Callable[[], Awaitable[T]]) -> T:
        """`step` on an agent, once the agent's turn under way has ended (another call
        continuing the same response, or one before it): it is tried again until then,
        within the gateway's --timeout."""
        deadline, delay = time.monotonic() + self.timeout, 0.02
        while True:
            try:
                return await step()
            except AgentBusy:
                if time.monotonic() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _say(self, agent: AsyncAgent, call: ChatCall) -> Turn:
        """The agent's turn, made first when it does not exist (a spare never does), or
        when the store cannot tell, its object store being down: the call brings the whole
        conversation, and the worker's CreateAgent takes that answer for "not known here".
        An agent the store lost (its manifest unreadable) is deleted and made anew."""
        memory = agent.memory
        options = say_options(call)
        try:
            await check_features(memory, agent.id, call)
        except BaseException:
            self.spares.discard(agent)  # a spare not made yet: nothing to delete, ever
            raise
        if agent not in self.spares:
            try:
                return Turn(await agent.say(call.messages, **options))
            except (AgentNotFound, BucketUnreachable):
                pass
            except AgentLost as exc:  # lost in the store: made anew, from the whole call
                log.warning(
                    "agent lost in the store: made anew from the call's conversation",
                    extra={"agent": agent.id, "error": exc.message},
                )
                await agent.delete()
        request = pb.CreateAgentRequest(
            namespace=memory.namespace,
            agent_id=agent.id,
            system_prompt=call.system,
            tools=call.tools,
        )
        created, made = None, False
        creating = asyncio.ensure_future(
            memory.route(agent.id, lambda w: w.call("CreateAgent", request))
        )
        self.creations[agent] = creating
        creating.add_done_callback(lambda _: self.creations.pop(agent, None))
        try:
            with contextlib.suppress(AgentExists):  # made meanwhile, or with another system
                # Its worker makes it even once cancelled: a spare is deleted after that.
                created = (await to_the_end(creating)).usage  # the turn resumes from it
                made = True
            return Turn(await agent.say(call.messages, **options), created)
        except (InvalidArgument, OutOfRange):  # the turn refused, before it changed anything
            if made and agent not in self.spares:  # made for this call alone
                self._deleting(delete_refused(agent), agent.id)
            self.ended(agent)
            raise
        except BaseException:
            self.ended(agent)
            raise

    def named(self, call: ChatCall, agent: AsyncAgent) -> None:
        """The reply's id goes out: a Responses id names its agent, so a spare (or a branch)
        is kept from now on, to be continued."""
        if call.mark_name:
            self.spares.discard(agent)

    def ended(self, agent: AsyncAgent) -> None:
        """After the agent's turn ended or was closed: a spare agent is deleted, once."""
        if agent in self.spares:
            self.spares.remove(agent)
            self._deleting(delete_spare(agent, self.creations.get(agent)), agent.id)

    def _deleting(self, deletion: Coroutine[Any, Any, None], agent_id: str) -> None:
        """Runs a deletion, which the gateway's stop waits for (`deletions`)."""
        task = asyncio.create_task(deletion, name=agent_id)
        self.deletions.add(task)
        task.add_done_callback(self.deletions.discard)


def branch_id(agent_id: str, call: ChatCall, reply: int) -> str:
    """The branch of agent `agent_id` that a conversation resent whole goes on in: named by
    its messages through the one at `reply`, in the words the worker's digest reads
    (role, text, calls, the call answered), and its tools."""
    said = [
        (m["role"], m.get("content") or "", m.get("tool_calls") or [], m.get("tool_call_id", ""))
        for m in call.messages[: reply + 1]
    ]
    words = json.dumps([agent_id, call.tools, said], sort_keys=True, ensure_ascii=False)
    digest = hashlib.blake2b(words.encode(), digest_size=6).hexdigest()
    return f"{agent_id[:100]}-c{digest}"


async def to_the_end(step: Awaitable[T]) -> T:
    """What `step` returns; a caller cancelled meanwhile is so once the step has ended, and
    the step's error, if any, goes with it (not to asyncio's "Task exception was never
    retrieved", logged once for each such call: a client gone while its agent was made)."""
    running = asyncio.ensure_future(step)
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        await asyncio.wait({running})
        if not running.cancelled():
            running.exception()  # retrieved: the cancelled caller answers no one
        raise
