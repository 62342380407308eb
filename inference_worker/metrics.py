"""Prometheus metrics of one worker."""

from __future__ import annotations

from agentkv.rpc import MetricSet

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class WorkerMetrics(MetricSet):
    prefix = "agentkv_worker_"

    def __init__(self) -> None:
        super().__init__()
        c = self.counter
        self.turns = c("turns", "Turns by cache state at start", "state")
        self.restore_failures = c("restore_failures", "Restores that fell back to re-prefill")
        self.turn_failures = c(
            "turn_failures",
            "Turns that failed after they were queued, rolled back: alone (scope turn), or "
            "with everyone in a failed batched step (scope batch)",
            "scope",
        )
        self.persists = c("persists", "Store writes by outcome", "outcome")
        self.generated_tokens = c("generated_tokens", "Tokens generated")
        self.ttft = self.histogram("ttft_seconds", "Time to first token", _TTFT_BUCKETS)
        self.batch_size = self.histogram(
            "batch_size", "Agents per decode step", (1, 2, 4, 8, 16, 32)
        )
        self.evictions = c(
            "evictions",
            "Agents dropped from RAM by the hot budget (theirs is in the store; with reason "
            "over_quota, their namespace's quota refused it and their unwritten turns are lost; "
            "stale, another worker committed it since)",
            "reason",
        )
        self.hot_bytes = self.gauge("hot_bytes", "Bytes of hot caches")
        self.turns_waiting = self.gauge("turns_waiting", "Turns queued for a place in the batch")
