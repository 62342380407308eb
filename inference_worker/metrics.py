"""Prometheus metrics of one worker, in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.turns = Counter(
            "agentkv_worker_turns", "Turns by cache state at start", ["state"], registry=r
        )
        self.restore_failures = Counter(
            "agentkv_worker_restore_failures", "Restores that fell back to re-prefill", registry=r
        )
        self.turn_failures = Counter(
            "agentkv_worker_turn_failures",
            "Turns that failed after they were queued, rolled back: alone (scope turn), or "
            "with everyone in a failed batched step (scope batch)",
            ["scope"],
            registry=r,
        )
        self.persists = Counter(
            "agentkv_worker_persists", "Store writes by outcome", ["outcome"], registry=r
        )
        self.generated_tokens = Counter(
            "agentkv_worker_generated_tokens", "Tokens generated", registry=r
        )
        self.ttft = Histogram(
            "agentkv_worker_ttft_seconds", "Time to first token", buckets=_TTFT_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            "agentkv_worker_batch_size",
            "Agents per decode step",
            buckets=(1, 2, 4, 8, 16, 32),
            registry=r,
        )
        self.evictions = Counter(
            "agentkv_worker_evictions",
            "Agents dropped from RAM by the hot budget (theirs is in the store), by reason",
            ["reason"],
            registry=r,
        )
        self.hot_bytes = Gauge("agentkv_worker_hot_bytes", "Bytes of hot caches", registry=r)
        self.rpc_errors = Counter(
            "agentkv_worker_rpc_errors", "RPCs that failed", ["code"], registry=r
        )
