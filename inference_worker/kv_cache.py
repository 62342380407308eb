"""Quantized KV caches that speak mlx-lm's cache protocol, and their blocks.

Attention path, per query length (DESIGN.md, measured on CPU):
- a turn's prefill (between `begin_turn` and `end_turn`, which the engine calls) stores its
  K/V quantized, then attends over the past dequantized and over the turn's own tokens in
  full precision (fp16), as an fp prefill would: on SmolLM2-135M that took Q4's perplexity
  from +14% of FP16's to +0.4% (benchmarks/perplexity.py). The turn's K/V are kept aside in
  fp16 until its prefill ends (the batcher drops them as the turn joins the batch to
  decode), so the result does not depend on how its prefill is split into chunks; then
  they are dropped, so the next turn sees exactly what is stored and restored:
  a restored agent continues bit for bit like a hot one. Outside a turn a chunk attends
  over the whole cache dequantized, its own tokens included. Dequantizing is faster on CPU
  than quantized matmul for these queries;
- a decode step (queries <= `quantized_query_max`) attends over the Q4 cache directly with
  quantized matmul. mlx-lm takes that path when the cache has a `bits` attribute, so `bits`
  exists only while the last fetch returned quantized arrays. K and V bits that differ
  always take the dequantize path, since mlx-lm's quantized attention has one `bits`.
"""

from __future__ import annotations

import weakref
from typing import Any

import mlx.core as mx
import numpy as np

from agentkv.client.blocks import Tensor
from agentkv.layers import KVFormat

PARTS = ("packed", "scales", "biases")
SAFETENSORS_DTYPES = {mx.uint32: "U32", mx.float16: "F16", mx.float32: "F32"}
NUMPY_DTYPES = {"U32": np.uint32, "F16": np.float16, "F32": np.float32}


QTensor = tuple[mx.array, mx.array, mx.array]  # packed, scales, biases


class QuantizedKV:
    """One layer's K and V, quantized, growing in steps of `step` tokens.

    A sliding-window layer (`window` W) keeps only what attention can still read: the last
    W - 1 tokens before each update, from a start aligned down to `align` tokens (the block
    size), so the layout depends only on the position and a restored cache matches a hot one
    block for block. Tokens not yet durable in the store (from `keep_from` on) are kept too,
    so that persistence can still cut them into blocks. `offset` is the absolute position
    (RoPE reads it); the arrays hold positions [start, offset).
    """

    step = 256

    def __init__(
        self,
        fmt: KVFormat,
        quantized_query_max: int = 1,
        window: int | None = None,
        align: int = 256,
    ) -> None:
        if window is not None and window < 1:
            raise ValueError(f"window {window} must be >= 1")
        self.fmt = fmt
        self.group_size = fmt.group_size
        self.quantized_query_max = quantized_query_max
        self.window, self.align = window, align
        self.keys: QTensor | None = None
        self.values: QTensor | None = None
        self.offset = 0
        self.start = 0  # absolute position of the arrays' first token
        self.keep_from = 0  # tokens from here on may not be dropped (not yet durable)
        self._quantized_fetch = False
        # Between begin_turn and end_turn (a turn's prefill), its K/V in fp16, positions
        # [turn_from, offset).
        self._turn_open = False
        self._turn: tuple[mx.array, mx.array] | None = None
        self.turn_from = 0
        # nbytes' K and V bytes at one position, and a weak reference to the first key array
        # they were counted on (new arrays, a batch's rows say, are counted again; a strong
        # one would keep replaced arrays alive)
        self._sized: tuple[weakref.ref | None, int] = (None, 0)

    @property
    def bits(self) -> int:
        """Present only after a fetch that returned quantized arrays (see the module doc)."""
        if not self._quantized_fetch:
            raise AttributeError("bits")
        return self.fmt.k_bits

    @property
    def view_start(self) -> int:
        """First position the next update attends over: all of them, or the window's."""
        if self.window is None:
            return self.start
        return max(self.start, (self.offset - self.window + 1) // self.align * self.align)

    # the protocol

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        num = keys.shape[2]
        view = self.view_start
        self.release()
        self._store(keys, values)
        fmt = self.fmt
        a, b = view - self.start, self.offset - self.start
        if not self._turn_open and num <= self.quantized_query_max and fmt.k_bits == fmt.v_bits:
            self._quantized_fetch = True
            return _cut(self.keys, a, b), _cut(self.values, a, b)
        self._quantized_fetch = False
        if not self._turn_open:
            return self.dequantized(a, b, keys.dtype)
        self._keep_turn(keys, values, view)
        split = self.turn_from - self.start  # _keep_turn keeps turn_from >= view
        turn_k, turn_v = (x.astype(keys.dtype) for x in self._turn)
        if split == a:  # no past in view
            return turn_k, turn_v
        past_k, past_v = self.dequantized(a, split, keys.dtype)
        return mx.concatenate([past_k, turn_k], axis=2), mx.concatenate([past_v, turn_v], axis=2)

    def _keep_turn(self, keys: mx.array, values: mx.array, view: int) -> None:
        """Adds this chunk's K/V to the turn's fp16 copy (and lets go of what left a
        sliding window)."""
        new = (keys.astype(mx.float16), values.astype(mx.float16))
        start = self.offset - keys.shape[2]
        if self._turn is None or self.turn_from + self._turn[0].shape[2] != start:
            self._turn, self.turn_from = new, start
        else:
            self._turn = tuple(  # type: ignore[assignment]
                mx.concatenate([old, x], axis=2) for old, x in zip(self._turn, new, strict=True)
            )
        if view > self.turn_from:
            self._turn = tuple(x[..., view - self.turn_from :, :] for x in self._turn)  # type: ignore[assignment]
            self.turn_from = view

    def begin_turn(self) -> None:
        """From here until end_turn, updates keep their K/V in fp16 and attend them so."""
        self._turn_open, self._turn = True, None

    def end_turn(self) -> None:
        """Drops the turn's full-precision K/V: from now on it is attended as stored."""
        self._turn_open, self._turn = False, None

    def quantized(self, end: int) -> tuple[QTensor, QTensor]:
        """K and V of positions [start, end), quantized."""
        assert self.keys is not None and self.values is not None
        n = end - self.start
        return _cut(self.keys, 0, n), _cut(self.values, 0, n)

    def dequantized(self, a: int, b: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """K and V of array rows [a, b) in `dtype`. The small scales and biases are cast, not
        the big result: 3x faster on CPU than dequantizing in fp16 and casting after."""
        g, fmt = self.group_size, self.fmt
        return tuple(
            mx.dequantize(q, s.astype(dtype), b_.astype(dtype), group_size=g, bits=bits)
            for (q, s, b_), bits in zip(
                (_cut(self.keys, a, b), _cut(self.values, a, b)),
                (fmt.k_bits, fmt.v_bits),
                strict=True,
            )
        )  # type: ignore[return-value]

    def release(self) -> None:
        """Drops now what the next update would: positions out of the window and durable."""
        self._drop_before(min(self.view_start, self.keep_from // self.align * self.align))

    def _drop_before(self, position: int) -> None:
        """Forgets positions before `position` (a sliding layer's past out of reach)."""
        drop = position - self.start
        if drop <= 0 or self.keys is None:
            return
        held = self.offset - self.start
        capacity = -(-(held - drop) // self.step) * self.step or self.step
        self.keys, self.values = (
            tuple(fit_tokens(x[..., drop:held, :], capacity) for x in q)
            for q in (self.keys, self.values)
        )
        self.start = position

    def _store(self, keys: mx.array, values: mx.array) -> None:
        fmt, prev = self.fmt, self.offset - self.start
        qk = mx.quantize(
            keys.astype(getattr(mx, fmt.scale_dtype)), group_size=fmt.group_size, bits=fmt.k_bits
        )
        qv = mx.quantize(
            values.astype(getattr(mx, fmt.scale_dtype)), group_size=fmt.group_size, bits=fmt.v_bits
        )
        self._reserve(prev + keys.shape[2], qk, qv)
        for stored, new in ((self.keys, qk), (self.values, qv)):
            for dest, src in zip(stored, new, strict=True):
                dest[..., prev : prev + keys.shape[2], :] = src
        self.offset += keys.shape[2]

    def _reserve(self, needed: int, qk: QTensor, qv: QTensor) -> None:
        capacity = 0 if self.keys is None else self.keys[0].shape[2]
        if needed <= capacity:
            return
        steps = (needed + self.step - 1) // self.step * self.step
        held = self.offset - self.start
        self.keys = _grow(self.keys, qk, held, steps)
        self.values = _grow(self.values, qv, held, steps)

    def state_arrays(self) -> list[mx.array]:
        """Every array this cache holds, for mx.eval before handing work to another thread."""
        return [*self.keys, *self.values] if self.keys is not None else []

    @property
    def state(self) -> tuple[QTensor, QTensor]:
        return self.quantized(self.offset)

    @state.setter
    def state(self, value: tuple[QTensor, QTensor]) -> None:
        self.keys, self.values = value
        self.start, self.offset = 0, self.keys[0].shape[2]

    @property
    def meta_state(self) -> tuple[str, ...]:
        fmt = self.fmt
        return tuple(map(str, (fmt.k_bits, fmt.v_bits, fmt.group_size, self.quantized_query_max)))

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forgets the last `n` positions (all of them: the cache starts over empty)."""
        self._turn = None  # a trim comes before a turn's prefill, never inside it
        if n >= self.offset:
            n, self.keys, self.values, self.offset, self.start = self.offset, None, None, 0, 0
            return n
        n = min(self.offset - self.start, n)
        self.offset -= n
        return n

    def rewind(self, offset: int) -> bool:
        """Back to positions [start, offset), as before a turn that failed; False when that
        cannot be: a sliding window dropped positions it needs, or an array holds a
        computation that fails (MLX is lazy: a failed forward may live on in the cache)."""
        self.end_turn()
        self.trim(self.offset - offset)
        if self.offset != offset or not self.holds(offset):
            return False
        try:
            mx.eval(self.state_arrays())
        except Exception:  # whatever the failed turn left in it, the cache is unusable
            return False
        return True

    def holds(self, offset: int) -> bool:
        """Whether, trimmed to `offset`, it still holds every position the next update
        attends over (a sliding window may have dropped them)."""
        if offset == 0:
            return True  # trimmed to nothing, it starts over empty
        if self.window is None:
            return self.start == 0
        return self.start <= max(0, (offset - self.window + 1) // self.align * self.align)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        """The mask for the next update's layout: keys from view_start on."""
        from mlx_lm.models.cache import create_attention_mask

        return create_attention_mask(n, self.offset - self.view_start, return_array, window_size)

    @property
    def nbytes(self) -> int:
        """Bytes of the tokens held (not of spare capacity)."""
        if self.keys is None:
            return 0
        # Per position, times positions: slicing every array cost ~15 us a cache, and the
        # hot tier counts every agent's each time a turn ends, on the MLX thread.
        counted, per_position = self._sized
        if counted is None or counted() is not self.keys[0]:
            arrays = (*self.keys, *self.values)
            per_position = sum(a.nbytes // a.shape[-2] for a in arrays)
            self._sized = (weakref.ref(self.keys[0]), per_position)
        return per_position * (self.offset - self.start)

    # blocks

    def span_tensors(self, layer: int, start: int, end: int) -> list[Tensor]:
        """Positions [start, end) of this layer as named tensors for a block."""
        if start < self.start:
            raise ValueError(f"positions before {self.start} left this layer's window")
        a, b = start - self.start, end - self.start
        k, v = _cut(self.keys, a, b), _cut(self.values, a, b)
        return [
            _tensor(f"layers.{layer}.{kv}.{part}", array)
            for kv, parts in (("keys", k), ("values", v))
            for part, array in zip(PARTS, parts, strict=True)
        ]

    def load(self, keys: QTensor, values: QTensor, offset: int, start: int = 0) -> None:
        """Restores positions [start, offset) from quantized arrays (from blocks), which may
        have spare capacity past them; replaces what was held. They count as durable."""
        self.keys, self.values = keys, values
        self.offset, self.start, self.keep_from = offset, start, offset
        self._quantized_fetch = False
        self.end_turn()


def _cut(q: QTensor, start: int, end: int) -> QTensor:
    return tuple(x[..., start:end, :] for x in q)  # type: ignore[return-value]


def fit_tokens(x: mx.array, capacity: int) -> mx.array:
    """x along tokens, cut or zero-padded to `capacity` positions."""
    n = x.shape[2]
    if n >= capacity:
        return x[..., :capacity, :]
    pad = mx.zeros((*x.shape[:2], capacity - n, x.shape[3]), dtype=x.dtype)
    return mx.concatenate([x, pad], axis=2)


def _grow(old: QTensor | None, like: QTensor, used: int, steps: int) -> QTensor:
    shape = like[0].shape[:2]
    fresh = tuple(mx.zeros((*shape, steps, x.shape[-1]), dtype=x.dtype) for x in like)
    if old is None or used == 0:
        return fresh  # type: ignore[return-value]
    return tuple(
        mx.concatenate([o[..., :used, :], f[..., used:, :]], axis=2)
        for o, f in zip(old, fresh, strict=True)
    )  # type: ignore[return-value]


def _tensor(name: str, array: mx.array) -> Tensor:
    host = np.array(array, copy=True)  # evaluated, contiguous, owned by numpy
    return Tensor(name, SAFETENSORS_DTYPES[array.dtype], host.shape, host)
