"""Builds and runs the worker's gRPC server: the model, the engine, health, reflection, metrics.

Import this only after inference_worker.blas.load_optimized_blas() (it imports mlx).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
import mlx.core as mx
from grpc_health.v1 import health
from mlx_lm import load

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
from inference_worker.fingerprint import model_fingerprint
from inference_worker.front import Front
from inference_worker.metrics import WorkerMetrics
from inference_worker.models import resolve_model
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


def compute_dtype(requested: str, device: str) -> str:
    """The dtype the model computes in; "" keeps the weights' own. On CPU "auto" is float32:
    the fastest there with BLAS, and what MoE's gather matmul needs on CPU."""
    if requested == "auto":
        return "float32" if device == "cpu" else ""
    return requested


def load_model(path: Path, dtype: str):
    model, tokenizer = load(str(path))
    if dtype:
        model.set_dtype(getattr(mx, dtype))  # floating parameters only; packed weights stay
    return model, tokenizer


def default_restore_path(config: WorkerConfig) -> str:
    """locate when the store is on this host (unix socket or loopback), else stream."""
    if config.restore_path != "auto":
        return config.restore_path
    return "locate" if is_loopback(config.store) else "stream"


def create_server(config: WorkerConfig, blas: str | None) -> RunningWorker:
    device = mx.default_device().type.name
    path = resolve_model(config.model, config.gguf_weights, device)
    dtype = compute_dtype(config.dtype, device)
    fingerprint = model_fingerprint(path, config.kv, config.block_tokens, dtype)
    model_config = json.loads((path / "config.json").read_text())
    max_context = int(model_config.get("max_position_embeddings") or 1 << 17)
    qmax = config.quantized_query_max or (1 if device == "cpu" else 32)
    metrics = WorkerMetrics()
    client = StoreClient(config.store, timeout=config.store_timeout, security=config.store_security)
    restore_path = default_restore_path(config)
    engine = Engine(
        config,
        lambda: load_model(path, dtype),
        fingerprint,
        client,
        metrics,
        max_context,
        restore_path,
        qmax,
    )
    info = {
        "model": config.model,
        "fingerprint": fingerprint,
        "kv_format": config.kv.name,
        "block_tokens": config.block_tokens,
        "max_context": max_context,
        "device": device,
        "dtype": dtype or "as stored",
        "blas": blas or "reference",
    }
    server = new_server(
        config.workers,
        16 << 20,
        lambda code: metrics.rpc_errors.labels(code.name).inc(),
        config.security.interceptors(),
    )
    servicer = InferenceWorkerServicer(Front(engine, config.store_check_timeout), info)
    server.add_generic_rpc_handlers(
        (
            service_handlers(
                worker_pb2.DESCRIPTOR.services_by_name["InferenceWorker"], worker_pb2, servicer
            ),
        )
    )
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
            "model_dir": str(path),
            "restore_path": restore_path,
            "quantized_query_max": qmax,
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
