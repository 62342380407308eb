"""What the store's components share, made once by CacheStore."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from cache_store.config import StoreConfig
from cache_store.index import Index
from cache_store.leases import Leases
from cache_store.metrics import StoreMetrics
from cache_store.payloads import Payloads


@dataclass(frozen=True, slots=True)
class Parts:
    config: StoreConfig
    index: Index
    payloads: Payloads
    leases: Leases
    metrics: StoreMetrics
    # held from a payload's rename to its index commit, against the orphan sweep
    publish_lock: threading.Lock = field(default_factory=threading.Lock, compare=False)
