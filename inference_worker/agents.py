"""Agents in this worker's RAM, and the hot tier that bounds them.

An agent is evicted only once its KV is durable in the store: every token in its cache is
covered by a committed manifest and no write for it is still in flight.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from agentkv.errors import (
    AgentExists,
    AgentKVError,
    NamespaceQuotaExceeded,
    OutOfRange,
    ResourceExhausted,
    SystemPromptDiffers,
)
from agentkv.ids import AgentId
from inference_worker.conversation import ChatState, common_prefix
from inference_worker.kv_cache import QuantizedKV
from inference_worker.metrics import WorkerMetrics
from inference_worker.turns import AgentInfo, UsageEvent

log = logging.getLogger("agentkv.worker")


@dataclass(slots=True)
class Agent:
    namespace: str
    agent_id: str
    tokens: list[int]  # the whole context; the cache holds tokens[:cached]
    caches: list[QuantizedKV]
    generation: int = 0  # of the store manifest this worker last committed or read
    persisted_tokens: int = 0  # cache tokens durable in the store
    queued_full_keys: list[bytes] = field(default_factory=list)  # full blocks stored or queued
    committed_full_keys: list[bytes] = field(default_factory=list)  # full blocks committed
    chat: ChatState = field(default_factory=ChatState)  # where its conversation stands
    phase: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    pending: Future | None = None  # the store write in flight, if any
    # Why the last write failed (the next one re-cuts its blocks); None when it did not.
    persist_error: AgentKVError | None = None
    stale: bool = False  # another writer committed: reload from the store before use
    # Commits whose reply never came (id -> Snapshot.written): one may have been applied.
    in_doubt: dict[str, tuple[list[bytes], int, list[int]]] = field(default_factory=dict)
    # time.monotonic() when RAM last matched the store (a commit landed, or the restore's
    # read): a store read asked before then may not show this worker's own latest commit.
    synced_at: float = 0.0
    # Writes refused in a row for want of room (a quota, a full disk), and the time.monotonic()
    # before which the next is not tried: each refusal doubles the wait, up to a minute.
    refusals: int = 0
    retry_at: float = 0.0
    # Held while a commit is recorded (writer thread) or a turn changes the context (MLX
    # thread): a commit of the context before a cut must not count as this one's.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def id(self) -> AgentId:
        return (self.namespace, self.agent_id)

    @property
    def persist_failed(self) -> bool:
        return self.persist_error is not None

    @property
    def cached(self) -> int:
        return self.caches[0].offset if self.caches else 0

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def keep_undurable(self) -> None:
        """Tells the caches which positions are not yet in the store: a sliding-window layer
        must keep those until they are, whatever its window."""
        for cache in self.caches:
            cache.keep_from = self.persisted_tokens

    @property
    def writing(self) -> bool:
        """Whether a store write of it is in flight."""
        return self.pending is not None and not self.pending.done()

    @property
    def durable(self) -> bool:
        return not self.writing and self.persisted_tokens >= self.cached

    @property
    def gone_stale(self) -> bool:
        """Another worker committed it since, and no write of it is in flight: this copy
        is never written, and it may leave RAM at no loss."""
        return self.stale and not self.writing

    @property
    def over_quota(self) -> bool:
        """Its last write was refused by its own namespace's quota: its tenant's limit."""
        return isinstance(self.persist_error, NamespaceQuotaExceeded) and not self.writing

    def begin_turn(
        self, tokens: list[int], chat: ChatState, phase: str, keep: int, block_tokens: int
    ) -> Checkpoint:
        """Gives the agent a turn's context, `tokens`, of which its caches keep the first
        `keep` (the turn prefills the rest); returns the agent as it was, to undo the turn."""
        drop = self.cached - keep
        for cache in self.caches:
            if drop > 0:  # the last token runs again for its logits, or the conversation
                cache.trim(drop)  # resumes from an earlier point (or renders differently)
            cache.begin_turn()
        with self.lock:
            undo = Checkpoint.of(self)
            same = common_prefix(self.tokens, tokens)
            del self.queued_full_keys[same // block_tokens :]
            del self.committed_full_keys[same // block_tokens :]
            # What the store holds past `same` is another context's: not durable for this one.
            self.persisted_tokens = min(self.persisted_tokens, same)
            self.keep_undurable()
            self.tokens, self.chat, self.phase = tokens, chat, phase or self.phase
        return undo

    def reusable(
        self,
        tokens: list[int],
        need_logits: bool,
        usage: UsageEvent,
        limit: int | None = None,
        whole: int = 0,
    ) -> int:
        """How many of a turn's `tokens` it keeps from the cache (it prefills the rest), at
        most `limit`, and the first `whole` all or none (a stable prefix, which a new agent
        makes as a turn of its own), capping what `usage` says was reused."""
        reuse = common_prefix(self.tokens[: self.cached], tokens)
        if limit is not None:
            reuse = min(reuse, limit)
        if reuse < whole:
            reuse = 0
        if reuse < self.cached:  # a first turn kept only part of the stable prefix
            usage.reused_hot_tokens = min(usage.reused_hot_tokens, reuse)
            usage.reused_store_tokens = min(usage.reused_store_tokens, reuse)
        if need_logits and reuse == len(tokens):
            reuse -= 1  # the last token runs again, for its logits
        if not all(c.holds(reuse) for c in self.caches):
            # A sliding window has dropped what the turn would attend over from there: the
            # whole context is prefilled again (the store's copy is the other way back).
            reuse = usage.reused_hot_tokens = usage.reused_store_tokens = 0
        return reuse

    def memory_for(self, num_tokens: int, token_bytes: int) -> int:
        """KV bytes it holds at its longest in a turn reaching `num_tokens`: what it holds
        now, plus every new token in every layer (a window layer keeps them too until they
        are committed, after the turn). The fp16 copy a turn keeps of its own tokens while
        it prefills is working memory, like the forward's activations: not counted."""
        return self.nbytes + max(0, num_tokens - self.cached) * token_bytes

    def check_context(self, adding: int, max_context: int) -> None:
        """Raises OutOfRange when `adding` more tokens would take it past `max_context`."""
        if len(self.tokens) + adding > max_context:
            raise OutOfRange(
                f"agent {self.agent_id!r} would reach {len(self.tokens) + adding} tokens "
                f"({len(self.tokens)} held, {adding} more asked), over the model's limit "
                f"of {max_context}"
            )

    def info(self, tier: str) -> AgentInfo:
        sizes = len(self.tokens), self.nbytes, self.persisted_tokens
        return AgentInfo(self.namespace, self.agent_id, tier, *sizes, self.generation, self.phase)


@dataclass(slots=True)
class Checkpoint:
    """An agent's context as it was before a turn changed it, to undo a turn that failed."""

    tokens: list[int]  # the list a turn replaces (it is never changed in place)
    chat: ChatState
    phase: str
    cached: int  # cache positions the turn did not touch
    persisted: int
    queued_keys: list[bytes]  # Agent.queued_full_keys, which a turn cuts to what it keeps
    committed_keys: list[bytes]

    @classmethod
    def of(cls, agent: Agent) -> Checkpoint:
        chat, persisted = replace(agent.chat), agent.persisted_tokens
        keys = list(agent.queued_full_keys), list(agent.committed_full_keys)
        return cls(agent.tokens, chat, agent.phase, agent.cached, persisted, *keys)

    def restore(self, agent: Agent) -> bool:
        """Puts the agent back as it was; False when its caches cannot be (see
        QuantizedKV.rewind): then only the store's copy is right."""
        with agent.lock:
            agent.tokens, agent.chat, agent.phase = self.tokens, self.chat, self.phase
            agent.persisted_tokens = max(agent.persisted_tokens, self.persisted)
            # The next write cuts from where these end: a window has dropped what precedes.
            # A commit landing during the turn recorded only what the turn kept of it.
            agent.queued_full_keys = self.queued_keys
            if len(self.committed_keys) > len(agent.committed_full_keys):
                agent.committed_full_keys = self.committed_keys
        rewound = [cache.rewind(self.cached) for cache in agent.caches]
        agent.keep_undurable()
        return all(rewound)


MAX_PINNED = 1024  # agents pinned on one worker in one namespace (PinAgent) ...
MAX_PINNED_IN_ALL = 65536  # ... and in all: one tenant's pins leave others room
EVICTED = {  # what the log says of an agent evicted, by reason
    "budget": "agent evicted to the store",
    "waiting_turn": "agent evicted for a waiting turn",
}


class HotTier:
    """LRU agents under a byte budget, and when they leave it; owned by the MLX thread (no
    locking needed)."""

    def __init__(self, budget_bytes: int, metrics: WorkerMetrics | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.metrics = metrics or WorkerMetrics()
        self._agents: OrderedDict[AgentId, Agent] = OrderedDict()
        self.pinned: set[AgentId] = set()  # evicted last (PinAgent); in RAM or not
        # (budget, bytes held, agents) as of the last change, for other threads to read
        # (GetWorkerInfo) without waiting for the MLX thread, which a flood keeps busy
        self.figures = (budget_bytes, 0, 0)
        self.by_namespace: dict[str, tuple[int, int]] = {}  # ns -> (bytes, agents), as figures

    def _publish(self) -> None:
        by_namespace: dict[str, tuple[int, int]] = {}
        for (ns, _), agent in self._agents.items():
            nbytes, count = by_namespace.get(ns, (0, 0))
            by_namespace[ns] = (nbytes + agent.nbytes, count + 1)
        self.by_namespace = by_namespace
        held = sum(nbytes for nbytes, _ in by_namespace.values())
        self.figures = (self.budget_bytes, held, len(self._agents))
        self.metrics.hot_bytes.set(self.figures[1])

    def pin(self, agent_id: AgentId, pinned: bool) -> None:
        if pinned and agent_id not in self.pinned:
            ns = agent_id[0]
            if sum(p[0] == ns for p in self.pinned) >= MAX_PINNED:
                raise ResourceExhausted(
                    f"{MAX_PINNED} agents of namespace {ns!r} are pinned on this worker already"
                )
            if len(self.pinned) >= MAX_PINNED_IN_ALL:
                raise ResourceExhausted(
                    f"{MAX_PINNED_IN_ALL} agents are pinned on this worker already"
                )
        (self.pinned.add if pinned else self.pinned.discard)(agent_id)

    def _by_eviction(self) -> list[Agent]:
        """The agents in the order they give way: unpinned ones least recently used first,
        then pinned ones so."""
        agents = list(self._agents.values())
        return sorted(agents, key=lambda a: a.id in self.pinned)  # stable: LRU within each

    def get(self, agent_id: AgentId) -> Agent | None:
        agent = self._agents.get(agent_id)
        if agent is not None:
            self._agents.move_to_end(agent_id)
        return agent

    def put(self, agent: Agent) -> None:
        self._hold(agent)
        self._publish()

    def _hold(self, agent: Agent) -> None:
        self._agents[agent.id] = agent
        self._agents.move_to_end(agent.id)

    def pop(self, agent_id: AgentId) -> Agent | None:
        agent = self._agents.pop(agent_id, None)
        self._publish()
        return agent

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._agents.values())

    def __len__(self) -> int:
        return len(self._agents)

    def enforce(self, keep: set[AgentId] | frozenset[AgentId] = frozenset()) -> list[Agent]:
        """Evicts least recently used durable agents until under budget; returns them."""
        evicted = []
        for agent in self._by_eviction():
            if self.nbytes <= self.budget_bytes:
                break
            if agent.id not in keep and self._may_go(agent):
                evicted.append(self._let_go(agent, "budget"))
        if self.nbytes > self.budget_bytes:
            log.warning(
                "hot tier over budget: agents not yet durable",
                extra={"bytes": self.nbytes, "budget": self.budget_bytes},
            )
        return evicted

    def admit(self, agent: Agent, busy: set[AgentId]) -> None:
        """Holds an agent at the end of its turn, then keeps within budget: least recently
        used durable agents go, never a busy one (its turn is in flight)."""
        self._hold(agent)
        self.enforce(keep=busy | {agent.id})
        self._publish()

    def make_room(self, busy: set[AgentId], room: int) -> int:
        """Idle agents give way to a waiting turn, until they hold at most `room` bytes: the
        hot tier is a cache, and a turn must not wait for RAM that only idle agents hold.
        Least recently used first, and only durable ones (their state is in the store).
        Returns the bytes idle agents still hold."""
        idle = [a for a in self._by_eviction() if a.id not in busy]  # LRU first, pinned last
        held = sum(a.nbytes for a in idle)
        for agent in idle:
            if held <= room:
                break
            if self._may_go(agent):
                held -= self._let_go(agent, "waiting_turn").nbytes
        self._publish()
        return held

    @staticmethod
    def _may_go(agent: Agent) -> bool:
        """Whether the agent may leave RAM: it is durable (the store has it); or stale:
        another worker committed it since, and the store keeps that (its turns here since
        its last commit are dropped already); or its own namespace's quota refused it,
        which is its tenant's limit: its turns since its last commit are dropped rather
        than hold RAM that other tenants' turns wait for."""
        return (agent.durable and not agent.persist_failed) or agent.gone_stale or agent.over_quota

    def _let_go(self, agent: Agent, reason: str) -> Agent:
        """Drops the agent from the tier (the caller publishes the figures once done),
        saying so and counting it by `reason`, or as over_quota when its turns are lost."""
        self._agents.pop(agent.id)
        if agent.gone_stale:
            reason = "stale"
            log.info("stale agent dropped from RAM", extra={"agent": agent.agent_id})
        elif not agent.over_quota:
            log.info(EVICTED[reason], extra={"agent": agent.agent_id})
        else:
            reason = "over_quota"
            log.warning(
                "agent dropped from RAM: its namespace is over its store quota, so its turns "
                "since its last commit are lost",
                extra={
                    "namespace": agent.namespace,
                    "agent": agent.agent_id,
                    "dropped_tokens": len(agent.tokens) - agent.persisted_tokens,
                },
            )
        self.metrics.evictions.labels(reason=reason).inc()
        return agent

    def release(self, agent: Agent, mid_turn: Callable[[Agent], bool]) -> None:
        """Once committed, window caches let go of what only persistence still needed."""
        if mid_turn(agent) or self._agents.get(agent.id) is not agent:  # not a use: LRU stays
            return  # mid-turn (the batch drops it), or no longer held here
        agent.keep_undurable()
        for cache in agent.caches:
            cache.release()
        self._publish()

    def unwritten(self) -> list[Agent]:
        """Agents whose latest state is not committed (a write failed, was cut or is still
        in flight), leaving out stale ones: another worker owns their newer state."""
        agents = list(self._agents.values())  # at exit: the MLX thread may outlive its join
        return [a for a in agents if not a.stale and (a.persist_failed or not a.durable)]

    def failed_writes(self, mid_turn: Callable[[Agent], bool]) -> list[Agent]:
        """Agents whose last write the store refused (it was down or full), to write again:
        once the store is back, every turn served meanwhile becomes durable. Not those
        writing now, mid-turn (their caches live in the batch) or stale, nor those whose
        wait after a refusal for want of room has not passed (Agent.retry_at)."""
        now = time.monotonic()
        return [
            a
            for a in self._agents.values()
            if a.persist_failed and now >= a.retry_at and not (a.writing or mid_turn(a) or a.stale)
        ]


SYSTEM_KEY = "agentkv.system_sha256"  # metadata a worker adds at create: its system prompt's


def system_digest(system: str, tools: str = "") -> str:
    """What an agent was made with: its system prompt and its tools (when it has any)."""
    made = f"{system}\0tools\0{tools}" if tools else system
    return hashlib.sha256(made.encode()).hexdigest()


def agent_exists(
    ns: str, agent_id: str, metadata: Mapping[str, str], system: str, tools: str = ""
) -> AgentKVError:
    """What creating an agent that exists raises: AgentExists when it was made with the system
    prompt (and tools) asked for (the SDK then uses it as it is; so too an agent from before
    workers kept the digest), SystemPromptDiffers when it was not."""
    stored = metadata.get(SYSTEM_KEY)
    if stored is None or stored == system_digest(system, tools):
        return AgentExists(f"agent {agent_id!r} already exists in namespace {ns!r}")
    return SystemPromptDiffers(
        f"agent {agent_id!r} in namespace {ns!r} exists with another system prompt or other tools: "
        "delete it first, or ask for it with replace=True (SDK) to make it anew"
    )
