"""Prometheus metrics of one store."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from agentkv.rpc import MetricSet

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_USAGE = (  # GetStats field: gauge, what it counts
    ("num_bytes", "bytes", "Payload bytes stored"),
    ("num_blocks", "blocks", "Blocks stored"),
    ("num_agents", "agents", "Agent manifests"),
    ("num_leases", "leases", "Leases held"),
    ("disk_free_bytes", "disk_free_bytes", "Free bytes on the data disk"),
)


class _UsageCollector(Collector):
    """Reads stored bytes, blocks and agents from the index at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self._stats()
        for field, name, what in _USAGE:
            yield GaugeMetricFamily(f"agentkv_store_{name}", what, value=s[field])
        if s.get("object_store"):
            yield GaugeMetricFamily(
                "agentkv_store_object_queue_depth",
                "Blocks and manifests waiting to be written to the object store",
                value=s["object_queue_depth"],
            )
            up = float(s["object_store_state"] != "unreachable")
            yield GaugeMetricFamily(
                "agentkv_store_object_store_up", "1 while the object store answers", value=up
            )


class StoreMetrics(MetricSet):
    prefix = "agentkv_store_"

    def __init__(self) -> None:
        super().__init__()
        c, h, b = self.counter, self.histogram, _LATENCY_BUCKETS
        self.prefix_hits = c("prefix_hits", "Prefix lookups that found blocks")
        self.prefix_misses = c("prefix_misses", "Prefix lookups that found none")
        self.dedup_hits = c("dedup_hits", "Uploaded blocks already stored")
        self.evictions = c("evictions", "Blocks and agents evicted", "kind")
        self.quarantines = c("quarantines", "Payloads quarantined")
        self.put_bytes = c("put_bytes", "Payload bytes received")
        self.get_bytes = c("get_bytes", "Payload bytes streamed out")
        self.put_seconds = h("put_seconds", "PutBlocks latency", b)
        self.get_seconds = h("get_seconds", "GetBlocks latency", b)
        self.idle_streams = c(
            "idle_streams_cancelled", "Payload streams cancelled for moving nothing", "method"
        )
        # The object-store tier (tier.py): requests by operation, and blocks moved.
        self.object_seconds = h("object_seconds", "Object-store request latency", b, "op")
        self.object_bytes = c("object_bytes", "Object-store payload bytes moved", "op")
        self.object_errors = c("object_errors", "Object-store requests that failed", "op")
        self.demoted_blocks = c(
            "demoted_blocks", "Local copies freed of blocks safe in the object store"
        )
        self.rehydrated_blocks = c("rehydrated_blocks", "Blocks fetched back from the object store")
        self.uploaded = c("object_uploads", "Objects written through", "kind")

    def watch_usage(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(_UsageCollector(stats))
