"""Builds and runs the store's gRPC server: the service, health, reflection and metrics."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health

from agentkv.rpc import (
    add_health_and_reflection,
    bind,
    new_server,
    start_health,
    start_metrics,
    wait_for_signal,
)
from cache_store.config import StoreConfig
from cache_store.service import SERVICE_NAME, CacheStoreServicer, rpc_handlers
from cache_store.store import CacheStore

log = logging.getLogger("agentkv.store")


@dataclass(slots=True)
class RunningStore:
    server: grpc.Server
    address: str  # what clients dial: host:port with the bound port, or unix:path
    store: CacheStore
    health: health.HealthServicer
    servicer: CacheStoreServicer

    def stop(self, grace: float = 5.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        self.servicer.streams.close()
        self.store.close()


def create_server(config: StoreConfig) -> RunningStore:
    """Opens the store and binds the server (port 0 picks a free port); does not start it."""
    os.umask(config.umask)  # before the store creates a file
    store = CacheStore(config)
    server = new_server(
        config.workers,
        config.max_message_bytes,
        lambda code: store.metrics.rpc_errors.labels(code.name).inc(),
        config.security.interceptors(),
    )
    servicer = CacheStoreServicer(store)
    server.add_generic_rpc_handlers((rpc_handlers(servicer),))
    health_servicer = add_health_and_reflection(server, SERVICE_NAME)
    try:
        address = bind(server, config.listen, config.security.credentials())
    except OSError:
        servicer.streams.close()
        store.close()
        raise
    return RunningStore(server, address, store, health_servicer, servicer)


def serve(config: StoreConfig) -> None:
    """Runs until SIGTERM or SIGINT, then drains in-flight RPCs and closes the index."""
    for warning in config.security.warnings(
        config.listen, config.is_loopback, config.metrics_listen
    ):
        log.warning(warning, extra={"listen": config.listen})
    running = create_server(config)
    metrics = start_metrics(config.metrics_listen, running.store.metrics.registry)
    running.server.start()
    health_server, health_address = start_health(config.health_listen, running.health)
    log.info(
        "serving",
        extra={
            "address": running.address,
            "data_dir": str(config.data_dir),
            "metrics": metrics,
            "health": health_address,
        },
    )
    wait_for_signal()
    log.info("stopping")
    running.stop()
    if health_server is not None:
        health_server.stop(0)
