"""Builds and runs the store's gRPC server: the service, health, reflection and metrics."""

from __future__ import annotations

import logging
import os

from grpc_health.v1 import health_pb2

from agentkv.serving import Served, bind_service, serve_until_signal
from cache_store.config import StoreConfig
from cache_store.service import SERVICE_NAME, CacheStoreServicer, rpc_handlers
from cache_store.store import CacheStore

log = logging.getLogger("agentkv.store")
OBJECT_STORE_HEALTH = "agentkv.v1.CacheStore/object-store"  # the health service name to ask


def create_server(config: StoreConfig) -> Served:
    """Opens the store and binds the server (port 0 picks a free port); does not start it."""
    os.umask(config.umask)  # before the store creates a file
    store = CacheStore(config)
    servicer = CacheStoreServicer(store)

    def close() -> None:
        servicer.streams.close()
        store.close()

    served = bind_service(
        config,
        SERVICE_NAME,
        rpc_handlers(servicer),
        store.metrics,
        close,
        max_message_bytes=config.max_message_bytes,
        grace=5.0,
    )
    if store.tier is not None:  # grpc.health.v1 for the tier: SERVING while uploads flow
        store.tier.watch_state(
            lambda state: served.health.set(
                OBJECT_STORE_HEALTH,
                health_pb2.HealthCheckResponse.NOT_SERVING
                if state in ("unreachable", "backlogged")
                else health_pb2.HealthCheckResponse.SERVING,
            )
        )
    return served


def serve(config: StoreConfig) -> None:
    """Runs until SIGTERM or SIGINT, then drains in-flight RPCs and closes the index."""
    serve_until_signal(config, lambda: create_server(config), log, data_dir=str(config.data_dir))
