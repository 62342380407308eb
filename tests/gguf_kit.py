"""Writes GGUF files the way llama.cpp's converter does, from models the tests build.

An independent writer (PyPI `gguf`, llama.cpp's own Python package) with its own name map,
so the importer's map is checked against it, not against itself: Q/K rows permuted for
RoPE on llama, Gemma's norms stored as 1 + w, tensors optionally quantized by gguf's numpy
reference quantizers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GEMMA3_LAYER = {
    **LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# Where a K-quant block keeps its fp16 super-block scales (d, and dmin where it has one), and
# the largest sub-block scale times quant it multiplies (so that weights stay within +-1).
_KQUANT_SCALES = {
    GGMLQuantizationType.Q2_K: ((80, 82), 15 * 3),
    GGMLQuantizationType.Q3_K: ((108,), 32 * 4),
    GGMLQuantizationType.Q4_K: ((0, 2), 63 * 15),
    GGMLQuantizationType.Q5_K: ((0, 2), 63 * 31),
    GGMLQuantizationType.Q6_K: ((208,), 128 * 32),
}


def gguf_name(hf: str, arch: str) -> str:
    stem, suffix = hf.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, index, part = stem.split(".", 3)
        names = GEMMA3_LAYER if arch == "gemma3_text" else LAYER
        return f"blk.{index}.{names[part]}.{suffix}"
    return f"{TOP[stem]}.{suffix}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def converted(hf: str, w: np.ndarray, config: dict) -> np.ndarray:
    arch = config["model_type"]
    if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config["num_attention_heads"] if "q_proj" in hf else config["num_key_value_heads"]
        return permute(w, heads)
    if arch == "gemma3_text" and hf.endswith("norm.weight"):
        return w + 1.0
    return w


def rope_freqs(config: dict) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: Llama 3's RoPE
    scaling written as one factor per frequency."""
    scaling = config["rope_scaling"]
    base, dim = config["rope_theta"], config["head_dim"]
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def ggml_data(shape: tuple[int, int], qtype: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """A tensor's raw data in GGML type `qtype`: gguf's own quantization of random weights,
    or random blocks where gguf has no quantizer (the K-quants), their fp16 scales set
    small so that the blocks decode to ordinary weights (within +-1)."""
    rng = np.random.default_rng(seed)
    try:
        return quantize(rng.standard_normal(shape).astype(np.float32), qtype)
    except NotImplementedError:
        pass
    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (shape[0] * shape[1] // block, size), dtype=np.uint8)
    offsets, span = _KQUANT_SCALES.get(qtype, ((), 1))
    for at in offsets:
        scales = rng.uniform(-1 / span, 1 / span, (len(data), 1)).astype(np.float16)
        data[:, at : at + 2] = scales.view(np.uint8)
    return data.reshape(shape[0], -1)


def write_metadata(writer: GGUFWriter, arch: str, config: dict) -> None:
    a = GGUF_ARCH[arch]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_uint32(f"{a}.block_count", config["num_hidden_layers"])
    writer.add_uint32(f"{a}.context_length", config["max_position_embeddings"])
    writer.add_uint32(f"{a}.embedding_length", config["hidden_size"])
    writer.add_uint32(f"{a}.feed_forward_length", config["intermediate_size"])
    writer.add_uint32(f"{a}.attention.head_count", heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", config["num_key_value_heads"])
    writer.add_uint32(f"{a}.attention.key_length", head_dim)
    writer.add_uint32(f"{a}.attention.value_length", head_dim)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    writer.add_float32(f"{a}.rope.freq_base", config["rope_theta"])
    if arch == "gemma3_text":
        writer.add_uint32(f"{a}.attention.sliding_window", config["sliding_window"])


def write_tokenizer(writer: GGUFWriter, tokenizer_dir: Path) -> None:
    """A byte-level BPE tokenizer.json (model_kit's) as llama.cpp's "gpt2" vocabulary."""
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in spec.get("added_tokens", []) if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "default")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [3 if t in special else 1 for t in tokens])
    writer.add_array("tokenizer.ggml.merges", merges)
    writer.add_uint32("tokenizer.ggml.bos_token_id", vocab[config["bos_token"]])
    writer.add_uint32("tokenizer.ggml.eos_token_id", vocab[config["eos_token"]])
    writer.add_uint32("tokenizer.ggml.padding_token_id", vocab[config["pad_token"]])
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_string("tokenizer.chat_template", config["chat_template"])


def write_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    config: dict,
    tokenizer_dir: Path,
    qtype: GGMLQuantizationType | None = None,
    arch: str | None = None,
    metadata: dict[str, int | list | str | None] | None = None,
    raw: dict[str, GGMLQuantizationType] | None = None,
) -> Path:
    """`weights` (HF names, float32) as a GGUF; 2-D weights quantized to `qtype` if given.
    `metadata` overrides keys (uint32, an array or a string; None removes one); `raw` names weights
    written as `ggml_data` of a type instead (random, the weight's shape)."""
    writer = GGUFWriter(str(path), arch or GGUF_ARCH[config["model_type"]])
    write_metadata(writer, config["model_type"], config)
    write_tokenizer(writer, tokenizer_dir)
    for key, value in (metadata or {}).items():
        writer.kv_data[0].pop(key, None)
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif value is not None:
            writer.add_uint32(key, value)
    for hf, w in sorted(weights.items()):
        w = converted(hf, np.asarray(w, dtype=np.float32), config)
        name = gguf_name(hf, config["model_type"])
        if hf in (raw or {}):
            writer.add_tensor(name, ggml_data(w.shape, raw[hf]), raw_dtype=raw[hf])
        elif qtype is not None and w.ndim == 2:
            writer.add_tensor(name, quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)
    if (config.get("rope_scaling") or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", rope_freqs(config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
