"""Builds and runs the store's gRPC server: the service, health, reflection and metrics."""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from agentkv.rpc import ErrorInterceptor, message_options
from agentkv.v1 import store_pb2
from cache_store.config import StoreConfig, listen_host
from cache_store.service import SERVICE_NAME, CacheStoreServicer, rpc_handlers
from cache_store.store import CacheStore

log = logging.getLogger("agentkv.store")


@dataclass(slots=True)
class RunningStore:
    server: grpc.Server
    address: str  # what clients dial: host:port with the bound port, or unix:path
    store: CacheStore
    health: health.HealthServicer

    def stop(self, grace: float = 5.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        self.store.close()


def create_server(config: StoreConfig) -> RunningStore:
    """Opens the store and binds the server (port 0 picks a free port); does not start it."""
    store = CacheStore(config)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="rpc"),
        interceptors=[
            ErrorInterceptor(lambda code: store.metrics.rpc_errors.labels(code.name).inc())
        ],
        options=message_options(config.max_message_bytes),
    )
    server.add_generic_rpc_handlers((rpc_handlers(CacheStoreServicer(store)),))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (
            store_pb2.DESCRIPTOR.services_by_name["CacheStore"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    port = server.add_insecure_port(config.listen)
    if not port:
        store.close()
        raise OSError(f"could not bind {config.listen}")
    address = config.listen
    if listen_host(config.listen) is not None:
        address = f"{listen_host(config.listen)}:{port}"
    return RunningStore(server, address, store, health_servicer)


def serve(config: StoreConfig) -> None:
    """Runs until SIGTERM or SIGINT, then drains in-flight RPCs and closes the index."""
    if not config.is_loopback:
        log.warning(
            "listening beyond loopback with no authentication", extra={"listen": config.listen}
        )
    running = create_server(config)
    metrics = None
    if config.metrics_listen:
        host, _, port = config.metrics_listen.rpartition(":")
        httpd, _ = start_http_server(int(port), addr=host, registry=running.store.metrics.registry)
        metrics = f"{host}:{httpd.server_port}"
    running.server.start()
    log.info(
        "serving",
        extra={"address": running.address, "data_dir": str(config.data_dir), "metrics": metrics},
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("stopping")
    running.stop()
