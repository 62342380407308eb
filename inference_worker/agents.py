"""Agents in this worker's RAM, and the hot tier that bounds them.

An agent is evicted only once its KV is durable in the store: every token in its cache is
covered by a committed manifest and no write for it is still in flight.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from agentkv.errors import AgentKVError
from inference_worker.chat import ChatState
from inference_worker.kv_cache import QuantizedKV

log = logging.getLogger("agentkv.worker")

AgentId = tuple[str, str]  # (namespace, agent_id)


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
    # Commits whose reply never came (id -> full block keys, tokens): one may be applied.
    in_doubt: dict[str, tuple[list[bytes], int]] = field(default_factory=dict)
    # time.monotonic() when RAM last matched the store (a commit landed, or the restore's
    # read): a store read asked before then may not show this worker's own latest commit.
    synced_at: float = 0.0

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
    def durable(self) -> bool:
        return (self.pending is None or self.pending.done()) and (
            self.persisted_tokens >= self.cached
        )


@dataclass(slots=True)
class Checkpoint:
    """An agent's context as it was before a turn changed it, to undo a turn that failed."""

    tokens: list[int]  # the list a turn replaces (it is never changed in place)
    chat: ChatState
    phase: str
    cached: int  # cache positions the turn did not touch

    @classmethod
    def of(cls, agent: Agent) -> Checkpoint:
        return cls(agent.tokens, replace(agent.chat), agent.phase, agent.cached)

    def restore(self, agent: Agent) -> bool:
        """Puts the agent back as it was; False when its caches cannot be (see
        QuantizedKV.rewind): then only the store's copy is right."""
        agent.tokens, agent.chat, agent.phase = self.tokens, self.chat, self.phase
        rewound = [cache.rewind(self.cached) for cache in agent.caches]
        return all(rewound)


class HotTier:
    """LRU agents under a byte budget; owned by the MLX thread (no locking needed)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._agents: OrderedDict[AgentId, Agent] = OrderedDict()

    def get(self, agent_id: AgentId) -> Agent | None:
        agent = self._agents.get(agent_id)
        if agent is not None:
            self._agents.move_to_end(agent_id)
        return agent

    def put(self, agent: Agent) -> None:
        self._agents[agent.id] = agent
        self._agents.move_to_end(agent.id)

    def pop(self, agent_id: AgentId) -> Agent | None:
        return self._agents.pop(agent_id, None)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._agents.values())

    def __len__(self) -> int:
        return len(self._agents)

    def agents(self) -> list[Agent]:
        return list(self._agents.values())

    def enforce(self, keep: set[AgentId] | frozenset[AgentId] = frozenset()) -> list[Agent]:
        """Evicts least recently used durable agents until under budget; returns them."""
        evicted = []
        for agent_id in list(self._agents):
            if self.nbytes <= self.budget_bytes:
                break
            agent = self._agents[agent_id]
            if agent_id not in keep and agent.durable:
                evicted.append(self._agents.pop(agent_id))
        if self.nbytes > self.budget_bytes:
            log.warning(
                "hot tier over budget: agents not yet durable",
                extra={"bytes": self.nbytes, "budget": self.budget_bytes},
            )
        return evicted
