"""An optimized BLAS for MLX on Linux CPUs, loaded before `mlx` is first imported.

The `mlx-cpu` wheel links a reference BLAS (~5-8 GFLOP/s here). Loading OpenBLAS into the
global symbol namespace first makes MLX resolve its BLAS calls there: float32 matmul runs
10-30x faster on CPU (DESIGN.md). `scripts/setup.sh` installs Debian's libopenblas0-pthread.

On CPUs with AVX-512, OpenBLAS's own kernels multiply one row by another route than several
rows, so a batched decode step differed from the same agent decoded alone in the last bits
(tests/test_batch_cache.py caught it on an AMD EPYC with AVX-512). Its AVX2 ("Haswell")
kernels give every row the same result; on SmolLM2-135M they cost no measurable time here
(decode 62-72 ms a step either way). OPENBLAS_CORETYPE set by the user wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)


def find_openblas() -> str | None:
    override = os.environ.get("AGENTKV_BLAS")
    if override:
        return override if override != "none" else None
    for candidate in CANDIDATES:
        if Path(candidate).exists():
            return candidate
    return ctypes.util.find_library("openblas")


def load_optimized_blas() -> str | None:
    """Loads OpenBLAS globally if present; returns its path, or None (macOS, or not installed).

    Must run before `import mlx`; afterwards it would have no effect, so it refuses.
    """
    if not sys.platform.startswith("linux"):
        return None  # macOS uses Accelerate and Metal
    if "mlx.core" in sys.modules:
        raise RuntimeError("load_optimized_blas() must run before mlx is imported")
    path = find_openblas()
    if path is None:
        return None
    if _has_avx512():
        os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")  # read when OpenBLAS loads
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return path


def _has_avx512() -> bool:
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
