"""The store process's configuration, filled once from the command line."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from agentkv import defaults
from agentkv.flags import flag
from agentkv.ids import NAMESPACE_RE
from agentkv.serving import ServerConfig, listen_flag
from agentkv.units import parse_bytes, parse_seconds
from agentkv.wire import MAX_CHUNK_BYTES
from cache_store.objects import Location

ANY_NAMESPACE = "*"
MIN_RETENTION_LEASES = 10  # the shortest --agent-idle, in --lease-seconds
T = TypeVar("T")


def per_namespace(parse: Callable[[str], T], what: str) -> Callable[[str], tuple[str, T]]:
    """A parser of 'NAMESPACE=VALUE' ('*=VALUE': every namespace not named) for one setting."""

    def parse_setting(text: str) -> tuple[str, T]:
        name, sep, value = text.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(
                f"expected NAMESPACE={what.upper()} or *={what.upper()}, got {text!r}"
            )
        try:
            return name.strip(), parse(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {what} {value!r} in {text!r}") from None

    return parse_setting


def parse_umask(text: str) -> int:
    """--umask's octal digits (077), as umask(1) takes them."""
    if not (text.isascii() and text.isdigit() and set(text) <= set("01234567")):
        raise argparse.ArgumentTypeError(f"an octal mode such as 077 or 027, got {text!r}")
    return int(text, 8)


def data_dir_path(text: str) -> Path:
    """--data-dir's path; an empty one (an unset variable, say) is no silent "here"."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: name the store's data directory")
    return Path(text)


parse_namespace_quota = per_namespace(parse_bytes, "size")  # 'team-a=2G' -> ('team-a', 2 GiB)
parse_namespace_idle = per_namespace(parse_seconds, "duration")  # 'team-a=7d'


@dataclass(slots=True)
class StoreConfig(ServerConfig):
    data_dir: Path = flag(help="where the index and payloads live", parse=data_dir_path)
    listen: str = listen_flag(defaults.STORE_ADDRESS)
    quota_bytes: int = flag(
        0, "payload byte quota, e.g. 20G; 0: only the disk limits", name="quota", parse=parse_bytes
    )
    # Per-namespace payload bytes; "*" applies to every namespace not named. The store-wide
    # quota still holds on top.
    namespace_quotas: dict[str, int] = flag(
        help="a namespace's payload byte quota, e.g. team-a=2G; '*=SIZE' for every namespace "
        "not named; repeatable",
        name="namespace-quota",
        parse=parse_namespace_quota,
        convert=dict,
        factory=dict,
        action="append",
        metavar="NS=SIZE",
    )
    evict_agents: bool = flag(
        False, "under quota pressure, also evict whole least-recently-used agents"
    )
    gc_idle_seconds: float = flag(
        3600.0,
        "delete unreferenced blocks (no agent's) nobody has read or written for this long; "
        "0: only quota pressure and CollectGarbage (agentkv store gc) delete them",
    )
    # Retention: agents nobody has read or written for this long are deleted (idle.py).
    agent_idle_seconds: float = flag(
        0.0,
        "delete agents nobody has read or written for this long, e.g. 7d (s, m, h, d), and "
        "their blocks no other agent shares; 0: keep agents until deleted (or evicted)",
        name="agent-idle",
        parse=parse_seconds,
        metavar="DURATION",
        shown="0",
    )
    namespace_agent_idle: dict[str, float] = flag(
        help="a namespace's --agent-idle, e.g. team-a=12h (0: keep its agents); '*=DURATION' "
        "for every namespace not named; repeatable",
        name="namespace-agent-idle",
        parse=parse_namespace_idle,
        convert=dict,
        factory=dict,
        action="append",
        metavar="NS=DURATION",
    )
    lease_seconds: int = flag(60, "how long a read or upload lease lasts unless renewed")
    # The object-store tier (tier.py).
    object_store: str = flag(
        "",
        "s3://BUCKET/PREFIX: write every block and manifest through to this S3-compatible "
        "bucket, demote local copies to it under quota pressure, and restore from it what "
        "the local disk lacks (credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
        "AWS_PROFILE, ~/.aws)",
    )
    s3_endpoint: str = flag(
        "", "the object store's URL, e.g. http://127.0.0.1:8333 (SeaweedFS, MinIO); empty: AWS"
    )
    store_id: str = flag(
        "", "this store's name in the bucket's writer leases; default: one kept in the data dir"
    )
    writer_lease_seconds: float = flag(
        30.0, "how long a namespace's writer lease in the bucket lasts unless renewed"
    )
    object_uploaders: int = flag(4, "threads writing blocks and manifests to the object store")
    object_queue_max: int = flag(
        100_000,
        "uploads queued in memory; past it the store reports 'backlogged' and finds the rest "
        "in its index once the queue drains",
    )
    max_lease_seconds: int = 600
    max_chunk_bytes: int = MAX_CHUNK_BYTES
    max_block_bytes: int = 1 << 30
    max_block_tokens: int = 1 << 16
    max_agent_tokens: int = 1 << 21
    max_message_bytes: int = 16 << 20  # gRPC transport limit, above every chunk and manifest
    lmdb_map_bytes: int = 64 << 30  # sparse; LMDB only uses what it writes
    workers: int = flag(32, "RPC threads", kw_only=True)
    # Of the RPC threads, at most this many serve each payload stream (PutBlocks, GetBlocks),
    # so idle or slow streams can never take every thread from the calls of other tenants.
    max_streams: int = flag(
        12,
        "RPC threads each payload stream kind (PutBlocks, GetBlocks) may hold at once; "
        "below --workers, so other calls always find one; one namespace's, 3/4 of them",
    )
    stream_idle_seconds: float = flag(
        30.0, "cancel a payload stream that moves no message for this long"
    )
    max_namespace_inflight_bytes: int = 2 << 30  # the same for all of one namespace's streams
    max_header_cache_bytes: int = 16 << 20  # built block-header replies kept for reuse
    max_leases_per_namespace: int = flag(
        10_000, "live leases one namespace may hold (reads, uploads not yet committed)"
    )
    # files 0600 and directories 0700: payloads and index hold every token
    umask: int = flag(
        0o077,
        "octal umask for the data dir's files (077: only the store's user reads them; 027 "
        "lets its group, e.g. a worker reading payloads in place)",
        parse=parse_umask,
        shown="077",
    )

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).resolve()
        if self.quota_bytes < 0:
            raise ValueError(f"quota_bytes must be >= 0, got {self.quota_bytes}")
        _check_names(self.namespace_quotas, "namespace quota")
        for name, size in self.namespace_quotas.items():
            if size <= 0:
                raise ValueError(f"namespace quota for {name!r} must be > 0, got {size}")
        self._check_agent_idle()
        if self.gc_idle_seconds and self.gc_idle_seconds < 2 * self.lease_seconds:
            raise ValueError(
                f"gc_idle_seconds must be 0 or at least twice lease_seconds "
                f"({2 * self.lease_seconds}), got {self.gc_idle_seconds}"
            )
        for name in ("stream_idle_seconds", "writer_lease_seconds"):
            if not getattr(self, name) > 0:  # 0 would cancel every stream, or never lease
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be > 0, got {getattr(self, name)}")
        if not 1 <= self.lease_seconds <= self.max_lease_seconds:
            raise ValueError(f"lease_seconds must be in 1..{self.max_lease_seconds}")
        if not 1 <= self.max_chunk_bytes < self.max_message_bytes:
            raise ValueError("max_chunk_bytes must be positive and below max_message_bytes")
        if self.workers < 2:  # one for streams, and at least one other call's
            raise ValueError(f"workers must be >= 2, got {self.workers}")
        if not 1 <= self.max_streams < self.workers:
            raise ValueError(
                f"max_streams must be in 1..{self.workers - 1} (below --workers {self.workers}, "
                f"so other calls always find a thread), got {self.max_streams}: with fewer "
                "--workers, lower --max-streams too"
            )
        if self.max_leases_per_namespace < 1:
            raise ValueError(
                f"max_leases_per_namespace must be >= 1, got {self.max_leases_per_namespace}"
            )
        if self.object_store:
            Location.parse(self.object_store)  # ValueError names the flag
            if self.s3_endpoint:
                Location.check_endpoint(self.s3_endpoint)
        if self.writer_lease_seconds < 3:
            raise ValueError(f"writer_lease_seconds must be >= 3, got {self.writer_lease_seconds}")
        if self.object_uploaders < 1:
            raise ValueError(f"object_uploaders must be >= 1, got {self.object_uploaders}")
        if self.object_queue_max < 1:
            raise ValueError(f"object_queue_max must be >= 1, got {self.object_queue_max}")
        if not 0 <= self.umask <= 0o777:
            raise ValueError(f"umask must be an octal mode 000..777, got {self.umask:o}")
        self.check_serving()

    def _check_agent_idle(self) -> None:
        """Retention of 0 (keep), or at least MIN_RETENTION_LEASES leases (10 min at the
        default --lease-seconds): a turn, from the read that marks its agent used to its
        commit, must end within it."""
        least = MIN_RETENTION_LEASES * self.lease_seconds
        _check_names(self.namespace_agent_idle, "agent retention")
        settings = [("", self.agent_idle_seconds), *self.namespace_agent_idle.items()]
        for name, seconds in settings:
            if seconds and seconds < least:
                where = f" for namespace {name!r}" if name else ""
                raise ValueError(
                    f"--agent-idle{where} must be 0 or at least {MIN_RETENTION_LEASES} times "
                    f"--lease-seconds ({least} s), got {seconds:g} s"
                )
        if self.agent_idle_seconds and ANY_NAMESPACE in self.namespace_agent_idle:
            raise ValueError(
                "--agent-idle and --namespace-agent-idle '*=DURATION' both set the retention "
                "of every namespace not named: give one"
            )

    def agent_idle(self, namespace: str) -> float:
        """How long one namespace's agents may sit unused before they are deleted; 0: kept."""
        default = self.namespace_agent_idle.get(ANY_NAMESPACE, self.agent_idle_seconds)
        return self.namespace_agent_idle.get(namespace, default)

    def namespace_quota(self, namespace: str) -> int:
        """The byte quota of one namespace; 0 when it has none."""
        return self.namespace_quotas.get(namespace, self.namespace_quotas.get(ANY_NAMESPACE, 0))

    def quotas(self, namespace: str) -> tuple[int, int]:
        """(the namespace's quota, the store's) in bytes; 0 for none."""
        return self.namespace_quota(namespace), self.quota_bytes


def _check_names(settings: dict[str, object], what: str) -> None:
    """Each per-namespace setting names a valid namespace, or "*" (every other one)."""
    for name in settings:
        if name != ANY_NAMESPACE and not NAMESPACE_RE.fullmatch(name):
            raise ValueError(f"{what} for invalid namespace {name!r}")
