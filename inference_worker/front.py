"""The worker's RPC-thread side: every store call a request needs is made here, on the
caller's thread, and only MLX work is handed to the engine's thread.

One hung store call on the MLX thread would freeze every agent's turn and GetWorkerInfo
behind it. Here it holds up only the request that needs the store: a hot agent's turn waits
at most `check_timeout` for the store's word that no other worker committed it since, then
answers from RAM.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

from agentkv import ids
from agentkv.errors import (
    AgentBusy,
    AgentExists,
    AgentKVError,
    AgentNotFound,
    BucketUnreachable,
    GenerationConflict,
    InvalidArgument,
    OutOfRange,
    SystemPromptDiffers,
)
from agentkv.v1 import store_pb2 as store_pb
from inference_worker.agents import SYSTEM_KEY, agent_exists, system_digest
from inference_worker.conversation import ChatMessage
from inference_worker.engine import Engine
from inference_worker.freshness import StoreView, read_view
from inference_worker.metadata import (
    INTERNAL_PREFIX,
    chat_state,
    check_metadata,
    check_system,
    fork_metadata,
    made_by_fork,
)
from inference_worker.runtime import Runtime
from inference_worker.turns import AgentInfo, TurnJob

log = logging.getLogger("agentkv.worker")


class Front:
    def __init__(self, engine: Engine, check_timeout: float) -> None:
        self.engine, self.client, self.check_timeout = engine, engine.store, check_timeout
        # Agents being read from the store into RAM (by how many calls), and being deleted.
        self._restoring: Counter[tuple[str, str]] = Counter()
        self._deleting: Counter[tuple[str, str]] = Counter()
        self._busy_lock = threading.Lock()

    def create_agent(self, job: TurnJob, system: str, metadata: dict[str, str]) -> None:
        """Starts a new agent (Engine.create_agent); raises what refused it. Its system
        prompt's blocks come from the store when another agent of the namespace stored the
        same prefix, and only the rest is prefilled."""
        ns, agent_id = _checked(job)
        view = self._view(ns, agent_id)
        if view.manifest is not None:
            if view.manifest.fingerprint != self.engine.runtime.fingerprint:
                raise SystemPromptDiffers(
                    f"agent {agent_id!r} in namespace {ns!r} exists, written under another "
                    f"model (fingerprint {view.manifest.fingerprint!r}): delete it first, or "
                    "ask for it with replace=True (SDK) to make it anew with this model"
                )
            raise agent_exists(ns, agent_id, view.manifest.metadata, system, job.tools)
        check_system(system)
        reserved = sorted(k for k in metadata if k.startswith(INTERNAL_PREFIX))
        if reserved:
            raise InvalidArgument(
                f"metadata key {reserved[0]!r}: keys that start with {INTERNAL_PREFIX!r} are "
                "the worker's own (the agent's conversation state)"
            )
        made = {**metadata, SYSTEM_KEY: system_digest(system, job.tools)}
        metadata = check_metadata(made, system, job.tools)
        # Rendered here, not on the MLX thread; it refuses tools the model cannot call.
        start = self.engine.chat.start(system, job.tools)
        if not view.answered:
            log.warning(
                "agent made without the object store's word that it is new: the store "
                "cannot ask it",
                extra={"namespace": ns, "agent": agent_id},
            )
        shared = self.engine.restorer.fetch_prefix(ns, start[0])
        self._mlx(self.engine.create_agent, job, system, metadata, start, shared, view)

    def start_turn(self, job: TurnJob) -> None:
        """Queues the turn (Engine.start_turn); raises what refused it. The store is asked
        first whether the agent changed elsewhere (briefly), and read whole when the agent
        must be restored."""
        ns, agent_id = _checked(job)
        if job.whole_conversation and not job.messages:
            raise InvalidArgument("whole_conversation needs the conversation: no message came")
        _check_fits(self.engine.runtime, job.messages)
        view = read_view(self.client, ns, agent_id, self.check_timeout)
        if job.forms is not None and job.own_tools:  # its form, with tools known only here
            self._warm(job, self._mlx(self.engine.agents.tools_of, ns, agent_id))
        if not self._mlx(self.engine.start_turn, job, view, None):  # not hot: restore it
            with self._busy(ns, agent_id, self._restoring, self._deleting, "is being deleted"):
                fetched = self.engine.restorer.fetch(ns, agent_id)
                self._warm(job, _tools_of(fetched.manifest))
                self._mlx(self.engine.start_turn, job, view, fetched)

    def _warm(self, job: TurnJob, tools: str | None) -> None:
        """For a turn on the agent's own tools (it sends none; None: not in RAM here),
        compiles here what holds its reply (their strict grammar, the turn's form with
        them), where the MLX thread would at the turn's start, every turn in flight waiting
        (an agent this worker did not create, restarted or moved here; or a form)."""
        if tools is None or not job.own_tools or not job.sampling.max_tokens:
            return
        if job.forms is None:
            self.engine.grammars.warm(tools)
            return
        # As Engine._forms does: strict tools' forms are compiled now and kept (llg.Compiler),
        # to be found there; others are kept in the turn's forms, by these tools. Neither is
        # taken for the turn's if its tools are others by then (its agent restored anew), and
        # a form these tools refuse is refused at the turn's start, by its own tools.
        with suppress(InvalidArgument):
            if self.engine.grammars.settled(job.forms, tools) is job.forms:
                job.forms.compile(tools)

    def count_tokens(self, messages: list[ChatMessage], tools: str) -> int:
        """A conversation's tokens (ChatFormat.count), here on the RPC thread; one too long
        for the context however it tokenizes is refused before it is rendered."""
        _check_fits(self.engine.runtime, messages, len(tools))
        return self.engine.chat.count(messages, tools)

    def describe(self, ns: str, agent_id: str) -> AgentInfo:
        ns, agent_id = ids.namespace(ns), ids.agent_id(agent_id)
        info = self._mlx(self.engine.agents.describe_hot, ns, agent_id)
        if info is not None:
            return info
        fingerprint = self.engine.runtime.fingerprint
        m = self.client.get_agent(ns, agent_id, fingerprint=fingerprint, peek=True)
        tier = "warm" if m.block_keys and not m.missing_block_keys else "cold"
        sizes = len(m.token_ids), m.num_bytes, sum(m.block_num_tokens)
        pinned = (ns, agent_id) in self.engine.hot.pinned
        return AgentInfo(m.namespace, m.agent_id, tier, *sizes, m.generation, m.phase, pinned)

    def pin(self, ns: str, agent_id: str, pinned: bool) -> AgentInfo:
        """Pins or unpins an agent that exists (here or in the store: NOT_FOUND if not)."""
        info = self.describe(ns, agent_id)
        self._mlx(self.engine.agents.pin, info.namespace, info.agent_id, pinned)
        info.pinned = pinned
        return info

    def evict(self, ns: str, agent_id: str) -> tuple[bool, int]:
        """Drops the agent from RAM once its whole cache is committed."""
        ns, agent_id = ids.namespace(ns), ids.agent_id(agent_id)
        self._wait_durable(ns, agent_id)
        return self._mlx(self.engine.agents.evict, ns, agent_id)

    def fork(
        self, ns: str, source_id: str, agent_id: str, phase: str, request_id: str = ""
    ) -> AgentInfo:
        """A new agent whose context is the source's: the store shares the source's blocks.
        A retry with the same `request_id` (a lost reply's) is answered with the fork made."""
        ns, source_id = ids.namespace(ns), ids.agent_id(source_id)
        agent_id = ids.agent_id(agent_id)
        if self._made_by(ns, agent_id, request_id):
            return self.describe(ns, agent_id)  # a retry: whatever the source did since
        try:
            self._fork(ns, source_id, agent_id, phase, request_id)
        except AgentExists:
            if not self._made_by(ns, agent_id, request_id):
                raise
        return self.describe(ns, agent_id)

    def _made_by(self, ns: str, agent_id: str, request_id: str) -> bool:
        """Whether the stored agent is as the fork with this request_id made it (never,
        without one: the store is not asked)."""
        if not request_id:
            return False
        stored = self._view(ns, agent_id).manifest
        return stored is not None and made_by_fork(stored.metadata, request_id)

    def _fork(self, ns: str, source_id: str, agent_id: str, phase: str, request_id: str) -> None:
        if self._mlx(self.engine.agents.fork_source, ns, source_id, agent_id):
            self._wait_durable(ns, source_id)
            self._mlx(self.engine.agents.durable_agent, ns, source_id, "fork")
        # The source as committed (it must be this model's): the fork takes these tokens with
        # their chat state, and the request_id in the same write, for a retry to know it by.
        source = self.client.get_agent(ns, source_id, fingerprint=self.engine.runtime.fingerprint)
        request = store_pb.ForkAgentRequest(
            namespace=ns,
            source_agent_id=source_id,
            new_agent_id=agent_id,
            num_tokens=len(source.token_ids),
            phase=phase,
            metadata=fork_metadata(source.metadata, request_id),
        )
        changed = GenerationConflict(
            f"agent {source_id!r} in namespace {ns!r} changed while {agent_id!r} was forked "
            f"from its generation {source.generation}: fork it again",
            source.generation,
        )
        try:
            fork = self.client.call("ForkAgent", request).agent
        except InvalidArgument:  # "cannot fork N tokens": the source got shorter since?
            now = self.client.get_agent(ns, source_id, summary_only=True)
            if now.generation != source.generation:
                raise changed from None
            raise
        if fork.token_ids != source.token_ids:  # rewritten since: the chat state would not fit
            self.client.delete_agent(ns, agent_id, expected_generation=1)
            raise changed

    def delete(self, ns: str, agent_id: str) -> bool:
        ns, agent_id = ids.namespace(ns), ids.agent_id(agent_id)
        reading = "is being read from the store for a turn: delete it once the turn ends"
        with self._busy(ns, agent_id, self._deleting, self._restoring, reading):
            return self._delete(ns, agent_id)

    def _delete(self, ns: str, agent_id: str) -> bool:
        agent = self._mlx(self.engine.agents.drop, ns, agent_id)
        try:
            if agent is not None and agent.pending is not None:
                agent.pending.result()  # its last write lands before the delete
            self.client.delete_agent(ns, agent_id)
        except AgentNotFound:
            return agent is not None
        except AgentKVError:  # not deleted (the store is down): what only RAM holds stays
            if agent is not None:
                self._mlx(self.engine.agents.keep, agent)
            raise
        return True

    @contextmanager
    def _busy(
        self, ns: str, agent_id: str, doing: Counter, other: Counter, refused: str
    ) -> Iterator[None]:
        """Counts a call in `doing` for the agent (a turn's read of it from the store into
        RAM, or its delete) while none is counted in `other` (else AgentBusy, the agent
        `refused`): a turn that read the store before a delete reached it would run on a
        copy the store no longer has (its reply then lost, a copy left in RAM)."""
        key = (ns, agent_id)
        with self._busy_lock:
            if other[key]:
                raise AgentBusy(f"agent {agent_id!r} {refused}")
            doing[key] += 1
        try:
            yield
        finally:
            with self._busy_lock:
                doing[key] -= 1
                if not doing[key]:
                    del doing[key]

    def hot_tier(self, namespaces: frozenset[str] | None = None) -> tuple[int, int, int]:
        """(budget, bytes held, agents) of the hot tier, as of its last change; of the agents
        of `namespaces` only, given (a token's: what other tenants hold is theirs)."""
        hot = self.engine.hot
        if namespaces is None:
            return hot.figures
        by_namespace = hot.by_namespace  # one publish's (the MLX thread swaps in a new one)
        held = [by_namespace.get(ns, (0, 0)) for ns in namespaces]
        return hot.figures[0], sum(h[0] for h in held), sum(h[1] for h in held)

    def _wait_durable(self, ns: str, agent_id: str) -> None:
        """Waits here for the agent's write in flight, then for one more if that failed."""
        for retry in (False, True):
            pending = self._mlx(self.engine.agents.write_pending, ns, agent_id, retry)
            if pending is not None:
                pending.result()

    def _view(self, ns: str, agent_id: str) -> StoreView:
        """What the store says of the agent: its manifest, or none. Also none, though not
        an answer, when the store cannot ask its object store, which is down, for an agent
        not on its disk (the store writes a new agent locally then, and its upload will not
        overwrite one made elsewhere). Any other error raises."""
        return read_view(self.client, ns, agent_id, unanswered=BucketUnreachable, peek=True)

    def _mlx(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs fn on the MLX thread and waits for it."""
        return self.engine.submit(fn, *args).result()


def _checked(job: TurnJob) -> tuple[str, str]:
    """The job's namespace and agent id, checked and written back ("" is "default", here
    and in the store), its phase checked."""
    job.namespace, job.agent_id = ids.namespace(job.namespace), ids.agent_id(job.agent_id)
    ids.phase(job.phase)
    return job.namespace, job.agent_id


def _check_fits(rt: Runtime, messages: list[ChatMessage], more: int = 0) -> None:
    """Refuses messages (and `more` characters: tools) too long for the context however they
    tokenize, here on the RPC thread: tokenizing megabytes on the MLX thread would stall
    every agent's decoding, and on an RPC thread every other call's."""
    calls = (c for m in messages for c in m.tool_calls)
    chars = sum(len(m.content) for m in messages) + sum(len(c.arguments) for c in calls) + more
    if chars > rt.max_context * rt.token_chars:
        raise OutOfRange(
            f"messages of {chars} characters are over the model's limit of "
            f"{rt.max_context} tokens however they tokenize (no token of its vocabulary "
            f"spells more than {rt.token_chars} characters)"
        )


def _tools_of(manifest: Any) -> str | None:
    """The tools of a restored agent's conversation; None for a corrupt record (which the
    restore reports)."""
    try:
        return chat_state(dict(manifest.metadata)).tools
    except AgentKVError:
        return None
