"""What the store deletes for sitting unused, on one thread: agents nobody has read or written
for their namespace's --agent-idle (retention), with their blocks no other agent shares, and
unreferenced blocks idle for --gc-idle-seconds (so garbage never piles up without a quota).

An agent's last use is its last commit, or a later read for use: a worker's restore, the
summary a worker asks for before each turn of an agent it holds, a fork from it (not an
inspection: GetAgent's `peek`). Uses are saved in the index at each sweep, so a restart
forgets at most one sweep's worth. A delete names the generation the sweep saw, so an agent
committed meanwhile stays.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from agentkv.errors import AgentKVError
from agentkv.units import human_seconds, utc_time
from cache_store.capacity import Capacity, now_ms
from cache_store.config import ANY_NAMESPACE, StoreConfig
from cache_store.index import Index
from cache_store.records import AgentRecord

log = logging.getLogger("agentkv.store")
MAX_INTERVAL = 60.0  # seconds between sweeps at most, but for long retentions
MAX_GONE = 10_000  # agents deleted for idling that a not-found error explains
LOCK_STRIPES = 64  # locks between a use and a delete for idling, one per agent hash
Stopping = Callable[[], bool]


class Sweeper:
    """Runs each sweep every its own period (seconds) on one thread until close(); a sweep
    that raises (a full disk, a bad record) is logged and tried again next period."""

    def __init__(self, sweeps: list[tuple[float, Callable[[Stopping], None]]]) -> None:
        self.sweeps = sweeps
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="idle-sweeper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        due = [time.monotonic() + period for period, _ in self.sweeps]
        while not self._stop.wait(max(0.0, min(due) - time.monotonic())):
            for i, (period, sweep) in enumerate(self.sweeps):
                if due[i] > time.monotonic():
                    continue
                try:
                    sweep(self._stop.is_set)
                except Exception:
                    log.exception("idle sweep failed")
                due[i] = time.monotonic() + period

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def sweeper(config: StoreConfig, capacity: Capacity, retention: Retention) -> Sweeper | None:
    """The store's sweeper, or None when nothing is deleted for idling. Unreferenced blocks
    are looked for every min(gc idle / 4, 60 s); idle agents, whose scan reads every
    manifest, every min(retention / 4, max(60 s, retention / 1000)): an agent goes at most
    a quarter of its retention, or 0.1% of it and no less than a minute, late."""
    sweeps = []
    if agent_idles := [s for s in retention_settings(config) if s]:
        idle = min(agent_idles)
        sweeps.append((min(idle / 4, max(MAX_INTERVAL, idle / 1000)), retention.sweep))
    if idle := config.gc_idle_seconds:
        sweeps.append((min(idle / 4, MAX_INTERVAL), BlockCollection(capacity, idle).sweep))
    return Sweeper(sweeps) if sweeps else None


def retention_settings(config: StoreConfig) -> list[float]:
    return [config.agent_idle_seconds, *config.namespace_agent_idle.values()]


class BlockCollection:
    """Deletes unreferenced blocks nobody has read or written for `idle_seconds`."""

    def __init__(self, capacity: Capacity, idle_seconds: float) -> None:
        self.capacity, self.idle_ms = capacity, int(idle_seconds * 1000)

    def sweep(self, stopping: Stopping) -> None:
        deleted, freed = self.capacity.collect(None, self.idle_ms, stopping)
        if deleted:
            self.capacity.metrics.evictions.labels("idle_block").inc(deleted)
            log.info("idle blocks collected", extra={"blocks": deleted, "bytes": freed})


class AgentStore(Protocol):
    """What retention asks of the store (CacheStore)."""

    def delete_agent(
        self, namespace: str, agent_id: str, expected_generation: int = 0, counter: str = ""
    ) -> int: ...

    def writes(self, namespace: str) -> bool: ...


class Retention:
    """Deletes the agents idle past their retention, then their blocks that no other agent
    holds and no lease protects (a shared prefix stays while it is shared).

    A use is marked (mark_used) under the same lock, one of LOCK_STRIPES by agent, as the
    sweep's last look and delete: a read that marked it first keeps the agent, and one that
    marks it after finds it deleted. Uses this process saw are saved in the index at each
    sweep, so a restart forgets at most one sweep's worth."""

    def __init__(
        self, config: StoreConfig, index: Index, capacity: Capacity, store: AgentStore
    ) -> None:
        self.config, self.index, self.capacity, self.store = config, index, capacity, store
        self._locks = [threading.Lock() for _ in range(LOCK_STRIPES)]
        self._gone: OrderedDict[tuple[str, str], str] = OrderedDict()  # recent, with why
        self._gone_lock = threading.Lock()
        self._saved: dict[tuple[str, str], int] = {}  # last uses saved in the index

    def mark_used(self, namespace: str, agent_id: str) -> None:
        """The agent is being read for use (a restore, a turn's check, a fork)."""
        with self._locks[hash((namespace, agent_id)) % LOCK_STRIPES]:
            self.capacity.touch_agent(namespace, agent_id)

    def why_gone(self, namespace: str, agent_id: str) -> str:
        """Why the agent is not found, when this process deleted it for idling; else ""."""
        with self._gone_lock:
            return self._gone.get((namespace, agent_id), "")

    def forget(self, namespace: str, agent_id: str) -> None:
        """The agent was written or deleted since: it is not gone for idling now."""
        with self._gone_lock:
            self._gone.pop((namespace, agent_id), None)

    def scopes(self) -> list[str | None]:
        """The namespaces to look in: all (None) when every one not named has a retention."""
        config = self.config
        if config.namespace_agent_idle.get(ANY_NAMESPACE, config.agent_idle_seconds):
            return [None]
        named = config.namespace_agent_idle.items()
        return sorted(n for n, seconds in named if n != ANY_NAMESPACE and seconds)

    def expired(self) -> list[tuple[AgentRecord, int]]:
        """The agents idle past their retention now, with their last use (Unix ms), from
        one read of the index."""
        now, found = now_ms(), []
        with self.index.read() as txn:
            for scope in self.scopes():
                for agent in self.index.agents(txn, scope):
                    saved = self.index.agent_used(txn, agent.namespace, agent.agent_id)
                    last = self.capacity.agent_last_access(agent, saved)
                    if self._is_past(agent.namespace, last, now):
                        found.append((agent, last))
        return found

    def _is_past(self, namespace: str, last_use_ms: int, now: int) -> bool:
        idle_ms = int(self.config.agent_idle(namespace) * 1000)
        return bool(idle_ms) and last_use_ms < now - idle_ms

    def sweep(self, stopping: Stopping) -> None:
        self._save_uses()
        agents = blocks = 0
        for agent, last in self.expired():
            if stopping():
                break
            if self._expire(agent, last):
                agents += 1
                blocks += self.capacity.drop_unreferenced(agent.namespace, agent.block_keys)
        if agents:
            self.capacity.metrics.evictions.labels("idle_agent").inc(agents)
            log.info("idle agents deleted", extra={"agents": agents, "blocks": blocks})

    def _expire(self, agent: AgentRecord, last: int) -> bool:
        """Deletes the agent if it is still idle and still the generation the scan saw."""
        ns, agent_id = agent.namespace, agent.agent_id
        with self._locks[hash((ns, agent_id)) % LOCK_STRIPES]:
            last = max(last, self.capacity.agent_last_access(agent))
            if not self._is_past(ns, last, now_ms()) or not self.store.writes(ns):
                return False  # used since the scan; another store writes the namespace
            self._note_gone(agent, (now_ms() - last) // 1000)  # before: a commit forgets it
            try:
                self.store.delete_agent(ns, agent_id, agent.generation, "expired_agents")
            except AgentKVError as exc:  # committed or deleted meanwhile
                self.forget(ns, agent_id)
                log.debug("idle agent kept", extra={"agent": agent_id, "why": exc.message})
                return False
        return True

    def _note_gone(self, agent: AgentRecord, idle: int) -> None:
        limit = human_seconds(self.config.agent_idle(agent.namespace))
        why = f"deleted at {utc_time(now_ms())} UTC, unused for {idle} s (--agent-idle {limit})"
        with self._gone_lock:
            self._gone[(agent.namespace, agent.agent_id)] = why
            while len(self._gone) > MAX_GONE:
                self._gone.popitem(last=False)
        log.info(
            "idle agent deleted",
            extra={"namespace": agent.namespace, "agent": agent.agent_id, "idle_s": idle},
        )

    def _save_uses(self) -> None:
        """Saves in the index the uses seen since the last sweep (one write)."""
        uses = self.capacity.agent_uses()
        changed = {k: ms for k, ms in uses.items() if self._saved.get(k) != ms}
        if not changed:
            return
        try:
            with self.index.write() as txn:
                for (ns, agent_id), ms in changed.items():
                    self.index.save_agent_used(txn, ns, agent_id, ms)
        except AgentKVError as exc:  # a full disk: the uses stay in memory meanwhile
            log.warning("agent uses not saved", extra={"why": exc.message})
            return
        self._saved = uses
