"""Several agents' quantized KV caches decoded together: one layer, left-padded.

Sequence i of a batch holds its tokens at positions [left_padding[i], idx); `offset[i]` is its
own length, which RoPE reads. `merge` builds a batch from single-agent caches (any lengths,
empty ones included), `extend` adds more, `filter` drops finished ones and `extract` gives
one back as a single-agent cache, bit for bit what the batch held. The attention path follows
QuantizedKV: dequantize for prefill chunks, quantized matmul for decode steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from agentkv.layers import KVFormat
from inference_worker.kv_cache import QTensor, QuantizedKV, fit_tokens


class BatchQuantizedKV:
    step = QuantizedKV.step

    def __init__(
        self,
        fmt: KVFormat,
        left_padding: Sequence[int],
        quantized_query_max: int = 1,
        window: int | None = None,
        align: int = 256,
    ):
        self.fmt = fmt
        self.group_size = fmt.group_size
        self.quantized_query_max = quantized_query_max
        self.window, self.align = window, align
        # Every row's tokens at [0, idx): storage, growth and the attention path are the
        # single cache's; the batch adds left padding and a position per sequence.
        self.kv = QuantizedKV(fmt, quantized_query_max)
        self.left_padding = mx.array(list(left_padding), dtype=mx.int32)
        self.offset = -self.left_padding
        # Per row, on the host: absolute position of its first held token, its position,
        # and where its not-yet-durable tokens begin (a sliding layer keeps those).
        n = len(left_padding)
        self.row_start, self.row_offset, self.row_keep = [0] * n, [0] * n, [0] * n

    @property
    def bits(self) -> int:
        return self.kv.bits  # raises AttributeError unless the last fetch was quantized

    @property
    def idx(self) -> int:
        return self.kv.offset

    @property
    def keys(self) -> QTensor | None:
        return self.kv.keys

    @property
    def values(self) -> QTensor | None:
        return self.kv.values

    @property
    def batch_size(self) -> int:
        return self.left_padding.shape[0]

    # the protocol

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        self._drop_out_of_reach()
        self.offset = self.offset + keys.shape[2]
        self.row_offset = [o + keys.shape[2] for o in self.row_offset]
        return self.kv.update_and_fetch(keys, values)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        """The mask for the next update's layout (after it drops what is out of reach).
        Rows are right-aligned, so a window is the same span of columns for every row."""
        cut = self._cut()
        return create_causal_mask(
            n,
            offset=self.idx - cut,
            left_padding=mx.maximum(self.left_padding - cut, 0),
            window_size=window_size,
        )

    def empty(self) -> bool:
        return self.keys is None

    def size(self) -> int:
        return self.idx

    def is_trimmable(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    def state_arrays(self) -> list[mx.array]:
        return self.kv.state_arrays()

    # batch operations

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKV], quantized_query_max: int = 1) -> BatchQuantizedKV:
        """One batch of single-agent caches, right-aligned (left-padded) to the longest."""
        first = caches[0]
        held = [c.offset - c.start for c in caches]
        longest = max(held)
        batch = cls(
            first.fmt, [longest - n for n in held], quantized_query_max, first.window, first.align
        )
        batch._rows(caches)
        template = next((c for c in caches if c.keys is not None), None)
        if template is None or longest == 0:
            return batch
        capacity = -(-longest // cls.step) * cls.step
        keys = _stack([c.keys for c in caches], held, template.keys, longest, capacity)
        values = _stack([c.values for c in caches], held, template.values, longest, capacity)
        batch.kv.load(keys, values, longest)
        batch.offset = mx.array(batch.row_offset, dtype=mx.int32)  # each sequence's position
        return batch

    def extract(self, i: int) -> QuantizedKV:
        """Sequence i as a single-agent cache holding exactly its tokens."""
        cache = QuantizedKV(self.fmt, self.quantized_query_max, self.window, self.align)
        pad = int(self.left_padding[i].item())
        n = self.idx - pad
        cache.offset = cache.start = self.row_offset[i]
        cache.keep_from = self.row_keep[i]
        if self.keys is None or n == 0:
            return cache
        capacity = -(-n // QuantizedKV.step) * QuantizedKV.step
        keys, values = (
            tuple(fit_tokens(x[i : i + 1, :, pad : self.idx, :], capacity) for x in q)
            for q in (self.keys, self.values)
        )
        cache.load(keys, values, self.row_offset[i], self.row_start[i])
        cache.keep_from = self.row_keep[i]
        return cache

    def filter(self, keep: Sequence[int]) -> None:
        """Keeps the sequences at `keep` (in that order); drops padding they all share."""
        index = mx.array(list(keep), dtype=mx.int32)
        self.left_padding, self.offset = self.left_padding[index], self.offset[index]
        self.row_start = [self.row_start[i] for i in keep]
        self.row_offset = [self.row_offset[i] for i in keep]
        self.row_keep = [self.row_keep[i] for i in keep]
        if self.keys is None:
            return
        shared = int(mx.min(self.left_padding).item()) if len(keep) else 0
        keys, values = (
            tuple(x[index][..., shared:, :] for x in q) for q in (self.keys, self.values)
        )
        self.kv.load(keys, values, self.idx - shared)
        self.left_padding = self.left_padding - shared

    def extend(self, caches: Sequence[QuantizedKV]) -> None:
        """Adds single-agent caches to the batch, all right-aligned to the longest. The held
        rows move only when a newcomer is longer: they gain that much left padding."""
        lengths = [c.offset - c.start for c in caches]
        longest = max(self.idx, *lengths)
        shift = longest - self.idx
        if self.keys is not None or any(c.keys is not None for c in caches):
            capacity = -(-longest // self.step) * self.step
            keys = self._joined(self.keys, [c.keys for c in caches], lengths, shift, capacity)
            values = self._joined(self.values, [c.values for c in caches], lengths, shift, capacity)
            self.kv.load(keys, values, longest)
        pads = mx.array([longest - n for n in lengths], dtype=mx.int32)
        self.left_padding = mx.concatenate([self.left_padding + shift, pads])
        self.offset = mx.concatenate([self.offset, mx.array([c.offset for c in caches], mx.int32)])
        self._rows(caches, extend=True)

    def _joined(
        self,
        held: QTensor | None,
        parts: list[QTensor | None],
        lengths: list[int],
        shift: int,
        capacity: int,
    ) -> QTensor:
        """The held rows (moved right by `shift`) above the newcomers, all at `capacity`."""
        longest = self.idx + shift
        if held is None:  # every held row is empty: zero rows above the newcomers
            empty = self.batch_size
            template = next(q for q in parts if q is not None)
            return _stack(
                [None] * empty + parts, [0] * empty + lengths, template, longest, capacity
            )
        new = _stack(parts, lengths, held, longest, capacity)
        moved = (_shifted(x[..., : self.idx, :], shift, capacity) for x in held)
        return tuple(mx.concatenate(p, axis=0) for p in zip(moved, new, strict=True))  # type: ignore[return-value]

    def _rows(self, caches: Sequence[QuantizedKV], extend: bool = False) -> None:
        rows = (
            [c.start for c in caches],
            [c.offset for c in caches],
            [c.keep_from for c in caches],
        )
        if extend:
            self.row_start += rows[0]
            self.row_offset += rows[1]
            self.row_keep += rows[2]
        else:
            self.row_start, self.row_offset, self.row_keep = map(list, rows)

    def _cut(self) -> int:
        """Columns the next update drops: those no row can attend again or still has to
        persist, a block of `align` tokens at a time, as a single sliding-window cache would."""
        if self.window is None or self.keys is None:
            return 0
        cut = self.idx
        for pad, start, offset, keep in zip(
            self.left_padding.tolist(), self.row_start, self.row_offset, self.row_keep, strict=True
        ):
            view = max(start, (offset - self.window + 1) // self.align * self.align)
            reach = min(view, keep // self.align * self.align)
            cut = min(cut, pad + max(0, reach - start))
        return cut if cut >= self.align else 0

    def _drop_out_of_reach(self) -> None:
        cut = self._cut()
        if not cut:
            return
        keys, values = (tuple(x[..., cut:, :] for x in q) for q in (self.keys, self.values))
        self.kv.load(keys, values, self.idx - cut)
        for i, pad in enumerate(self.left_padding.tolist()):
            self.row_start[i] += max(0, cut - pad)
        self.left_padding = mx.maximum(self.left_padding - cut, 0)


def _stack(
    parts: list[QTensor | None], lengths: list[int], template: QTensor, longest: int, capacity: int
) -> QTensor:
    """Each sequence's tokens placed at [longest - n, longest) of a zeroed (B, H, cap, D)."""
    out = []
    for j, like in enumerate(template):
        rows = []
        for q, n in zip(parts, lengths, strict=True):
            row = mx.zeros((1, like.shape[1], capacity, like.shape[3]), dtype=like.dtype)
            if n:
                row[..., longest - n : longest, :] = q[j][..., :n, :]
            rows.append(row)
        out.append(mx.concatenate(rows, axis=0))
    return tuple(out)  # type: ignore[return-value]


def _shifted(x: mx.array, shift: int, capacity: int) -> mx.array:
    """x's tokens moved right by `shift`, in a zeroed array of `capacity` positions."""
    n = x.shape[2]
    parts = [x]
    if shift:
        parts.insert(0, mx.zeros((*x.shape[:2], shift, x.shape[3]), dtype=x.dtype))
    if shift + n < capacity:
        parts.append(mx.zeros((*x.shape[:2], capacity - shift - n, x.shape[3]), dtype=x.dtype))
    return mx.concatenate(parts, axis=2) if len(parts) > 1 else x
