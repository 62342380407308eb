"""The KV format: how keys and values are quantized. No MLX import, so configs can use it
before the optimized BLAS is loaded."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agentkv.flags import flag
from agentkv.layers import KVStorage, LayerSpec


@dataclass(frozen=True, slots=True)
class KVFormat:
    """How K and V are stored: bits each, quantization group, and the scales' dtype."""

    k_bits: int = flag(4, "bits per key element")
    v_bits: int = flag(4, "bits per value element")
    group_size: int = flag(64, "elements per quantization scale and bias (32, 64 or 128)")
    scale_dtype: str = "float16"

    def __post_init__(self) -> None:
        for name, bits in (("k_bits", self.k_bits), ("v_bits", self.v_bits)):
            if bits not in (2, 3, 4, 5, 6, 8):
                raise ValueError(f"{name} must be one of 2, 3, 4, 5, 6, 8; got {bits}")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"group_size must be 32, 64 or 128; got {self.group_size}")
        if self.scale_dtype not in ("float16", "float32"):
            raise ValueError(f"scale_dtype must be float16 or float32; got {self.scale_dtype}")

    @property
    def name(self) -> str:
        """e.g. "k4v4g64f16": part of the model fingerprint."""
        scales = "f16" if self.scale_dtype == "float16" else "f32"
        return f"k{self.k_bits}v{self.v_bits}g{self.group_size}{scales}"

    def token_bytes(self, specs: Sequence[LayerSpec]) -> int:
        """Bytes one token of context costs in these layers' caches (agentkv.layers' sizes)."""
        scale_bytes = 2 if self.scale_dtype == "float16" else 4
        k, v = (KVStorage(b, self.group_size, scale_bytes) for b in (self.k_bits, self.v_bits))
        per_layer = (
            s.kv_heads * (k.vector_bytes(s.k_head_dim) + v.vector_bytes(s.v_head_dim))
            for s in specs
        )
        return sum(per_layer)
