"""A GGUF file as an mlx-lm model's weights and config: its tensors read from their raw
blocks (gguf_header, gguf_quants) and dequantized or, for "native", kept as MLX affine
quantization; the architecture's tensor names and config; what llama.cpp's converter
changed (Q/K row order, Gemma's norms, Llama 3's RoPE factors) undone.

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K are MLX affine quantization with group size 32,
so under "native" they load as 4-, 5- or 8-bit MLX layers (the K-quants' scales rounded to
fp16); Q2_K, Q3_K and Q6_K scale groups of 16, which MLX has no layout for, and come as
float16."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from inference_worker.gguf_header import TensorInfo, read_header
from inference_worker.gguf_quants import (
    AFFINE,
    BLOCKS,
    GROUP,
    affine,
    block_weights,
    dequantize,
    nbytes,
)
from inference_worker.gguf_tokenizer import GGUFError

GROUP_SIZE = GROUP  # every GGUF block quantization kept as MLX layers (gguf_quants.AFFINE)

# GGUF tensor names (after "blk.N.") to HF names (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms around attention and the MLP (llama.cpp's names for them).
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True, slots=True)
class Architecture:
    """How one GGUF architecture maps onto an mlx-lm model type."""

    model_type: str
    config: Callable[[Callable[[str, object], object]], dict]
    layer_names: dict[str, str] = field(default_factory=lambda: _LAYER_NAMES)
    unpermute_qk: bool = False  # llama.cpp reorders Q/K rows for its RoPE on llama only
    norm_shift: float = 0.0  # Gemma's converter stores RMSNorm weights as 1 + w


def _dense(get) -> dict:
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    return {
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
    }


def _gemma3(get) -> dict:
    config = _dense(get)
    layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    # llama.cpp's rule: Gemma 3 27B (62 layers) scales queries by hidden / heads.
    scalar = config["hidden_size"] // config["num_attention_heads"] if layers == 62 else head_dim
    config.update(
        rope_local_base_freq=10000.0,  # fixed for Gemma 3's local layers (llama.cpp too)
        sliding_window=int(get("attention.sliding_window", 1024)),
        sliding_window_pattern=6,
        query_pre_attn_scalar=scalar,
    )
    factor = get("rope.scaling.factor", None)
    if factor is not None and float(factor) != 1.0:
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    return config


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", _dense, unpermute_qk=True),
    "qwen2": Architecture("qwen2", _dense),
    "qwen3": Architecture("qwen3", _dense),
    "gemma3": Architecture("gemma3_text", _gemma3, _GEMMA3_LAYER_NAMES, norm_shift=1.0),
}
# GGML tensor types agentkv decodes (gguf_quants), bit for bit as llama.cpp does.
READABLE = ("F32", "F16", "BF16", *BLOCKS)
TENSOR_TYPES = f"{', '.join(READABLE[:-1])} and {READABLE[-1]}"
# What `native` keeps a tensor it decodes to floats in (F32/F16 stay as they are): the dtype
# MLX's own reader gave Q2_K and Q6_K, and half the memory of float32.
NATIVE_FLOAT = "float16"
FLOAT16_MAX = 65504.0


def check_tensor_types(path: Path) -> None:
    """Refuses a file with a tensor type agentkv does not decode, naming the first such
    tensor."""
    _check_types(read_header(path).tensors)


def _check_types(tensors: list[TensorInfo]) -> None:
    refused = {info.name: info.kind for info in tensors if info.kind not in READABLE}
    if refused:
        name, kind = next(iter(refused.items()))
        others = sorted(set(refused.values()) - {kind})
        also = f", nor {', '.join(others)} (also in this file)" if others else ""
        raise GGUFError(
            f"GGUF tensor {name!r} is {kind}, which agentkv does not import{also}; it imports "
            f"{TENSOR_TYPES} (the model's Q4_K_M or Q8_0 GGUF would do)"
        )


def read_gguf(path: Path, weights: str = "float32") -> tuple[dict, dict]:
    """(tensors, metadata). Under `native`, gguf_quants.AFFINE tensors come as MLX affine
    quantization (`stem.weight` packed, `stem.scales`, `stem.biases`), other decoded types as
    NATIVE_FLOAT; otherwise every tensor comes in the `weights` dtype or F32/F16 as stored."""
    header = read_header(path)
    _check_types(header.tensors)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for info in header.tensors:
        tensors.update(_read_tensor(path, data, info, weights))
    return tensors, header.metadata


def _read_tensor(path: Path, data: np.ndarray, info: TensorInfo, weights: str) -> dict:
    """One tensor, decoded from its raw blocks (a GGUFError if they are not all there)."""
    import mlx.core as mx

    if info.shape and info.shape[-1] % block_weights(info.kind):
        raise GGUFError(f"GGUF tensor {info.name!r} has rows of {info.shape[-1]} weights, "
                        f"not whole {info.kind} blocks")  # fmt: skip
    raw = data[info.offset : info.offset + nbytes(info.kind, info.size)]
    if len(raw) != nbytes(info.kind, info.size):
        raise GGUFError(f"GGUF {path} is cut short: tensor {info.name!r} lacks its data")
    stem = info.name.rpartition(".")[0]
    if weights == "native" and info.kind in AFFINE:
        packed, scales, biases = affine(raw, info.kind, info.shape)
        _check_finite(path, info, scales, biases, per=GROUP)
        parts = zip(("weight", "scales", "biases"), (packed, scales, biases), strict=True)
        return {f"{stem}.{part}": mx.array(array) for part, array in parts}
    target = NATIVE_FLOAT if weights == "native" else weights
    half = target == "float16" and info.kind in BLOCKS  # decoded straight into float16
    decoded = dequantize(raw, info.kind, info.shape, np.float16 if half else np.float32)
    _check_finite(path, info, decoded)
    kept = info.kind in ("F32", "F16")  # as stored here; cast to `weights` once converted
    if (weights if kept else target) == "float16" and decoded.dtype != np.float16:
        _check_fits_float16(path, info, decoded)
    array = mx.array(decoded)
    if not kept:
        array = array.astype(getattr(mx, target))
        mx.eval(array)  # now, so that only one tensor's float32 is held at a time
    return {info.name: array}


def _check_finite(path: Path, info: TensorInfo, *arrays: np.ndarray, per: int = 1) -> None:
    """Refuses a tensor with NaN or infinite weights (its model would answer one token over
    and over). `arrays` hold its weights, or a scale and a bias per group of `per` weights."""
    if all(map(_all_finite, arrays)):
        return
    finite = np.logical_and.reduce([np.isfinite(a) for a in arrays])
    count = (finite.size - np.count_nonzero(finite)) * per
    raise GGUFError(
        f"GGUF {path}: tensor {info.name!r} holds {count:,} weights that are NaN or infinite"
    )


def _check_fits_float16(path: Path, info: TensorInfo, decoded: np.ndarray) -> None:
    """Refuses a tensor with weights past float16's range, which the cast to it would make
    infinite (as _check_finite refuses those)."""
    largest = float(np.abs(decoded).max(initial=0.0))
    if largest > FLOAT16_MAX:
        raise GGUFError(
            f"GGUF {path}: tensor {info.name!r} holds weights up to {largest:.4g}, past "
            f"float16's {FLOAT16_MAX:g}: import it in float32 (the worker's --gguf-weights "
            "float32, or agentkv model import --weights float32)"
        )


def _all_finite(array: np.ndarray) -> bool:
    if array.dtype == np.float16:  # numpy's isfinite is 5x slower there: NaN and inf are
        # the float16s whose exponent bits are all ones, and only they reach 0x7C00
        return int((array.view(np.uint16) & 0x7FFF).max(initial=0)) < 0x7C00
    return bool(np.isfinite(array).all())


def _scalar(value):
    import mlx.core as mx

    return value.item() if isinstance(value, mx.array) else value


def architecture_of(meta: dict) -> tuple[str, Architecture]:
    name = str(meta.get("general.architecture", ""))
    if name not in ARCHITECTURES:
        raise GGUFError(
            f"GGUF architecture {name!r} is not supported "
            f"(agentkv imports {', '.join(sorted(ARCHITECTURES))})"
        )
    return name, ARCHITECTURES[name]


_MISSING = object()


def arch_value(meta: dict, key: str, default=_MISSING):
    """The architecture's `{arch}.{key}`; a missing one without a default is a GGUFError."""
    name, _ = architecture_of(meta)
    value = meta.get(f"{name}.{key}", default)
    if value is _MISSING:
        raise GGUFError(f"GGUF metadata lacks {name}.{key}")
    return _scalar(value)


def model_config(meta: dict, vocab_size: int, tied: bool) -> dict:
    _, arch = architecture_of(meta)
    config = {"model_type": arch.model_type, **arch.config(partial(arch_value, meta))}
    eos = [int(_scalar(meta[k])) for k in _EOS_KEYS if k in meta]
    config.update(
        vocab_size=vocab_size,
        tie_word_embeddings=tied,
        bos_token_id=int(_scalar(meta.get("tokenizer.ggml.bos_token_id", 0))),
        eos_token_id=sorted(set(eos)) or None,
    )
    return config


_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")


def hf_name(gguf_name: str, arch: Architecture) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, index, part = stem.split(".", 2)
        if part not in arch.layer_names:
            raise GGUFError(f"GGUF tensor {gguf_name!r} has no counterpart in {arch.model_type}")
        return f"model.layers.{index}.{arch.layer_names[part]}.{suffix}"
    if stem not in _TOP_NAMES:
        raise GGUFError(f"GGUF tensor {gguf_name!r} has no counterpart in {arch.model_type}")
    return f"{_TOP_NAMES[stem]}.{suffix}"


def _unpermute(x, heads: int):
    """Undoes llama.cpp's per-head row order for RoPE (the two halves interleaved)."""
    rows = x.shape[0]
    x = x.reshape(heads, rows // heads // 2, 2, *x.shape[1:])
    return x.swapaxes(1, 2).reshape(rows, *x.shape[3:])


def _bits(tensors: dict, stem: str) -> int:
    packed, scales = tensors[f"{stem}.weight"], tensors[f"{stem}.scales"]
    return packed.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)


ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's precomputed Llama 3 RoPE factors
_LLAMA3_FACTORS = (8.0, 16.0, 32.0)  # Llama 3.1 and 3.3: 8; Llama 3.2: 32


def llama3_rope(factors, head_dim: int, theta: float) -> dict:
    """The rope_scaling whose factors llama.cpp's converter wrote as rope_freqs: the GGUF
    keeps only the factors, so they are matched against the Llama 3 family's settings."""
    import numpy as np

    got = np.asarray(factors, dtype=np.float64).reshape(-1)
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    low, high, context = 1.0, 4.0, 8192
    smooth = (context / wavelen - low) / (high - low)
    for factor in _LLAMA3_FACTORS:
        want = np.where(
            wavelen < context / high,
            1.0,
            np.where(wavelen > context / low, factor, 1 / ((1 - smooth) / factor + smooth)),
        )
        if got.shape == want.shape and np.allclose(got, want, rtol=1e-5):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": context,
            }
    raise GGUFError(
        "GGUF rope_freqs match no Llama 3 RoPE scaling agentkv knows "
        f"(factors {', '.join(map(str, _LLAMA3_FACTORS))}, low 1, high 4, context 8192)"
    )


def convert_tensors(tensors: dict, meta: dict, weights: str) -> tuple[dict, dict]:
    """HF-named weights and, for native, mlx-lm's per-layer quantization config."""
    import mlx.core as mx

    _, arch = architecture_of(meta)
    tensors = {k: v for k, v in tensors.items() if k != ROPE_FREQS}
    heads = int(arch_value(meta, "attention.head_count"))
    kv_heads = int(arch_value(meta, "attention.head_count_kv", heads))
    quantized = {k.rpartition(".")[0] for k in tensors if k.endswith(".scales")}
    out, quantization = {}, {}
    for key, value in tensors.items():
        stem = key.rpartition(".")[0]
        if key.endswith((".scales", ".biases")) and stem in quantized:
            continue  # travels with its packed weight
        if stem in quantized and key.endswith(".weight"):  # native: an AFFINE type
            group = {p: tensors[f"{stem}.{p}"] for p in ("weight", "scales", "biases")}
            quantization[hf_name(key, arch).rpartition(".")[0]] = {
                "group_size": GROUP_SIZE,
                "bits": _bits(tensors, stem),
            }
        else:
            group = {key.rpartition(".")[2]: value}
        for part, array in group.items():
            out[hf_name(f"{stem}.{part}", arch)] = _fix(stem, array, arch, heads, kv_heads)
    if weights != "native":
        out = {k: v.astype(getattr(mx, weights)) for k, v in out.items()}
    return out, quantization


def _fix(stem: str, array, arch: Architecture, heads: int, kv_heads: int):
    """Undoes what llama.cpp's converter changed in one tensor."""
    import mlx.core as mx

    part = stem.rpartition(".")[2]
    if arch.unpermute_qk and part in ("attn_q", "attn_k"):
        array = _unpermute(array, heads if part == "attn_q" else kv_heads)
    if arch.norm_shift and part.endswith("norm"):
        array = (array.astype(mx.float32) - arch.norm_shift).astype(array.dtype)
    return array
