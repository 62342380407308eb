"""agentkv-worker: the inference worker process."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from agentkv import defaults, logs
from agentkv.channels import ClientSecurity, read_token
from agentkv.security import add_server_flags, server_security
from agentkv.units import parse_bytes


def build_config(argv: list[str] | None = None):
    from inference_worker.config import DTYPES, GGUF_WEIGHTS, RESTORE_PATHS, WorkerConfig
    from inference_worker.kv_format import KVFormat
    from inference_worker.models import DEFAULT_MODEL

    p = argparse.ArgumentParser(prog="agentkv-worker", description=__doc__)
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"a shipped model name, a GGUF file, an mlx-lm model directory or a hub id "
        f"(default: {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--gguf-weights",
        choices=GGUF_WEIGHTS,
        default="auto",
        help="what a GGUF's weights become: dequantized float32/float16/bfloat16, or native "
        "(its own 4/8-bit layers); auto: float32 on CPU, native on a GPU",
    )
    p.add_argument("--store", required=True, help="cache store address, HOST:PORT or unix:PATH")
    p.add_argument(
        "--listen", default=defaults.WORKER_ADDRESS, help="HOST:PORT (0 picks) or unix:PATH"
    )
    p.add_argument("--metrics-listen", default=None, help="HOST:PORT for Prometheus metrics")
    p.add_argument(
        "--health-listen",
        default=None,
        help="HOST:PORT serving only grpc.health.v1, plaintext and open (kubelet's grpc probe)",
    )
    p.add_argument("--k-bits", type=int, default=4, help="bits per key element (default 4)")
    p.add_argument("--v-bits", type=int, default=4, help="bits per value element (default 4)")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument(
        "--quantized-query-max",
        type=int,
        default=None,
        help="longest query that attends over Q4 directly (default: 1 on CPU)",
    )
    p.add_argument(
        "--hot-budget",
        type=parse_bytes,
        default=2 << 30,
        help="RAM for KV caches: the hot tier and the live batch together",
    )
    p.add_argument("--max-batch", type=int, default=8, help="agents decoded together")
    p.add_argument(
        "--step-tokens",
        type=int,
        default=512,
        help="tokens per model step: every decoder's next token, then prefill chunks",
    )
    p.add_argument(
        "--queue-limit",
        type=int,
        default=64,
        help="turns that may wait for a slot; past it RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--restore-path",
        choices=RESTORE_PATHS,
        default="auto",
        help="how to read the store: locate (same host), stream, or auto",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="dtype the weights compute in (auto: float32 on CPU, the weights' own on a GPU)",
    )
    p.add_argument(
        "--full-window-layers",
        action="store_true",
        help="keep sliding-window layers at full length in RAM and restore (default: window)",
    )
    p.add_argument(
        "--blas-threads",
        type=int,
        default=0,
        help="OpenBLAS threads (default: its own choice, one per core); on CPU one thread is "
        "faster for single-agent decode, more for large batches and prefill",
    )
    p.add_argument(
        "--store-check-timeout",
        type=float,
        default=2.0,
        help="seconds a hot agent's turn waits for the store to confirm it is current; past "
        "that (a hung store) it answers from RAM (default 2)",
    )
    p.add_argument("--log-level", default="info")
    add_server_flags(p)
    p.add_argument("--store-token-file", default="", help="file holding the store's bearer token")
    p.add_argument("--store-tls-ca", default="", help="PEM CA the store's certificate chains to")
    p.add_argument("--store-tls-cert", default="", help="PEM client certificate (store mTLS)")
    p.add_argument("--store-tls-key", default="", help="PEM key of --store-tls-cert")
    a = p.parse_args(argv)
    if a.blas_threads < 0:
        p.error(f"--blas-threads {a.blas_threads} must be >= 0")
    if a.blas_threads:
        os.environ["OPENBLAS_NUM_THREADS"] = str(a.blas_threads)  # read when OpenBLAS loads
    try:
        return WorkerConfig(
            model=a.model,
            store=a.store,
            listen=a.listen,
            metrics_listen=a.metrics_listen,
            health_listen=a.health_listen,
            kv=KVFormat(a.k_bits, a.v_bits, a.group_size),
            block_tokens=a.block_tokens,
            prefill_chunk=a.prefill_chunk,
            quantized_query_max=a.quantized_query_max,
            hot_budget_bytes=a.hot_budget,
            restore_path=a.restore_path,
            window_caches=not a.full_window_layers,
            dtype=a.dtype,
            gguf_weights=a.gguf_weights,
            security=server_security(a),
            store_security=ClientSecurity(
                read_token(a.store_token_file), a.store_tls_ca, a.store_tls_cert, a.store_tls_key
            ),
            max_batch=a.max_batch,
            step_tokens=a.step_tokens,
            queue_limit=a.queue_limit,
            store_check_timeout=a.store_check_timeout,
            log_level=a.log_level,
        )
    except (ValueError, OSError) as exc:
        p.error(str(exc))


def main(argv: list[str] | None = None) -> None:
    config = build_config(argv)
    logs.configure(config.log_level)
    from inference_worker.blas import load_optimized_blas

    blas = load_optimized_blas()  # before anything imports mlx
    from inference_worker.models import ModelError
    from inference_worker.server import serve

    try:
        serve(config, blas)
    except (RuntimeError, ModelError) as exc:  # no model, or it cannot run here: say why
        logging.getLogger("agentkv.worker").error("cannot start", extra={"error": str(exc)})
        print(f"agentkv-worker: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
