"""Writing agents to the store after every turn, off the MLX thread.

The MLX thread cuts the new blocks (evaluated, copied to host memory) and queues them; one
writer thread uploads them and commits the manifest with compare-and-swap, in turn order.
A reply never waits for the disk. A crash loses only work never committed.

A commit whose reply is lost (the store died after applying it) is "in doubt". Each commit
carries an id in the manifest's metadata, so when the store later shows a newer generation,
the worker can tell its own commit from another writer's and keep the turns it served since.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from agentkv.client.blocks import Block
from agentkv.client.store import StoreClient
from agentkv.errors import (
    AgentKVError,
    AgentNotFound,
    DeadlineExceeded,
    FailedPrecondition,
    GenerationConflict,
    NotCommitted,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from inference_worker.agents import Agent
from inference_worker.blocks import cache_blocks
from inference_worker.conversation import common_prefix
from inference_worker.metadata import COMMIT_ID, chat_metadata
from inference_worker.metrics import WorkerMetrics

log = logging.getLogger("agentkv.worker")
Written = tuple[list[bytes], int, list[int]]  # Snapshot.written
NOT_WRITTEN = "the worker stopped before writing agent {!r}: the store keeps its last commit"


@dataclass(slots=True)
class Snapshot:
    """One agent's state at the end of a turn, ready to write."""

    tokens: list[int]
    blocks: list[Block]  # new blocks, from the last full-block boundary on
    keys: list[bytes]  # theirs
    stored_keys: list[bytes]  # the full blocks before them, stored or queued earlier
    new_full_keys: list[bytes]
    cached: int
    phase: str
    metadata: dict[str, str]

    @property
    def written(self) -> Written:
        """What a commit of it makes durable: full block keys, cache tokens, all tokens."""
        return self.stored_keys + self.new_full_keys, self.cached, self.tokens


def snapshot(agent: Agent, fingerprint: str, block_tokens: int) -> Snapshot:
    """Cuts the agent's unsaved blocks. Runs on the MLX thread (it evaluates arrays)."""
    if agent.persist_failed:
        # Cut again from the last committed block on. When the store has lost a block, from
        # the first block on instead, which heals it, where the caches still hold every
        # position (a sliding-window layer forgets what left its window once committed).
        keep = len(agent.committed_full_keys)
        if isinstance(agent.persist_error, NotFound):
            held_from = max((c.start for c in agent.caches), default=0)
            keep = -(-held_from // block_tokens)
        agent.queued_full_keys = list(agent.committed_full_keys[:keep])
        agent.persist_error = None
    stored = list(agent.queued_full_keys)
    start = len(stored) * block_tokens
    parent = stored[-1] if stored else b""
    blocks, keys = cache_blocks(
        agent.caches, agent.tokens, fingerprint, block_tokens, start, parent
    )
    full = [k for k, b in zip(keys, blocks, strict=True) if len(b.token_ids) == block_tokens]
    agent.queued_full_keys = stored + full
    metadata = {**agent.metadata, **chat_metadata(agent.chat)}
    return Snapshot(
        list(agent.tokens), blocks, keys, stored, full, agent.cached, agent.phase, metadata
    )


def commit_id(expected_generation: int, snap: Snapshot) -> str:
    """Names a commit by the generation it expects and what it writes: every retry of one
    state has the same id, so a commit whose reply was lost is recognised afterwards."""
    h = hashlib.blake2b(f"{expected_generation}:{len(snap.tokens)}:".encode(), digest_size=12)
    for key in (*snap.stored_keys, *snap.keys):
        h.update(key)
    return h.hexdigest()


def not_committed(agent: Agent, error: AgentKVError | None, what: str) -> AgentKVError:
    """The error for `what`, which needed the agent durable, when the store refused: a full
    store keeps its RESOURCE_EXHAUSTED and a store's refusal its FAILED_PRECONDITION (a
    namespace another store writes: no retry through this store fares better), all else is
    UNAVAILABLE (NotCommitted); either way the agent stays in this worker's RAM and is
    written later. But when another worker committed the agent meanwhile, this copy is not
    written at all: ABORTED (GenerationConflict), saying so; or NOT_FOUND when that was a
    delete (generation 0: the turn, sent again, would find no agent)."""
    if agent.stale or isinstance(error, GenerationConflict):
        current = error.current_generation if isinstance(error, GenerationConflict) else 0
        if isinstance(error, GenerationConflict) and not current:
            return AgentNotFound(
                f"{what} of agent {agent.agent_id!r} in namespace {agent.namespace!r} was not "
                "committed: the agent was deleted meanwhile (elsewhere: another worker, or a "
                "store client), and this copy is dropped"
            )
        return GenerationConflict(
            f"{what} of agent {agent.agent_id!r} in namespace {agent.namespace!r} was not "
            "committed: another worker committed the agent meanwhile, and the store keeps "
            "that; this one is dropped (send it again)",
            current,
        )
    reason = error.message if error is not None else "the store is unreachable"
    message = (
        f"{what} of agent {agent.agent_id!r} was not committed to the store ({reason}); "
        "it stays in this worker's RAM and is written once the store takes it"
    )
    if isinstance(error, ResourceExhausted):
        return type(error)(message)
    refused = isinstance(error, FailedPrecondition) and error.remote  # the store's word
    return FailedPrecondition(message) if refused else NotCommitted(message)


def _back_off(agent: Agent) -> None:
    """One more write refused in a row: the next is tried 2 s, 4 s, ... up to a minute on."""
    agent.refusals += 1
    wait = 2.0 * 2 ** min(agent.refusals - 1, 5)
    agent.retry_at = time.monotonic() + min(60.0, wait)


def _committed(agent: Agent, generation: int, written: Written, block_tokens: int) -> None:
    """Records a commit. A turn that began since may have cut the context back: only the
    part it kept is durable (Agent.begin_turn)."""
    full_keys, cached, tokens = written
    with agent.lock:  # Agent.begin_turn may cut the context meanwhile
        same = common_prefix(tokens, agent.tokens)
        agent.generation = generation
        agent.committed_full_keys = full_keys[: same // block_tokens]
        agent.persisted_tokens = min(cached, same)
    agent.in_doubt.clear()
    agent.refusals, agent.retry_at = 0, 0.0
    agent.synced_at = time.monotonic()


def turn_not_durable(agent: Agent, error: AgentKVError | None) -> AgentKVError | None:
    """What a durable turn ends with once its write is done: None when it was committed."""
    if error is None and not agent.stale:
        return None
    return not_committed(agent, error, "the turn ran, but the cache")


class Persister:
    def __init__(
        self,
        client: StoreClient,
        fingerprint: str,
        block_tokens: int,
        metrics: WorkerMetrics,
        on_written: Callable[[Agent], None],  # after each write, on the writer thread
    ) -> None:
        self.client, self.fingerprint, self.block_tokens = client, fingerprint, block_tokens
        self.metrics, self._on_written = metrics, on_written
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="agentkv-persist")
        self._stopping = threading.Event()  # past close()'s wait: no write reaches the store

    def persist(self, agent: Agent) -> None:
        """Cuts the agent's unsaved blocks (on the MLX thread: it evaluates arrays) and
        queues their write (agent.pending)."""
        try:
            snap = snapshot(agent, self.fingerprint, self.block_tokens)
        except Exception as exc:  # ValueError: blocks it would rewrite have left a window
            # cache; else evaluating them failed (MLX is lazy: out of memory, say). Either way
            # the turn has ended and its reply is out: its write fails, and is tried again.
            log.error(
                "cannot persist agent",
                extra={"agent": agent.agent_id, "error": str(exc)},
                exc_info=not isinstance(exc, ValueError) and not agent.refusals,  # once
            )
            failed = FailedPrecondition if isinstance(exc, ValueError) else AgentKVError
            agent.persist_error = failed(str(exc))
            _back_off(agent)  # not soon over either: tried again after a while
            agent.pending = Future()  # a write that failed at once: a durable turn says so
            agent.pending.set_result(self._report("failed", agent.persist_error))
            return
        agent.pending = self._pool.submit(self._save, agent, snap)
        agent.pending.add_done_callback(lambda write: self._on_written(agent))

    def pending(self, agent: Agent, retry: bool) -> Future | None:
        """The agent's write in flight; with `retry`, a new one when the last failed or left
        tokens unwritten (not when it is stale: the store keeps another worker's commit)."""
        if agent.writing:
            return agent.pending
        if retry and not agent.stale and (agent.persist_failed or not agent.durable):
            self.persist(agent)
            return agent.pending
        return None

    def _save(self, agent: Agent, snap: Snapshot) -> AgentKVError | None:
        """Writes and commits one snapshot; the error that stopped it, or None."""
        if self._stopping.is_set():  # the server's stop cut every call: no durable turn waits
            agent.persist_error = Unavailable(NOT_WRITTEN.format(agent.agent_id))
            return agent.persist_error
        expected = agent.generation
        cid = commit_id(expected, snap)
        try:
            _, manifest = self.client.save_agent(
                agent.namespace,
                agent.agent_id,
                self.fingerprint,
                snap.tokens,
                snap.blocks,
                expected_generation=expected,
                stored_keys=snap.stored_keys,
                phase=snap.phase,
                metadata={**snap.metadata, COMMIT_ID: cid},
            )
        except GenerationConflict as exc:
            if self.adopt_own_commit(agent):
                return self._save(agent, snap)  # ours after all: this one goes on top
            agent.stale = True  # another worker owns the newer state; reload before use
            where = "deleted" if not exc.current_generation else "committed"
            log.warning(
                f"agent {where} elsewhere: this worker's turns since its last commit dropped",
                extra={
                    "namespace": agent.namespace,
                    "agent": agent.agent_id,
                    "generation": exc.current_generation,
                    "dropped_tokens": len(agent.tokens) - agent.persisted_tokens,
                },
            )
            return self._report("conflict", exc)
        except AgentKVError as exc:
            if isinstance(exc, (Unavailable, DeadlineExceeded)):  # it may have been applied
                agent.in_doubt[cid] = snap.written
            agent.persist_error = exc
            # A quota or a full disk; a namespace another store writes: not soon over.
            if isinstance(exc, ResourceExhausted | FailedPrecondition):
                _back_off(agent)
            log.warning(
                "persist failed",
                extra={"namespace": agent.namespace, "agent": agent.agent_id, "error": exc.message},
            )
            return self._report("failed", exc)
        _committed(agent, manifest.generation, snap.written, self.block_tokens)
        return self._report("ok", None)

    def adopt_own_commit(self, agent: Agent, manifest: Any = None) -> bool:
        """Whether the store's newer manifest (read when not given) is a commit of this
        worker's whose reply was lost; if so the agent takes it as committed."""
        if not agent.in_doubt:
            return False
        if manifest is None:
            try:
                manifest = self.client.get_agent(agent.namespace, agent.agent_id, summary_only=True)
            except AgentKVError:
                return False
        mine = agent.in_doubt.get(manifest.metadata.get(COMMIT_ID, ""))
        # A first commit's generation is the store's first for a new agent (past those of
        # the agents it deleted), any other's the next.
        if mine is None or (agent.generation and manifest.generation != agent.generation + 1):
            return False
        log.info(
            "own commit adopted, its reply was lost",
            extra={"agent": agent.agent_id, "generation": manifest.generation},
        )
        _committed(agent, manifest.generation, mine, self.block_tokens)
        return True

    def _report(self, outcome: str, error: AgentKVError | None) -> AgentKVError | None:
        self.metrics.persists.labels(outcome=outcome).inc()
        return error

    def flush(self) -> None:
        """Waits for every queued write."""
        self._pool.submit(lambda: None).result()

    def close(self, timeout: float | None = None) -> bool:
        """Lets the queued writes finish for up to `timeout` seconds (None: however long);
        whether they did. Past it (a hung store), the writes not begun skip the store, and
        the caller cuts the one in flight (closing the store client), then calls join()."""
        last = self._pool.submit(lambda: None)  # one writer: done once all before it are
        self._pool.shutdown(wait=False)
        if wait([last], timeout).done:
            return True
        self._stopping.set()
        return False

    def join(self) -> None:
        """Waits for the writer thread to end (after close())."""
        self._pool.shutdown(wait=True)
