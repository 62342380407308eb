"""The engine: the one thread that owns MLX, and everything it does for agents.

RPC handlers hand it work through `submit`; a turn's tokens come back through the job's
event queue. Arrays that leave this thread (blocks for the store) are evaluated first. This
thread never waits for the store: reads happen on the RPC thread before its work is
submitted (inference_worker.front), writes on the persister's thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import mlx.core as mx

from agentkv import ids
from agentkv.errors import (
    AgentExists,
    AgentKVError,
    FailedPrecondition,
    InvalidArgument,
    OutOfRange,
)
from agentkv.layers import KVStorage
from client.store import StoreClient
from inference_worker.agents import Agent, Checkpoint, HotTier
from inference_worker.batching import ActiveTurn, Batcher
from inference_worker.chat import ChatFormat, ChatState, common_prefix
from inference_worker.config import WorkerConfig
from inference_worker.freshness import StoreView, is_current
from inference_worker.layer_spec import model_layers
from inference_worker.metrics import WorkerMetrics
from inference_worker.persistence import (
    MAX_SYSTEM_CHUNKS,
    SYSTEM_CHUNK,
    Persister,
    not_committed,
    snapshot,
)
from inference_worker.restore import Fetched, Restorer
from inference_worker.sampling import StopMatcher, vocab_size
from inference_worker.scheduler import Request, Scheduler
from inference_worker.turns import END, AgentInfo, TurnJob, UsageEvent

log = logging.getLogger("agentkv.worker")
_IDLE = object()  # no job arrived while turns are in flight
CATCH_UP_SECONDS = 2.0  # how often a worker retries writes the store refused
# What a turn hears when the batched step it was in failed for everyone: never the error's
# own text, which may quote another tenant's request.
STEP_FAILED = "the batched model step failed; this turn left no trace in its agent, retry it"


class Engine:
    def __init__(
        self,
        config: WorkerConfig,
        load_model: Callable[[], tuple[Any, Any]],
        fingerprint: str,
        client: StoreClient,
        metrics: WorkerMetrics,
        max_context: int,
        restore_path: str,
        quantized_query_max: int,
    ) -> None:
        """Starts the MLX thread, which loads the model itself: MLX ties arrays to the thread
        that made them, so the model must live where it runs."""
        self.config, self.fingerprint, self.client = config, fingerprint, client
        self.metrics, self.max_context, self.qmax = metrics, max_context, quantized_query_max
        self._jobs: queue.Queue = queue.Queue()
        self.batcher: Batcher | None = None  # made once the model is loaded
        self._thread = threading.Thread(target=self._loop, name="agentkv-mlx", daemon=True)
        self._thread.start()
        self.model, self.tokenizer = self.submit(load_model).result()
        try:  # one probe token through the model: also proves it runs here
            self.layers = self.submit(model_layers, self.model).result()
        except RuntimeError as exc:
            self._jobs.put(None)
            self._thread.join(timeout=60)
            raise RuntimeError(
                f"the model does not run on this device in this dtype: {exc} "
                "(on CPU, --dtype float32 runs everything)"
            ) from exc
        self.num_layers = len(self.layers)
        self.vocab_size = self.submit(vocab_size, self.model).result()
        # Sliding-window layers keep only their window (and restore only blocks reaching it).
        self.windows = [layer.window if config.window_caches else None for layer in self.layers]
        self.chat = ChatFormat(self.tokenizer)
        self.hot = HotTier(config.hot_budget_bytes)
        self.persister = Persister(
            client, fingerprint, lambda outcome: metrics.persists.labels(outcome=outcome).inc()
        )
        self.scheduler = Scheduler(
            config.max_batch,
            max(config.step_tokens, config.max_batch),
            config.prefill_chunk,
            config.queue_limit,
            config.hot_budget_bytes,
        )
        self._turn_ids = itertools.count(1)
        fmt = config.kv
        k_store, v_store = (
            KVStorage(bits, fmt.group_size, 2 if fmt.scale_dtype == "float16" else 4)
            for bits in (fmt.k_bits, fmt.v_bits)
        )
        self._token_bytes = sum(  # one token of context in every layer's Q4 cache
            s.kv_heads * (k_store.vector_bytes(s.k_head_dim) + v_store.vector_bytes(s.v_head_dim))
            for s in self.layers
        )
        self.batcher = self._new_batcher()
        self.restorer = Restorer(
            client,
            fingerprint,
            config.kv,
            self.layers,
            config.block_tokens,
            restore_path,
            quantized_query_max,
            self.windows,
        )

    # the MLX thread

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._jobs.put((fn, args, future))
        return future

    def _loop(self) -> None:
        """Runs queued work; while turns are in flight, one model step between jobs. Every
        few seconds it retries writes the store refused (_catch_up), busy or not: a turn may
        be waiting for RAM that only those agents hold until they are durable."""
        last_catch_up = time.monotonic()
        while True:
            try:
                item = self._jobs.get(block=not self._busy, timeout=CATCH_UP_SECONDS)
            except queue.Empty:
                item = _IDLE
            if item is None:
                return
            if item is not _IDLE:
                self._run(*item)
            if self._busy:
                self._step()
            if time.monotonic() - last_catch_up >= CATCH_UP_SECONDS and self.batcher:
                last_catch_up = time.monotonic()
                self._catch_up()

    @property
    def _busy(self) -> bool:
        return self.batcher is not None and bool(self.batcher.active)

    def _run(self, fn: Callable[..., Any], args: tuple, future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)

    def _step(self) -> None:
        if self.scheduler.waiting:  # only admitting a waiting turn reads it
            self._make_room()
        try:
            self.batcher.step()
        except Exception:  # a failed shared step fails every turn in flight, not the worker
            log.exception("model step failed")
            for turn in self.batcher.drop_all():
                self._turn_failed(turn, AgentKVError(STEP_FAILED), scope="batch")

    def _make_room(self) -> None:
        """Idle hot agents give way to a waiting turn: the hot tier is a cache, and a turn
        must not wait for RAM that only idle agents hold. Least recently used first, and
        only durable ones (their state is in the store)."""
        busy = {t.agent.id for t in self.batcher.active.values()}
        idle = [a for a in self.hot.agents() if a.id not in busy]  # LRU first
        held = sum(a.nbytes for a in idle)
        room = self.scheduler.hot_room()
        for agent in idle:
            if held <= room:
                break
            if agent.durable and not agent.persist_failed:
                self.hot.pop(agent.id)
                held -= agent.nbytes
                log.info("agent evicted for a waiting turn", extra={"agent": agent.agent_id})
                self.metrics.evictions.labels(reason="waiting_turn").inc()
        self.scheduler.hot_bytes = held
        self.metrics.hot_bytes.set(self.hot.nbytes)
        if held > room and not self.scheduler.running:
            time.sleep(0.005)  # nothing can run until a write lands: do not spin

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)
        self.persister.close()

    def _new_batcher(self) -> Batcher:
        return Batcher(
            self.model,
            self.chat.eos_ids,
            self.scheduler,
            self.qmax,
            self._turn_done,
            self._turn_failed,
            self.metrics.batch_size.observe,
        )

    # agents (each runs on the MLX thread)

    def create_agent(
        self, ns: str, agent_id: str, system: str, phase: str, metadata: dict[str, str]
    ) -> AgentInfo:
        ns, agent_id = ids.namespace(ns), ids.agent_id(agent_id)
        metadata = ids.metadata(metadata)
        if self.hot.get((ns, agent_id)) is not None:  # the RPC thread asked the store
            raise AgentExists(f"agent {agent_id!r} already exists in namespace {ns!r}")
        if len(system) > SYSTEM_CHUNK * MAX_SYSTEM_CHUNKS:
            raise InvalidArgument(
                f"system prompt of {len(system)} characters is over the "
                f"{SYSTEM_CHUNK * MAX_SYSTEM_CHUNKS} an agent keeps until its first turn"
            )
        tokens, chat = self.chat.start(system)
        agent = Agent(
            ns,
            agent_id,
            tokens,
            self.restorer.empty_caches(),
            phase=phase,
            metadata=metadata,
            chat=chat,
        )
        self._check_context(agent, 0)
        for cache in agent.caches:
            cache.begin_turn()
        self._prefill(agent, need_logits=False)
        self._finish_turn(agent)
        return self._info(agent, "hot")

    def start_turn(
        self, job: TurnJob, view: StoreView | None = None, fetched: Fetched | None = None
    ) -> bool:
        """Prepares a turn and queues it for the batch; its tokens, usage and END arrive on
        job.events. Errors before it is queued are raised; a refused turn leaves the agent
        exactly as it was, so the client may retry. `view` is what the store said of the
        agent (freshness). Returns False, changing nothing, when the agent must first be
        read from the store: the caller fetches it (Restorer.fetch, off this thread) and
        calls again with it."""
        usage = UsageEvent()
        agent = self._checkout(job.namespace, job.agent_id, usage, view, fetched)
        if agent is None:
            return False
        turn, tokens, chat = self._prepare(job, agent, usage)
        if turn.pending:
            self.batcher.add(turn)  # may refuse: RESOURCE_EXHAUSTED
        drop = agent.cached - (len(tokens) - len(turn.pending))
        for cache in agent.caches:
            if drop > 0:  # the last token runs again for its logits, or a first turn
                cache.trim(drop)  # rendered the conversation's start differently
            cache.begin_turn()
        turn.undo = Checkpoint.of(agent)
        kept_blocks = common_prefix(agent.tokens, tokens) // self.config.block_tokens
        del agent.queued_full_keys[kept_blocks:], agent.committed_full_keys[kept_blocks:]
        agent.tokens, agent.chat = tokens, chat
        agent.phase = job.phase or agent.phase
        if not turn.pending:  # nothing to run: an empty append-only turn ends here
            turn.usage.finish_reason = "none"
            self._turn_done(turn)
        return True

    def _prepare(
        self, job: TurnJob, agent: Agent, usage: UsageEvent
    ) -> tuple[ActiveTurn, list[int], ChatState]:
        """The turn and the agent's new context, computed without changing the agent."""
        if self.batcher.holds(agent):
            raise FailedPrecondition(f"agent {agent.agent_id!r} already has a turn in progress")
        sampling = job.sampling
        tokens, chat = self.chat.extend(
            agent.tokens, agent.chat, job.messages, sampling.max_tokens > 0
        )
        self._check_context(agent, len(tokens) - len(agent.tokens) + sampling.max_tokens)
        reuse = common_prefix(agent.tokens[: agent.cached], tokens)
        if reuse < agent.cached:  # a first turn kept only part of the stable prefix
            usage.reused_hot_tokens = min(usage.reused_hot_tokens, reuse)
            usage.reused_store_tokens = min(usage.reused_store_tokens, reuse)
        if sampling.max_tokens > 0 and reuse == len(tokens):
            reuse -= 1  # the last token runs again, for its logits
        if reuse < max(c.start for c in agent.caches):
            raise FailedPrecondition(
                f"agent {agent.agent_id!r}: its first turn renders the conversation's start "
                "differently, and its sliding-window caches no longer hold it"
            )
        pending = tokens[reuse:]
        usage.prompt_tokens, usage.prefilled_tokens = len(tokens), len(pending)
        deadline = time.monotonic() + job.deadline_ms / 1000 if job.deadline_ms else None
        memory = self._memory_for(agent, len(tokens) + sampling.max_tokens)
        request = Request(
            f"{next(self._turn_ids)}",
            len(pending),
            sampling.max_tokens,
            memory,
            job.priority,
            deadline,
        )
        turn = ActiveTurn(
            job,
            agent,
            usage,
            request,
            pending,
            sampling.sampler(),
            self.tokenizer.detokenizer,
            StopMatcher(sampling.stop),
        )
        return turn, tokens, chat

    def _turn_failed(self, turn: ActiveTurn, error: Exception, scope: str = "turn") -> None:
        """A turn failed after it was queued: its agent goes back to before it (so a retry
        does not say its messages twice), and its stream ends with `error`, its own."""
        agent = turn.agent
        if not isinstance(error, AgentKVError):  # a bug, or a bad input not caught at submit
            log.error("turn failed", extra={"agent": agent.agent_id, "error": repr(error)})
            error = AgentKVError(
                f"turn of agent {agent.agent_id!r} failed: {type(error).__name__}: {error}"
            )
        if turn.undo is not None and not turn.undo.restore(agent):
            self.hot.pop(agent.id)  # its caches cannot be rewound: the store's copy is right
            log.warning(
                "agent dropped from RAM after a failed turn", extra={"agent": agent.agent_id}
            )
        self.metrics.turn_failures.labels(scope=scope).inc()
        turn.job.error = error
        turn.job.events.put(END)

    def _turn_done(self, turn: ActiveTurn) -> None:
        """A turn left the batch: persist the agent, send its usage, close its stream."""
        usage, agent = turn.usage, turn.agent
        if usage.generated_tokens:
            agent.chat.reply_open, agent.chat.last_role = True, "assistant"
            self.metrics.generated_tokens.inc(usage.generated_tokens)
            self.metrics.ttft.observe(usage.time_to_first_token_ms / 1000)
        if usage.generated_tokens > 1:
            elapsed = max(time.perf_counter() - turn.first_at, 1e-9)
            usage.decode_tokens_per_second = (usage.generated_tokens - 1) / elapsed
        self._finish_turn(agent)
        self.metrics.turns.labels(state=usage.cache_state).inc()
        job = turn.job
        if job.durable and agent.pending is not None:
            agent.pending.add_done_callback(
                lambda write: self._end_durable(job, agent, usage, write.result())
            )
            return
        job.events.put(usage)
        job.events.put(END)

    @staticmethod
    def _end_durable(
        job: TurnJob, agent: Agent, usage: UsageEvent, error: AgentKVError | None
    ) -> None:
        """Ends a durable turn once its commit is done (on the writer thread)."""
        if error is not None or agent.stale:
            job.error = not_committed(agent, error, "the turn ran, but the cache")
        job.events.put(usage)
        job.events.put(END)

    def _memory_for(self, agent: Agent, num_tokens: int) -> int:
        """KV bytes the agent holds at its longest in a turn reaching `num_tokens`: what it
        holds now, plus every new token in every layer (a window layer keeps them too until
        they are committed, after the turn). The fp16 copy a turn keeps of its own tokens
        while it prefills is working memory, like the forward's activations: not counted."""
        return agent.nbytes + max(0, num_tokens - agent.cached) * self._token_bytes

    def describe_hot(self, ns: str, agent_id: str) -> AgentInfo | None:
        """The agent's state if it is in RAM here; None if only the store may hold it."""
        ns, agent_id = ids.namespace(ns), ids.agent_id(agent_id)
        agent = self.hot.get((ns, agent_id))
        return self._info(agent, "hot") if agent is not None else None

    def fork_source(self, ns: str, source_id: str, agent_id: str) -> bool:
        """Checks a fork can start here; whether its source is in RAM (it must then be made
        durable first) rather than only in the store."""
        if self.hot.get((ns, agent_id)) is not None:
            raise AgentExists(f"agent {agent_id!r} already exists in namespace {ns!r}")
        source = self.hot.get((ns, source_id))
        if source is None or source.stale:
            return False
        if self.batcher.holds(source):
            raise FailedPrecondition(f"agent {source_id!r} is mid-turn; fork it after the turn")
        return True

    def write_pending(self, ns: str, agent_id: str, retry: bool) -> Future | None:
        """The agent's store write in flight, for the caller to wait on off this thread;
        with `retry`, a new one when the last failed or left tokens unwritten."""
        agent = self.hot.get((ns, agent_id))
        if agent is None or self.batcher.holds(agent):
            return None  # durable_agent then says why
        if agent.pending is not None and not agent.pending.done():
            return agent.pending
        if retry and (agent.persist_failed or agent.persisted_tokens < agent.cached):
            self._persist(agent)
            return agent.pending
        return None

    def durable_agent(self, ns: str, agent_id: str, what: str) -> Agent | None:
        """The agent in RAM, whose whole cache is committed; None when it is not in RAM.
        Raises when it is mid-turn, or its cache was not committed (write_pending first)."""
        agent = self.hot.get((ns, agent_id))
        if agent is None:
            return None
        if self.batcher.holds(agent):
            raise FailedPrecondition(f"agent {agent_id!r} is mid-turn; {what} it after the turn")
        if not agent.durable or agent.persist_failed:
            raise not_committed(agent, agent.persist_error, "the cache")
        return agent

    def evict(self, ns: str, agent_id: str) -> tuple[bool, int]:
        """Drops a durable agent from RAM (write_pending first); (evicted, bytes freed)."""
        agent = self.durable_agent(ns, agent_id, "evict")
        if agent is None:
            return False, 0
        self.hot.pop(agent.id)
        return True, agent.nbytes

    def drop(self, ns: str, agent_id: str) -> Agent | None:
        """Forgets the agent here (it is being deleted); the agent, if it was in RAM."""
        return self.hot.pop((ns, agent_id))

    # turn steps

    def _checkout(
        self,
        ns: str,
        agent_id: str,
        usage: UsageEvent,
        view: StoreView | None,
        fetched: Fetched | None,
    ) -> Agent | None:
        """The agent in RAM if that copy is current, else restored from `fetched`; None when
        it must be fetched first."""
        ns, agent_id = ids.namespace(ns), ids.agent_id(agent_id)
        agent = self.hot.get((ns, agent_id))
        adopt = self.persister.adopt_own_commit
        if agent is not None and (agent.stale or not is_current(agent, view, adopt)):
            self.hot.pop(agent.id)
            agent = None
        if agent is not None:
            usage.cache_state, usage.reused_hot_tokens = "hot", agent.cached
            return agent
        if fetched is None:
            return None
        restored = self.restorer.build(fetched)
        usage.reused_store_tokens = restored.tokens_restored
        usage.cache_state = "warm" if restored.tokens_restored else "cold"
        usage.restore_path, usage.restore_failure = restored.path, restored.failure
        usage.restored_bytes = restored.bytes_read
        if restored.failure:
            self.metrics.restore_failures.inc()
        self.hot.put(restored.agent)
        return restored.agent

    def _catch_up(self) -> None:
        """Retries the writes of hot agents whose last persist failed (the store was down or
        full): once the store is back, every turn served meanwhile becomes durable."""
        for agent in self.hot.agents():
            waiting = agent.pending is not None and not agent.pending.done()
            mid_turn = self.batcher.holds(agent)  # its caches live in the batch now
            if agent.persist_failed and not (waiting or mid_turn or agent.stale):
                self._persist(agent)

    def _prefill(self, agent: Agent, need_logits: bool) -> tuple[int, mx.array | None]:
        """Runs the tokens the cache lacks through the model in chunks; the last logits."""
        if need_logits and agent.cached == len(agent.tokens):
            for cache in agent.caches:
                cache.trim(1)  # re-run the last token to get its logits
        pending = agent.tokens[agent.cached :]
        logits = None
        step = self.config.prefill_chunk
        agent.keep_undurable()
        for start in range(0, len(pending), step):
            logits = self.model(mx.array([pending[start : start + step]]), cache=agent.caches)
            mx.eval(logits)
        return len(pending), (logits[0, -1] if logits is not None else None)

    def _finish_turn(self, agent: Agent) -> None:
        """Queues the store write, then keeps the hot tier within budget."""
        for cache in agent.caches:
            cache.end_turn()  # the next turn sees what is stored, as a restored agent does
        self._persist(agent)
        self.hot.put(agent)
        busy = {t.agent.id for t in self.batcher.active.values()} | {agent.id}
        for evicted in self.hot.enforce(keep=busy):
            log.info("agent evicted to the store", extra={"agent": evicted.agent_id})
            self.metrics.evictions.labels(reason="budget").inc()
        self.metrics.hot_bytes.set(self.hot.nbytes)

    def _persist(self, agent: Agent) -> None:
        """Cuts the agent's unsaved blocks and queues their write."""
        try:
            snap = snapshot(agent, self.fingerprint, self.config.block_tokens)
        except ValueError as exc:  # blocks it would rewrite have left a window cache
            log.error("cannot persist agent", extra={"agent": agent.agent_id, "error": str(exc)})
            agent.persist_error = FailedPrecondition(str(exc))
            self.metrics.persists.labels(outcome="failed").inc()
            return
        agent.pending = self.persister.submit(agent, snap)
        if any(w is not None for w in self.windows):
            agent.pending.add_done_callback(lambda write: self.submit(self._release, agent))

    def _release(self, agent: Agent) -> None:
        """Once committed, window caches let go of what only persistence still needed."""
        if self.batcher.holds(agent) or self.hot.get(agent.id) is not agent:
            return  # mid-turn (the batch drops it), or no longer held here
        agent.keep_undurable()
        for cache in agent.caches:
            cache.release()
        self.metrics.hot_bytes.set(self.hot.nbytes)

    # helpers

    def _check_context(self, agent: Agent, adding: int) -> None:
        if len(agent.tokens) + adding > self.max_context:
            raise OutOfRange(
                f"agent {agent.agent_id!r} would reach {len(agent.tokens) + adding} tokens "
                f"({len(agent.tokens)} held, {adding} more asked), over the model's limit "
                f"of {self.max_context}"
            )

    def _info(self, agent: Agent, tier: str) -> AgentInfo:
        return AgentInfo(
            agent.namespace,
            agent.agent_id,
            tier,
            len(agent.tokens),
            agent.nbytes,
            agent.persisted_tokens,
            agent.generation,
            agent.phase,
        )
