"""Checks on the tensors a block upload declares, each failure naming the offending value
(names and ids: agentkv.ids)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import NamedTuple

from agentkv.errors import InvalidArgument
from agentkv.ids import show

TENSOR_NAME_RE = re.compile(r"layers\.([0-9]{1,5})\.[A-Za-z0-9_.]{1,64}")  # ASCII digits
MAX_TENSORS = 8192

DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}


class TensorLayout(NamedTuple):
    """A validated tensor: where its bytes sit (a tuple: records decode thousands of these)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    layer: int
    offset: int  # within the data section, after the safetensors header
    num_bytes: int


def tensor_layout(
    specs: Sequence[tuple[str, str, Sequence[int]]], max_block_bytes: int
) -> list[TensorLayout]:
    """Validates (name, dtype, shape) specs and lays their bytes out back to back, in order."""
    if not specs:
        raise InvalidArgument("a block needs at least one tensor")
    if len(specs) > MAX_TENSORS:
        raise InvalidArgument(f"block declares {len(specs)} tensors, limit {MAX_TENSORS}")
    layout: list[TensorLayout] = []
    seen: set[str] = set()
    offset = 0
    for name, dtype, shape in specs:
        tensor = _tensor(name, dtype, shape, offset, layout[-1].layer if layout else 0, seen)
        offset += tensor.num_bytes
        if offset > max_block_bytes:
            raise InvalidArgument(f"block declares {offset}+ bytes, limit {max_block_bytes}")
        layout.append(tensor)
    return layout


def _tensor(
    name: str, dtype: str, shape: Sequence[int], offset: int, last_layer: int, seen: set[str]
) -> TensorLayout:
    match = TENSOR_NAME_RE.fullmatch(name)
    if not match:
        raise InvalidArgument(f"invalid tensor name {show(name)}: must match layers.<i>.<part>")
    if name in seen:
        raise InvalidArgument(f"tensor {name!r} declared twice")
    seen.add(name)
    layer = int(match.group(1))
    if layer < last_layer:
        raise InvalidArgument(f"tensor {name!r}: layers must be in ascending order")
    if dtype not in DTYPE_SIZES:
        raise InvalidArgument(f"tensor {name!r} has unknown dtype {show(dtype)}")
    if len(shape) > 8:
        raise InvalidArgument(f"tensor {name!r} has {len(shape)} dimensions, limit 8")
    if not all(type(n) is int and n >= 0 for n in shape):  # JSON (a bucket's) may say -1, 1.5
        raise InvalidArgument(f"tensor {name!r} has shape {list(shape)}: not whole sizes")
    num_bytes = math.prod(shape) * DTYPE_SIZES[dtype]
    return TensorLayout(name, dtype, tuple(shape), layer, offset, num_bytes)
