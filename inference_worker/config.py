"""The worker process's configuration, filled once from the command line."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentkv import defaults
from agentkv.addresses import is_loopback, listen_host, tcp_listen
from agentkv.channels import ClientSecurity
from agentkv.security import ServerSecurity
from inference_worker.kv_format import KVFormat

RESTORE_PATHS = ("auto", "locate", "stream")
DTYPES = ("auto", "float32", "float16", "bfloat16")
GGUF_WEIGHTS = ("auto", "float32", "float16", "bfloat16", "native")


@dataclass(slots=True)
class WorkerConfig:
    model: str  # a shipped name, a GGUF file, an mlx-lm model directory or a hub id
    store: str  # the cache store's address, HOST:PORT or unix:PATH
    listen: str = defaults.WORKER_ADDRESS
    metrics_listen: str | None = None
    health_listen: str | None = None  # HOST:PORT for plaintext grpc.health.v1 alone
    kv: KVFormat = field(default_factory=KVFormat)
    block_tokens: int = 256
    prefill_chunk: int = 512
    # Queries up to this length attend over Q4 with quantized matmul; longer ones dequantize
    # first (DESIGN.md, CPU). None picks per device: 1 on CPU, 32 on a GPU.
    quantized_query_max: int | None = None
    hot_budget_bytes: int = 2 << 30  # RAM for KV: the hot tier and the live batch together
    max_batch: int = 8
    step_tokens: int = 512  # tokens one model step may process: decodes first, then prefill
    queue_limit: int = 64
    restore_path: str = "auto"  # auto: locate when the store's files are visible here
    # Sliding-window layers keep only their window in RAM and restore only the blocks that
    # reach into it. False keeps every layer at full length (the paper's reference).
    window_caches: bool = True
    # The dtype the weights compute in: "auto" is float32 on CPU (fastest with BLAS, and
    # MoE's gather matmul needs it there) and the weights' own on a GPU.
    dtype: str = "auto"
    # What a GGUF's weights become on import: auto (float32 on CPU, native on a GPU),
    # float32 / float16 / bfloat16 (dequantized), or native (its own 4/8-bit layers).
    gguf_weights: str = "auto"
    security: ServerSecurity = field(default_factory=ServerSecurity)  # its own server
    store_security: ClientSecurity = field(default_factory=ClientSecurity)  # to the store
    store_timeout: float = 60.0
    # How long a turn of an agent hot here waits for the store to say whether another
    # worker committed it since; past that (a hung store) the RAM copy stands.
    store_check_timeout: float = 2.0
    max_stop_strings: int = 16
    workers: int = 16
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model is required")
        listen_host(self.store)
        listen_host(self.listen)
        if self.block_tokens < 16 or self.block_tokens % 16:
            raise ValueError(f"block_tokens must be a positive multiple of 16: {self.block_tokens}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.hot_budget_bytes < 0:
            raise ValueError(f"hot_budget_bytes must be >= 0, got {self.hot_budget_bytes}")
        if not 0 < self.store_check_timeout <= self.store_timeout:
            raise ValueError(
                f"store_check_timeout must be in (0, store_timeout={self.store_timeout}], "
                f"got {self.store_check_timeout}"
            )
        if self.max_batch < 1 or self.step_tokens < 1 or self.queue_limit < 0:
            raise ValueError("max_batch and step_tokens must be >= 1, queue_limit >= 0")
        if self.restore_path not in RESTORE_PATHS:
            raise ValueError(f"restore_path must be one of {RESTORE_PATHS}: {self.restore_path!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}: {self.dtype!r}")
        if self.gguf_weights not in GGUF_WEIGHTS:
            raise ValueError(f"gguf_weights must be one of {GGUF_WEIGHTS}: {self.gguf_weights!r}")
        tcp_listen("metrics_listen", self.metrics_listen)
        tcp_listen("health_listen", self.health_listen)

        self.security.check(self.listen, is_loopback(self.listen))
