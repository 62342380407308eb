"""Perplexity benchmark: what FP16, Q4, Q8 and K8V4 KV caches cost the real model.

The paper's Table 9: 512-token windows, stride 256, over the prose of the Python docs
(Debian's python3-doc), each quantized context put to a real store and read back before it is
scored; then greedy agreement with FP16 on chat prompts. The README explains the method.
Run: python benchmarks/perplexity.py [--tokens 7935] [--quick] [--model SPEC]
[--own-chunk both|quantized,fp,worker] [--prompts 4] [--gen-tokens 128] [--agree q4,k8v4|all]
[--docs DIR] [--out DIR]
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from common import describe_model
from common import model_dir as resolve_model_dir
from harness import machine, parser, plot, report, say, services, table
from paper import TABLE9, TABLE9_TOKENS

from agentkv.client.store import StoreClient
from agentkv.layers import KVFormat
from agentkv.v1 import store_pb2 as pb
from inference_worker.blas import load_optimized_blas

NS = "perplexity"
WINDOW, STRIDE = 512, 256
CONTEXT = WINDOW - STRIDE - 1  # 255: the scored forward feeds the token before the first target
PREFILL_CHUNK = 128
ROUND_TRIPS = ((256, "stream"), (64, "local"), (256, "local"), (64, "stream"))
QUANTIZED = {"Q4 (k4v4)": KVFormat(4, 4), "Q8 (k8v8)": KVFormat(8, 8), "K8V4": KVFormat(8, 4)}
OWN_CHUNK = ("quantized", "fp", "worker")  # "both", the default: quantized and fp
BASELINE, REFERENCE, HEADLINE = "FP16", "FP32", "Q4 (k4v4)"
SHORT = {"fp32": REFERENCE, "q4": "Q4 (k4v4)", "q8": "Q8 (k8v8)", "k8v4": "K8V4"}
AGREE = "q4,k8v4"  # the formats whose greedy agreement with FP16 is measured, by default
TARGET_PCT = 1.0
BOOTSTRAP_SAMPLES = 10_000
# Checks: FP16 against FP32 (|PPL change|, %), cache path against a cache-free forward (NLL)
FP16_TOLERANCE_PCT, FORWARD_TOLERANCE_NLL = 0.1, 1e-3

# The text: Debian's python3-doc (the Python docs' reStructuredText sources), these documents
# in this order: the Tutorial, the FAQ and the HOWTOs, each as its index's toctree lists them.
DOCS = Path("/usr/share/doc/python3-doc/html/_sources")
DOCS_HINT = "apt-get install python3-doc"
CORPUS = tuple(
    f"{part}/{name}"
    for part, names in (
        (
            "tutorial",
            "index appetite interpreter introduction controlflow datastructures modules "
            "inputoutput errors classes stdlib stdlib2 venv whatnow interactive floatingpoint "
            "appendix",
        ),
        ("faq", "general programming design library extending windows gui installed"),
        (
            "howto",
            "pyporting cporting curses descriptor enum functional logging logging-cookbook regex "
            "sockets sorting unicode urllib2 argparse ipaddress clinic instrumentation "
            "annotations isolating-extensions",
        ),
    )
    for name in names.split()
)
# The greedy-agreement prompts (chat turns; each asks for a long answer)
PROMPTS = (
    "Explain in detail how a hash table works, with its advantages and drawbacks.",
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Describe the water cycle step by step, as a teacher would to a class of twelve-year-olds.",
    "What should someone consider when planning a two-week trip to Japan? Give a thorough answer.",
)


# the text: reStructuredText as plain prose

KEEP_BODY = {  # directives whose body is prose: the body stays, the directive line goes
    "note", "warning", "seealso", "tip", "important", "topic", "sidebar", "impl-detail",
    "versionadded", "versionchanged", "deprecated", "attention", "caution", "hint",
}  # fmt: skip
DIRECTIVE = re.compile(r"^(\s*)\.\.(?:\s+([\w:-]+)::)?")
LABEL = re.compile(r"^\.\. _([^:`]+):\s*$")
ADORNMENT = re.compile(r"^\s*([=\-`:'\"~^_*+#<>.])\1{2,}\s*$")
TABLE = re.compile(r"^\s*(?:[+|]|=+\s+=)")
OPTION = re.compile(r"^\s*:[\w -]+:")
LIST_ITEM = re.compile(r"^(?:[*+-]|\d+\.|#\.|\(\d+\))\s")
ROLE = re.compile(r":([\w:+.-]+):`([^`]*)`")
LINK = re.compile(r"`([^`<]*?)\s*(?:<[^>]*>)?`__?")
LITERAL = re.compile(r"``(.+?)``")
STRONG = re.compile(r"\*\*(\S(?:.*?\S)?)\*\*")
EMPH = re.compile(r"(?<![\w*])\*(\S(?:[^*]*?\S)?)\*(?![\w*])")
FOOTNOTE_REF = re.compile(r"\s*\[(?:#\w*|\d+)\]_")
NUMBERED_ROLES = {"pep": "PEP", "rfc": "RFC"}


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def section_titles(texts: list[str]) -> dict[str, str]:
    """`.. _label:` -> the title of the section it labels, for :ref:`label`."""
    titles: dict[str, str] = {}
    for text in texts:
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if not (m := LABEL.match(line)):
                continue
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or LABEL.match(lines[j])):
                j += 1
            if j < len(lines) and ADORNMENT.match(lines[j]):
                j += 1  # an overline
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
    line = LITERAL.sub(r"\1", line)
    line = LINK.sub(r"\1", line)
    line = FOOTNOTE_REF.sub("", line)
    line = STRONG.sub(r"\1", line)
    line = EMPH.sub(r"\1", line)
    return line.replace("\\ ", "").replace("\\", "")


def prose(rst: str, titles: dict[str, str]) -> str:
    """reStructuredText as plain paragraphs: code, directives, tables and heading rules out."""
    lines, out, i = rst.expandtabs().splitlines(), [], 0

    def past_block(i: int, indent: int) -> int:  # past blank lines and lines indented deeper
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > indent):
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
            i = past_block(i + 1, _indent(line))
            out.append("")
        elif text.startswith(">>>"):  # a doctest block: to the next blank line
            while i < len(lines) and lines[i].strip():
                i += 1
            out.append("")
        elif ADORNMENT.match(line) or TABLE.match(line):
            i += 1
        elif text.endswith("::"):  # "text::" is "text:" and a literal block follows
            head = text[:-2].rstrip()
            if head:
                out.append(head if text[-3:-2].isspace() else head + ":")
            i = past_block(i + 1, _indent(line))
            out.append("")
        else:
            out.append(text)
            i += 1
    paragraphs, current = [], []
    for text in [*out, ""]:
        if not text:
            if current:
                paragraphs.append("\n".join(current))
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


def docs_version(docs: Path) -> str:
    options = docs.parent / "_static" / "documentation_options.js"
    if options.is_file() and (m := re.search(r"VERSION:\s*'([^']+)'", options.read_text())):
        return m.group(1)
    return "unknown"


def load_text(docs: Path, tokenizer: Any, needed: int) -> Text:
    """CORPUS's documents as prose, tokenized, until there are `needed` tokens."""
    present = [name for name in CORPUS if (docs / f"{name}.rst.txt").is_file()]
    if not present:
        raise SystemExit(
            f"the text is missing: no Python documentation sources at {docs} "
            f"({DOCS_HINT}, or --docs DIR for another Sphinx _sources tree)"
        )
    titles = section_titles([p.read_text(errors="replace") for p in docs.rglob("*.rst.txt")])
    tokens: list[int] = []
    used: list[str] = []
    digest = hashlib.sha256()
    separator = "\n\n"
    for name in present:
        text = prose((docs / f"{name}.rst.txt").read_text(errors="replace"), titles)
        text = (separator if used else "") + text
        digest.update(text.encode())
        tokens += tokenizer.encode(text, add_special_tokens=False)
        used.append(name)
        if len(tokens) >= needed:
            break
    if len(tokens) < needed:
        raise SystemExit(
            f"the text at {docs} has {len(tokens):,} tokens, too few for {needed:,}: "
            "ask for fewer (--tokens)"
        )
    version = docs_version(docs)
    return Text(np.array(tokens, dtype=np.int64), used, version, digest.hexdigest(), docs)


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


@dataclass(frozen=True, slots=True)
class Kind:
    """One row: a KV format, and for a quantized one what a chunk attends for its own tokens."""

    fmt_name: str  # FP32, FP16 or a QUANTIZED key
    own: str = ""  # an OWN_CHUNK name for a quantized format

    @property
    def variant(self) -> str:
        return "worker's QuantizedKV" if self.own == "worker" else f"own chunk {self.own}"

    @property
    def label(self) -> str:
        return f"{self.fmt_name}, {self.variant}" if self.own else self.fmt_name

    @property
    def fmt(self) -> KVFormat | None:
        return QUANTIZED.get(self.fmt_name)


def plan_kinds(own_chunks: tuple[str, ...]) -> list[Kind]:
    return [Kind(REFERENCE), Kind(BASELINE)] + [
        Kind(name, own) for name in QUANTIZED for own in own_chunks
    ]


@dataclass(slots=True)
class Scores:
    """One KV format's NLL per scored token, per window."""

    kind: Kind
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


@functools.cache
def own_chunk_classes() -> dict[str, tuple[type, int]]:
    """--own-chunk's caches, by name: (class, quantized_query_max). Each is a QuantizedKV
    that stores and holds exactly what the worker's does (its update_and_fetch stores the
    update quantized), and hands attention a past and an own part of its own definition, so
    that what is measured does not move when QuantizedKV's attention path does. "worker" is
    QuantizedKV itself: whatever the worker's prefill and decode attend in this tree. Built on
    first use: it imports mlx. Full-attention layers only (the benchmark checks)."""
    import mlx.core as mx

    from inference_worker.kv_cache import QuantizedKV

    class OwnChunkQuantized(QuantizedKV):
        """Every position as stored, its own included: a decode step of equal K and V bits
        takes mlx-lm's quantized attention (as the worker's does), anything else the whole
        cache dequantized."""

        def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
            fetched = super().update_and_fetch(keys, values)
            if hasattr(self, "end_turn"):
                self.end_turn()  # no full-precision copy of the turn: none is attended
            if hasattr(self, "bits"):  # quantized arrays, for mlx-lm's quantized attention
                return fetched
            return self.dequantized(0, self.offset - self.start, keys.dtype)

    class OwnChunkFP(QuantizedKV):
        """The past dequantized, the update's own keys and values as computed."""

        def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
            super().update_and_fetch(keys, values)  # quantized_query_max=0: never `bits`
            if hasattr(self, "end_turn"):
                self.end_turn()
            past = self.offset - self.start - keys.shape[2]
            if not past:
                return keys, values
            past_k, past_v = self.dequantized(0, past, keys.dtype)
            return mx.concatenate([past_k, keys], axis=2), mx.concatenate([past_v, values], axis=2)

    return {"quantized": (OwnChunkQuantized, 1), "fp": (OwnChunkFP, 0), "worker": (QuantizedKV, 1)}


def quantized_cache(kind: Kind) -> Any:
    cls, quantized_query_max = own_chunk_classes()[kind.own]
    return cls(kind.fmt, quantized_query_max=quantized_query_max)


def new_caches(kind: Kind, num_layers: int) -> list:
    from mlx_lm.models.cache import KVCache

    if kind.fmt_name == REFERENCE:
        return [KVCache() for _ in range(num_layers)]
    if kind.fmt_name == BASELINE:
        return [Float16KV() for _ in range(num_layers)]
    return [quantized_cache(kind) for _ in range(num_layers)]


def as_kind(restored: list, kind: Kind) -> list:
    """Caches rebuilt from blocks (QuantizedKV) as this kind's caches, holding the same
    arrays."""
    if kind.own == "worker":
        return restored
    caches = []
    for r in restored:
        c = quantized_cache(kind)
        c.load(r.keys, r.values, r.offset, r.start)
        caches.append(c)
    return caches


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

    def __call__(self, caches: list, context: list[int], kind: Kind, w: Window) -> list:
        from inference_worker.blocks import cache_blocks, caches_from_blocks
        from inference_worker.fingerprint import model_fingerprint

        fmt = kind.fmt
        key = (fmt, w.block_tokens)
        if key not in self.fingerprints:  # it hashes the weights
            self.fingerprints[key] = model_fingerprint(self.model_dir, fmt, w.block_tokens)
        fingerprint = self.fingerprints[key]
        # the variants' blocks have the same keys (same tokens) but other bytes: one
        # namespace each, so that neither reads the other's
        ns = f"{NS}-own-{kind.own}"
        blocks, keys = cache_blocks(caches, context, fingerprint, w.block_tokens)
        put = self.store.put_blocks(ns, fingerprint, blocks)
        read = self.store.get_blocks if w.read_path == "stream" else self.store.read_blocks_local
        restored = caches_from_blocks(list(read(ns, fingerprint, keys)), len(caches), fmt)
        self.store.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=put.lease_id))
        check_identical(caches, restored, f"{kind.label} window {w.index}")
        self.num_round_trips += 1
        self.bytes_stored += sum(t.num_bytes for b in blocks for t in b.tensors)
        return as_kind(restored, kind)


def check_identical(put: list, restored: list, what: str) -> None:
    import mlx.core as mx

    for layer, (a, b) in enumerate(zip(put, restored, strict=True)):
        parts = zip((*a.state[0], *a.state[1]), (*b.state[0], *b.state[1]), strict=True)
        if a.offset != b.offset or not all(mx.array_equal(x, y).item() for x, y in parts):
            raise RuntimeError(f"{what}: layer {layer} came back from the store changed")


# scoring


def prefill(model: Any, ids: list[int], caches: list) -> Any:
    """Feeds ids in chunks of PREFILL_CHUNK; the last chunk's logits (lazy)."""
    import mlx.core as mx

    logits = None
    for a in range(0, len(ids), PREFILL_CHUNK):
        logits = model(mx.array([ids[a : a + PREFILL_CHUNK]]), cache=caches)
        mx.eval(logits)
    return logits


def turn(kind: Kind, caches: list, begin: bool) -> None:
    """The worker's engine opens a turn on its caches around each turn's prefill
    (QuantizedKV.begin_turn / end_turn); the "worker" kind does the same."""
    if kind.own == "worker":
        for c in caches:
            c.begin_turn() if begin else c.end_turn()


def score_window(
    model: Any, kind: Kind, tokens: np.ndarray, w: Window, round_trip: RoundTrip
) -> tuple[np.ndarray, float]:
    """(NLL of the window's scored tokens, KV bytes per token held after scoring)."""
    import mlx.core as mx

    ids = tokens[w.start : w.start + WINDOW].tolist()
    caches = new_caches(kind, len(model.layers))
    turn(kind, caches, begin=True)
    prefill(model, ids[: w.context], caches)
    turn(kind, caches, begin=False)
    if kind.fmt is not None and w.context:
        caches = round_trip(caches, ids[: w.context], kind, w)
    turn(kind, caches, begin=True)  # the scored forward is the next turn's prefill
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
    model: Any,
    kinds: list[Kind],
    tokens: np.ndarray,
    windows: list[Window],
    round_trip: RoundTrip,
) -> tuple[dict[Kind, Scores], list[np.ndarray]]:
    """Every kind's scores, and each window's cache-free NLL (a check of the cache path)."""
    scores = {kind: Scores(kind) for kind in kinds}
    free = []
    for w in windows:
        for kind, s in scores.items():
            start = time.perf_counter()
            nll, per_token = score_window(model, kind, tokens, w, round_trip)
            s.seconds += time.perf_counter() - start
            s.nll.append(nll)
            s.bytes_per_token.append(per_token)
        free.append(cache_free_nll(model, tokens, w))
        if w.index % 5 == 4 or w.index == len(windows) - 1:
            done = sum(len(n) for n in scores[Kind(BASELINE)].nll)
            say(f"window {w.index + 1}/{len(windows)}: {done:,} tokens scored per format")
    return scores, free


# greedy agreement


@dataclass(slots=True)
class Agreement:
    """One kind teacher-forced on FP16's greedy generations: argmax matches, per prompt."""

    kind: Kind
    matches: list[np.ndarray] = field(default_factory=list)  # bool per generated position

    @property
    def rate(self) -> float:
        return float(np.concatenate(self.matches).mean())

    @property
    def positions(self) -> int:
        return int(sum(len(m) for m in self.matches))

    @property
    def first_divergence(self) -> list[int | None]:
        """Per prompt, the first position whose argmax differs (None: none did)."""
        return [int(np.argmin(m)) if not m.all() else None for m in self.matches]


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    if getattr(tokenizer, "has_chat_template", False):
        messages = [{"role": "user", "content": prompt}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode(prompt))


def greedy(
    model: Any, kind: Kind, prompt: list[int], n: int, forced: list[int] | None = None
) -> list[int]:
    """The argmax at each of n positions after the prompt; fed its own (or `forced`) tokens."""
    import mlx.core as mx

    caches = new_caches(kind, len(model.layers))
    logits = prefill(model, prompt, caches)[0, -1]
    out: list[int] = []
    for i in range(n):
        out.append(int(mx.argmax(logits).item()))
        if i + 1 < n:
            fed = out[-1] if forced is None else forced[i]
            logits = model(mx.array([[fed]]), cache=caches)[0, -1]
    return out


def agreement(
    model: Any, tokenizer: Any, kinds: list[Kind], num_prompts: int, n: int
) -> tuple[dict[Kind, Agreement], list[int]]:
    """Each kind against FP16's greedy generations; the prompts' lengths."""
    if not num_prompts or not kinds:
        return {}, []
    results = {kind: Agreement(kind) for kind in kinds}
    lengths = []
    for p, text in enumerate(PROMPTS[:num_prompts]):
        prompt = prompt_ids(tokenizer, text)
        lengths.append(len(prompt))
        reference = greedy(model, Kind(BASELINE), prompt, n)
        for kind, a in results.items():
            a.matches.append(np.array(greedy(model, kind, prompt, n, reference)) == reference)
        say(f"agreement: prompt {p + 1}/{num_prompts} ({len(prompt)} tokens, {n} generated)")
    return results, lengths


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


def run_checks(scores: dict[Kind, Scores], free: list[np.ndarray]) -> list[dict[str, Any]]:
    """Each check: what, the numbers, and whether it held."""
    fp16, fp32 = scores[Kind(BASELINE)], scores[Kind(REFERENCE)]
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
    for kind, s in scores.items():
        if kind.own == "fp":  # no past in window 0: it attends exactly what FP32 does
            diff = max_abs_diff(s.nll[:1], fp32.nll[:1])
            checks.append(
                {
                    "check": f"{kind.label}, window 0 (no past) vs FP32",
                    "result": f"max abs ΔNLL per token {diff:.2e}",
                    "ok": diff < FORWARD_TOLERANCE_NLL,
                }
            )
    return checks


# the report


def signed(value: float, digits: int = 3) -> str:
    return f"{value:+.{digits}f}"


def results_table(scores: dict[Kind, Scores], intervals: dict[Kind, dict[str, float]]) -> str:
    base, rows = scores[Kind(BASELINE)], []
    for kind, s in scores.items():
        ci, is_base = intervals.get(kind), kind.fmt_name == BASELINE
        name = f"{kind.fmt_name} (reference)" if kind.fmt_name == REFERENCE else kind.fmt_name
        rows.append(
            (
                name,
                kind.own or "fp",
                f"{s.ppl:.3f}",
                "" if is_base else signed(s.ppl - base.ppl),
                "" if is_base else f"{s.delta_pct(base):+.2f}%",
                f"{ci['pct_lo']:+.2f} .. {ci['pct_hi']:+.2f}" if ci else "",
                f"{s.counts.sum():,}",
                f"{np.mean(s.bytes_per_token):,.0f}",
                "yes" if kind.fmt else "no",
            )
        )
    headers = ("KV format", "own chunk", "PPL", "ΔPPL vs FP16", "Δ%")
    headers += ("95% CI of Δ% (paired bootstrap)", "tokens scored", "KV bytes/token")
    return table((*headers, "through the store"), rows, "llrrrrrrl")


def paper_table(scores: dict[Kind, Scores], model_name: str) -> str:
    rows = [
        (f"{model} (paper)", f"{fp16:.2f}", f"{q4:.2f}", signed(q4 - fp16, 2))
        + (f"{100 * (q4 / fp16 - 1):+.1f}%", f"{TABLE9_TOKENS:,}")
        for model, (fp16, q4) in TABLE9.items()
    ]
    fp16 = scores[Kind(BASELINE)]
    rows += [
        (f"{model_name}, {kind.variant} (this run)", f"{fp16.ppl:.2f}", f"{q4.ppl:.2f}")
        + (signed(q4.ppl - fp16.ppl, 2), f"{q4.delta_pct(fp16):+.1f}%", f"{q4.counts.sum():,}")
        for kind, q4 in scores.items()
        if kind.fmt_name == HEADLINE
    ]
    return table(("model", "FP16 PPL", "Q4 PPL", "ΔPPL", "Δ%", "tokens"), rows)


def agreement_table(results: dict[Kind, Agreement], n: int) -> str:
    rows = [
        (kind.fmt_name, kind.own or "fp", f"{a.positions:,}", f"{100 * a.rate:.1f}%")
        + (", ".join("-" if f is None else str(f) for f in a.first_divergence),)
        for kind, a in results.items()
    ]
    headers = ("KV format", "own chunk", "positions", "argmax agrees with FP16 greedy")
    first = f"first divergence per prompt (of {n}; - none)"
    return table((*headers, first), rows, "llrrl")


def checks_table(checks: list[dict[str, Any]], round_trip: RoundTrip) -> str:
    rows = [(c["check"], c["result"], "ok" if c["ok"] else "FAILED") for c in checks]
    n = round_trip.num_round_trips
    stored = f"{n} of {n} ({round_trip.bytes_stored:,} bytes put and read back)"
    rows.append(("store round trips bit-identical", stored, "ok"))
    return table(("check", "result", ""), rows, "lll")


def targets(
    scores: dict[Kind, Scores], intervals: dict[Kind, dict[str, float]], model_name: str
) -> list[dict[str, Any]]:
    """One target per own-chunk variant: Q4 within +TARGET_PCT% of FP16."""
    base = scores[Kind(BASELINE)]
    goals = []
    for kind, s in scores.items():
        if kind.fmt_name != HEADLINE:
            continue
        pct, ci = s.delta_pct(base), intervals[kind]
        goals.append(
            {
                "target": f"Q4 perplexity within +{TARGET_PCT:g}% of FP16 KV on {model_name} "
                f"({kind.variant})",
                "met": pct <= TARGET_PCT,
                "measured": f"{pct:+.2f}% (95% CI {ci['pct_lo']:+.2f} .. {ci['pct_hi']:+.2f}%)",
                "own": kind.own,
                "pct": pct,
            }
        )
    return goals


def target_notes(
    scores: dict[Kind, Scores], intervals: dict[Kind, dict[str, float]], goal: dict[str, Any]
) -> list[str]:
    """Per target: which formats meet it at how many bytes, and whether Q4's interval
    includes 0."""
    base = scores[Kind(BASELINE)]
    base_bytes, own = np.mean(base.bytes_per_token), goal["own"]
    variant = Kind(HEADLINE, own).variant
    meeting = sorted(
        (np.mean(s.bytes_per_token), k.fmt_name, s.delta_pct(base))
        for k, s in scores.items()
        if k.own == own and s.delta_pct(base) <= TARGET_PCT
    )
    met = ", ".join(f"{n} ({pct:+.2f}%, {b:,.0f} B/token)" for b, n, pct in meeting)
    if goal["met"]:
        head = "Q4 meets the target"
    else:
        head = f"Q4 misses the target by {goal['pct'] - TARGET_PCT:.2f} points"
    smallest = (
        f"the smallest that does: {meeting[0][1]} at {meeting[0][0]:,.0f} B/token, "
        f"{meeting[0][0] / base_bytes:.2f}x FP16's {base_bytes:,.0f}"
        if meeting
        else "no quantized format does"
    )
    ci = intervals[Kind(HEADLINE, own)]
    if ci["pct_lo"] <= 0 <= ci["pct_hi"]:
        verdict = "includes 0: Q4's change is not distinguishable from window-to-window noise"
    else:
        verdict = "excludes 0: the change is more than window-to-window noise"
    return [
        f"{variant}: {head}; within +{TARGET_PCT:g}% of FP16: {met or 'none'}; {smallest}",
        f"{variant}: Q4 - FP16, 95% paired-bootstrap interval over {len(base.nll)} "
        f"windows {verdict}",
    ]


def method_notes(windows: list[Window], text: Text, model_dir: Path) -> list[str]:
    notes = [
        f"scored tokens: window 0, tokens 1..{WINDOW - 1}; window w >= 1, tokens "
        f"{STRIDE}w+{STRIDE}..{STRIDE}w+{WINDOW - 1} after a {CONTEXT}-token context "
        "(prefilled, and for Q4/Q8/K8V4 put to the store and read back); the same tokens for "
        "every format. Window 0 has no past, so there own chunk fp scores exactly as FP32",
        "FP16 and FP32 do not go through the store: it holds only quantized blocks",
        "own chunk fp keeps a forward's own tokens in full precision: for the scored forward "
        f"that is up to its {STRIDE} latest tokens, for a decode step only the one being fed; "
        "the greedy-agreement table is where decoding shows",
        f"the text: tokens 0..{windows[-1].targets[1] - 1} of the prose of the Python "
        f"{text.version} documentation ({text.docs}, Debian's python3-doc: {DOCS_HINT}), "
        f"documents {', '.join(text.files)}; SHA-256 of the text tokenized {text.sha256[:16]}…",
    ]
    gguf = json.loads((model_dir / "config.json").read_text()).get("agentkv_gguf")
    if gguf:
        notes.append(
            f"the weights: {gguf['file']} imported as {gguf['weights']} (the GGUF's own "
            "quantized weights, dequantized): the KV formats are compared on these weights"
        )
    notes.append(
        "the paper's rows are 8-12B models on an M4 Pro; this is a much smaller model on CPU: "
        "compare the changes, not the perplexities"
    )
    return notes


def draw(scores: dict[Kind, Scores]) -> Any:
    """PPL per format, and the per-window mean NLL change against FP16."""

    def panels(axes: Any) -> None:
        left, right = axes
        kinds = list(scores)
        names = [k.label.replace(", own chunk ", "\nown ") for k in kinds]
        left.bar(range(len(kinds)), [scores[k].ppl for k in kinds], color="tab:blue")
        left.set_xticks(range(len(kinds)), names, fontsize=7)
        for x, kind in enumerate(kinds):
            ppl = scores[kind].ppl
            left.text(x, ppl, f"{ppl:.3f}", ha="center", va="bottom", fontsize=7)
        low = min(s.ppl for s in scores.values())
        left.set_ylim(low * 0.98, max(s.ppl for s in scores.values()) * 1.01)
        left.set_ylabel("perplexity (Python docs prose)")
        base = scores[Kind(BASELINE)]
        for kind, s in scores.items():
            if kind.fmt is None:
                continue
            diffs = [(a.mean() - b.mean()) for a, b in zip(s.nll, base.nll, strict=True)]
            style = {"quantized": "o-", "fp": "x--"}.get(kind.own, "s:")
            right.plot(range(len(diffs)), diffs, style, ms=3, label=f"{kind.label} - FP16")
        right.axhline(0, color="grey", lw=0.8)
        right.set_xlabel("window")
        right.set_ylabel("mean NLL change per scored token (nats)")
        right.legend(fontsize=7)

    return panels


@dataclass(slots=True)
class Run:
    """What main measured, for the report."""

    scores: dict[Kind, Scores]
    agreed: dict[Kind, Agreement]
    windows: list[Window]
    checks: list[dict[str, Any]]
    round_trip: RoundTrip
    text: Text
    model_dir: Path


def sections_for(run: Run, intervals: dict, header: dict[str, Any]) -> list[tuple[str, str]]:
    base, model = run.scores[Kind(BASELINE)], header["model"]
    sections = [
        (
            f"perplexity by KV format ({len(run.windows)} windows of {WINDOW}, stride {STRIDE}, "
            f"{base.counts.sum():,} tokens)",
            results_table(run.scores, intervals),
        ),
        ("the paper's Table 9 beside this run (Q4 against FP16)", paper_table(run.scores, model)),
    ]
    if run.agreed:
        n, prompts = header["gen_tokens"], len(next(iter(run.agreed.values())).matches)
        title = f"greedy agreement with FP16 KV ({prompts} chat prompts, {n} tokens each, "
        title += "teacher-forced on FP16's generation)"
        sections.append((title, agreement_table(run.agreed, n)))
    return [*sections, ("checks", checks_table(run.checks, run.round_trip))]


def document(run: Run, intervals: dict) -> dict[str, Any]:
    scores, base = run.scores, run.scores[Kind(BASELINE)]
    formats = {
        k.label: {"format": k.fmt_name, "own_chunk": k.own or None, "ppl": s.ppl}
        | {"tokens": int(s.counts.sum()), "kv_bytes_per_token": float(np.mean(s.bytes_per_token))}
        | {"seconds": s.seconds, "bootstrap_vs_fp16": intervals.get(k)}
        for k, s in scores.items()
    }
    windows = [
        {"index": w.index, "start": w.start, "context": w.context, "targets": w.targets}
        | {"block_tokens": w.block_tokens if w.context else None}
        | {"read_path": w.read_path if w.context else None}
        | {"nll_sum": {k.label: float(s.nll[w.index].sum()) for k, s in scores.items()}}
        | {"tokens": len(base.nll[w.index])}
        for w in run.windows
    ]
    agreement = {
        k.label: {"rate": a.rate, "positions": a.positions, "first_divergence": a.first_divergence}
        for k, a in run.agreed.items()
    }
    paper9 = {"rows": TABLE9, "tokens": TABLE9_TOKENS}
    return {"formats": formats, "windows": windows, "agreement": agreement} | {
        "paper_table9": paper9,
        "checks": run.checks,
    }


def write_report(run: Run, header: dict[str, Any], out: Path) -> None:
    base = run.scores[Kind(BASELINE)]
    intervals = {k: paired_bootstrap(base, s) for k, s in run.scores.items() if k.fmt}
    goals = targets(run.scores, intervals, header["model"])
    notes = [n for goal in goals for n in target_notes(run.scores, intervals, goal)]
    notes += method_notes(run.windows, run.text, run.model_dir)
    notes += [f"check failed: {c['check']}: {c['result']}" for c in run.checks if not c["ok"]]
    sections = sections_for(run, intervals, header)
    png = report("perplexity", out, header, sections, goals, notes, document(run, intervals))
    plot(
        png, header, f"perplexity, {header['model']}", draw(run.scores), ncols=2, figsize=(14, 5.2)
    )


# main


def parse_args(argv: list[str] | None) -> Any:
    p = parser(__doc__, quick="a smoke run: 3 windows, 1 prompt of 8 tokens")
    p.add_argument("--tokens", type=int, default=TABLE9_TOKENS, help="tokens to score (at least)")
    p.add_argument(
        "--own-chunk",
        default="both",
        help=f"what a chunk attends for its own tokens: some of {','.join(OWN_CHUNK)}, or both "
        "(quantized,fp)",
    )
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="greedy-agreement prompts")
    p.add_argument("--gen-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument(
        "--agree",
        default=AGREE,
        help=f"formats whose greedy agreement is measured: some of {','.join(SHORT)}, or all",
    )
    p.add_argument("--docs", type=Path, default=DOCS, help="a Sphinx _sources tree")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.prompts, args.gen_tokens = WINDOW - 1 + 2 * STRIDE, 1, 8
    if args.tokens < 1:
        p.error("--tokens must be at least 1")
    if not 0 <= args.prompts <= len(PROMPTS):
        p.error(f"--prompts must be 0..{len(PROMPTS)}")
    if args.gen_tokens < 1:
        p.error("--gen-tokens must be at least 1")
    own = ["quantized", "fp"] if args.own_chunk == "both" else args.own_chunk.split(",")
    if unknown := [o for o in own if o not in OWN_CHUNK]:
        p.error(f"--own-chunk: unknown {', '.join(unknown)} (choose from {', '.join(OWN_CHUNK)})")
    args.own_chunk = tuple(dict.fromkeys(own))
    agree = list(SHORT) if args.agree == "all" else [a for a in args.agree.split(",") if a]
    if unknown := [a for a in agree if a not in SHORT]:
        p.error(f"--agree: unknown {', '.join(unknown)} (choose from {', '.join(SHORT)}, all)")
    args.agree = [SHORT[a] for a in agree]
    return args


def load_model(model_dir: Path) -> tuple[Any, Any, str]:
    """The model, its tokenizer, and its weights' dtype."""
    from mlx.utils import tree_flatten
    from mlx_lm import load

    from inference_worker.layer_spec import cache_windows

    model, tokenizer = load(str(model_dir))
    if any(w is not None for w in cache_windows(model)):
        raise SystemExit(f"{model_dir} has sliding-window layers; this benchmark needs full ones")
    dtype = tree_flatten(model.parameters())[0][1].dtype
    return model, tokenizer, str(dtype).removeprefix("mlx.core.")


def model_name(spec: str, model_dir: Path) -> str:
    gguf = json.loads((model_dir / "config.json").read_text()).get("agentkv_gguf")
    if gguf:
        return Path(gguf["file"]).stem.split(".")[0]  # SmolLM2-135M-Instruct
    return Path(spec).name or spec


def main(argv: list[str] | None = None) -> None:
    started = time.perf_counter()
    args = parse_args(argv)
    blas = load_optimized_blas()  # before anything here imports mlx
    model_dir = resolve_model_dir(args.model)  # as the worker resolves it; one line if not
    windows = plan_windows(args.tokens)
    kinds = plan_kinds(args.own_chunk)
    model, tokenizer, dtype = load_model(model_dir)
    text = load_text(args.docs, tokenizer, windows[-1].start + WINDOW)
    name = model_name(args.model, model_dir)
    say(
        f"{len(text.tokens):,} tokens of Python {text.version} docs prose ({len(text.files)} "
        f"documents); {len(windows)} windows; {len(kinds)} KV formats; model {name} ({dtype})"
    )
    root = Path(tempfile.mkdtemp(prefix="agentkv-perplexity-"))
    try:
        with services(root) as svc:
            say(f"store up at {svc.store_address}")
            round_trip = RoundTrip(svc.store, model_dir)
            scores, free = score_all(model, kinds, text.tokens, windows, round_trip)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    agree_kinds = [k for k in kinds if k.fmt_name in args.agree]
    agreed, lengths = agreement(model, tokenizer, agree_kinds, args.prompts, args.gen_tokens)
    checks = run_checks(scores, free)
    header = machine(blas=blas or "reference (bundled with mlx)", model=name)
    header |= {"model_described": describe_model(model_dir, args.model), "dtype": dtype}
    header |= {"text": f"Python {text.version} docs ({DOCS_HINT})", "text_sha256": text.sha256}
    header |= {"tokens_requested": args.tokens, "prefill_chunk": PREFILL_CHUNK}
    header |= {"prompt_tokens": lengths, "gen_tokens": args.gen_tokens}
    header |= {"seconds": round(time.perf_counter() - started)}
    run = Run(scores, agreed, windows, checks, round_trip, text, model_dir)
    write_report(run, header, args.out)


if __name__ == "__main__":
    main()
