"""agentkv-worker: the inference worker process."""

from __future__ import annotations

if __name__ == "__main__":  # python -m: its imports below run as the console script's do
    from agentkv.entry import worker

    worker()
    raise SystemExit

import logging
import os
import sys
from typing import TYPE_CHECKING

from agentkv import logs
from agentkv.entry import interrupted, interrupted_exit, unwind_on_sigterm
from agentkv.flags import parse_config

if TYPE_CHECKING:
    from inference_worker.config import WorkerConfig


def build_config(argv: list[str] | None = None) -> WorkerConfig:
    from inference_worker.config import WorkerConfig

    config = parse_config(WorkerConfig, "agentkv-worker", __doc__, argv)
    if config.blas_threads:
        os.environ["OPENBLAS_NUM_THREADS"] = str(config.blas_threads)  # read when OpenBLAS loads
    return config


def main(argv: list[str] | None = None) -> None:
    config = build_config(argv)
    logs.configure(config.log_level)
    unwind_on_sigterm()  # until it serves: a model import under way is removed
    try:
        start(config)
    except (KeyboardInterrupt, ImportError) as exc:  # once it serves, SIGINT stops it gracefully
        if not interrupted(exc):
            raise
        interrupted_exit(exc, "agentkv-worker")


def start(config: WorkerConfig) -> None:
    """Loads the model and serves it until SIGTERM or SIGINT."""
    from inference_worker.blas import load_optimized_blas

    blas = load_optimized_blas()  # before anything imports mlx
    from agentkv.errors import AgentKVError
    from inference_worker.chat import chat_template_stuck
    from inference_worker.models import ModelError
    from inference_worker.server import serve

    try:
        serve(config, blas)
    except (RuntimeError, ModelError, OSError, AgentKVError) as exc:
        # no model, it cannot run here, or its chat template fails on the worker's probes
        error = exc.message if isinstance(exc, AgentKVError) else str(exc)
        if isinstance(exc, AgentKVError) and config.chat_template:
            error += f" (--chat-template {config.chat_template})"
        elif isinstance(exc, AgentKVError) and "chat template" in error:
            error += " (give the model one that works with --chat-template FILE)"
        logging.getLogger("agentkv.worker").error("cannot start", extra={"error": error})
        print(f"agentkv-worker: error: {error}", file=sys.stderr)
        if chat_template_stuck():  # its thread still renders: no interpreter shutdown under it
            sys.stderr.flush()
            os._exit(2)
        sys.exit(2)
