"""Checks on everything a caller sends, each failure naming the offending value."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from agentkv.errors import InvalidArgument
from agentkv.keys import KEY_BYTES

NAMESPACE_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
AGENT_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
FINGERPRINT_RE = re.compile(r"[A-Za-z0-9:._-]{8,128}")
TENSOR_NAME_RE = re.compile(r"layers\.(\d{1,5})\.[A-Za-z0-9_.]{1,64}")
DEFAULT_NAMESPACE = "default"
MAX_TENSORS = 8192
MAX_METADATA_ENTRIES = 64
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 4096
MAX_METADATA_TOTAL = 96 << 10  # characters of keys and values together, per agent
MAX_PHASE = 256

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


def _show(value: str, limit: int = 80) -> str:
    return repr(value if len(value) <= limit else value[:limit] + "...")


def namespace(value: str) -> str:
    value = value or DEFAULT_NAMESPACE
    if not NAMESPACE_RE.fullmatch(value):
        raise InvalidArgument(
            f"invalid namespace {_show(value)}: must match {NAMESPACE_RE.pattern}"
        )
    return value


def agent_id(value: str, field: str = "agent_id") -> str:
    if not AGENT_ID_RE.fullmatch(value):
        raise InvalidArgument(f"invalid {field} {_show(value)}: must match {AGENT_ID_RE.pattern}")
    return value


def fingerprint(value: str) -> str:
    if not FINGERPRINT_RE.fullmatch(value):
        raise InvalidArgument(
            f"invalid fingerprint {_show(value)}: must match {FINGERPRINT_RE.pattern}"
        )
    return value


def key(value: bytes, field: str = "key", allow_root: bool = False) -> bytes:
    if allow_root and not value:
        return value
    if len(value) != KEY_BYTES:
        raise InvalidArgument(f"invalid {field} {value.hex()!r}: must be {KEY_BYTES} bytes")
    return bytes(value)


def token_ids(values: Sequence[int], limit: int, field: str = "token_ids") -> list[int]:
    if len(values) > limit:
        raise InvalidArgument(f"{field} holds {len(values)} tokens, more than the limit {limit}")
    return list(values)


def metadata(values: Mapping[str, str]) -> dict[str, str]:
    if len(values) > MAX_METADATA_ENTRIES:
        raise InvalidArgument(f"metadata has {len(values)} entries, limit {MAX_METADATA_ENTRIES}")
    for k, v in values.items():
        if not k or len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE:
            raise InvalidArgument(
                f"metadata entry {_show(k)}: keys need 1..{MAX_METADATA_KEY} chars, "
                f"values at most {MAX_METADATA_VALUE}"
            )
    total = sum(len(k) + len(v) for k, v in values.items())
    if total > MAX_METADATA_TOTAL:
        raise InvalidArgument(
            f"metadata holds {total} characters of keys and values, limit {MAX_METADATA_TOTAL}"
        )
    return dict(values)


def phase(value: str) -> str:
    if len(value) > MAX_PHASE:
        raise InvalidArgument(f"phase {_show(value)} is {len(value)} characters, limit {MAX_PHASE}")
    return value


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
        raise InvalidArgument(f"invalid tensor name {_show(name)}: must match layers.<i>.<part>")
    if name in seen:
        raise InvalidArgument(f"tensor {name!r} declared twice")
    seen.add(name)
    layer = int(match.group(1))
    if layer < last_layer:
        raise InvalidArgument(f"tensor {name!r}: layers must be in ascending order")
    if dtype not in DTYPE_SIZES:
        raise InvalidArgument(f"tensor {name!r} has unknown dtype {_show(dtype)}")
    if len(shape) > 8:
        raise InvalidArgument(f"tensor {name!r} has {len(shape)} dimensions, limit 8")
    num_bytes = math.prod(shape) * DTYPE_SIZES[dtype]
    return TensorLayout(name, dtype, tuple(shape), layer, offset, num_bytes)
