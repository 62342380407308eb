"""The store process's configuration, filled once from the command line."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agentkv import defaults
from agentkv.addresses import is_loopback, listen_host, tcp_listen
from agentkv.ids import NAMESPACE_RE
from agentkv.security import ServerSecurity
from agentkv.wire import MAX_CHUNK_BYTES

ANY_NAMESPACE = "*"


@dataclass(slots=True)
class StoreConfig:
    data_dir: Path
    listen: str = defaults.STORE_ADDRESS  # host:port, or unix:/path/to.sock
    metrics_listen: str | None = None  # host:port for Prometheus; None disables
    health_listen: str | None = None  # host:port for plaintext grpc.health.v1 alone
    quota_bytes: int = 0  # payload bytes; 0 = only the disk limits
    # Per-namespace payload bytes; "*" applies to every namespace not named. The store-wide
    # quota still holds on top.
    namespace_quotas: dict[str, int] = field(default_factory=dict)
    evict_agents: bool = False  # under quota pressure, also evict whole cold agents
    lease_seconds: int = 60
    max_lease_seconds: int = 600
    max_chunk_bytes: int = MAX_CHUNK_BYTES
    max_block_bytes: int = 1 << 30
    max_block_tokens: int = 1 << 16
    max_agent_tokens: int = 1 << 21
    max_message_bytes: int = 16 << 20  # gRPC transport limit, above every chunk and manifest
    lmdb_map_bytes: int = 64 << 30  # sparse; LMDB only uses what it writes
    workers: int = 32
    # Of the RPC threads, at most this many serve each payload stream (PutBlocks, GetBlocks),
    # so idle or slow streams can never take every thread from the calls of other tenants.
    max_streams: int = 12
    stream_idle_seconds: float = 30.0  # a payload stream that moves no message is cancelled
    max_namespace_inflight_bytes: int = 2 << 30  # the same for all of one namespace's streams
    max_header_cache_bytes: int = 16 << 20  # built block-header replies kept for reuse
    max_leases_per_namespace: int = 10_000
    umask: int = 0o077  # files 0600 and directories 0700: payloads and index hold every token
    log_level: str = "info"
    security: ServerSecurity = field(default_factory=ServerSecurity)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).resolve()
        if self.quota_bytes < 0:
            raise ValueError(f"quota_bytes must be >= 0, got {self.quota_bytes}")
        for name, size in self.namespace_quotas.items():
            if name != ANY_NAMESPACE and not NAMESPACE_RE.fullmatch(name):
                raise ValueError(f"namespace quota for invalid namespace {name!r}")
            if size <= 0:
                raise ValueError(f"namespace quota for {name!r} must be > 0, got {size}")
        if not 1 <= self.lease_seconds <= self.max_lease_seconds:
            raise ValueError(f"lease_seconds must be in 1..{self.max_lease_seconds}")
        if not 1 <= self.max_chunk_bytes < self.max_message_bytes:
            raise ValueError("max_chunk_bytes must be positive and below max_message_bytes")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if not 1 <= self.max_streams < self.workers:
            raise ValueError(
                f"max_streams must be in 1..{self.workers - 1} (below --workers {self.workers}, "
                f"so other calls always find a thread), got {self.max_streams}"
            )
        if self.max_leases_per_namespace < 1:
            raise ValueError(
                f"max_leases_per_namespace must be >= 1, got {self.max_leases_per_namespace}"
            )
        if not 0 <= self.umask <= 0o777:
            raise ValueError(f"umask must be an octal mode 000..777, got {self.umask:o}")
        listen_host(self.listen)
        tcp_listen("metrics_listen", self.metrics_listen)
        tcp_listen("health_listen", self.health_listen)
        self.security.check(self.listen, self.is_loopback)

    @property
    def is_loopback(self) -> bool:
        return is_loopback(self.listen)

    def namespace_quota(self, namespace: str) -> int:
        """The byte quota of one namespace; 0 when it has none."""
        return self.namespace_quotas.get(namespace, self.namespace_quotas.get(ANY_NAMESPACE, 0))
