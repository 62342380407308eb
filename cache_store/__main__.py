"""agentkv-store: the cache store process."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agentkv import defaults, logs
from agentkv.errors import AgentKVError
from agentkv.security import add_server_flags, server_security
from agentkv.units import parse_bytes
from cache_store.config import StoreConfig
from cache_store.server import serve


def parse_namespace_quota(text: str) -> tuple[str, int]:
    """'team-a=2G' -> ('team-a', 2 GiB); '*=1G' sets the default for every other namespace."""
    name, sep, size = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAMESPACE=SIZE or *=SIZE, got {text!r}")
    try:
        return name.strip(), parse_bytes(size)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size {size!r} in {text!r}") from None


def build_config(argv: list[str] | None = None) -> StoreConfig:
    p = argparse.ArgumentParser(prog="agentkv-store", description=__doc__)
    p.add_argument("--data-dir", type=Path, required=True, help="where the index and payloads live")
    p.add_argument(
        "--listen",
        default=defaults.STORE_ADDRESS,
        help="HOST:PORT (port 0 picks one) or unix:/path/to.sock; default loopback",
    )
    p.add_argument("--metrics-listen", default=None, help="HOST:PORT for Prometheus metrics")
    p.add_argument(
        "--health-listen",
        default=None,
        help="HOST:PORT serving only grpc.health.v1, plaintext and open (kubelet's grpc probe)",
    )
    p.add_argument("--quota", type=parse_bytes, default=0, help="payload byte quota, e.g. 20G")
    p.add_argument(
        "--namespace-quota",
        type=parse_namespace_quota,
        action="append",
        default=[],
        metavar="NS=SIZE",
        help="a namespace's payload byte quota, e.g. team-a=2G; '*=SIZE' for every namespace "
        "not named; repeatable",
    )
    p.add_argument(
        "--evict-agents",
        action="store_true",
        help="under quota pressure, also evict whole least-recently-used agents",
    )
    p.add_argument("--lease-seconds", type=int, default=60)
    p.add_argument("--workers", type=int, default=32, help="RPC threads")
    p.add_argument(
        "--max-streams",
        type=int,
        default=12,
        help="RPC threads each payload stream kind (PutBlocks, GetBlocks) may hold at once; "
        "below --workers, so other calls always find one",
    )
    p.add_argument(
        "--stream-idle-seconds",
        type=float,
        default=30.0,
        help="cancel a payload stream that moves no message for this long",
    )
    p.add_argument(
        "--max-leases-per-namespace",
        type=int,
        default=10_000,
        help="live leases one namespace may hold (reads, uploads not yet committed)",
    )
    p.add_argument(
        "--umask",
        type=lambda text: int(text, 8),
        default=0o077,
        help="octal umask for the data dir's files (default 077: only the store's user reads "
        "them; 027 lets its group, e.g. a worker reading payloads in place)",
    )
    p.add_argument("--log-level", default="info")
    add_server_flags(p)
    a = p.parse_args(argv)
    try:
        return StoreConfig(
            data_dir=a.data_dir,
            listen=a.listen,
            metrics_listen=a.metrics_listen,
            health_listen=a.health_listen,
            quota_bytes=a.quota,
            namespace_quotas=dict(a.namespace_quota),
            evict_agents=a.evict_agents,
            lease_seconds=a.lease_seconds,
            workers=a.workers,
            max_streams=a.max_streams,
            stream_idle_seconds=a.stream_idle_seconds,
            max_leases_per_namespace=a.max_leases_per_namespace,
            umask=a.umask,
            log_level=a.log_level,
            security=server_security(a),
        )
    except ValueError as exc:
        p.error(str(exc))


def main(argv: list[str] | None = None) -> None:
    config = build_config(argv)
    logs.configure(config.log_level)
    try:
        serve(config)
    except (AgentKVError, OSError) as exc:  # at start-up: a data dir in use, a bad index
        message = exc.message if isinstance(exc, AgentKVError) else str(exc)
        sys.exit(f"agentkv-store: error: {message}")


if __name__ == "__main__":
    main()
