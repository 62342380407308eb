"""An agent's KV caches as store blocks, and back.

Blocks cut the token sequence at multiples of `block_tokens` from the first token, so two
agents that share a prefix produce the same blocks (the store keeps them once). The last
block of an agent may be shorter; it is replaced by a fuller one on a later turn.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from agentkv.client.blocks import Block, StoredBlock, Tensor
from agentkv.errors import BlockMisfit, CorruptBlock
from agentkv.keys import ROOT_KEY, block_key
from agentkv.layers import KVFormat, LayerSpec
from inference_worker.kv_cache import NUMPY_DTYPES, PARTS, QuantizedKV


class TensorSpec(NamedTuple):
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]


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


def check_chain(
    blocks: Sequence[StoredBlock],
    keys: Sequence[bytes],
    counts: Sequence[int],
    token_ids: Sequence[int],
) -> None:
    """Raises CorruptBlock unless each block read back is the one asked for and holds the
    manifest's tokens at its place in the chain."""
    if len(blocks) != len(keys):
        raise CorruptBlock(f"{len(blocks)} blocks read back for the {len(keys)} asked")
    pos = 0
    for block, key, n in zip(blocks, keys, counts, strict=True):
        held = list(block.token_ids)
        if block.key != key or len(held) != n or held != list(token_ids[pos : pos + n]):
            raise CorruptBlock(
                f"block {key.hex()} read back as {block.key.hex()} with {len(held)} tokens, "
                f"not the {n} the manifest holds at position {pos}"
            )
        pos += n


def part_spec(spec: LayerSpec, fmt: KVFormat, kv: str, part: str, tokens: int) -> TensorSpec:
    """The dtype and shape that part ("packed", "scales", "biases") of a layer's K or V
    (`kv`: "keys" or "values") has for `tokens` tokens: mx.quantize's layout."""
    dim, bits = (spec.k_head_dim, fmt.k_bits) if kv == "keys" else (spec.v_head_dim, fmt.v_bits)
    if part == "packed":
        return TensorSpec("U32", (1, spec.kv_heads, tokens, dim * bits // 32))
    dtype = "F16" if fmt.scale_dtype == "float16" else "F32"
    return TensorSpec(dtype, (1, spec.kv_heads, tokens, dim // fmt.group_size))


def check_tensor(tensor: Tensor, want: TensorSpec, key: bytes) -> None:
    """Raises CorruptBlock unless the tensor has the dtype, shape and bytes the model needs."""
    got = TensorSpec(tensor.dtype, tuple(tensor.shape))
    size = math.prod(want.shape) * NUMPY_DTYPES[want.dtype]().itemsize
    if got != want or tensor.num_bytes != size:
        raise BlockMisfit(
            f"block {key.hex()} tensor {tensor.name} is {got.dtype} {list(got.shape)} "
            f"({tensor.num_bytes} bytes); this model needs {want.dtype} {list(want.shape)} "
            f"({size} bytes)",
            [key],
        )


def check_blocks(blocks: Sequence[StoredBlock], specs: Sequence[LayerSpec], fmt: KVFormat) -> None:
    """Raises one BlockMisfit naming every block with a tensor that does not fit the model
    (check_tensor), or that the model has no place for."""
    if bad := _misfits(blocks, specs, fmt):
        more = f" (and {len(bad) - 1} more blocks)" if len(bad) > 1 else ""
        raise BlockMisfit(bad[0].message + more, [b.keys[0] for b in bad])


def _misfits(
    blocks: Sequence[StoredBlock], specs: Sequence[LayerSpec], fmt: KVFormat
) -> list[BlockMisfit]:
    found = []
    for block in blocks:
        try:
            for t in block.tensors:
                _, layer, kv, part = (t.name.split(".") + ["", "", ""])[:4]
                if not layer.isdigit() or int(layer) >= len(specs) or part not in PARTS:
                    raise BlockMisfit(f"block {block.key.hex()} holds {t.name!r}", [block.key])
                want = part_spec(specs[int(layer)], fmt, kv, part, len(block.token_ids))
                check_tensor(t, want, block.key)
        except BlockMisfit as exc:
            found.append(exc)
    return found


@dataclass(slots=True)
class HostLayer:
    """One layer's restored K and V parts in host memory, positions [start, total), sized
    to the cache's growth step: what a cache loads, made without MLX."""

    keys: tuple[np.ndarray, ...]
    values: tuple[np.ndarray, ...]
    total: int
    start: int


def host_layers(
    blocks: Sequence[StoredBlock],
    windows: Sequence[int | None],
    fmt: KVFormat,
    align: int = QuantizedKV.step,
    specs: Sequence[LayerSpec] | None = None,
) -> list[HostLayer]:
    """Per layer, the blocks' K and V parts joined along tokens, copied out of the blocks'
    buffers (any thread may run this). With `specs`, every block is first checked against the
    model's layer specs (check_blocks): a block that does not fit raises BlockMisfit (a
    CorruptBlock) and never reaches a cache.

    A sliding layer (`windows[i]` not None) takes only the blocks that reach into its window
    (block_layers); the others need not carry it.
    """
    if not blocks:
        return []
    if specs is not None:
        check_blocks(blocks, specs, fmt)
    by_name = [{t.name: t for t in b.tensors} for b in blocks]
    counts = [len(b.token_ids) for b in blocks]
    total = sum(counts)
    positions = [sum(counts[:i]) for i in range(len(counts))]
    layers = []
    for layer, need in enumerate(window_starts(windows, total, align)):
        first = max(i for i, p in enumerate(positions) if p <= need)  # the block holding it
        capacity = -(-(total - positions[first]) // QuantizedKV.step) * QuantizedKV.step
        parts = {}
        for kv, part in itertools.product(("keys", "values"), PARTS):
            tensors = [t[f"layers.{layer}.{kv}.{part}"] for t in by_name[first:]]
            parts[kv, part] = _stacked(tensors, capacity)
        keys, values = (tuple(parts[kv, p] for p in PARTS) for kv in ("keys", "values"))
        layers.append(HostLayer(keys, values, total, positions[first]))
    return layers


def caches_from_host(
    layers: Sequence[HostLayer],
    windows: Sequence[int | None],
    fmt: KVFormat,
    quantized_query_max: int = 1,
    align: int = QuantizedKV.step,
) -> list[QuantizedKV]:
    """Per-layer caches loaded from host_layers' output (one copy into MLX each part); empty
    caches when there is none. Runs on the MLX thread."""
    caches = [QuantizedKV(fmt, quantized_query_max, w, align) for w in windows]
    for cache, layer in zip(caches, layers, strict=False):
        keys, values = (tuple(mx.array(x) for x in q) for q in (layer.keys, layer.values))
        cache.load(keys, values, layer.total, layer.start)  # type: ignore[arg-type]
    mx.eval([a for c in caches for a in c.state_arrays()])
    return caches


def caches_from_blocks(
    blocks: Sequence[StoredBlock],
    num_layers: int,
    fmt: KVFormat,
    quantized_query_max: int = 1,
    windows: Sequence[int | None] | None = None,
    align: int = QuantizedKV.step,
    specs: Sequence[LayerSpec] | None = None,
) -> list[QuantizedKV]:
    """Per-layer caches holding the blocks' tokens, in order; bit for bit what was stored.
    host_layers then caches_from_host (see them); with `specs`, every tensor is checked."""
    windows = list(windows) if windows is not None else [None] * num_layers
    layers = host_layers(blocks, windows, fmt, align, specs)
    return caches_from_host(layers, windows, fmt, quantized_query_max, align)


def _stacked(tensors: list[Tensor], capacity: int) -> np.ndarray:
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
    return out
