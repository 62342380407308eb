"""Capacity planning: how many agents' KV caches fit in a memory budget. Pure Python, no MLX.

For one agent holding `context` tokens, summed over the layers of `layers.layer_specs(config)`:

    bytes per agent = sum over layers of  held tokens x kv_heads x (K bytes + V bytes per head)
    FP16:      2 bytes per element
    Q4:        bits/8 bytes per element, plus a scale and a bias (`scale_bytes` each) per group
               of `group_size` elements; 4 bits, group 64, fp16 scales: 0.5625 bytes (4.5 bits)
    held:      FP16 and Q4 hold the whole context in every layer (what agentkv's worker stores
               today); Q4 window-aware holds min(context, window + chunk - 1) in a sliding layer
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
    (`shipped_names()`). Raises FileNotFoundError, or ValueError for a file that is not a
    JSON object."""
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
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds {type(config).__name__}, not a JSON object")
    return config


def parse_size(text: str) -> int:
    """Bytes from e.g. "10.2Gi" (2^30), "10.2G" or "10.2GB" (10^9), "512Mi", "1000000"."""
    match = SIZE.fullmatch(text)
    num_bytes = round(float(match[1]) * UNITS[(match[2] or "").lower()]) if match else 0
    if num_bytes < 1:
        raise ValueError(
            f"a budget is a positive number of bytes with an optional unit (K, M, G, T: powers "
            f"of 1000; Ki, Mi, Gi, Ti: powers of 1024), e.g. 10.2Gi; got {text!r}"
        )
    return num_bytes


def parse_tokens(text: str) -> int:
    """Tokens from e.g. "8192" or "8K" (8 x 1024)."""
    match = re.fullmatch(r"\s*(\d+)\s*(k?)\s*", text, re.IGNORECASE)
    num_tokens = int(match[1]) * (1024 if match[2] else 1) if match else 0
    if num_tokens < 1:
        raise ValueError(f"a context is a positive number of tokens, e.g. 8192 or 8K; got {text!r}")
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


# Table 14 of Shkolnikov (2026), "Agent Memory Below the Prompt": "Agent capacity comparison,
# all models. M4 Pro, 10.2 GB cache budget". Agents that fit, (FP16, Q4), at 4K, 8K, 16K, 32K.
TABLE14_CONTEXTS = (4096, 8192, 16384, 32768)
TABLE14: dict[str, tuple[tuple[int, int], ...]] = {
    "gemma3_12b": ((6, 24), (3, 12), (1, 6), (0, 3)),
    "deepseek_coder_v2_lite": ((9, 33), (4, 16), (2, 8), (1, 4)),
    "llama3_1_8b": ((19, 70), (9, 35), (4, 17), (2, 8)),
}
# The paper's GB is 2^30 bytes: its Table 2 puts Gemma 3 at 8K at 3.0 GB FP16, and
# 8192 tokens x 393,216 bytes = 3.0 x 2^30.
TABLE14_BUDGET_BYTES = parse_size("10.2Gi")
TABLE14_NOTES = (
    "The paper's counts imply: every layer holds the whole context (Gemma 3's 40 sliding "
    "layers, window 1024, counted at full length: Table 2 has 3.0 GB per agent at 8K); "
    "GB = 2^30 bytes and K = 1024 tokens (10.2e9 bytes would give Gemma Q4 22/11/5/2); "
    "Q4 = 4-bit values plus an fp16 scale and bias per 64 (4.5 bits, 0.28125 of FP16; "
    "Table 2: 0.42 GB at 4K; without them Gemma Q4 at 4K would be 27); DeepSeek MLA as "
    "mlx-lm caches it, 16 heads of K 192 and V 128 per layer.",
    "With those, the Gemma row matches in all 8 cells, DeepSeek in 6, Llama in 1; each other "
    "cell is 1 or 2 agents more here. The DeepSeek and Llama rows match in all 16 cells if "
    "each agent costs 1.024x the bytes (equivalently a budget of 10,200 x 2^20 bytes, "
    "'10.2 GB' read as 10,200 MiB), but that budget drops Gemma's Q4 counts to 23/11/5/2.",
    "No one budget fits all three rows: Gemma 3 stores exactly 3x Llama's bytes per token "
    "(48 x 8 x 256 vs 32 x 8 x 128 per K and per V), so floor(B/x) >= 3 floor(B/3x) makes "
    "Llama's count at least 3x Gemma's, yet the paper has Llama Q4 70, 35, 17, 8 against "
    "Gemma's 24, 12, 6, 3. This planner keeps the convention of the paper's headline row.",
    "Q4 window: what a window-aware cache would hold (sliding layers keep 1024 tokens); "
    "the paper does not count it.",
)


@dataclass(frozen=True, slots=True)
class Table14Row:
    """One model and context of Table 14: the paper's counts and this planner's."""

    model: str
    paper_fp16: int
    paper_q4: int
    ours: Capacity

    def differences(self) -> list[str]:
        """e.g. "llama3_1_8b 4K FP16: 20 here, 19 in the paper"."""
        where = f"{self.model} {self.ours.context_tokens // 1024}K"
        return [
            f"{where} {name}: {ours} here, {paper} in the paper"
            for name, ours, paper in (
                ("FP16", self.ours.num_fp16_agents, self.paper_fp16),
                ("Q4", self.ours.num_q_agents, self.paper_q4),
            )
            if ours != paper
        ]


def table14(budget_bytes: int = TABLE14_BUDGET_BYTES) -> list[Table14Row]:
    """The paper's Table 14 beside this planner's counts for the shipped configs."""
    return [
        Table14Row(model, fp16, q4, plan(load_config(model), context, budget_bytes))
        for model, cells in TABLE14.items()
        for context, (fp16, q4) in zip(TABLE14_CONTEXTS, cells, strict=True)
    ]
