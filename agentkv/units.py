"""Units and plain-text tables: byte sizes in and out, times, and the CLI's table layout."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

BINARY_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


MAX_BYTES = (1 << 63) - 1  # what the int64 fields of the protos and metrics carry


def parse_bytes(text: str) -> int:
    """'512M', '20G', '20GiB', '1048576' -> bytes (K, M, G, T are powers of 1024). ValueError,
    naming `text`, for anything else: negative, not finite, or past MAX_BYTES."""
    number = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = BINARY_UNITS.get(number[-1:], 1)
    try:
        num_bytes = int(float(number[:-1]) * unit) if unit > 1 else int(number)
    except (ValueError, OverflowError):  # not a number, NaN, or infinite
        num_bytes = -1
    if not 0 <= num_bytes <= MAX_BYTES:
        raise ValueError(
            f"not a byte size: {text!r} (0 to 2^63-1 bytes, or with K, M, G or T, e.g. 512M)"
        )
    return num_bytes


SECONDS_PER = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_SECONDS = 36_500 * 86400  # a hundred years: longer is "forever", which is 0 where taken


def parse_seconds(text: str) -> float:
    """'90', '90s', '30m', '12h', '7d' -> seconds. ValueError, naming `text`, for anything
    else: negative, or over a hundred years."""
    number = text.strip().lower()
    unit = SECONDS_PER.get(number[-1:], 0)
    try:
        seconds = float(number[:-1] if unit else number) * (unit or 1)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= MAX_SECONDS:
        raise ValueError(
            f"not a duration: {text!r} (seconds, or with s, m, h or d, e.g. 12h; at most 36500d)"
        )
    return seconds


def human_seconds(seconds: float) -> str:
    """86400 -> '1d', 5400 -> '90m', 1.5 -> '1.5s': the largest unit that divides it whole."""
    for unit, size in reversed(SECONDS_PER.items()):
        if seconds and seconds % size == 0:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:g}s"


def human_bytes(num_bytes: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError


def utc_time(unix_ms: int) -> str:
    return datetime.fromtimestamp(unix_ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table with columns padded to fit."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
