"""The engine: the one thread that owns MLX, and everything it does for agents.

RPC handlers hand it work through `submit`; a turn's tokens come back through the job's
event queue. Arrays that leave this thread (blocks for the store) are evaluated first.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from agentkv.errors import AgentExists, AgentNotFound, OutOfRange, Unavailable
from cache_store import validation
from client.store import StoreClient
from inference_worker.agents import Agent, HotTier
from inference_worker.chat import ChatFormat, ChatMessage
from inference_worker.config import WorkerConfig
from inference_worker.kv_cache import QuantizedKV
from inference_worker.metrics import WorkerMetrics
from inference_worker.persistence import Persister, snapshot
from inference_worker.restore import Restorer
from inference_worker.sampling import Sampling, StopMatcher

log = logging.getLogger("agentkv.worker")
END = object()  # closes a turn's event stream


@dataclass(slots=True)
class TokenEvent:
    text: str
    token_ids: list[int]


@dataclass(slots=True)
class UsageEvent:
    prompt_tokens: int = 0
    reused_hot_tokens: int = 0
    reused_store_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    time_to_first_token_ms: float = 0.0
    decode_tokens_per_second: float = 0.0
    cache_state: str = ""
    finish_reason: str = "none"
    restore_path: str = ""
    restore_failure: str = ""


@dataclass(slots=True)
class TurnJob:
    namespace: str
    agent_id: str
    messages: list[ChatMessage]
    sampling: Sampling
    phase: str = ""
    started: float = field(default_factory=time.perf_counter)
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass(slots=True)
class AgentInfo:
    namespace: str
    agent_id: str
    tier: str
    num_tokens: int
    num_bytes: int
    persisted_tokens: int
    generation: int
    phase: str


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
        self._thread = threading.Thread(target=self._loop, name="agentkv-mlx", daemon=True)
        self._thread.start()
        self.model, self.tokenizer = self.submit(load_model).result()
        self.num_layers = len(self.model.layers)
        self.chat = ChatFormat(self.tokenizer)
        self.hot = HotTier(config.hot_budget_bytes)
        self.persister = Persister(
            client, fingerprint, lambda outcome: metrics.persists.labels(outcome=outcome).inc()
        )
        self.restorer = Restorer(
            client,
            fingerprint,
            config.kv,
            self.num_layers,
            config.block_tokens,
            restore_path,
            quantized_query_max,
        )

    # the MLX thread

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._jobs.put((fn, args, future))
        return future

    def _loop(self) -> None:
        while (item := self._jobs.get()) is not None:
            fn, args, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)
        self.persister.close()

    # agents (each runs on the MLX thread)

    def create_agent(
        self, ns: str, agent_id: str, system: str, phase: str, metadata: dict[str, str]
    ) -> AgentInfo:
        ns, agent_id = validation.namespace(ns), validation.agent_id(agent_id)
        metadata = validation.metadata(metadata)
        if self.hot.get((ns, agent_id)) is not None or self._in_store(ns, agent_id):
            raise AgentExists(f"agent {agent_id!r} already exists in namespace {ns!r}")
        messages = [ChatMessage("system", system)] if system else []
        agent = Agent(
            ns,
            agent_id,
            self.chat.first_turn(messages, False),
            self._caches(),
            phase=phase,
            metadata=metadata,
        )
        self._check_context(agent, 0)
        self._prefill(agent, need_logits=False)
        self._finish_turn(agent)
        return self._info(agent, "hot")

    def turn(self, job: TurnJob) -> None:
        """Runs a turn, streaming TokenEvents then one UsageEvent into job.events; END last,
        whatever happens (an error travels through the submit future)."""
        try:
            self._turn(job)
        finally:
            job.events.put(END)

    def _turn(self, job: TurnJob) -> None:
        usage = UsageEvent()
        agent = self._checkout(job.namespace, job.agent_id, usage)
        close = self.chat.close_reply(agent.tokens) if agent.reply_open else []
        appended = close + self.chat.append(job.messages, job.sampling.max_tokens > 0)
        self._check_context(agent, len(appended) + job.sampling.max_tokens)
        agent.tokens += appended
        agent.reply_open = False
        agent.phase = job.phase or agent.phase
        usage.prompt_tokens = len(agent.tokens)
        usage.prefilled_tokens, logits = self._prefill(agent, job.sampling.max_tokens > 0)
        if job.sampling.max_tokens > 0:
            self._generate(agent, job, logits, usage)
            self.metrics.ttft.observe(usage.time_to_first_token_ms / 1000)
        self._finish_turn(agent)
        self.metrics.turns.labels(state=usage.cache_state).inc()
        job.events.put(usage)

    def evict(self, ns: str, agent_id: str) -> tuple[bool, int]:
        agent = self.hot.get((ns, agent_id))
        if agent is None:
            return False, 0
        self._make_durable(agent)
        self.hot.pop(agent.id)
        return True, agent.nbytes

    def describe(self, ns: str, agent_id: str) -> AgentInfo:
        ns, agent_id = validation.namespace(ns), validation.agent_id(agent_id)
        agent = self.hot.get((ns, agent_id))
        if agent is not None:
            return self._info(agent, "hot")
        m = self.client.get_agent(ns, agent_id, fingerprint=self.fingerprint)
        tier = "warm" if m.block_keys and not m.missing_block_keys else "cold"
        covered = sum(m.block_num_tokens)
        return AgentInfo(
            ns, agent_id, tier, len(m.token_ids), m.num_bytes, covered, m.generation, m.phase
        )

    def delete(self, ns: str, agent_id: str) -> bool:
        ns, agent_id = validation.namespace(ns), validation.agent_id(agent_id)
        agent = self.hot.pop((ns, agent_id))
        if agent is not None and agent.pending is not None:
            agent.pending.result()
        try:
            self.client.delete_agent(ns, agent_id)
        except AgentNotFound:
            return agent is not None
        return True

    # turn steps

    def _checkout(self, ns: str, agent_id: str, usage: UsageEvent) -> Agent:
        ns, agent_id = validation.namespace(ns), validation.agent_id(agent_id)
        agent = self.hot.get((ns, agent_id))
        if agent is not None and agent.stale:
            self.hot.pop(agent.id)
            agent = None
        if agent is not None:
            usage.cache_state, usage.reused_hot_tokens = "hot", agent.cached
            return agent
        restored = self.restorer.restore(ns, agent_id)
        usage.reused_store_tokens = restored.tokens_restored
        usage.cache_state = "warm" if restored.tokens_restored else "cold"
        usage.restore_path, usage.restore_failure = restored.path, restored.failure
        if restored.failure:
            self.metrics.restore_failures.inc()
        self.hot.put(restored.agent)
        return restored.agent

    def _prefill(self, agent: Agent, need_logits: bool) -> tuple[int, mx.array | None]:
        """Runs the tokens the cache lacks through the model in chunks; the last logits."""
        if need_logits and agent.cached == len(agent.tokens):
            for cache in agent.caches:
                cache.trim(1)  # re-run the last token to get its logits
        pending = agent.tokens[agent.cached :]
        logits = None
        step = self.config.prefill_chunk
        for start in range(0, len(pending), step):
            logits = self.model(mx.array([pending[start : start + step]]), cache=agent.caches)
            mx.eval(logits)
        return len(pending), (logits[0, -1] if logits is not None else None)

    def _generate(self, agent: Agent, job: TurnJob, logits: mx.array, usage: UsageEvent) -> None:
        sampler, stops = job.sampling.sampler(), StopMatcher(job.sampling.stop)
        detok = self.tokenizer.detokenizer
        detok.reset()
        first = time.perf_counter()
        for i in range(job.sampling.max_tokens):
            token = sampler(logits - mx.logsumexp(logits))
            agent.tokens.append(token)
            if i == 0:
                first = time.perf_counter()
                usage.time_to_first_token_ms = (first - job.started) * 1000
            usage.generated_tokens = i + 1
            reason = self._emit(job, token, detok, stops)
            if reason or i + 1 == job.sampling.max_tokens:
                usage.finish_reason = reason or "length"
                break
            logits = self.model(mx.array([[token]]), cache=agent.caches)[0, -1]
        if usage.generated_tokens > 1:
            rate = (usage.generated_tokens - 1) / max(time.perf_counter() - first, 1e-9)
            usage.decode_tokens_per_second = rate
        agent.reply_open = True
        self.metrics.generated_tokens.inc(usage.generated_tokens)

    def _emit(self, job: TurnJob, token: int, detok: Any, stops: StopMatcher) -> str:
        """Sends a token; returns why generation must end, or ""."""
        if token in self.chat.eos_ids:
            detok.finalize()
            text, _ = stops.feed(detok.last_segment)
            job.events.put(TokenEvent(text + stops.flush(), [token]))
            return "stop"
        detok.add_token(token)
        text, stopped = stops.feed(detok.last_segment)
        job.events.put(TokenEvent(text, [token]))
        if stopped:
            return "stop"
        return "cancelled" if job.cancelled.is_set() else ""

    def _finish_turn(self, agent: Agent) -> None:
        """Queues the store write, then keeps the hot tier within budget."""
        agent.pending = self.persister.submit(
            agent, snapshot(agent, self.fingerprint, self.config.block_tokens)
        )
        self.hot.put(agent)
        for evicted in self.hot.enforce(keep=agent.id):
            log.info("agent evicted to the store", extra={"agent": evicted.agent_id})
        self.metrics.hot_bytes.set(self.hot.nbytes)

    def _make_durable(self, agent: Agent) -> None:
        if agent.pending is not None:
            agent.pending.result()
        if agent.persist_failed or agent.persisted_tokens < agent.cached:
            self.persister.submit(
                agent, snapshot(agent, self.fingerprint, self.config.block_tokens)
            ).result()
        if not agent.durable or agent.persist_failed:
            raise Unavailable(
                f"agent {agent.agent_id!r} cannot be made durable: the store "
                "refused or is unreachable; it stays in RAM"
            )

    # helpers

    def _check_context(self, agent: Agent, adding: int) -> None:
        if len(agent.tokens) + adding > self.max_context:
            raise OutOfRange(
                f"agent {agent.agent_id!r} would reach {len(agent.tokens) + adding} tokens "
                f"({len(agent.tokens)} held, {adding} more asked), over the model's limit "
                f"of {self.max_context}"
            )

    def _in_store(self, ns: str, agent_id: str) -> bool:
        try:
            self.client.get_agent(ns, agent_id)
        except AgentNotFound:
            return False
        return True

    def _caches(self) -> list[QuantizedKV]:
        return [QuantizedKV(self.config.kv, self.qmax) for _ in range(self.num_layers)]

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
