"""Per-layer KV cache shapes read from a model's config.json, the KV format (how keys and
values are quantized), and the bytes a token costs.

Pure Python, no MLX. The shapes are what mlx-lm's model classes (0.32) pass to their caches'
`update_and_fetch`, which is what agentkv's worker quantizes and stores; tests check them
against real forward passes of tiny models.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agentkv.flags import flag

KINDS = ("full", "sliding")


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One layer's KV cache per token: `kv_heads` K vectors of `k_head_dim` elements and as
    many V vectors of `v_head_dim`. A sliding layer attends to its last `window` tokens only."""

    kind: str
    window: int | None
    kv_heads: int
    k_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}; got {self.kind!r}")
        if (self.kind == "sliding") != (self.window is not None):
            raise ValueError(f"a {self.kind} layer cannot have window={self.window}")
        if min(self.kv_heads, self.k_head_dim, self.v_head_dim, self.window or 1) < 1:
            raise ValueError(f"heads, head dims and window must be positive: {self}")

    def held_tokens(self, context_tokens: int, chunk_tokens: int = 0) -> int:
        """Tokens a window-aware cache of this layer holds at `context_tokens`, while a
        prefill chunk of `chunk_tokens` is being appended (0 or 1: at rest)."""
        if self.window is None:
            return context_tokens
        # mlx-lm's RotatingKVCache keeps window - 1 old tokens, then appends the chunk
        return min(context_tokens, self.window + max(chunk_tokens - 1, 0))


@dataclass(frozen=True, slots=True)
class KVStorage:
    """How K and V elements are stored: 16-bit floats (`bits=16`), or `bits`-bit integers with
    a scale and a bias of `scale_bytes` each per `group_size` elements (mx.quantize's layout,
    which KVFormat configures for keys and values)."""

    bits: int = 16
    group_size: int = 64
    scale_bytes: int = 2

    def __post_init__(self) -> None:
        if self.bits not in (2, 3, 4, 5, 6, 8, 16):
            raise ValueError(f"bits must be one of 2, 3, 4, 5, 6, 8 or 16; got {self.bits}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be positive; got {self.group_size}")
        if self.scale_bytes not in (2, 4):
            raise ValueError(f"scale_bytes must be 2 or 4; got {self.scale_bytes}")

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    def vector_bytes(self, dim: int) -> int:
        """Bytes of one head's K or V vector of `dim` elements."""
        packed = math.ceil(dim * self.bits / 8)
        if not self.quantized:
            return packed
        return packed + 2 * self.scale_bytes * math.ceil(dim / self.group_size)


FP16 = KVStorage()


KV_BITS = (2, 3, 4, 5, 6, 8)  # what KVFormat stores K and V in
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True, slots=True)
class KVFormat:
    """How K and V are stored: bits each, quantization group, and the scales' dtype."""

    k_bits: int = flag(4, "bits per key element")
    v_bits: int = flag(4, "bits per value element")
    group_size: int = flag(64, "elements per quantization scale and bias (32, 64 or 128)")
    scale_dtype: str = "float16"

    def __post_init__(self) -> None:
        for name, bits in (("k_bits", self.k_bits), ("v_bits", self.v_bits)):
            if bits not in KV_BITS:
                raise ValueError(f"{name} must be one of 2, 3, 4, 5, 6, 8; got {bits}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be 32, 64 or 128; got {self.group_size}")
        if self.scale_dtype not in ("float16", "float32"):
            raise ValueError(f"scale_dtype must be float16 or float32; got {self.scale_dtype}")

    @property
    def name(self) -> str:
        """e.g. "k4v4g64f16": part of the model fingerprint."""
        scales = "f16" if self.scale_dtype == "float16" else "f32"
        return f"k{self.k_bits}v{self.v_bits}g{self.group_size}{scales}"

    def check_fits(self, specs: Sequence[LayerSpec]) -> None:
        """Raises ValueError when a layer's head dim is not a whole number of groups
        (MLX quantizes whole groups only), naming the group sizes that would fit."""
        dims = sorted({d for s in specs for d in (s.k_head_dim, s.v_head_dim)})
        if all(d % self.group_size == 0 for d in dims):
            return
        fits = [g for g in GROUP_SIZES if all(d % g == 0 for d in dims)]
        raise ValueError(
            f"the model's head dims {dims} are not multiples of --group-size {self.group_size}"
            + (f"; use {' or '.join(map(str, fits))}" if fits else "; no group size fits them")
        )

    def token_bytes(self, specs: Sequence[LayerSpec]) -> int:
        """Bytes one token of context costs in these layers' caches (agentkv.layers' sizes)."""
        scale_bytes = 2 if self.scale_dtype == "float16" else 4
        k, v = (KVStorage(b, self.group_size, scale_bytes) for b in (self.k_bits, self.v_bits))
        per_layer = (
            s.kv_heads * (k.vector_bytes(s.k_head_dim) + v.vector_bytes(s.v_head_dim))
            for s in specs
        )
        return sum(per_layer)


def layer_bytes_per_token(spec: LayerSpec, fmt: KVStorage) -> int:
    """Bytes one token costs in one layer's cache."""
    return spec.kv_heads * (fmt.vector_bytes(spec.k_head_dim) + fmt.vector_bytes(spec.v_head_dim))


def kv_bytes_per_token(specs: Sequence[LayerSpec], fmt: KVStorage) -> int:
    """Bytes one token of context costs across all layers, each holding the whole context."""
    return sum(layer_bytes_per_token(s, fmt) for s in specs)


def kv_bytes_window_aware(
    specs: Sequence[LayerSpec], fmt: KVStorage, context_tokens: int, chunk_tokens: int = 0
) -> int:
    """Bytes a context of `context_tokens` costs when each sliding layer holds only its
    window (see LayerSpec.held_tokens); full layers hold the whole context."""
    return sum(
        layer_bytes_per_token(s, fmt) * s.held_tokens(context_tokens, chunk_tokens) for s in specs
    )


def describe(specs: Sequence[LayerSpec]) -> str:
    """e.g. "48 layers (8 full, 40 sliding of 1024 tokens); 8 KV heads, K/V dims 256/256"."""
    windows = sorted({s.window for s in specs if s.window is not None})
    num_sliding = sum(s.kind == "sliding" for s in specs)
    kinds = f"{len(specs) - num_sliding} full"
    if num_sliding:
        kinds += f", {num_sliding} sliding of {'/'.join(map(str, windows))} tokens"
    shapes = sorted({(s.kv_heads, s.k_head_dim, s.v_head_dim) for s in specs})
    heads = "; ".join(f"{h} KV heads, K/V dims {k}/{v}" for h, k, v in shapes)
    return f"{len(specs)} layers ({kinds}); {heads}"


def layer_specs(config: dict) -> list[LayerSpec]:
    """Per-layer KV cache shapes of the model a config.json dict describes. A multimodal
    config's `text_config` (Gemma 3) describes the language model, whose cache this is.
    Raises ValueError for a model type without a known layout or a config missing a field."""
    if isinstance(config.get("text_config"), dict):
        config = {"model_type": config.get("model_type"), **config["text_config"]}
    model_type = config.get("model_type")
    build = LAYOUTS.get(model_type) if isinstance(model_type, str) else None
    if build is None:
        known = ", ".join(sorted(LAYOUTS))
        raise ValueError(f"no KV cache layout known for model_type {model_type!r} (known: {known})")
    try:
        return build(config)
    except KeyError as exc:
        raise ValueError(f"{model_type} config has no {exc.args[0]!r}") from None
    except TypeError as exc:  # a field of the wrong JSON type (a list for a number, ...)
        raise ValueError(f"{model_type} config has a field of the wrong type: {exc}") from None


MAX_LAYERS = 10_000  # a config's layers: the largest models have a few hundred
MAX_COUNT = 1 << 24  # any other count (heads, dims, windows)


def _count(config: dict, key: str, default: int | None = None) -> int:
    """`config[key]` (`default` when absent or null) as a positive int: a 0 or a "2" would
    divide by zero or fail later with no word of which field. KeyError when it is missing."""
    value = config.get(key)
    if value is None and default is None:
        raise KeyError(key)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be a positive integer; got {value!r}")
    most = MAX_LAYERS if key == "num_hidden_layers" else MAX_COUNT
    if value > most:  # a list of specs per layer would not fit in memory: a traceback
        raise ValueError(f"{key} is {value}, past {most:,}: no model has so many")
    return value


def _sliding_flags(config: dict, pattern: int | None) -> list[bool]:
    """Which layers use sliding-window attention: `layer_types` when the config lists them,
    else every `pattern`-th layer is full and the rest slide (None: all full)."""
    num_layers = _count(config, "num_hidden_layers")
    types = config.get("layer_types")
    if types is None:
        return [pattern is not None and (i + 1) % pattern != 0 for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"layer_types must list full_attention or sliding_attention for each of "
            f"{num_layers} layers; got {types!r}"
        )
    return [t == "sliding_attention" for t in types]


def _layers(
    config: dict, flags: list[bool], kv_heads: int, k_dim: int, v_dim: int
) -> list[LayerSpec]:
    window = _count(config, "sliding_window") if any(flags) else None
    return [
        LayerSpec("sliding" if flag else "full", window if flag else None, kv_heads, k_dim, v_dim)
        for flag in flags
    ]


def _dense(config: dict) -> list[LayerSpec]:
    """Llama-style GQA (mlx-lm llama.py; mistral maps to it): `layer_types` may mark layers
    that slide over `sliding_window`."""
    heads = _count(config, "num_attention_heads")
    kv_heads = _count(config, "num_key_value_heads", heads)
    if heads % kv_heads:  # each key/value head serves a whole group of query heads
        raise ValueError(
            f"num_key_value_heads must divide num_attention_heads; got {kv_heads} and {heads}"
        )
    if config.get("head_dim"):
        head_dim = _count(config, "head_dim")
    else:
        head_dim = _count(config, "hidden_size") // heads
    return _layers(config, _sliding_flags(config, None), kv_heads, head_dim, head_dim)


def _gemma3(config: dict) -> list[LayerSpec]:
    """Gemma 3 (mlx-lm gemma3_text.py): five sliding layers, then one full, unless `layer_types`
    says otherwise. Its head dim is not hidden/heads (12B: 256, not 3840/16)."""
    head_dim = _count(config, "head_dim", 256)  # transformers' and mlx-lm's default
    flags = _sliding_flags(config, _count(config, "sliding_window_pattern", 6))
    return _layers(config, flags, _count(config, "num_key_value_heads"), head_dim, head_dim)


def _deepseek_v2(config: dict) -> list[LayerSpec]:
    """MLA as mlx-lm's deepseek_v2.py caches it: K and V decompressed per attention head,
    K = [nope; rope] (128 + 64 = 192 for V2-Lite), V = v_head_dim (128)."""
    heads, v_dim = _count(config, "num_attention_heads"), _count(config, "v_head_dim")
    k_dim = _count(config, "qk_nope_head_dim") + _count(config, "qk_rope_head_dim")
    return [LayerSpec("full", None, heads, k_dim, v_dim)] * _count(config, "num_hidden_layers")


def _deepseek_v3(config: dict) -> list[LayerSpec]:
    """MLA as mlx-lm's deepseek_v3.py caches it: the compressed latent as "K" and the rotary
    key as "V", one head shared by all attention heads."""
    spec = LayerSpec(
        "full", None, 1, _count(config, "kv_lora_rank"), _count(config, "qk_rope_head_dim")
    )
    return [spec] * _count(config, "num_hidden_layers")


LAYOUTS: dict[str, Callable[[dict], list[LayerSpec]]] = {
    "llama": _dense,
    "mistral": _dense,
    # mlx-lm's Qwen 2/3 attend fully everywhere; their configs list no sliding layer_types
    "qwen2": _dense,
    "qwen3": _dense,
    "gemma3": _gemma3,
    "gemma3_text": _gemma3,
    "deepseek_v2": _deepseek_v2,
    "deepseek_v3": _deepseek_v3,
}
