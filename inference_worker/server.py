"""Builds and runs the worker's gRPC server: the model, the engine, health, reflection, metrics.

Import this only after inference_worker.blas.load_optimized_blas() (it imports mlx).
"""

from __future__ import annotations

import logging
import os

from agentkv.client.store import StoreClient
from agentkv.errors import InvalidArgument
from agentkv.rpc import service_handlers
from agentkv.serving import Served, bind_service, serve_until_signal
from agentkv.worker.v1 import worker_pb2
from inference_worker.config import WorkerConfig
from inference_worker.engine import Engine
from inference_worker.front import Front
from inference_worker.metrics import WorkerMetrics
from inference_worker.runtime import resolve_runtime
from inference_worker.scheduler import Request, claim
from inference_worker.service import FEATURES, SERVICE_NAME, InferenceWorkerServicer
from inference_worker.store_health import StoreHealth, check_store

log = logging.getLogger("agentkv.worker")
SHORT_TURN = 32  # tokens: a system prompt's template alone, about (a budget's least)


def create_server(config: WorkerConfig, blas: str | None) -> Served:
    """Loads the model, starts the engine and binds the server; does not start it."""
    store = StoreClient(config.store, timeout=config.store_timeout, security=config.store_security)
    check_store(store, config.store, timeout=10.0)  # before the model loads: at once
    runtime = resolve_runtime(config)
    check_budget(config, runtime.token_bytes)
    metrics = WorkerMetrics()
    engine = Engine(config, runtime, store, metrics)
    # The tool-call format turns use (ChatFormat's: none where its template renders tools
    # anew with each user message, whatever mlx-lm infers).
    tools = engine.chat.tool_format
    info = {**runtime.info(config, blas), "tool_parser": tools.name if tools else ""}
    info["features"] = FEATURES
    servicer = InferenceWorkerServicer(Front(engine, config.store_check_timeout), info)
    service = worker_pb2.DESCRIPTOR.services_by_name["InferenceWorker"]
    served = bind_service(
        config,
        SERVICE_NAME,
        service_handlers(service, worker_pb2, servicer),
        metrics,
        engine.close,  # finishes queued store writes (for up to --stop-write-seconds)
        max_message_bytes=16 << 20,
        grace=config.drain_seconds,
    )
    watch = StoreHealth(store, config.store, served.health)  # warns now if it does not answer

    def close() -> None:
        watch.close()
        engine.close()
        # An RPC thread still in a store call (a restore, a fork) ends now: the exit joins it.
        store.close()

    served.close = close
    log.info(
        "model loaded",
        extra={
            **info,
            "model_dir": str(runtime.model_dir),
            "restore_path": runtime.restore_path,
            "quantized_query_max": runtime.quantized_query_max,
        },
    )
    return served


def check_budget(config: WorkerConfig, token_bytes: int) -> None:
    """Refuses a hot budget that holds no turn of SHORT_TURN tokens of this model and one
    token of reply, as the scheduler claims it (held twice while it runs: in the batch, and
    to undo it), where every turn would be OUT_OF_RANGE; warns of one past this host's RAM."""
    turn = Request("least", SHORT_TURN, 1, (SHORT_TURN + 1) * token_bytes)
    turn.own_bytes = SHORT_TURN * token_bytes
    least = claim([turn])
    if config.hot_budget_bytes < least:
        raise InvalidArgument(
            f"--hot-budget {config.hot_budget_bytes} bytes holds no turn of {SHORT_TURN} "
            f"tokens of this model: give it at least {least}"
        )
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if config.hot_budget_bytes > ram:
        log.warning(
            "hot budget past this host's RAM: agents are evicted only past it",
            extra={"hot_budget": config.hot_budget_bytes, "ram": ram},
        )


def serve(config: WorkerConfig, blas: str | None) -> None:
    """Runs until SIGTERM or SIGINT, then drains RPCs and finishes queued store writes."""
    serve_until_signal(config, lambda: create_server(config, blas), log, store=config.store)
