"""The worker process's configuration, filled once from the command line."""

from __future__ import annotations

from dataclasses import dataclass

from agentkv import defaults
from agentkv.addresses import listen_host
from agentkv.channels import ClientSecurity
from agentkv.flags import flag, nested
from agentkv.ids import MAX_STOP_STRINGS
from agentkv.layers import KVFormat
from agentkv.serving import ServerConfig, listen_flag
from agentkv.units import parse_bytes

RESTORE_PATHS = ("auto", "locate", "stream")
DTYPES = ("auto", "float32", "float16", "bfloat16")
GGUF_WEIGHTS = ("auto", "float32", "float16", "bfloat16", "native")


@dataclass(slots=True)
class WorkerConfig(ServerConfig):
    model: str = flag(
        defaults.MODEL, "a shipped model name, a GGUF file, an mlx-lm model directory or a hub id"
    )
    store: str = flag(help="cache store address, HOST:PORT or unix:PATH", kw_only=True)
    listen: str = listen_flag(defaults.WORKER_ADDRESS)
    gguf_weights: str = flag(
        "auto",
        "what a GGUF's weights become: dequantized float32/float16/bfloat16, or native (its "
        "own 4/8-bit layers); auto: float32 on CPU, native on a GPU",
        choices=GGUF_WEIGHTS,
    )
    chat_template: str = flag(
        "",
        "a chat template (Jinja) to use instead of the model's own: a file of it, or a "
        "tokenizer_config.json holding one (its tool-call format is inferred from it)",
        shown="the model's",
    )
    kv: KVFormat = nested(KVFormat)
    block_tokens: int = flag(256, "tokens per stored block (a multiple of 16)")
    prefill_chunk: int = flag(512, "tokens per prefill chunk")
    # Queries up to this length attend over Q4 with quantized matmul; longer ones dequantize
    # first (DESIGN.md, CPU). None picks per device.
    quantized_query_max: int | None = flag(
        None, "longest query that attends over Q4 directly", shown="1 on CPU, 32 on a GPU"
    )
    hot_budget_bytes: int = flag(
        2 << 30,
        "RAM for KV caches: the hot tier and the live batch together",
        name="hot-budget",
        parse=parse_bytes,
        shown="2G",
    )
    max_batch: int = flag(8, "agents decoded together")
    step_tokens: int = flag(
        512, "tokens per model step: every decoder's next token, then prefill chunks"
    )
    queue_limit: int = flag(
        64, "turns that may wait for a slot (each waits for a step); past it RESOURCE_EXHAUSTED"
    )
    # A turn holds an RPC thread from its start to its end: with fewer threads than turns
    # the batch and the queue hold, a flood from one tenant waits in gRPC's own first-come
    # line, ahead of every other tenant, and never reaches the queue's fair order.
    workers: int | None = flag(
        None,
        "RPC threads",
        parse=int,
        shown="--max-batch + --queue-limit + 16 (every turn it runs or queues, and the calls "
        "beside them)",
        kw_only=True,
    )
    restore_path: str = flag(
        "auto",
        "how to read the store: locate (same host), stream, or auto (locate when the store "
        "is on loopback)",
        choices=RESTORE_PATHS,
    )
    # Sliding-window layers keep only their window in RAM and restore only the blocks that
    # reach into it. False keeps every layer at full length (the paper's reference).
    window_caches: bool = flag(
        True,
        "keep sliding-window layers at full length in RAM and restore (default: window)",
        name="full-window-layers",
    )
    dtype: str = flag(
        "auto",
        "dtype the weights compute in (auto: float32 on CPU, the weights' own on a GPU)",
        choices=DTYPES,
    )
    blas_threads: int = flag(
        0,
        "OpenBLAS threads (0: its own choice, one per core); on CPU one thread is faster for "
        "single-agent decode, more for large batches and prefill",
    )
    drain_seconds: float = flag(
        10.0, "at SIGTERM, seconds in-flight turns get to finish before they are cancelled"
    )
    stop_write_seconds: float = flag(
        10.0,
        "after the drain, seconds queued store writes get to finish; past that (a hung store) "
        "they are given up and logged, each agent keeping its last commit in the store",
    )
    store_security: ClientSecurity = nested(ClientSecurity, prefix="store-")  # to the store
    store_timeout: float = 60.0
    # How long a turn of an agent hot here waits for the store to say whether another
    # worker committed it since; past that (a hung store) the RAM copy stands.
    store_check_timeout: float = flag(
        2.0,
        "seconds a hot agent's turn waits for the store to confirm it is current; past that "
        "(a hung store) it answers from RAM",
    )
    max_stop_strings: int = MAX_STOP_STRINGS

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model is required")
        try:
            listen_host(self.store)
        except ValueError as exc:
            raise ValueError(f"--store: {exc}") from None
        if self.block_tokens < 16 or self.block_tokens % 16:
            raise ValueError(f"block_tokens must be a positive multiple of 16: {self.block_tokens}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.hot_budget_bytes <= 0:  # no turn could ever run
            raise ValueError(f"hot_budget_bytes must be > 0, got {self.hot_budget_bytes}")
        if not 0 < self.store_check_timeout <= self.store_timeout:
            raise ValueError(
                f"store_check_timeout must be over 0 and at most {self.store_timeout:g} s "
                f"(the worker's store calls' timeout), got {self.store_check_timeout:g}"
            )
        if min(self.max_batch, self.step_tokens, self.queue_limit) < 1:  # a turn waits first
            raise ValueError("max_batch, step_tokens and queue_limit must be >= 1")
        if self.workers is None:
            self.workers = self.max_batch + self.queue_limit + 16
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.restore_path not in RESTORE_PATHS:
            raise ValueError(f"restore_path must be one of {RESTORE_PATHS}: {self.restore_path!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}: {self.dtype!r}")
        if self.gguf_weights not in GGUF_WEIGHTS:
            raise ValueError(f"gguf_weights must be one of {GGUF_WEIGHTS}: {self.gguf_weights!r}")
        if self.blas_threads < 0:
            raise ValueError(f"--blas-threads {self.blas_threads} must be >= 0")
        if self.drain_seconds < 0:
            raise ValueError(f"--drain-seconds {self.drain_seconds} must be >= 0")
        if self.stop_write_seconds < 0:
            raise ValueError(f"--stop-write-seconds {self.stop_write_seconds} must be >= 0")
        self.check_serving()
