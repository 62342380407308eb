"""Builds and runs the worker's gRPC server: the model, the engine, health, reflection, metrics.

Import this only after inference_worker.blas.load_optimized_blas() (it imports mlx).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health

from agentkv.addresses import is_loopback
from agentkv.rpc import (
    add_health_and_reflection,
    bind,
    new_server,
    service_handlers,
    start_health,
    start_metrics,
    wait_for_signal,
)
from agentkv.worker.v1 import worker_pb2
from client.store import StoreClient
from inference_worker.config import WorkerConfig
from inference_worker.engine import Engine
from inference_worker.front import Front
from inference_worker.metrics import WorkerMetrics
from inference_worker.runtime import resolve_runtime
from inference_worker.service import SERVICE_NAME, InferenceWorkerServicer

log = logging.getLogger("agentkv.worker")


@dataclass(slots=True)
class RunningWorker:
    server: grpc.Server
    address: str
    engine: Engine
    health: health.HealthServicer
    metrics: WorkerMetrics
    info: dict

    def stop(self, grace: float = 10.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        self.engine.close()  # finishes queued store writes


def create_server(config: WorkerConfig, blas: str | None) -> RunningWorker:
    runtime = resolve_runtime(config)
    metrics = WorkerMetrics()
    store = StoreClient(config.store, timeout=config.store_timeout, security=config.store_security)
    engine = Engine(config, runtime, store, metrics)
    info = runtime.info(config, blas)
    server = new_server(
        config.workers,
        16 << 20,
        lambda code: metrics.rpc_errors.labels(code.name).inc(),
        config.security.interceptors(),
    )
    servicer = InferenceWorkerServicer(Front(engine, config.store_check_timeout), info)
    service = worker_pb2.DESCRIPTOR.services_by_name["InferenceWorker"]
    server.add_generic_rpc_handlers((service_handlers(service, worker_pb2, servicer),))
    health_servicer = add_health_and_reflection(server, SERVICE_NAME)
    try:
        address = bind(server, config.listen, config.security.credentials())
    except OSError:
        engine.close()
        raise
    log.info(
        "model loaded",
        extra={
            **info,
            "model_dir": str(runtime.model_dir),
            "restore_path": runtime.restore_path,
            "quantized_query_max": runtime.quantized_query_max,
        },
    )
    return RunningWorker(server, address, engine, health_servicer, metrics, info)


def serve(config: WorkerConfig, blas: str | None) -> None:
    """Runs until SIGTERM or SIGINT, then drains RPCs and finishes queued store writes."""
    for warning in config.security.warnings(
        config.listen, is_loopback(config.listen), config.metrics_listen
    ):
        log.warning(warning, extra={"listen": config.listen})
    running = create_server(config, blas)
    metrics = start_metrics(config.metrics_listen, running.metrics.registry)
    running.server.start()
    health_server, health_address = start_health(config.health_listen, running.health)
    log.info(
        "serving",
        extra={
            "address": running.address,
            "store": config.store,
            "metrics": metrics,
            "health": health_address,
        },
    )
    wait_for_signal()
    log.info("stopping")
    running.stop()
    if health_server is not None:
        health_server.stop(0)
