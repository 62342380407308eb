"""Perplexity benchmark: what FP16, Q4, Q8 and K8V4 KV caches cost the shipped model.

Reproduces the paper's Table 9 on the default model (models/agentkv-default, float32 on CPU)
over the held-out standard-library source its training left out: the text is exactly
`scripts/train_default_model.py`'s (its `corpus` and `encode`, seed 0), and the model's own
held-out perplexity (training.json) is recomputed as a check that it is.

Windows. 512-token windows, stride 256, scored the standard strided way (as the paper: 30
windows score 7,935 tokens). Window w covers tokens [256w, 256w + 512) of the held-out token
stream. Window 0 has no context: one forward of its tokens 0..510 scores tokens 1..511. Window
w >= 1 prefills its first 255 tokens (the context, in chunks of 128) into the cache, then one
forward of its tokens 255..510 over that cache scores its last 256 tokens, 256w+256 ..
256w+511 (teacher forcing: the NLL of each next token). Every scored token is scored once, after
at least 256 tokens of its window (or all of window 0 before it); every format scores the same
tokens. The context is 255 tokens, not 256, because the logits that predict a window's first
scored token are those of the token before it, which the scored forward must feed.

KV formats, each a fresh cache per window:
  FP32         mlx-lm's KVCache at the model's dtype: the reference the others are checked on
  FP16         mlx-lm's KVCache holding K and V in float16, handed to attention in the
               model's dtype. No store round trip: the store holds only quantized blocks.
  Q4, Q8, K8V4 our QuantizedKV (k4v4, k8v8, k8v4; groups of 64, float16 scales). The context
               goes through the real store: a real `agentkv-store` process (temp dir) gets the
               caches cut into blocks (`cache_blocks`), they are read back and rebuilt
               (`caches_from_blocks`) and checked bit-identical to what was put, then scored.
               Block size and read path cycle per window: (256, GetBlocks stream), (64, local
               read), (256, local), (64, stream). A forward stores its own K/V quantized and
               attends over the whole cache dequantized, as the worker's prefill does.

Reported: perplexity (exp of the mean NLL over the scored tokens), its change against FP16,
a 95% interval for that change from a paired bootstrap over windows, and KV bytes per token
measured from the caches; the paper's rows beside ours. Target: Q4 within +1% of FP16. Checks:
the held-out split, FP16 against FP32, the FP32 cache path against one cache-free forward of
each window. Full-attention models only (sliding-window layers would need matching FP16
rotating caches). Prints Markdown tables; writes JSON and a PNG (matplotlib is optional) to
--out. Progress goes to stderr.

Run:  python benchmarks/perplexity.py [--tokens 7935] [--quick] [--model models/agentkv-default]
                                      [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import math
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from ttft import load_tokenizer, machine

from agentkv.launch import store_process
from agentkv.v1 import store_pb2 as pb
from client.store import StoreClient
from inference_worker.blas import load_optimized_blas
from inference_worker.kv_format import KVFormat

ROOT = Path(__file__).resolve().parent.parent
MODEL = Path("models/agentkv-default")
NS = "perplexity"
WINDOW, STRIDE = 512, 256
CONTEXT = WINDOW - STRIDE - 1  # 255: the scored forward feeds the token before the first target
PREFILL_CHUNK = 128
TRAINING_SEQ = 256  # train_default_model.py's --seq, with which training.json's PPL was taken
ROUND_TRIPS = ((256, "stream"), (64, "local"), (256, "local"), (64, "stream"))
QUANTIZED = {"Q4 (k4v4)": KVFormat(4, 4), "Q8 (k8v8)": KVFormat(8, 8), "K8V4": KVFormat(8, 4)}
BASELINE, REFERENCE, HEADLINE = "FP16", "FP32", "Q4 (k4v4)"
FORMATS = (REFERENCE, BASELINE, *QUANTIZED)
TARGET_PCT = 1.0
BOOTSTRAP_SAMPLES = 10_000
# Shkolnikov, "Agent Memory Below the Prompt" (2026), Table 9: perplexity with FP16 and Q4 KV,
# 512-token windows, stride 256, 7,935 tokens.
PAPER_TABLE9 = {
    "Gemma 3 12B": (14.40, 14.30),
    "DeepSeek-V2-Lite": (6.26, 6.45),
    "Llama 3.1 8B": (4.28, 4.40),
}
PAPER_TOKENS = 7935
# Checks: FP16 against FP32 (|PPL change|, %), cache path against a cache-free forward (NLL)
FP16_TOLERANCE_PCT, FORWARD_TOLERANCE_NLL = 0.1, 1e-3
_T0 = time.perf_counter()


def say(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


# the text


def load_trainer() -> Any:
    """scripts/train_default_model.py as a module (it loads the BLAS and imports mlx)."""
    path = ROOT / "scripts" / "train_default_model.py"
    spec = importlib.util.spec_from_file_location("train_default_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def held_out_tokens(trainer: Any, model_dir: Path) -> np.ndarray:
    """The held-out token stream exactly as training built it, with this model's tokenizer."""
    with contextlib.redirect_stdout(io.StringIO()):  # corpus() prints its counts
        _, eval_docs = trainer.corpus(random.Random(0))  # the seed its main() uses
    return trainer.encode(load_tokenizer(model_dir), eval_docs)


# windows and scores


@dataclass(frozen=True, slots=True)
class Window:
    """Tokens [start, start + WINDOW): `context` prefilled, then the rest fed and scored."""

    index: int
    start: int
    context: int
    block_tokens: int
    read_path: str  # "stream" (GetBlocks) or "local" (read_blocks_local)

    @property
    def targets(self) -> tuple[int, int]:
        """[a, b) of the token stream: the tokens this window scores."""
        return self.start + self.context + 1, self.start + WINDOW


def plan_windows(num_tokens: int) -> list[Window]:
    """The fewest windows scoring at least num_tokens tokens."""
    count = 1 + max(0, math.ceil((num_tokens - (WINDOW - 1)) / STRIDE))
    trips = [ROUND_TRIPS[(i - 1) % len(ROUND_TRIPS)] for i in range(count)]  # unused for 0
    return [Window(i, i * STRIDE, min(i, 1) * CONTEXT, *trips[i]) for i in range(count)]


@dataclass(slots=True)
class Scores:
    """One KV format's NLL per scored token, per window."""

    name: str
    nll: list[np.ndarray] = field(default_factory=list)
    bytes_per_token: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def sums(self) -> np.ndarray:
        return np.array([n.sum() for n in self.nll])

    @property
    def counts(self) -> np.ndarray:
        return np.array([len(n) for n in self.nll])

    @property
    def ppl(self) -> float:
        return math.exp(self.sums.sum() / self.counts.sum())

    def delta_pct(self, base: Scores) -> float:
        return 100 * (self.ppl / base.ppl - 1)


def next_token_nll(logits: Any, targets: np.ndarray) -> np.ndarray:
    """-log p(target) at each position, float64 on the host."""
    import mlx.core as mx

    logits = logits.astype(mx.float32)
    picked = mx.take_along_axis(logits, mx.array(targets)[:, None], axis=-1)[:, 0]
    nll = mx.logsumexp(logits, axis=-1) - picked
    return np.array(nll, dtype=np.float64)


# caches


class Float16KV:
    """The FP16 baseline: mlx-lm's KVCache holding K and V in float16, handing them to
    attention in the model's dtype."""

    def __init__(self) -> None:
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache

        self.cache, self.float16 = KVCache(), mx.float16

    @property
    def offset(self) -> int:
        return self.cache.offset

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        k, v = self.cache.update_and_fetch(keys.astype(self.float16), values.astype(self.float16))
        return k.astype(keys.dtype), v.astype(values.dtype)

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return self.cache.make_mask(*args, **kwargs)

    def keys_and_values(self) -> tuple[Any, Any]:
        return self.cache.keys_and_values()


def new_caches(name: str, num_layers: int) -> list:
    from mlx_lm.models.cache import KVCache

    from inference_worker.kv_cache import QuantizedKV

    if name == REFERENCE:
        return [KVCache() for _ in range(num_layers)]
    if name == BASELINE:
        return [Float16KV() for _ in range(num_layers)]
    return [QuantizedKV(QUANTIZED[name]) for _ in range(num_layers)]


def kv_bytes(cache: Any) -> int:
    """Bytes of the tokens a cache holds (not of spare capacity)."""
    from inference_worker.kv_cache import QuantizedKV

    if isinstance(cache, QuantizedKV):
        return cache.nbytes
    return sum(a.nbytes for a in cache.keys_and_values())


# the store round trip


@dataclass(slots=True)
class RoundTrip:
    """Puts a window's context to the store and rebuilds its caches from what comes back."""

    store: StoreClient
    model_dir: Path
    num_round_trips: int = 0
    bytes_stored: int = 0
    fingerprints: dict[tuple[KVFormat, int], str] = field(default_factory=dict)

    def __call__(self, caches: list, context: list[int], fmt: KVFormat, w: Window) -> list:
        from inference_worker.blocks import cache_blocks, caches_from_blocks
        from inference_worker.fingerprint import model_fingerprint

        key = (fmt, w.block_tokens)
        if key not in self.fingerprints:  # it hashes the weights
            self.fingerprints[key] = model_fingerprint(self.model_dir, fmt, w.block_tokens)
        fingerprint = self.fingerprints[key]
        blocks, keys = cache_blocks(caches, context, fingerprint, w.block_tokens)
        put = self.store.put_blocks(NS, fingerprint, blocks)
        read = self.store.get_blocks if w.read_path == "stream" else self.store.read_blocks_local
        restored = caches_from_blocks(list(read(NS, fingerprint, keys)), len(caches), fmt)
        self.store.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=put.lease_id))
        check_identical(caches, restored, f"{fmt.name} window {w.index}")
        self.num_round_trips += 1
        self.bytes_stored += sum(t.num_bytes for b in blocks for t in b.tensors)
        return restored


def check_identical(put: list, restored: list, what: str) -> None:
    import mlx.core as mx

    for layer, (a, b) in enumerate(zip(put, restored, strict=True)):
        parts = zip((*a.state[0], *a.state[1]), (*b.state[0], *b.state[1]), strict=True)
        if a.offset != b.offset or not all(mx.array_equal(x, y).item() for x, y in parts):
            raise RuntimeError(f"{what}: layer {layer} came back from the store changed")


# scoring


def score_window(
    model: Any, name: str, tokens: np.ndarray, w: Window, round_trip: RoundTrip
) -> tuple[np.ndarray, float]:
    """(NLL of the window's scored tokens, KV bytes per token held after scoring)."""
    import mlx.core as mx

    ids = tokens[w.start : w.start + WINDOW].tolist()
    caches = new_caches(name, len(model.layers))
    for a in range(0, w.context, PREFILL_CHUNK):
        mx.eval(model(mx.array([ids[a : min(a + PREFILL_CHUNK, w.context)]]), cache=caches))
    if name in QUANTIZED and w.context:
        caches = round_trip(caches, ids[: w.context], QUANTIZED[name], w)
    logits = model(mx.array([ids[w.context : -1]]), cache=caches)[0]
    nll = next_token_nll(logits, np.array(ids[w.context + 1 :]))
    return nll, sum(kv_bytes(c) for c in caches) / caches[0].offset


def cache_free_nll(model: Any, tokens: np.ndarray, w: Window) -> np.ndarray:
    """The window's scored NLL from one forward of its tokens with no cache at all."""
    import mlx.core as mx

    ids = tokens[w.start : w.start + WINDOW]
    logits = model(mx.array([ids[:-1].tolist()]))[0, w.context :]
    return next_token_nll(logits, ids[w.context + 1 :])


def score_all(
    model: Any, tokens: np.ndarray, windows: list[Window], round_trip: RoundTrip
) -> dict[str, Scores]:
    scores = {name: Scores(name) for name in FORMATS}
    for w in windows:
        for name, s in scores.items():
            start = time.perf_counter()
            nll, per_token = score_window(model, name, tokens, w, round_trip)
            s.seconds += time.perf_counter() - start
            s.nll.append(nll)
            s.bytes_per_token.append(per_token)
        if w.index % 5 == 4 or w.index == len(windows) - 1:
            done = sum(len(n) for n in scores[BASELINE].nll)
            say(f"window {w.index + 1}/{len(windows)}: {done:,} tokens scored per format")
    return scores


# statistics and checks


def paired_bootstrap(base: Scores, other: Scores, seed: int = 0) -> dict[str, float]:
    """95% interval of other's PPL change against base, resampling windows with replacement."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(base.nll), (BOOTSTRAP_SAMPLES, len(base.nll)))
    counts = base.counts[idx].sum(axis=1)
    ppl_base = np.exp(base.sums[idx].sum(axis=1) / counts)
    ppl_other = np.exp(other.sums[idx].sum(axis=1) / counts)
    delta, pct = ppl_other - ppl_base, 100 * (ppl_other / ppl_base - 1)
    return {
        "delta_lo": float(np.percentile(delta, 2.5)),
        "delta_hi": float(np.percentile(delta, 97.5)),
        "pct_lo": float(np.percentile(pct, 2.5)),
        "pct_hi": float(np.percentile(pct, 97.5)),
    }


def max_abs_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def run_checks(
    trainer: Any,
    model: Any,
    model_dir: Path,
    tokens: np.ndarray,
    windows: list[Window],
    scores: dict[str, Scores],
) -> list[dict[str, Any]]:
    """Each check: what, the numbers, and whether it held."""
    fp16, fp32 = scores[BASELINE], scores[REFERENCE]
    free = [cache_free_nll(model, tokens, w) for w in windows]
    checks = [
        {
            "check": "FP16 path vs mlx-lm KVCache at the model's dtype",
            "result": f"PPL {fp16.ppl:.4f} vs {fp32.ppl:.4f} ({fp16.delta_pct(fp32):+.4f}%), "
            f"max abs ΔNLL per token {max_abs_diff(fp16.nll, fp32.nll):.2e}",
            "ok": abs(fp16.delta_pct(fp32)) < FP16_TOLERANCE_PCT,
        },
        {
            "check": "FP32 cache path vs one cache-free forward per window",
            "result": f"max abs ΔNLL per token {max_abs_diff(fp32.nll, free):.2e}",
            "ok": max_abs_diff(fp32.nll, free) < FORWARD_TOLERANCE_NLL,
        },
    ]
    training = model_dir / "training.json"
    recorded = json.loads(training.read_text()) if training.exists() else {}
    if "held_out_perplexity" in recorded:
        again = trainer.evaluate(model, tokens, TRAINING_SEQ)
        checks.insert(
            0,
            {
                "check": "held-out split: training's evaluate() on this text",
                "result": f"PPL {again:.2f} (training.json: {recorded['held_out_perplexity']})",
                "ok": round(again, 2) == recorded["held_out_perplexity"],
            },
        )
    return checks


# the report


def signed(value: float, digits: int = 3) -> str:
    return f"{value:+.{digits}f}"


def results_table(scores: dict[str, Scores], intervals: dict[str, dict[str, float]]) -> str:
    base = scores[BASELINE]
    rows = [
        "| KV format | PPL | ΔPPL vs FP16 | Δ% | 95% CI of Δ% (paired bootstrap) | tokens scored "
        "| KV bytes/token | through the store |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, s in scores.items():
        ci = intervals.get(name)
        interval = f"{ci['pct_lo']:+.2f} .. {ci['pct_hi']:+.2f}" if ci else ""
        delta = "" if name == BASELINE else signed(s.ppl - base.ppl)
        pct = "" if name == BASELINE else f"{s.delta_pct(base):+.2f}%"
        label = f"{name} (reference)" if name == REFERENCE else name
        stored = "yes" if name in QUANTIZED else "no"
        rows.append(
            f"| {label} | {s.ppl:.3f} | {delta} | {pct} | {interval} | {s.counts.sum():,} "
            f"| {np.mean(s.bytes_per_token):,.0f} | {stored} |"
        )
    return "\n".join(rows)


def paper_table(scores: dict[str, Scores], model_name: str) -> str:
    rows = [
        "| model | FP16 PPL | Q4 PPL | ΔPPL | Δ% | tokens |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for model, (fp16, q4) in PAPER_TABLE9.items():
        rows.append(
            f"| {model} (paper) | {fp16:.2f} | {q4:.2f} | {signed(q4 - fp16, 2)} "
            f"| {100 * (q4 / fp16 - 1):+.1f}% | {PAPER_TOKENS:,} |"
        )
    fp16, q4 = scores[BASELINE], scores[HEADLINE]
    delta = signed(q4.ppl - fp16.ppl, 2)
    rows.append(
        f"| {model_name} (this run) | {fp16.ppl:.2f} | {q4.ppl:.2f} | {delta} "
        f"| {q4.delta_pct(fp16):+.1f}% | {q4.counts.sum():,} |"
    )
    return "\n".join(rows)


def checks_table(checks: list[dict[str, Any]], round_trip: RoundTrip) -> str:
    rows = ["| check | result | |", "|---|---|---|"]
    rows += [f"| {c['check']} | {c['result']} | {'ok' if c['ok'] else 'FAILED'} |" for c in checks]
    rows.append(
        f"| store round trips bit-identical | {round_trip.num_round_trips} of "
        f"{round_trip.num_round_trips} ({round_trip.bytes_stored:,} bytes put and read back) | ok |"
    )
    return "\n".join(rows)


def target(scores: dict[str, Scores], ci: dict[str, float], shipped: bool) -> dict[str, Any]:
    pct = scores[HEADLINE].delta_pct(scores[BASELINE])
    on = "the shipped model" if shipped else "this model"
    return {
        "target": f"Q4 perplexity within +{TARGET_PCT:g}% of FP16 on {on}",
        "met": pct <= TARGET_PCT,
        "measured": f"{pct:+.2f}% (95% CI {ci['pct_lo']:+.2f} .. {ci['pct_hi']:+.2f}%)",
    }


def make_notes(
    scores: dict[str, Scores],
    intervals: dict[str, dict[str, float]],
    windows: list[Window],
    num_held_out: int,
    shipped: bool,
) -> list[str]:
    ci = intervals[HEADLINE]
    if ci["pct_lo"] <= 0 <= ci["pct_hi"]:
        verdict = "the interval includes 0: Q4's change is not distinguishable from noise"
    else:
        verdict = "the interval excludes 0: the change is more than window-to-window noise"
    notes = [f"Q4 - FP16, 95% paired-bootstrap interval over {len(windows)} windows: {verdict}"]
    if scores[HEADLINE].ppl < scores[BASELINE].ppl:
        notes.append(
            "Q4 scores lower than FP16: quantization noise in K/V perturbs attention, and on a "
            "model this small the perturbation can help as easily as hurt (the paper's Gemma "
            "row does the same); the checks table says whether the baseline is sound"
        )
    notes += [
        f"scored tokens: window 0, tokens 1..{WINDOW - 1}; window w >= 1, tokens "
        f"{STRIDE}w+{STRIDE}..{STRIDE}w+{WINDOW - 1} after a {CONTEXT}-token context "
        "(prefilled, and for Q4/Q8/K8V4 put to the store and read back); the same tokens for "
        "every format",
        "FP16 and FP32 do not go through the store: it holds only quantized blocks",
        f"the text: tokens 0..{windows[-1].targets[1] - 1} of the {num_held_out:,} held-out "
        "tokens, i.e. the first held-out files in the split's order (their kinds of text "
        "differ widely; --tokens scores more of them)",
    ]
    if shipped:
        notes += [
            "the default model was trained on 256-token windows: here a scored token sees 256 "
            "to 511 tokens before it. training.json's perplexity is training's evaluate() over "
            f"the first {64 * TRAINING_SEQ:,} held-out tokens in {TRAINING_SEQ}-token windows, "
            "another span and protocol (the first check recomputes it)",
            "the paper's rows are 8-12B models on an M4 Pro; this is a 4.2M-parameter model on "
            "CPU: compare the changes, not the perplexities",
        ]
    return notes


def plot(scores: dict[str, Scores], header: dict[str, Any], path: Path) -> str:
    """PPL per format, and the per-window mean NLL change against FP16; says what it did."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: chart skipped (pip install matplotlib)"
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = list(scores)
    left.bar(names, [scores[n].ppl for n in names], color="tab:blue")
    for x, name in enumerate(names):
        ppl = scores[name].ppl
        left.text(x, ppl, f"{ppl:.3f}", ha="center", va="bottom", fontsize=8)
    low = min(s.ppl for s in scores.values())
    left.set_ylim(low * 0.98, max(s.ppl for s in scores.values()) * 1.01)
    left.set_ylabel("perplexity (held-out stdlib source)")
    base = scores[BASELINE]
    for name in QUANTIZED:
        diffs = [(a.mean() - b.mean()) for a, b in zip(scores[name].nll, base.nll, strict=True)]
        right.plot(range(len(diffs)), diffs, "o-", ms=3, label=f"{name} - FP16")
    right.axhline(0, color="grey", lw=0.8)
    right.set_xlabel("window")
    right.set_ylabel("mean NLL change per scored token (nats)")
    right.legend(fontsize=7)
    fig.suptitle(
        f"agentkv perplexity, {header['model']}, {header['date']}; {header['cpu']}, "
        f"{header['cores']} cores, MLX {header['mlx']}, BLAS {header['blas']}",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def report(
    scores: dict[str, Scores],
    windows: list[Window],
    checks: list[dict[str, Any]],
    round_trip: RoundTrip,
    header: dict[str, Any],
    args: argparse.Namespace,
) -> None:
    intervals = {n: paired_bootstrap(scores[BASELINE], scores[n]) for n in QUANTIZED}
    shipped = args.model.resolve() == (ROOT / MODEL).resolve()
    goal = target(scores, intervals[HEADLINE], shipped)
    notes = make_notes(scores, intervals, windows, header["held_out_tokens"], shipped)
    notes += [f"check failed: {c['check']}: {c['result']}" for c in checks if not c["ok"]]
    tokens, model = scores[BASELINE].counts.sum(), header["model"]
    print(", ".join(f"{k}: {v}" for k, v in header.items()))
    for title, text in (
        (
            f"perplexity by KV format ({len(windows)} windows of {WINDOW}, stride {STRIDE}, "
            f"{tokens:,} tokens)",
            results_table(scores, intervals),
        ),
        ("the paper's Table 9 beside this run (Q4 against FP16)", paper_table(scores, model)),
        ("checks", checks_table(checks, round_trip)),
    ):
        print(f"\n### {title}\n\n{text}")
    print()
    print(f"{'MET' if goal['met'] else 'MISS'} {goal['target']}: {goal['measured']}")
    for note in notes:
        print(f"note: {note}")
    write_results(scores, windows, checks, intervals, goal, notes, header, args.out)


def write_results(
    scores: dict[str, Scores],
    windows: list[Window],
    checks: list[dict[str, Any]],
    intervals: dict[str, dict[str, float]],
    goal: dict[str, Any],
    notes: list[str],
    header: dict[str, Any],
    out: Path,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"perplexity-{datetime.now():%Y%m%d-%H%M%S}"
    document = {
        "header": header,
        "formats": {
            name: {
                "ppl": s.ppl,
                "tokens": int(s.counts.sum()),
                "kv_bytes_per_token": float(np.mean(s.bytes_per_token)),
                "seconds": s.seconds,
                "bootstrap_vs_fp16": intervals.get(name),
            }
            for name, s in scores.items()
        },
        "windows": [
            {
                "index": w.index,
                "start": w.start,
                "context": w.context,
                "targets": w.targets,
                "block_tokens": w.block_tokens if w.context else None,
                "read_path": w.read_path if w.context else None,
                "nll_sum": {n: float(s.nll[w.index].sum()) for n, s in scores.items()},
                "tokens": len(scores[BASELINE].nll[w.index]),
            }
            for w in windows
        ],
        "paper_table9": {"rows": PAPER_TABLE9, "tokens": PAPER_TOKENS},
        "checks": checks,
        "targets": [goal],
        "notes": notes,
    }
    stem.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {stem.with_suffix('.json')}")
    print(plot(scores, header, stem.with_suffix(".png")))


# main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=PAPER_TOKENS, help="tokens to score (at least)")
    p.add_argument("--quick", action="store_true", help="about 1K tokens (3 windows)")
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    if args.quick:
        args.tokens = WINDOW - 1 + 2 * STRIDE
    if args.tokens < 1:
        p.error("--tokens must be at least 1")
    return args


def load_model(model_dir: Path) -> tuple[Any, str]:
    """The model, and its weights' dtype."""
    from mlx.utils import tree_flatten
    from mlx_lm import load

    from inference_worker.layer_spec import cache_windows

    model, _ = load(str(model_dir))
    if any(w is not None for w in cache_windows(model)):
        raise SystemExit(f"{model_dir} has sliding-window layers; this benchmark needs full ones")
    dtype = tree_flatten(model.parameters())[0][1].dtype
    return model, str(dtype).removeprefix("mlx.core.")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    blas = load_optimized_blas()  # before anything here imports mlx
    trainer = load_trainer()
    tokens = held_out_tokens(trainer, args.model)
    windows = plan_windows(args.tokens)
    if windows[-1].start + WINDOW > len(tokens):
        raise SystemExit(f"the held-out text has {len(tokens):,} tokens: too few for {args.tokens}")
    model, dtype = load_model(args.model)
    say(f"{len(tokens):,} held-out tokens; {len(windows)} windows; model {args.model} ({dtype})")
    root = Path(tempfile.mkdtemp(prefix="agentkv-perplexity-"))
    store = store_process(root / "data", root / "store.log")
    try:
        store.start()
        with StoreClient(store.address) as client:
            say(f"store up at {store.address}")
            round_trip = RoundTrip(client, args.model)
            scores = score_all(model, tokens, windows, round_trip)
    finally:
        store.stop()
        shutil.rmtree(root, ignore_errors=True)
    say("checks")
    checks = run_checks(trainer, model, args.model, tokens, windows, scores)
    header = machine([]) | {"blas": blas or "reference (bundled with mlx)"}
    header |= {"model": str(args.model), "held_out_tokens": len(tokens)}
    header |= {"dtype": dtype, "tokens_requested": args.tokens, "prefill_chunk": PREFILL_CHUNK}
    report(scores, windows, checks, round_trip, header, args)


if __name__ == "__main__":
    main()
