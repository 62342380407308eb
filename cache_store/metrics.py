"""Prometheus metrics of one store, in a registry of its own (so tests can run several)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class _UsageCollector(Collector):
    """Reads stored bytes, blocks and agents from the index at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self._stats()
        yield GaugeMetricFamily("agentkv_store_bytes", "Payload bytes stored", value=s["num_bytes"])
        yield GaugeMetricFamily("agentkv_store_blocks", "Blocks stored", value=s["num_blocks"])
        yield GaugeMetricFamily("agentkv_store_agents", "Agent manifests", value=s["num_agents"])
        yield GaugeMetricFamily("agentkv_store_leases", "Leases held", value=s["num_leases"])
        yield GaugeMetricFamily(
            "agentkv_store_disk_free_bytes",
            "Free bytes on the data disk",
            value=s["disk_free_bytes"],
        )
        if s.get("object_store"):
            yield GaugeMetricFamily(
                "agentkv_store_object_queue_depth",
                "Blocks and manifests waiting to be written to the object store",
                value=s["object_queue_depth"],
            )
            yield GaugeMetricFamily(
                "agentkv_store_object_store_up",
                "1 while the object store answers",
                value=float(s["object_store"] != "unreachable"),
            )


class StoreMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prefix_hits = Counter(
            "agentkv_store_prefix_hits", "Prefix lookups that found blocks", registry=r
        )
        self.prefix_misses = Counter(
            "agentkv_store_prefix_misses", "Prefix lookups that found none", registry=r
        )
        self.dedup_hits = Counter(
            "agentkv_store_dedup_hits", "Uploaded blocks already stored", registry=r
        )
        self.evictions = Counter(
            "agentkv_store_evictions", "Blocks and agents evicted", ["kind"], registry=r
        )
        self.quarantines = Counter("agentkv_store_quarantines", "Payloads quarantined", registry=r)
        self.put_bytes = Counter("agentkv_store_put_bytes", "Payload bytes received", registry=r)
        self.get_bytes = Counter(
            "agentkv_store_get_bytes", "Payload bytes streamed out", registry=r
        )
        self.put_seconds = Histogram(
            "agentkv_store_put_seconds", "PutBlocks latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.get_seconds = Histogram(
            "agentkv_store_get_seconds", "GetBlocks latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.idle_streams = Counter(
            "agentkv_store_idle_streams_cancelled",
            "Payload streams cancelled for moving nothing",
            ["method"],
            registry=r,
        )
        self.rpc_errors = Counter(
            "agentkv_store_rpc_errors", "RPCs that failed", ["code"], registry=r
        )
        # The object-store tier (tier.py): requests by operation, and blocks moved.
        self.object_seconds = Histogram(
            "agentkv_store_object_seconds",
            "Object-store request latency",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.object_bytes = Counter(
            "agentkv_store_object_bytes", "Object-store payload bytes moved", ["op"], registry=r
        )
        self.object_errors = Counter(
            "agentkv_store_object_errors", "Object-store requests that failed", ["op"], registry=r
        )
        self.demoted_blocks = Counter(
            "agentkv_store_demoted_blocks",
            "Local copies freed of blocks safe in the object store",
            registry=r,
        )
        self.rehydrated_blocks = Counter(
            "agentkv_store_rehydrated_blocks",
            "Blocks fetched back from the object store",
            registry=r,
        )
        self.uploaded = Counter(
            "agentkv_store_object_uploads", "Objects written through", ["kind"], registry=r
        )

    def watch_usage(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(_UsageCollector(stats))
