"""Capacity planning: how many agents' KV caches fit in a memory budget. Pure Python, no MLX.

For one agent holding `context` tokens, summed over the layers of `layers.layer_specs(config)`:

    bytes per agent = sum over layers of  held tokens x kv_heads x (K bytes + V bytes per head)
    FP16:      2 bytes per element
    Q4:        bits/8 bytes per element, plus a scale and a bias (`scale_bytes` each) per group
               of `group_size` elements; 4 bits, group 64, fp16 scales: 0.5625 bytes (4.5 bits)
    held:      FP16 and Q4 hold the whole context in every layer (as the paper counts); Q4
               window-aware holds min(context, window + chunk - 1) in a sliding layer, as
               agentkv's worker does (its cache trimmed at block boundaries: a block more)
    agents   = floor(budget / bytes per agent)

Nothing else is counted: no weights, activations, allocator slack or cache growth steps.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from agentkv.layers import FP16, KVStorage, kv_bytes_per_token, kv_bytes_window_aware, layer_specs

SHIPPED_CONFIGS = Path(__file__).parent / "model_configs"
MAX_CONFIG_BYTES = 16 << 20  # a config.json is kilobytes

UNITS = {
    "": 1,
    **{u: 1000 ** (i + 1) for i, u in enumerate("kmgt")},
    **{f"{u}i": 1024 ** (i + 1) for i, u in enumerate("kmgt")},
}
SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)


def shipped_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.json"))


def load_config(name_or_path: str | Path) -> dict:
    """A config.json dict from a file, a model directory holding one, or a shipped name
    (`shipped_names()`). Raises FileNotFoundError, or ValueError naming the file for one
    that is not a JSON object or whose layers `layer_specs` cannot build."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    elif not path.exists() and str(name_or_path) in shipped_names():
        path = SHIPPED_CONFIGS / f"{name_or_path}.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no model config at {str(name_or_path)!r}: not a config.json, a directory with "
            f"one, or a shipped name ({', '.join(shipped_names())})"
        )
    with path.open("rb") as file:
        raw = file.read(MAX_CONFIG_BYTES + 1)  # not a GGUF's gigabytes, read whole
    try:
        if raw.startswith(b"GGUF") or len(raw) > MAX_CONFIG_BYTES:
            raise UnicodeDecodeError("utf-8", raw[:1], 0, 1, "a GGUF, or too big for a config")
        config = json.loads(raw.decode())
    except UnicodeDecodeError:  # a weights file, say, or a GGUF
        raise ValueError(
            f"{path} is no text file: --config takes a model's config.json, its directory, or "
            "a shipped name (a GGUF's: `agentkv model import` it, then give the directory)"
        ) from None
    except RecursionError:
        raise ValueError(f"{path}: its JSON nests too deeply") from None
    except ValueError as exc:  # not JSON
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds {type(config).__name__}, not a JSON object")
    try:
        layer_specs(config)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return config


def parse_size(text: str) -> int:
    """Bytes from e.g. "10.2Gi" (2^30), "10.2G" or "10.2GB" (10^9), "512Mi", "1000000"."""
    match = SIZE.fullmatch(text)
    try:
        num_bytes = round(float(match[1]) * UNITS[(match[2] or "").lower()]) if match else 0
    except OverflowError:  # so many digits the float is infinite
        num_bytes = 0
    if num_bytes < 1:
        raise ValueError(
            f"a budget is a positive number of bytes with an optional unit (K, M, G, T: powers "
            f"of 1000; Ki, Mi, Gi, Ti: powers of 1024), e.g. 10.2Gi; got {text!r}"
        )
    return num_bytes


MAX_CONTEXT_TOKENS = 1 << 30  # past any model's window; the plan's figures stay exact


def parse_tokens(text: str) -> int:
    """Tokens from e.g. "8192" or "8K" (8 x 1024), 1 to MAX_CONTEXT_TOKENS."""
    match = re.fullmatch(r"\s*(\d{1,12})\s*(k?)\s*", text, re.IGNORECASE)
    num_tokens = int(match[1]) * (1024 if match[2] else 1) if match else 0
    if not 1 <= num_tokens <= MAX_CONTEXT_TOKENS:
        raise ValueError(
            f"a context is a positive number of tokens, at most {MAX_CONTEXT_TOKENS:,} (1M K), "
            f"e.g. 8192 or 8K; got {text!r}"
        )
    return num_tokens


@dataclass(frozen=True, slots=True)
class Capacity:
    """KV bytes of one agent at `context_tokens`, and how many such agents fit the budget."""

    context_tokens: int
    budget_bytes: int
    fp16_bytes: int
    q_bytes: int
    q_window_bytes: int

    @property
    def num_fp16_agents(self) -> int:
        return self.budget_bytes // self.fp16_bytes

    @property
    def num_q_agents(self) -> int:
        return self.budget_bytes // self.q_bytes

    @property
    def num_q_window_agents(self) -> int:
        return self.budget_bytes // self.q_window_bytes


def plan(
    config: dict,
    context_tokens: int,
    budget_bytes: int,
    bits: int = 4,
    group_size: int = 64,
    scale_bytes: int = 2,
    chunk_tokens: int = 0,
) -> Capacity:
    """Per-agent KV bytes and agents that fit, FP16 and quantized, by the module's formula.
    `chunk_tokens`: a prefill chunk in flight, which sliding layers hold on top of their
    window (0: at rest)."""
    if context_tokens < 1 or budget_bytes < 1 or chunk_tokens < 0:
        raise ValueError(
            f"context ({context_tokens}) and budget ({budget_bytes}) must be positive, "
            f"chunk ({chunk_tokens}) not negative"
        )
    specs = layer_specs(config)
    q = KVStorage(bits, group_size, scale_bytes)
    return Capacity(
        context_tokens,
        budget_bytes,
        fp16_bytes=context_tokens * kv_bytes_per_token(specs, FP16),
        q_bytes=context_tokens * kv_bytes_per_token(specs, q),
        q_window_bytes=kv_bytes_window_aware(specs, q, context_tokens, chunk_tokens),
    )
