"""Whether a hot agent's RAM copy is still its latest state, without the MLX thread ever
waiting for the store.

Another worker may have committed turns of the agent since (a client that failed over and
came back). The RPC thread asks the store for the agent's summary under a short deadline
(`read_view`) before it hands the turn to the MLX thread, which compares (`is_current`). A
store that is down, hung or slow costs at most that deadline, and the RAM copy stands.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentkv.client.store import StoreClient
from agentkv.errors import AgentKVError, AgentNotFound
from agentkv.v1 import store_pb2 as pb
from inference_worker.agents import Agent


@dataclass(frozen=True, slots=True)
class StoreView:
    """What the store said of an agent, and when it was asked."""

    asked_at: float  # time.monotonic() before the request went out
    manifest: Any = None  # the summary (an AgentManifest); None when the store has none
    answered: bool = True  # False: the store could not be asked (down, hung, refusing)


def read_view(
    client: StoreClient,
    namespace: str,
    agent_id: str,
    timeout: float | None = None,
    unanswered: type[AgentKVError] = AgentKVError,
    peek: bool = False,
) -> StoreView:
    """The agent's summary in the store, waiting at most `timeout` seconds (the client's
    own deadline when None). An `unanswered` error is a view without an answer; any other
    raises. `peek`: an inspection, which the store does not count as a use."""
    asked_at = time.monotonic()
    request = pb.GetAgentRequest(
        namespace=namespace, agent_id=agent_id, summary_only=True, peek=peek
    )
    try:
        return StoreView(asked_at, client.call("GetAgent", request, timeout=timeout).agent)
    except AgentNotFound:
        return StoreView(asked_at)
    except unanswered:
        return StoreView(asked_at, answered=False)


def is_current(agent: Agent, view: StoreView | None, adopt: Callable[[Agent, Any], bool]) -> bool:
    """Whether the RAM copy is the agent's latest state, by `view` (on the MLX thread).
    With no answer, while this worker's own write is in flight, or when that view may
    predate its last commit, the RAM copy stands. `adopt` takes a newer manifest that is
    this worker's own commit whose reply was lost (Persister.adopt_own_commit)."""
    if view is None or not view.answered or view.asked_at <= agent.synced_at:
        return True
    if agent.writing:
        return True
    if view.manifest is None:
        # Never committed (the store was full or down since its creation): RAM is all
        # there is. Committed once and gone now: deleted elsewhere, the restore says so.
        return agent.generation == 0
    if view.manifest.generation == agent.generation:
        return True
    return adopt(agent, view.manifest)
