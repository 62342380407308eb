"""What the store deletes for sitting unused, on one thread: agents nobody has read or written
for their namespace's --agent-idle (retention), with their blocks no other agent shares, and
unreferenced blocks idle for --gc-idle-seconds (so garbage never piles up without a quota).

An agent's last use is its last commit, or a later read this process served (a worker's
restore, or the summary a worker asks for before each turn of an agent it holds). A delete
names the generation the sweep saw, so an agent committed meanwhile stays.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from agentkv.errors import AgentKVError
from agentkv.units import human_seconds, utc_time
from cache_store.capacity import Capacity, now_ms
from cache_store.config import ANY_NAMESPACE, StoreConfig
from cache_store.index import Index
from cache_store.records import AgentRecord

log = logging.getLogger("agentkv.store")
MAX_INTERVAL = 60.0  # seconds between sweeps at most, but for long retentions
MAX_GONE = 10_000  # agents deleted for idling that a not-found error explains
Stopping = Callable[[], bool]
DeleteAgent = Callable[..., Any]  # CacheStore.delete_agent


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


class Retention:
    """Deletes the agents idle past their namespace's retention, then their blocks that no
    other agent holds and no lease protects (a shared prefix stays while it is shared)."""

    def __init__(
        self, config: StoreConfig, index: Index, capacity: Capacity, delete: DeleteAgent
    ) -> None:
        self.config, self.index, self.capacity, self.delete = config, index, capacity, delete
        self._gone: OrderedDict[tuple[str, str], str] = OrderedDict()  # recent, with why

    def why_gone(self, namespace: str, agent_id: str) -> str:
        """Why the agent is not found, when this process deleted it for idling; else ""."""
        return self._gone.get((namespace, agent_id), "")

    def forget(self, namespace: str, agent_id: str) -> None:
        """The agent was written or deleted since: it is not gone for idling now."""
        self._gone.pop((namespace, agent_id), None)

    def expired(self) -> list[AgentRecord]:
        """The agents idle past their retention now, from one read of the index."""
        now = now_ms()
        named = set(self.config.namespace_agent_idle) - {ANY_NAMESPACE}
        everywhere = any(s for s in retention_settings(self.config) if s not in named)
        scopes = [None] if everywhere else sorted(named)
        with self.index.read() as txn:
            agents = [a for scope in scopes for a in self.index.agents(txn, scope)]
        return [a for a in agents if self._is_expired(a, now)]

    def _is_expired(self, agent: AgentRecord, now: int) -> bool:
        idle_ms = int(self.config.agent_idle(agent.namespace) * 1000)
        return bool(idle_ms) and self.capacity.agent_last_access(agent) < now - idle_ms

    def sweep(self, stopping: Stopping) -> None:
        agents = blocks = 0
        for agent in self.expired():
            if stopping():
                break
            if not self._is_expired(agent, now_ms()):
                continue  # read since the scan
            idle_s = (now_ms() - self.capacity.agent_last_access(agent)) // 1000
            try:
                self.delete(agent.namespace, agent.agent_id, agent.generation, "expired_agents")
            except AgentKVError as exc:  # committed or deleted meanwhile; not this store's
                where = {"namespace": agent.namespace, "agent": agent.agent_id}
                log.debug("idle agent kept", extra={**where, "why": exc.message})
                continue
            agents += 1
            blocks += self.capacity.drop_unreferenced(agent.namespace, agent.block_keys)
            self._note_gone(agent, idle_s)
        if agents:
            self.capacity.metrics.evictions.labels("idle_agent").inc(agents)
            log.info("idle agents deleted", extra={"agents": agents, "blocks": blocks})

    def _note_gone(self, agent: AgentRecord, idle: int) -> None:
        limit = human_seconds(self.config.agent_idle(agent.namespace))
        why = f"deleted at {utc_time(now_ms())} UTC, unused for {idle} s (--agent-idle {limit})"
        self._gone[(agent.namespace, agent.agent_id)] = why
        while len(self._gone) > MAX_GONE:
            self._gone.popitem(last=False)
        log.info(
            "idle agent deleted",
            extra={"namespace": agent.namespace, "agent": agent.agent_id, "idle_s": idle},
        )
