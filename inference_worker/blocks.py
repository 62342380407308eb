"""An agent's KV caches as store blocks, and back.

Blocks cut the token sequence at multiples of `block_tokens` from the first token, so two
agents that share a prefix produce the same blocks (the store keeps them once). The last
block of an agent may be shorter; it is replaced by a fuller one on a later turn.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from agentkv.keys import ROOT_KEY, block_key
from client.blocks import Block, StoredBlock, Tensor
from inference_worker.kv_cache import NUMPY_DTYPES, PARTS, QuantizedKV
from inference_worker.kv_format import KVFormat


def block_spans(start: int, end: int, block_tokens: int) -> list[tuple[int, int]]:
    """[a, b) spans covering [start, end), cut at multiples of block_tokens."""
    spans, a = [], start
    while a < end:
        b = min((a // block_tokens + 1) * block_tokens, end)
        spans.append((a, b))
        a = b
    return spans


def cache_blocks(
    caches: Sequence[QuantizedKV],
    token_ids: Sequence[int],
    fingerprint: str,
    block_tokens: int,
    start: int = 0,
    parent_key: bytes = ROOT_KEY,
) -> tuple[list[Block], list[bytes]]:
    """Blocks (and keys) for tokens [start, offset) of the caches; `start` must be a block
    boundary and `parent_key` the key of the block ending there."""
    if start % block_tokens:
        raise ValueError(f"start {start} is not a multiple of block_tokens {block_tokens}")
    end = caches[0].offset
    mx.eval([a for c in caches for a in c.state_arrays()])
    blocks, keys, parent = [], [], parent_key
    for a, b in block_spans(start, end, block_tokens):
        span = list(token_ids[a:b])
        tensors = [t for layer, c in enumerate(caches) for t in c.span_tensors(layer, a, b)]
        blocks.append(Block(parent, span, tensors))
        parent = block_key(fingerprint, parent, span)
        keys.append(parent)
    return blocks, keys


def window_starts(windows: Sequence[int | None], total: int, align: int) -> list[int]:
    """Per layer, the first position a cache of `total` tokens still needs: 0 for a full
    layer; for a sliding one, its view start (see QuantizedKV) less what precedes it in the
    block holding it."""
    return [0 if w is None else max(0, (total - w + 1) // align * align) for w in windows]


def block_layers(
    counts: Sequence[int], windows: Sequence[int | None], align: int
) -> list[tuple[int, ...]]:
    """Per block (of `counts` tokens each, in order), the layers a restore must read: every
    full layer, and a sliding layer only where the block reaches into its window. An empty
    tuple means every layer."""
    starts = window_starts(windows, sum(counts), align)
    out, pos = [], 0
    for n in counts:
        layers = tuple(i for i, s in enumerate(starts) if pos + n > s)
        out.append(() if len(layers) == len(windows) else layers)
        pos += n
    return out


def caches_from_blocks(
    blocks: Sequence[StoredBlock],
    num_layers: int,
    fmt: KVFormat,
    quantized_query_max: int = 1,
    windows: Sequence[int | None] | None = None,
    align: int = QuantizedKV.step,
) -> list[QuantizedKV]:
    """Per-layer caches holding the blocks' tokens, in order; bit for bit what was stored.

    A sliding layer (`windows[i]` not None) takes only the blocks that reach into its window
    (block_layers); the others need not carry it. Each part is assembled once in host memory,
    already sized to the cache's growth step, and copied into MLX once.
    """
    windows = list(windows) if windows is not None else [None] * num_layers
    caches = [QuantizedKV(fmt, quantized_query_max, w, align) for w in windows]
    if not blocks:
        return caches
    by_name = [{t.name: t for t in b.tensors} for b in blocks]
    counts = [len(b.token_ids) for b in blocks]
    total = sum(counts)
    positions = [sum(counts[:i]) for i in range(len(counts))]
    for layer, (cache, need) in enumerate(
        zip(caches, window_starts(windows, total, align), strict=True)
    ):
        first = max(i for i, p in enumerate(positions) if p <= need)  # the block holding it
        start = positions[first]
        capacity = -(-(total - start) // QuantizedKV.step) * QuantizedKV.step
        keys, values = (
            tuple(
                _stacked([t[f"layers.{layer}.{kv}.{p}"] for t in by_name[first:]], capacity)
                for p in PARTS
            )
            for kv in ("keys", "values")
        )
        cache.load(keys, values, total, start)
    mx.eval([a for c in caches for a in c.state_arrays()])
    return caches


def _stacked(tensors: list[Tensor], capacity: int) -> mx.array:
    """Tensors of shape (B, H, n_i, D) joined along tokens into (B, H, capacity, D)."""
    first = tensors[0]
    dtype = NUMPY_DTYPES[first.dtype]
    b, h, _, d = first.shape
    out = np.zeros((b, h, capacity, d), dtype=dtype)
    pos = 0
    for t in tensors:
        n = t.shape[2]
        out[:, :, pos : pos + n] = np.frombuffer(t.data, dtype=dtype).reshape(tuple(t.shape))
        pos += n
    return mx.array(out)
