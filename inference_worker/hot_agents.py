"""What the worker's RPCs do to the agents in RAM (describe, pin, fork, evict, delete),
on the MLX thread, which owns them: the engine hands these out (Engine.agents)."""

from __future__ import annotations

from concurrent.futures import Future

from agentkv.errors import AgentBusy, AgentExists
from inference_worker.agents import Agent, HotTier
from inference_worker.batching import Batcher
from inference_worker.persistence import Persister, not_committed
from inference_worker.turns import AgentInfo


class HotAgents:
    """The agents in RAM as RPCs see them: each call runs on the MLX thread (Front._mlx)."""

    def __init__(self, hot: HotTier, batcher: Batcher, persister: Persister) -> None:
        self.hot, self.batcher, self.persister = hot, batcher, persister

    def describe_hot(self, ns: str, agent_id: str) -> AgentInfo | None:
        """The agent's state if it is in RAM here; None if only the store may hold it."""
        agent = self.hot.get((ns, agent_id))
        if agent is None:
            return None
        info = agent.info("hot")
        info.pinned = agent.id in self.hot.pinned
        return info

    def tools_of(self, ns: str, agent_id: str) -> str | None:
        """The tools of the agent's conversation if it is in RAM here, else None."""
        agent = self.hot.get((ns, agent_id))
        return None if agent is None else agent.chat.tools

    def pin(self, ns: str, agent_id: str, pinned: bool) -> None:
        """Pins the agent (it need not be in RAM now), or unpins it: see HotTier."""
        self.hot.pin((ns, agent_id), pinned)

    def fork_source(self, ns: str, source_id: str, agent_id: str) -> bool:
        """Checks a fork can start here; whether its source is in RAM (it must then be made
        durable first) rather than only in the store."""
        if self.hot.get((ns, agent_id)) is not None:
            raise AgentExists(f"agent {agent_id!r} already exists in namespace {ns!r}")
        source = self.hot.get((ns, source_id))
        if source is None or source.stale:
            return False
        self._check_idle(source, "fork")
        return True

    def write_pending(self, ns: str, agent_id: str, retry: bool) -> Future | None:
        """The agent's store write in flight, for the caller to wait on off this thread;
        with `retry`, a new one when the last failed or left tokens unwritten."""
        agent = self.hot.get((ns, agent_id))
        if agent is None or self.batcher.holds(agent):
            return None  # durable_agent then says why
        return self.persister.pending(agent, retry)

    def durable_agent(self, ns: str, agent_id: str, what: str) -> Agent | None:
        """The agent in RAM, whose whole cache is committed; None when it is not in RAM.
        Raises when it is mid-turn, or its cache was not committed (write_pending first)."""
        agent = self.hot.get((ns, agent_id))
        if agent is None:
            return None
        self._check_idle(agent, what)
        if agent.writing:  # a turn ended after the caller waited (write_pending): not a fault
            raise AgentBusy(
                f"agent {agent_id!r} ended a turn meanwhile, and that turn's write is in "
                f"flight; {what} it once the write lands"
            )
        if not agent.durable or agent.persist_failed:
            raise not_committed(agent, agent.persist_error, "the cache")
        return agent

    def evict(self, ns: str, agent_id: str) -> tuple[bool, int]:
        """Drops a durable agent from RAM (write_pending first), or a stale one (another
        worker committed it since); (evicted, bytes freed)."""
        agent = self.hot.get((ns, agent_id))
        if agent is not None and agent.gone_stale:
            self._check_idle(agent, "evict")
        else:
            agent = self.durable_agent(ns, agent_id, "evict")  # checks it is idle too
        if agent is None:
            return False, 0
        self.hot.pop(agent.id)
        return True, agent.nbytes

    def drop(self, ns: str, agent_id: str) -> Agent | None:
        """Forgets the agent here (it is being deleted); the agent, if it was in RAM. One
        with a turn in flight is not deleted: the turn would put it back."""
        agent = self.hot.get((ns, agent_id))
        if agent is not None and self.batcher.holds(agent):
            raise AgentBusy(
                f"agent {agent_id!r} has a turn in progress: delete it once the turn ends"
            )
        self.hot.pin((ns, agent_id), False)
        return self.hot.pop((ns, agent_id))

    def keep(self, agent: Agent) -> None:
        """Takes back an agent whose deletion failed, unless one of its id came meanwhile."""
        if self.hot.get(agent.id) is None:
            self.hot.put(agent)

    def _check_idle(self, agent: Agent, what: str) -> None:
        if self.batcher.holds(agent):
            raise AgentBusy(f"agent {agent.agent_id!r} is mid-turn; {what} it after the turn")
