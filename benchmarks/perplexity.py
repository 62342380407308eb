"""Perplexity benchmark: what FP16, Q4, Q8 and K8V4 KV caches cost the real model.

The paper's Table 9: 512-token windows, stride 256, over the prose of the Python docs
(Debian's python3-doc), each quantized context put to a real store and read back before it is
scored; then greedy agreement with FP16 on chat prompts. The README explains the method.
Run: python benchmarks/perplexity.py [--tokens 7935] [--quick] [--model SPEC] [--prompts 4]
[--gen-tokens 128] [--agree q4,k8v4|all] [--docs DIR] [--out DIR]
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness as h
import numpy as np
from paper import TABLE9, TABLE9_TOKENS

from agentkv.layers import KVFormat
from agentkv.v1 import store_pb2 as pb
from inference_worker.blas import load_optimized_blas

NS = "perplexity"
WINDOW, STRIDE = 512, 256
CONTEXT = WINDOW - STRIDE - 1  # 255: the scored forward feeds the token before the first target
PREFILL_CHUNK = 128
ROUND_TRIPS = ((256, "stream"), (64, "local"), (256, "local"), (64, "stream"))
QUANTIZED = {"Q4 (k4v4)": KVFormat(4, 4), "Q8 (k8v8)": KVFormat(8, 8), "K8V4": KVFormat(8, 4)}
BASELINE, REFERENCE, HEADLINE = "FP16", "FP32", "Q4 (k4v4)"
KINDS = (REFERENCE, BASELINE, *QUANTIZED)
SHORT = {"fp32": REFERENCE, "q4": "Q4 (k4v4)", "q8": "Q8 (k8v8)", "k8v4": "K8V4"}
TARGET_PCT = 1.0
BOOTSTRAP_SAMPLES = 10_000
# Checks: FP16 against FP32 (|PPL change|, %), cache path against a cache-free forward (NLL)
FP16_TOLERANCE_PCT, FORWARD_TOLERANCE_NLL = 0.1, 1e-3

# The text: Debian's python3-doc (the Python docs' reStructuredText sources), these documents
# in this order: the Tutorial, the FAQ and the HOWTOs, each as its index's toctree lists them.
DOCS = Path("/usr/share/doc/python3-doc/html/_sources")
DOCS_HINT = "apt-get install python3-doc"
CORPUS_PARTS = {
    "tutorial": "index appetite interpreter introduction controlflow datastructures modules "
    "inputoutput errors classes stdlib stdlib2 venv whatnow interactive floatingpoint appendix",
    "faq": "general programming design library extending windows gui installed",
    "howto": "pyporting cporting curses descriptor enum functional logging logging-cookbook "
    "regex sockets sorting unicode urllib2 argparse ipaddress clinic instrumentation "
    "annotations isolating-extensions",
}
CORPUS = [f"{part}/{name}" for part, names in CORPUS_PARTS.items() for name in names.split()]
# The greedy-agreement prompts (chat turns; each asks for a long answer)
PROMPTS = (
    "Explain in detail how a hash table works, with its advantages and drawbacks.",
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Describe the water cycle step by step, as a teacher would to a class of twelve-year-olds.",
    "What should someone consider when planning a two-week trip to Japan? Give a thorough answer.",
)


# the text: reStructuredText as plain prose

# directives whose body is prose: the body stays, the directive line goes
KEEP_BODY = {
    "note",
    "warning",
    "seealso",
    "tip",
    "important",
    "topic",
    "sidebar",
    "impl-detail",
    "versionadded",
    "versionchanged",
    "deprecated",
    "attention",
    "caution",
    "hint",
}
DIRECTIVE = re.compile(r"^(\s*)\.\.(?:\s+([\w:-]+)::)?")
LABEL = re.compile(r"^\.\. _([^:`]+):\s*$")
ADORNMENT = re.compile(r"^\s*([=\-`:'\"~^_*+#<>.])\1{2,}\s*$")
TABLE = re.compile(r"^\s*(?:[+|]|=+\s+=)")
OPTION = re.compile(r"^\s*:[\w -]+:")
LIST_ITEM = re.compile(r"^(?:[*+-]|\d+\.|#\.|\(\d+\))\s")
ROLE = re.compile(r":([\w:+.-]+):`([^`]*)`")
INLINE = (  # (pattern, replacement) in turn, after the roles
    (re.compile(r"``(.+?)``"), r"\1"),  # literals
    (re.compile(r"`([^`<]*?)\s*(?:<[^>]*>)?`__?"), r"\1"),  # links
    (re.compile(r"\s*\[(?:#\w*|\d+)\]_"), ""),  # footnote references
    (re.compile(r"\*\*(\S(?:.*?\S)?)\*\*"), r"\1"),  # strong
    (re.compile(r"(?<![\w*])\*(\S(?:[^*]*?\S)?)\*(?![\w*])"), r"\1"),  # emphasis
)
NUMBERED_ROLES = {"pep": "PEP", "rfc": "RFC"}


def indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def section_titles(texts: list[str]) -> dict[str, str]:
    """`.. _label:` -> the title of the section it labels, for :ref:`label`."""
    titles: dict[str, str] = {}
    for lines in (text.splitlines() for text in texts):
        for i, line in enumerate(lines):
            if not (m := LABEL.match(line)):
                continue
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or LABEL.match(lines[j])):
                j += 1
            j += bool(j < len(lines) and ADORNMENT.match(lines[j]))  # an overline
            if j + 1 < len(lines) and ADORNMENT.match(lines[j + 1]) and lines[j].strip():
                titles[m.group(1).strip().lower()] = lines[j].strip()
    return titles


def inline(line: str, titles: dict[str, str]) -> str:
    def role(m: re.Match) -> str:
        name, text = m.group(1), m.group(2)
        if text.endswith(">") and " <" in text:
            return text[: text.rindex(" <")]
        text = text.lstrip("!")
        if name == "ref":
            return inline(titles.get(text.lower(), text.replace("-", " ")), {})
        if name in NUMBERED_ROLES:
            return f"{NUMBERED_ROLES[name]} {text}"
        return text[1:].rsplit(".", 1)[-1] if text.startswith("~") else text

    line = ROLE.sub(role, line)
    for pattern, replacement in INLINE:
        line = pattern.sub(replacement, line)
    return line.replace("\\ ", "").replace("\\", "")


def prose_lines(lines: list[str]) -> list[str]:
    """The lines that are prose, stripped; "" where a paragraph ends: code, directives,
    tables and heading rules out."""
    out, i = [], 0

    def past_block(i: int, depth: int) -> int:  # past blank lines and lines indented deeper
        while i < len(lines) and (not lines[i].strip() or indent(lines[i]) > depth):
            i += 1
        return i

    while i < len(lines):
        line = lines[i]
        text = line.strip()
        m = DIRECTIVE.match(line)
        if m and (text == ".." or text.startswith(".. ")):  # a directive, comment or label
            if m.group(2) in KEEP_BODY:
                i += 1
                while i < len(lines) and OPTION.match(lines[i]):
                    i += 1
                continue
            i = past_block(i + 1, indent(line))
            out.append("")
        elif text.startswith(">>>"):  # a doctest block: to the next blank line
            while i < len(lines) and lines[i].strip():
                i += 1
            out.append("")
        elif ADORNMENT.match(line) or TABLE.match(line):
            i += 1
        elif text.endswith("::"):  # "text::" is "text:" and a literal block follows
            if head := text[:-2].rstrip():
                out.append(head if text[-3:-2].isspace() else head + ":")
            i = past_block(i + 1, indent(line))
            out.append("")
        else:
            out.append(text)
            i += 1
    return out


def prose(rst: str, titles: dict[str, str]) -> str:
    """reStructuredText as plain paragraphs, each on one line."""
    paragraphs, current = [], []
    for text in [*prose_lines(rst.expandtabs().splitlines()), ""]:
        if not text:
            paragraphs += ["\n".join(current)] if current else []
            current = []
        elif current and not LIST_ITEM.match(text):
            current[-1] += " " + text
        else:
            current.append(text)
    paragraphs = [re.sub(r"  +", " ", inline(p, titles)).strip() for p in paragraphs]
    return "\n\n".join(p for p in paragraphs if p)


@dataclass(slots=True)
class Text:
    """The token stream scored, and where it came from."""

    tokens: np.ndarray
    files: list[str]
    version: str
    sha256: str
    docs: Path


def load_text(docs: Path, tokenizer: Any, needed: int) -> Text:
    """CORPUS's documents as prose, joined by a blank line and tokenized one by one, until
    there are `needed` tokens."""
    present = [name for name in CORPUS if (docs / f"{name}.rst.txt").is_file()]
    if not present:
        h.usage_error(
            f"the text is missing: no Python documentation sources at {docs} "
            f"({DOCS_HINT}, or --docs DIR for another Sphinx _sources tree)"
        )
    titles = section_titles([p.read_text(errors="replace") for p in docs.rglob("*.rst.txt")])
    tokens, used, digest = [], [], hashlib.sha256()
    for name in present:
        text = ("\n\n" if used else "") + prose(
            (docs / f"{name}.rst.txt").read_text(errors="replace"), titles
        )
        digest.update(text.encode())
        tokens += tokenizer.encode(text, add_special_tokens=False)
        used.append(name)
        if len(tokens) >= needed:
            break
    if len(tokens) < needed:
        h.usage_error(
            f"the text at {docs} has {len(tokens):,} tokens, too few for "
            f"{needed:,}: ask for fewer (--tokens)"
        )
    options = docs.parent / "_static" / "documentation_options.js"
    found = options.is_file() and re.search(r"VERSION:\s*'([^']+)'", options.read_text())
    version = found.group(1) if found else "unknown"
    return Text(np.array(tokens, dtype=np.int64), used, version, digest.hexdigest(), docs)


# windows, KV formats and scores


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

    kind: str  # FP32, FP16 or a QUANTIZED key
    nll: list[np.ndarray] = field(default_factory=list)
    bytes_per_token: list[float] = field(default_factory=list)
    seconds: float = 0.0
    ci: dict[str, float] | None = None  # paired_bootstrap against FP16

    @property
    def sums(self) -> np.ndarray:
        return np.array([n.sum() for n in self.nll])

    @property
    def counts(self) -> np.ndarray:
        return np.array([len(n) for n in self.nll])

    @property
    def ppl(self) -> float:
        return math.exp(self.sums.sum() / self.counts.sum())

    @property
    def kv_bytes(self) -> float:
        return float(np.mean(self.bytes_per_token))

    def delta_pct(self, base: Scores) -> float:
        return 100 * (self.ppl / base.ppl - 1)


def next_token_nll(logits: Any, targets: np.ndarray) -> np.ndarray:
    """-log p(target) at each position, float64 on the host."""
    import mlx.core as mx

    logits = logits.astype(mx.float32)
    picked = mx.take_along_axis(logits, mx.array(targets)[:, None], axis=-1)[:, 0]
    return np.array(mx.logsumexp(logits, axis=-1) - picked, dtype=np.float64)


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


def new_caches(kind: str, num_layers: int) -> list:
    """FP32: mlx-lm's KVCache at the model's dtype; FP16: Float16KV; the rest the worker's
    QuantizedKV."""
    from mlx_lm.models.cache import KVCache

    from inference_worker.kv_cache import QuantizedKV

    make = {REFERENCE: KVCache, BASELINE: Float16KV}.get(kind) or (
        lambda: QuantizedKV(QUANTIZED[kind])
    )
    return [make() for _ in range(num_layers)]


def kv_bytes(cache: Any) -> int:
    """Bytes of the tokens a cache holds (not of spare capacity)."""
    if hasattr(cache, "fmt"):  # QuantizedKV
        return cache.nbytes
    return sum(a.nbytes for a in cache.keys_and_values())


@dataclass(slots=True)
class RoundTrip:
    """Puts a window's context to the store and rebuilds its caches from what comes back."""

    store: Any  # StoreClient
    model_dir: Path
    num_round_trips: int = 0
    bytes_stored: int = 0
    fingerprints: dict[tuple[KVFormat, int], str] = field(default_factory=dict)

    def __call__(self, caches: list, context: list[int], kind: str, w: Window) -> list:
        from inference_worker.blocks import cache_blocks, caches_from_blocks
        from inference_worker.fingerprint import model_fingerprint

        key = (QUANTIZED[kind], w.block_tokens)
        if key not in self.fingerprints:  # it hashes the weights
            self.fingerprints[key] = model_fingerprint(self.model_dir, *key)
        fp = self.fingerprints[key]
        blocks, keys = cache_blocks(caches, context, fp, w.block_tokens)
        put = self.store.put_blocks(NS, fp, blocks)
        read = self.store.get_blocks if w.read_path == "stream" else self.store.read_blocks_local
        restored = caches_from_blocks(list(read(NS, fp, keys)), len(caches), key[0])
        self.store.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=put.lease_id))
        check_identical(caches, restored, f"{kind} window {w.index}")
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


def prefill(model: Any, ids: list[int], caches: list) -> Any:
    """Feeds ids in chunks of PREFILL_CHUNK as one turn (the worker's engine opens a turn on
    its caches around a turn's prefill: QuantizedKV.begin_turn / end_turn); the last chunk's
    logits."""
    import mlx.core as mx

    turn(caches, begin=True)
    logits = None
    for a in range(0, len(ids), PREFILL_CHUNK):
        logits = model(mx.array([ids[a : a + PREFILL_CHUNK]]), cache=caches)
        mx.eval(logits)
    turn(caches, begin=False)
    return logits


def turn(caches: list, begin: bool) -> None:
    for c in caches if hasattr(caches[0], "begin_turn") else ():
        c.begin_turn() if begin else c.end_turn()


def score_window(model: Any, kind: str, tokens: np.ndarray, w: Window, trip: RoundTrip) -> tuple:
    """(NLL of the window's scored tokens, KV bytes per token held after scoring)."""
    import mlx.core as mx

    ids = tokens[w.start : w.start + WINDOW].tolist()
    caches = new_caches(kind, len(model.layers))
    prefill(model, ids[: w.context], caches)
    if kind in QUANTIZED and w.context:
        caches = trip(caches, ids[: w.context], kind, w)
    turn(caches, begin=True)  # the scored forward is the next turn's prefill
    logits = model(mx.array([ids[w.context : -1]]), cache=caches)[0]
    nll = next_token_nll(logits, np.array(ids[w.context + 1 :]))
    return nll, sum(kv_bytes(c) for c in caches) / caches[0].offset


def score_all(model: Any, tokens: np.ndarray, windows: list[Window], trip: RoundTrip) -> tuple:
    """Every kind's scores, and each window's NLL from one cache-free forward (a check of
    the cache path)."""
    import mlx.core as mx

    scores, free = {kind: Scores(kind) for kind in KINDS}, []
    for w in windows:
        for kind, s in scores.items():
            start = time.perf_counter()
            nll, per_token = score_window(model, kind, tokens, w, trip)
            s.seconds += time.perf_counter() - start
            s.nll.append(nll)
            s.bytes_per_token.append(per_token)
        ids = tokens[w.start : w.start + WINDOW]
        logits = model(mx.array([ids[:-1].tolist()]))[0, w.context :]
        free.append(next_token_nll(logits, ids[w.context + 1 :]))
        if w.index % 5 == 4 or w.index == len(windows) - 1:
            done = sum(len(n) for n in scores[BASELINE].nll)
            h.say(f"window {w.index + 1}/{len(windows)}: {done:,} tokens scored per format")
    return scores, free


# greedy agreement


@dataclass(slots=True)
class Agreement:
    """One kind teacher-forced on FP16's greedy generations: argmax matches, per prompt."""

    kind: str
    matches: list[np.ndarray] = field(default_factory=list)  # bool per generated position

    @property
    def rate(self) -> float:
        return float(np.concatenate(self.matches).mean())

    @property
    def first_divergence(self) -> list[int | None]:
        """Per prompt, the first position whose argmax differs (None: none did)."""
        return [int(np.argmin(m)) if not m.all() else None for m in self.matches]


def greedy(
    model: Any, kind: str, prompt: list[int], n: int, forced: list[int] | None = None
) -> list[int]:
    """The argmax at each of n positions after the prompt; fed its own (or `forced`) tokens."""
    import mlx.core as mx

    caches = new_caches(kind, len(model.layers))
    logits, out = prefill(model, prompt, caches)[0, -1], []
    for i in range(n):
        out.append(int(mx.argmax(logits).item()))
        if i + 1 < n:
            fed = out[-1] if forced is None else forced[i]
            logits = model(mx.array([[fed]]), cache=caches)[0, -1]
    return out


def agreement(model: Any, tokenizer: Any, kinds: list[str], num_prompts: int, n: int) -> tuple:
    """Each kind against FP16's greedy generations on chat prompts; the prompts' lengths."""
    results, lengths = {kind: Agreement(kind) for kind in kinds}, []
    for p, text in enumerate(PROMPTS[:num_prompts] if kinds else ()):
        if getattr(tokenizer, "has_chat_template", False):
            messages = [{"role": "user", "content": text}]
            prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        else:
            prompt = list(tokenizer.encode(text))
        lengths.append(len(prompt))
        reference = greedy(model, BASELINE, prompt, n)
        for kind, a in results.items():
            a.matches.append(np.array(greedy(model, kind, prompt, n, reference)) == reference)
        h.say(f"agreement: prompt {p + 1}/{num_prompts} ({len(prompt)} tokens, {n} generated)")
    return (results if lengths else {}), lengths


# statistics and checks


def paired_bootstrap(base: Scores, other: Scores, seed: int = 0) -> dict[str, float]:
    """95% interval of other's PPL change against base, resampling windows with replacement."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(base.nll), (BOOTSTRAP_SAMPLES, len(base.nll)))
    counts = base.counts[idx].sum(axis=1)
    ppl_base = np.exp(base.sums[idx].sum(axis=1) / counts)
    ppl_other = np.exp(other.sums[idx].sum(axis=1) / counts)
    change = {"delta": ppl_other - ppl_base, "pct": 100 * (ppl_other / ppl_base - 1)}
    ends = (("lo", 2.5), ("hi", 97.5))
    return {f"{k}_{e}": float(np.percentile(v, q)) for k, v in change.items() for e, q in ends}


def max_abs_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def run_checks(scores: dict[str, Scores], free: list[np.ndarray]) -> list[tuple[str, str, bool]]:
    """Each check: what, the numbers, and whether it held."""
    fp16, fp32 = scores[BASELINE], scores[REFERENCE]
    pct, diff = fp16.delta_pct(fp32), max_abs_diff(fp16.nll, fp32.nll)
    cache_free = max_abs_diff(fp32.nll, free)
    return [
        (
            "FP16 path vs mlx-lm KVCache at the model's dtype",
            f"PPL {fp16.ppl:.4f} vs {fp32.ppl:.4f} ({pct:+.4f}%), max abs ΔNLL per token "
            f"{diff:.2e}",
            abs(pct) < FP16_TOLERANCE_PCT,
        ),
        (
            "FP32 cache path vs one cache-free forward per window",
            f"max abs ΔNLL per token {cache_free:.2e}",
            cache_free < FORWARD_TOLERANCE_NLL,
        ),
    ]


# the report


@dataclass(slots=True)
class Run:
    """What main measured, for the report."""

    name: str  # the model's
    scores: dict[str, Scores]
    agreed: dict[str, Agreement]
    windows: list[Window]
    checks: list[tuple[str, str, bool]]
    trip: RoundTrip
    text: Text

    @property
    def base(self) -> Scores:
        return self.scores[BASELINE]

    @property
    def q4(self) -> Scores:
        return self.scores[HEADLINE]


def results_table(run: Run) -> str:
    base = run.base
    spec = {
        "KV format": lambda s: s.kind + (" (reference)" if s.kind == REFERENCE else ""),
        "PPL": lambda s: f"{s.ppl:.3f}",
        "ΔPPL vs FP16": lambda s: "" if s is base else f"{s.ppl - base.ppl:+.3f}",
        "Δ%": lambda s: "" if s is base else f"{s.delta_pct(base):+.2f}%",
        "95% CI of Δ% (paired bootstrap)": lambda s: interval(s.ci, ""),
        "tokens scored": lambda s: f"{s.counts.sum():,}",
        "KV bytes/token": lambda s: f"{s.kv_bytes:,.0f}",
        "through the store": lambda s: "yes" if s.kind in QUANTIZED else "no",
    }
    return h.columns(run.scores.values(), spec, "lrrrrrrl")


def interval(ci: dict[str, float] | None, unit: str = "%") -> str:
    return f"{ci['pct_lo']:+.2f} .. {ci['pct_hi']:+.2f}{unit}" if ci else ""


def paper_table(run: Run) -> str:
    rows = [(f"{model} (paper)", fp16, q4, TABLE9_TOKENS) for model, (fp16, q4) in TABLE9.items()]
    rows.append((f"{run.name} (this run)", run.base.ppl, run.q4.ppl, run.q4.counts.sum()))
    cells = [
        (m, f"{a:.2f}", f"{b:.2f}", f"{b - a:+.2f}", f"{100 * (b / a - 1):+.1f}%", f"{n:,}")
        for m, a, b, n in rows
    ]
    return h.table(("model", "FP16 PPL", "Q4 PPL", "ΔPPL", "Δ%", "tokens"), cells)


def agreement_table(run: Run, n: int) -> str:
    spec = {
        "KV format": lambda a: a.kind,
        "positions": lambda a: f"{sum(len(m) for m in a.matches):,}",
        "argmax agrees with FP16 greedy": lambda a: f"{100 * a.rate:.1f}%",
        f"first divergence per prompt (of {n}; - none)": lambda a: ", ".join(
            "-" if f is None else str(f) for f in a.first_divergence
        ),
    }
    return h.columns(run.agreed.values(), spec, "lrrl")


def checks_table(run: Run) -> str:
    rows = [(check, result, "ok" if ok else "FAILED") for check, result, ok in run.checks]
    n, stored = run.trip.num_round_trips, run.trip.bytes_stored
    trips = ("store round trips bit-identical", f"{n} of {n} ({stored:,} bytes put and read back)")
    rows.append((*trips, "ok"))
    return h.table(("check", "result", ""), rows, "lll")


def notes_for(run: Run, model_dir: Path, met: bool) -> list[str]:
    """Which formats meet the target at how many bytes, whether Q4's interval holds 0, and
    what text and weights ran."""
    base, ci = run.base, run.q4.ci
    meeting = sorted(
        (s.kv_bytes, s.kind, s.delta_pct(base))
        for s in run.scores.values()
        if s.kind in QUANTIZED and s.delta_pct(base) <= TARGET_PCT
    )
    met_by = ", ".join(f"{n} ({pct:+.2f}%, {b:,.0f} B/token)" for b, n, pct in meeting) or "none"
    head = "meets" if met else f"misses by {run.q4.delta_pct(base) - TARGET_PCT:.2f} points"
    within = ci["pct_lo"] <= 0 <= ci["pct_hi"]
    noise = "includes 0: not distinguishable from" if within else "excludes 0: more than"
    text, end = run.text, run.windows[-1].targets[1] - 1
    notes = [
        f"Q4 {head} the target; within +{TARGET_PCT:g}% of FP16: {met_by} (FP16 "
        f"{base.kv_bytes:,.0f} B/token)",
        f"Q4 - FP16, 95% paired-bootstrap interval over {len(base.nll)} windows {noise} "
        "window-to-window noise",
        f"the text: tokens 0..{end} of the prose of the Python {text.version} documentation "
        f"({text.docs}, {DOCS_HINT}), documents {', '.join(text.files)}; SHA-256 of the text "
        f"tokenized {text.sha256[:16]}…",
    ]
    if gguf := json.loads((model_dir / "config.json").read_text()).get("agentkv_gguf"):
        notes.append(f"the weights: {gguf['file']} imported as {gguf['weights']} (dequantized)")
    return notes + [
        f"check failed: {check}: {result}" for check, result, ok in run.checks if not ok
    ]


def draw(run: Run, axes: Any) -> None:
    """PPL per format, and the per-window mean NLL change against FP16."""
    left, right = axes
    scores = list(run.scores.values())
    left.bar(range(len(scores)), [s.ppl for s in scores], color="tab:blue")
    left.set_xticks(range(len(scores)), [s.kind for s in scores], fontsize=7)
    for x, s in enumerate(scores):
        left.text(x, s.ppl, f"{s.ppl:.3f}", ha="center", va="bottom", fontsize=7)
    left.set_ylim(min(s.ppl for s in scores) * 0.98, max(s.ppl for s in scores) * 1.01)
    left.set_ylabel("perplexity (Python docs prose)")
    for s in (s for s in scores if s.kind in QUANTIZED):
        diffs = [a.mean() - b.mean() for a, b in zip(s.nll, run.base.nll, strict=True)]
        right.plot(range(len(diffs)), diffs, "o-", ms=3, label=f"{s.kind} - FP16")
    right.axhline(0, color="grey", lw=0.8)
    right.set(xlabel="window", ylabel="mean NLL change per scored token (nats)")
    right.legend(fontsize=7)


def write_report(run: Run, header: dict[str, Any], args: Any) -> None:
    for s in run.scores.values():
        s.ci = paired_bootstrap(run.base, s) if s.kind in QUANTIZED else None
    pct = run.q4.delta_pct(run.base)
    what = f"Q4 perplexity within +{TARGET_PCT:g}% of FP16 KV on {run.name}"
    goals = [h.goal(what, f"{pct:+.2f}% (95% CI {interval(run.q4.ci)})", pct <= TARGET_PCT)]
    title = f"perplexity by KV format ({len(run.windows)} windows of {WINDOW}, stride {STRIDE}, "
    sections = [
        (f"{title}{run.base.counts.sum():,} tokens)", results_table(run)),
        ("the paper's Table 9 beside this run (Q4 against FP16)", paper_table(run)),
    ]
    if run.agreed:
        n, prompts = header["gen_tokens"], len(header["prompt_tokens"])
        title = f"greedy agreement with FP16 KV ({prompts} chat prompts, {n} tokens each, "
        sections.append((title + "teacher-forced on FP16's generation)", agreement_table(run, n)))
    sections.append(("checks", checks_table(run)))
    document = {"scores": run.scores, "agreement": run.agreed, "windows": run.windows}
    document |= {"checks": run.checks, "paper_table9": {"rows": TABLE9, "tokens": TABLE9_TOKENS}}
    notes = notes_for(run, args.path, goals[0]["met"])
    png = h.report("perplexity", args.out, header, sections, goals, notes, document)
    h.plot(png, header, f"perplexity, {run.name}", draw, run, ncols=2, figsize=(14, 5.2))


def parse_args(argv: list[str] | None) -> Any:
    quick = {"tokens": WINDOW - 1 + 2 * STRIDE, "prompts": 1, "gen_tokens": 8}
    p = h.parser(__doc__, quick=quick, quick_help="a smoke run of 3 windows")
    p.add_argument("--tokens", type=int, default=TABLE9_TOKENS, help="tokens to score (at least)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="greedy-agreement prompts")
    p.add_argument("--gen-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument(
        "--agree",
        type=h.name_list([*SHORT, "all"]),
        default=["q4", "k8v4"],
        help="formats whose greedy agreement with FP16 is measured",
    )
    p.add_argument("--docs", type=Path, default=DOCS, help="a Sphinx _sources tree")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.gen_tokens < 1 or not 0 <= args.prompts <= len(PROMPTS):
        p.error(f"--tokens and --gen-tokens must be at least 1, --prompts 0..{len(PROMPTS)}")
    args.agree = [SHORT[a] for a in (SHORT if "all" in args.agree else args.agree)]
    return args


def load_model(path: Path) -> tuple[Any, Any, str]:
    """The model, its tokenizer, and its weights' dtype."""
    from mlx.utils import tree_flatten
    from mlx_lm import load

    from inference_worker.layer_spec import cache_windows

    model, tokenizer = load(str(path))
    if any(w is not None for w in cache_windows(model)):
        h.usage_error(f"{path} has sliding-window layers; this benchmark needs full ones")
    dtype = str(tree_flatten(model.parameters())[0][1].dtype).removeprefix("mlx.core.")
    return model, tokenizer, dtype


def main(argv: list[str] | None = None) -> None:
    started, args = time.perf_counter(), parse_args(argv)
    blas = load_optimized_blas()  # before anything here imports mlx
    args.path = h.model_dir(args.model)  # as the worker resolves it; one line if not
    gguf = json.loads((args.path / "config.json").read_text()).get("agentkv_gguf")
    name = Path(gguf["file"]).stem.split(".")[0] if gguf else Path(args.model).name or args.model
    windows = plan_windows(args.tokens)
    model, tokenizer, dtype = load_model(args.path)
    text = load_text(args.docs, tokenizer, windows[-1].start + WINDOW)
    h.say(
        f"{len(text.tokens):,} tokens of Python {text.version} docs prose ({len(text.files)} "
        f"documents); {len(windows)} windows; model {name} ({dtype})"
    )
    with h.services(None) as svc:
        trip = RoundTrip(svc.store, args.path)
        scores, free = score_all(model, text.tokens, windows, trip)
    agreed, lengths = agreement(model, tokenizer, args.agree, args.prompts, args.gen_tokens)
    header = h.machine(blas=blas or "reference (bundled with mlx)", model=name)
    header |= {"model_described": h.describe_model(args.path, args.model), "dtype": dtype}
    header |= {"text": f"Python {text.version} docs ({DOCS_HINT})", "text_sha256": text.sha256}
    header |= {"tokens_requested": args.tokens, "prefill_chunk": PREFILL_CHUNK}
    header |= {"prompt_tokens": lengths, "gen_tokens": args.gen_tokens}
    header |= {"seconds": round(time.perf_counter() - started)}
    run = Run(name, scores, agreed, windows, run_checks(scores, free), trip, text)
    write_report(run, header, args)


if __name__ == "__main__":
    main()
