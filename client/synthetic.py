"""Q4-shaped blocks of random bytes, for the walkthrough, benchmarks and tests (no model needed).

Shapes follow MLX's 4-bit quantization with group size 64: per layer and per K/V, packed
uint32 (heads, tokens, head_dim / 8) plus fp16 scales and biases (heads, tokens, head_dim / 64).
"""

from __future__ import annotations

import numpy as np

from agentkv.client.blocks import Block, Tensor
from agentkv.keys import ROOT_KEY, block_key


def q4_tensors(
    num_tokens: int, num_layers: int = 4, kv_heads: int = 2, head_dim: int = 64, seed: int = 0
) -> list[Tensor]:
    """K and V of every layer, in layer order, as named, typed byte arrays."""
    rng = np.random.default_rng(seed)
    shape = (1, kv_heads, num_tokens)
    tensors = []
    for layer in range(num_layers):
        for kv in ("keys", "values"):
            packed = rng.integers(0, 2**32, (*shape, head_dim // 8), dtype=np.uint32)
            scales = rng.standard_normal((*shape, head_dim // 64)).astype(np.float16)
            biases = rng.standard_normal((*shape, head_dim // 64)).astype(np.float16)
            tensors += [
                Tensor(f"layers.{layer}.{kv}.packed", "U32", packed.shape, packed),
                Tensor(f"layers.{layer}.{kv}.scales", "F16", scales.shape, scales),
                Tensor(f"layers.{layer}.{kv}.biases", "F16", biases.shape, biases),
            ]
    return tensors


def make_chain(
    token_ids: list[int], fingerprint: str, block_tokens: int = 64, seed: int = 0, **shape: int
) -> tuple[list[Block], list[bytes]]:
    """Blocks (and their keys) covering token_ids in spans of block_tokens, the last shorter."""
    blocks, keys, parent = [], [], ROOT_KEY
    for i, start in enumerate(range(0, len(token_ids), block_tokens)):
        span = token_ids[start : start + block_tokens]
        blocks.append(Block(parent, span, q4_tensors(len(span), seed=seed + i, **shape)))
        parent = block_key(fingerprint, parent, span)
        keys.append(parent)
    return blocks, keys
