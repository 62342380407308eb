"""Builds and runs the worker's gRPC server: the model, the engine, health, reflection, metrics.

Import this only after inference_worker.blas.load_optimized_blas() (it imports mlx).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import mlx.core as mx
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from mlx_lm import load
from prometheus_client import start_http_server

from agentkv.rpc import ErrorInterceptor, message_options
from agentkv.worker.v1 import worker_pb2, worker_pb2_grpc
from cache_store.config import StoreConfig
from client.store import StoreClient
from inference_worker.config import WorkerConfig
from inference_worker.engine import Engine
from inference_worker.fingerprint import model_fingerprint
from inference_worker.metrics import WorkerMetrics
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


def model_dir(model: str) -> Path:
    """The local directory of a model path, or of a hub id (downloaded if not cached)."""
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(
            model,
            allow_patterns=[
                "*.json",
                "*.safetensors",
                "*.py",
                "tokenizer.model",
                "*.tiktoken",
                "*.txt",
            ],
        )
    )


def default_restore_path(config: WorkerConfig) -> str:
    """locate when the store is on this host (unix socket or loopback), else stream."""
    if config.restore_path != "auto":
        return config.restore_path
    local = (
        config.store.startswith("unix:") or StoreConfig(Path("."), listen=config.store).is_loopback
    )
    return "locate" if local else "stream"


def create_server(config: WorkerConfig, blas: str | None) -> RunningWorker:
    path = model_dir(config.model)
    fingerprint = model_fingerprint(path, config.kv, config.block_tokens)
    model_config = json.loads((path / "config.json").read_text())
    max_context = int(model_config.get("max_position_embeddings") or 1 << 17)
    device = mx.default_device().type.name
    qmax = config.quantized_query_max or (1 if device == "cpu" else 32)
    metrics = WorkerMetrics()
    client = StoreClient(config.store, timeout=config.store_timeout)
    restore_path = default_restore_path(config)
    engine = Engine(
        config,
        lambda: load(str(path)),
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
        "blas": blas or "reference",
    }
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="rpc"),
        interceptors=[ErrorInterceptor(lambda code: metrics.rpc_errors.labels(code.name).inc())],
        options=message_options(16 << 20),
    )
    worker_pb2_grpc.add_InferenceWorkerServicer_to_server(
        InferenceWorkerServicer(engine, info), server
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (
            worker_pb2.DESCRIPTOR.services_by_name["InferenceWorker"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    port = server.add_insecure_port(config.listen)
    if not port:
        engine.close()
        raise OSError(f"could not bind {config.listen}")
    host = config.listen.rpartition(":")[0]
    address = config.listen if config.listen.startswith("unix:") else f"{host}:{port}"
    log.info(
        "model loaded", extra={**info, "restore_path": restore_path, "quantized_query_max": qmax}
    )
    return RunningWorker(server, address, engine, health_servicer, metrics, info)


def serve(config: WorkerConfig, blas: str | None) -> None:
    running = create_server(config, blas)
    metrics = None
    if config.metrics_listen:
        host, _, port = config.metrics_listen.rpartition(":")
        httpd, _ = start_http_server(int(port), addr=host, registry=running.metrics.registry)
        metrics = f"{host}:{httpd.server_port}"
    running.server.start()
    log.info(
        "serving", extra={"address": running.address, "store": config.store, "metrics": metrics}
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("stopping")
    running.stop()
