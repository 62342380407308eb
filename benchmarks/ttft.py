"""TTFT benchmark: time to first token, cold vs hot vs warm restore, against mlx-lm's cache files.

For each model (--models) it starts a real `agentkv-store` process and two `agentkv-worker`
processes on loopback (--block-tokens 256; one with --restore-path locate, one with stream),
warms both up, then for each context length (--contexts, tokens) measures, --passes times:

  cold           CreateAgent (empty system prompt), then a Turn whose user message is ~N tokens
                 of Python standard-library source: all but what CreateAgent cached (the chat
                 template's stable prefix: SmolLM2's default system prompt, ~30 tokens) is
                 prefilled (so the worker's usage.cache_state may say "hot"; the check asks
                 for the prefill instead)
  hot            a further Turn ("Go on.") on the same agent, still in the worker's RAM, once
                 the last turn's background store write has finished (it would compete)
  warm (locate)  EvictAgent, then the same Turn: the worker restores the agent's Q4 blocks by
                 LocateBlocks + direct file reads
  warm (stream)  a fork of that agent (same tokens, same blocks) restored by the other worker
                 over the GetBlocks stream; then that fork's hot turn on the stream worker, so
                 its process's speed can be told apart from its restore path
  decode         (`default` only) --passes store forks of the agent, each restored by one
                 untimed Turn on the locate worker, then (hot) a Turn asking to explain the
                 code (or, if its greedy reply ends before half of max_tokens, the next of
                 DECODE_PROMPTS), max_tokens --decode-tokens (32; EOS may still end it sooner:
                 the table counts the tokens): the worker's usage.decode_tokens_per_second
                 (the tokens after the first, per second)

Every Turn but decode's asks max_tokens=1. TTFT is the worker's usage.time_to_first_token_ms
(from the request's arrival); the client's wall time to the first token is kept in the JSON.
Every pass prefills a fresh agent unless the extra prefills would take over --cold-budget
seconds (default 90) at that context; then later passes reuse the last agent (each pass adds
~32 tokens of turns), and the output says how many cold passes ran.

Then, in this process with no server, on that agent's stored blocks (the same tokens and the
same Q4 group-64 bytes):

  mlx-lm load        mlx-lm's own save_prompt_cache file, on the same disk, of
                     QuantizedKVCache(bits=4, group_size=64) layers holding the agent's exact
                     Q4 bytes (fp16 scales and biases); load_prompt_cache + one decode step
  raw read + decode  os.preadv of the agent's located block bytes into a preallocated buffer
                     (no checksum) + one decode step on an in-memory cache of that length
  breakdown          where a warm (locate) restore's time goes, step by step

Models: `default` is --model SPEC (a shipped name, a .gguf file or an mlx-lm directory, as
agentkv-worker --model takes; default SmolLM2-135M-Instruct, the worker's own default, its
GGUF imported once into the model cache as float32 on a CPU); `llama8b-shape` has random
float32 weights with Llama-3.1-8B layer shapes (hidden 4096, 32 heads, 8 KV heads, head_dim
128, intermediate 14336) but only --layers layers and a 4096-token vocabulary, built into a
temporary directory. A context that leaves too little of the model's window for its turns
(96 + 32 x passes + --decode-tokens tokens) is cut to fit, and the output says so: on
SmolLM2 (a window of 8192) 8K runs as 7968 tokens of user text, an ~8000-token prompt,
labelled 7968 (the paper's 8K figures stand beside it). Targets, on medians:
warm (locate) within 1.3x of raw read + decode, and within 1.2x of mlx-lm's load + decode.
The page cache is warm throughout (every block was just written). Prints Markdown tables;
writes JSON and a PNG (matplotlib is optional) to --out. Progress goes to stderr.

Full run: 21 minutes here with other jobs sharing the 2 cores (load average 3-6): SmolLM2
~12.5 (its 8K's single cold prefill took 211 s), llama8b-shape ~8.5; less on a quiet machine
(--models default, or a smaller --cold-budget, shortens it). --quick (512 and 1K, 1 pass,
`default` only when report.py runs it) about a minute.

Run:  python benchmarks/ttft.py [--model smollm2-135m-instruct] [--models default,llama8b-shape]
                                [--contexts 1024,2048,4096,8192] [--passes 3] [--layers 2]
                                [--decode-tokens 32] [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from common import (
    RawReader,
    add_model_argument,
    describe_model,
    load_tokenizer,
    max_context,
    model_dir,
    wait_ready,
)
from google.protobuf.json_format import MessageToDict

from agentkv.launch import ServiceProcess, store_process, worker_process
from agentkv.v1 import store_pb2 as pb
from client.store import StoreClient
from client.worker import WorkerClient
from inference_worker.blas import load_optimized_blas
from inference_worker.kv_format import KVFormat
from tests import model_kit

MODELS = ("default", "llama8b-shape")  # default: --model
NS = "ttft"
BLOCK_TOKENS = 256
KV = KVFormat()  # k4v4g64f16: the worker's default; mlx-lm's bits=4, group_size=64
SHORT = "Go on."
# What the decode turns ask, tried in order until the greedy reply runs to at least half of
# --decode-tokens (a turn cannot ignore EOS, and SmolLM2 answers some of these after some
# contexts with EOS at once); the first that does is used for every pass at that context.
DECODE_PROMPTS = (
    "Explain the code above in detail, line by line.",
    "Continue the code.",
    "Write a long, detailed explanation of what this code does.",
    "Go on.",
)
NEVER = "\x00"  # a stop string no reply contains
SHAPE_VOCAB = 4096  # llama8b-shape's tokenizer (a small one trained on the standard library)
PATHS = ("cold", "warm (locate)", "warm (stream)", "hot")
# Each worker is its own process, and two processes doing the same work can differ by a few
# percent; the stream worker's own hot turn separates its restore path from its process.
TURNS = (*PATHS, "hot (stream worker)")
RAW_TARGET = 1.3  # warm (locate) within this factor of raw read + one decode step
MLX_TARGET = 1.2  # warm (locate) within this factor of mlx-lm's load + one decode step
LLAMA_8B_SHAPE = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
# Shkolnikov, "Agent Memory Below the Prompt" (2026), Apple M4 Pro: TTFT ms (cold, warm) by
# context. Gemma 3 12B and DeepSeek-Coder-V2-Lite from Table 3; Llama 3.1 8B from Table 5
# (its agent-memory Cold and Warm columns; Table 3 gives no Llama TTFTs).
PAPER = {
    "Gemma": {
        1024: (3964, 475),
        2048: (7119, 495),
        4096: (15736, 577),
        8192: (35009, 626),
        16384: (74219, 795),
        32768: (172096, 1819),
    },
    "DeepSeek": {
        1024: (1043, 234),
        2048: (1737, 246),
        4096: (3970, 271),
        8192: (8296, 338),
        16384: (19396, 434),
        32768: (47315, 633),
    },
    "Llama": {
        1024: (2500, 260),
        2048: (4530, 274),
        4096: (10235, 290),
        8192: (21536, 331),
        16384: (47629, 431),
    },
}
# In-process steps, in the order the breakdown table lists them.
STEPS = {
    "get_agent": "GetAgent RPC (manifest)",
    "locate": "LocateBlocks RPC",
    "read": "file read (preadv into a preallocated buffer)",
    "xxh3": "xxh3 checksums of every segment",
    "release": "ReleaseLease RPC",
    "read_blocks_local": "read_blocks_local (all four above, fresh buffer)",
    "get_blocks": "GetBlocks stream (what the stream path reads instead)",
    "caches_from_blocks": "caches_from_blocks (MLX arrays, eval)",
    "first_forward": "first forward after restore (the turn's k tokens; grows the cache)",
    "forward": "forward of k tokens on a grown cache",
    "decode": "one decode step (1 token, in-memory cache)",
    "mlx_lm_load": "mlx-lm load_prompt_cache (+ eval)",
    "mlx_lm": "mlx-lm load_prompt_cache + one decode step",
    "raw_decode": "raw read + one decode step",
}
_T0 = time.perf_counter()


def say(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


# results


@dataclass(slots=True)
class Sample:
    server_ms: float  # usage.time_to_first_token_ms
    client_ms: float  # the client's wall time from sending the Turn to the first token
    usage: dict[str, Any]


@dataclass(slots=True)
class ContextRun:
    nominal: int  # tokens asked for in the cold turn's user message
    turns: dict[str, list[Sample]] = field(default_factory=lambda: {p: [] for p in TURNS})
    decode: list[Sample] = field(default_factory=list)  # hot turns of --decode-tokens
    decode_prompt: str = ""  # what they asked (DECODE_PROMPTS)
    inproc: dict[str, list[float]] = field(default_factory=dict)  # ms, by STEPS key
    agent: str = ""  # the locate-path agent whose blocks the in-process rows read
    context_tokens: int = 0  # tokens in that agent's stored cache
    notes: list[str] = field(default_factory=list)

    def median(self, name: str) -> float | None:
        values = [s.server_ms for s in self.turns[name]] if name in TURNS else self.inproc[name]
        return statistics.median(values) if values else None

    def decode_tps(self) -> list[float]:
        return [s.usage["decode_tokens_per_second"] for s in self.decode]

    def as_dict(self) -> dict[str, Any]:
        series = {p: [s.server_ms for s in self.turns[p]] for p in TURNS} | self.inproc
        return {
            "nominal_tokens": self.nominal,
            "context_tokens": self.context_tokens,
            "agent": self.agent,
            "summary_ms": {k: spread(v) for k, v in series.items() if v},
            "decode_tokens_per_second": spread(self.decode_tps()) if self.decode else None,
            "turns": {p: [vars_of(s) for s in self.turns[p]] for p in TURNS},
            "decode": [vars_of(s) for s in self.decode],
            "decode_prompt": self.decode_prompt,
            "inproc_ms": self.inproc,
            "notes": self.notes,
        }


@dataclass(slots=True)
class ModelRun:
    name: str
    path: str
    info: dict[str, Any] = field(default_factory=dict)
    contexts: list[ContextRun] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def vars_of(sample: Sample) -> dict[str, Any]:
    return {"server_ms": sample.server_ms, "client_ms": sample.client_ms, "usage": sample.usage}


# models


def build_llama8b_shape(root: Path, layers: int, max_context: int) -> Path:
    """Random float32 weights with Llama-3.1-8B layer shapes, `layers` deep, saved to root,
    with a 4096-token vocabulary (a real one's 128K-row embedding would dwarf two layers)."""
    tokenizer = model_kit.tiny_tokenizer(SHAPE_VOCAB)
    config = {
        **LLAMA_8B_SHAPE,
        "num_hidden_layers": layers,
        "max_position_embeddings": max(16384, 2 * max_context),
        "vocab_size": tokenizer.get_vocab_size(),
    }
    model = model_kit.random_model(config)
    return model_kit.save_model(root / "llama8b-shape", model, config, tokenizer)


def context_text(tokenizer, num_tokens: int) -> str:
    """Standard-library source trimmed to num_tokens tokens, as text."""
    ids: list[int] = []
    for text in model_kit.read_texts(model_kit.stdlib_files()):
        ids += tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) >= num_tokens:
            break
    return tokenizer.decode(ids[:num_tokens])


# the processes


@dataclass(slots=True)
class Services:
    store: StoreClient
    locate: WorkerClient  # a worker with --restore-path locate
    stream: WorkerClient  # a worker with --restore-path stream


@contextmanager
def running_services(model: Path, root: Path) -> Iterator[Services]:
    """A store and two workers as their own processes, SIGTERMed afterwards."""
    with ExitStack() as stack:

        def start(service: ServiceProcess) -> ServiceProcess:
            stack.callback(service.stop)
            return service.start(timeout=600)

        store = start(store_process(root / "data", root / "store.log"))
        args = ["--block-tokens", str(BLOCK_TOKENS), "--hot-budget", "8G"]
        workers = {
            path: start(
                worker_process(
                    str(model),
                    store.address,
                    root / f"worker-{path}.log",
                    extra_args=[*args, "--restore-path", path],
                )
            )
            for path in ("locate", "stream")
        }
        clients = [StoreClient(store.address), *(WorkerClient(w.address) for w in workers.values())]
        for client in clients:
            stack.callback(client.close)
        for client in clients[1:]:
            wait_ready(client)
        yield Services(*clients)


# turns


def timed_turn(worker: WorkerClient, agent: str, text: str, max_tokens: int = 1) -> Sample:
    """One Turn (greedy; by default max_tokens=1), timed by the worker and by this client."""
    start = time.perf_counter()
    first, usage = 0.0, None
    messages = [("user", text)]
    for response in worker.stream_turn(NS, agent, messages, max_tokens=max_tokens, stop=[NEVER]):
        if response.HasField("tokens"):
            first = first or time.perf_counter()
        else:
            usage = response.usage
    if usage is None or not first:
        raise RuntimeError(f"turn of {agent!r} ended without a token and a usage")
    fields = MessageToDict(
        usage, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return Sample(usage.time_to_first_token_ms, (first - start) * 1e3, fields)


def check(sample: Sample, path: str, agent: str, created: int = 1) -> Sample:
    """Aborts unless the turn ran as `path` says, with no restore failure. A cold turn's
    agent held `created` tokens after CreateAgent."""
    u, problems = sample.usage, []
    if u["restore_failure"]:
        problems.append(f"restore failed: {u['restore_failure']}")
    if path == "cold":
        # CreateAgent left only its conversation's stable prefix in RAM (the BOS token, or a
        # template's default system prompt), so the worker may call this turn "hot"; what
        # makes it cold is that everything after that prefix is prefilled.
        if u["cache_state"] not in ("cold", "hot") or u["reused_store_tokens"]:
            problems.append(f"cache_state {u['cache_state']!r}, store tokens reused")
        if u["prefilled_tokens"] < u["prompt_tokens"] - max(1, created):
            problems.append(f"only {u['prefilled_tokens']} of {u['prompt_tokens']} prefilled")
    elif u["cache_state"] != path.split()[0]:
        problems.append(f"cache_state {u['cache_state']!r}, expected {path.split()[0]!r}")
    if path.startswith("warm") and u["restore_path"] != path[6:-1]:
        problems.append(f"restore_path {u['restore_path']!r}")
    if problems:
        raise RuntimeError(f"{path} turn of {agent!r}: {'; '.join(problems)}; usage {u}")
    return sample


def warm_up(svc: Services, text: str) -> None:
    """Runs every path once untimed, so no measured turn pays a first forward or connect."""
    svc.store.stats()
    for path, worker in (("warm (locate)", svc.locate), ("warm (stream)", svc.stream)):
        agent = f"warm-up-{path[6:-1]}"
        worker.create_agent(NS, agent)
        timed_turn(worker, agent, text)
        worker.evict(NS, agent)
        check(timed_turn(worker, agent, SHORT), path, agent)
        worker.evict(NS, agent)


def cold_passes(first_s: float, passes: int, budget_s: float) -> int:
    """All passes prefill afresh if the extra ones fit in budget_s; else as many as fit (>= 1)."""
    if first_s * (passes - 1) <= budget_s:
        return passes
    return 1 + int(budget_s // first_s)


def run_context(
    svc: Services, text: str, nominal: int, args: argparse.Namespace, decode: int, note: str
) -> ContextRun:
    run, agent, passes = ContextRun(nominal), "", args.passes
    colds = passes
    if note:
        run.notes.append(note)
    for p in range(passes):
        before = {k: len(v) for k, v in run.turns.items()}
        if p < colds:
            agent = f"ctx{nominal}-p{p}"
            created = svc.locate.create_agent(NS, agent).num_tokens
            cold = check(timed_turn(svc.locate, agent, text), "cold", agent, created)
            run.turns["cold"].append(cold)
            if p == 0:
                first_s = run.turns["cold"][0].client_ms / 1e3
                colds = cold_passes(first_s, passes, args.cold_budget)
        one_pass(svc, run, agent, p)
        new = [f"{k} {v[-1].server_ms:.1f}" for k, v in run.turns.items() if len(v) > before[k]]
        say(f"  {label(nominal)} pass {p + 1}/{passes}: {', '.join(new)} ms")
    if colds < passes:
        run.notes.append(
            f"{label(nominal)} cold: {colds} of {passes} passes (one prefill took "
            f"{run.turns['cold'][0].server_ms / 1e3:.0f} s; --cold-budget "
            f"{args.cold_budget:.0f} s); later passes reuse the last agent, each pass adding "
            "its ~32 tokens of turns"
        )
    svc.locate.evict(NS, agent)  # durable, and what the in-process rows read
    run.agent = agent
    if decode:
        decode_passes(svc, run, agent, passes, decode)
    return run


def decode_turn(svc: Services, agent: str, fork: str, prompt: str, tokens: int) -> Sample:
    """A store fork of the (evicted) agent, restored on the locate worker by one untimed
    turn, then a hot turn of up to `tokens` tokens; the fork is deleted after."""
    svc.store.fork_agent(NS, agent, fork)
    check(timed_turn(svc.locate, fork, SHORT), "warm (locate)", fork)
    sample = check(timed_turn(svc.locate, fork, prompt, tokens), "hot", fork)
    svc.locate.delete(NS, fork)
    return sample


def decode_passes(svc: Services, run: ContextRun, agent: str, passes: int, tokens: int) -> None:
    """`passes` decode turns on forks of the agent (so the agent the in-process rows read
    keeps its length): the worker's decode rate at this context. The first pass picks the
    prompt (DECODE_PROMPTS, in order, until one's reply runs to tokens / 2)."""
    for i, prompt in enumerate(DECODE_PROMPTS):
        sample = decode_turn(svc, agent, f"{agent}-decode0-{i}", prompt, tokens)
        if sample.usage["generated_tokens"] >= max(2, tokens // 2):
            break
    run.decode_prompt = prompt
    run.decode.append(sample)
    if prompt != DECODE_PROMPTS[0]:
        run.notes.append(
            f"{label(run.nominal)} decode: asked {prompt!r} (the earlier prompts' greedy "
            f"replies ended sooner than {max(2, tokens // 2)} tokens)"
        )
    for p in range(1, passes):
        run.decode.append(decode_turn(svc, agent, f"{agent}-decode{p}", prompt, tokens))
    rates = ", ".join(f"{r:.1f}" for r in run.decode_tps())
    tokens_out = ", ".join(str(s.usage["generated_tokens"]) for s in run.decode)
    say(f"  {label(run.nominal)} decode: {rates} tokens/s ({tokens_out} tokens; {prompt!r})")


def one_pass(svc: Services, run: ContextRun, agent: str, p: int) -> None:
    """hot, evict, fork a twin for the stream worker, warm (locate), warm (stream), and
    the twin's hot turn on the stream worker."""
    svc.locate.wait_durable(NS, agent)
    run.turns["hot"].append(check(timed_turn(svc.locate, agent, SHORT), "hot", agent))
    svc.locate.evict(NS, agent)
    twin = f"{agent}-stream{p}"
    svc.store.fork_agent(NS, agent, twin)  # same tokens and blocks, never hot anywhere
    warm = timed_turn(svc.locate, agent, SHORT)
    run.turns["warm (locate)"].append(check(warm, "warm (locate)", agent))
    run.turns["warm (stream)"].append(
        check(timed_turn(svc.stream, twin, SHORT), "warm (stream)", twin)
    )
    svc.stream.wait_durable(NS, twin)
    own_hot = timed_turn(svc.stream, twin, SHORT)
    run.turns["hot (stream worker)"].append(check(own_hot, "hot (stream worker)", twin))
    svc.stream.evict(NS, twin)


# in this process: mlx-lm's cache files, the raw read, and the restore step by step


def repeat(fn: Callable[[], object], passes: int) -> list[float]:
    """fn() once untimed, then `passes` timed calls; milliseconds."""
    fn()
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def forward(model: Any, caches: list, tokens: list[int]) -> Any:
    """Logits of `tokens` after the cache, evaluated; the cache is trimmed back after."""
    import mlx.core as mx

    logits = model(mx.array([tokens]), cache=caches)
    mx.eval(logits)
    for cache in caches:
        cache.trim(len(tokens))
    return logits


def save_mlx_lm_cache(caches: list, path: Path) -> None:
    """The same Q4 bytes (fp16 scales and biases, as agentkv stores them) as mlx-lm
    QuantizedKVCache layers, written by mlx-lm's own save_prompt_cache."""
    from mlx_lm.models.cache import QuantizedKVCache, save_prompt_cache

    layers = []
    for cache in caches:
        layer = QuantizedKVCache(group_size=KV.group_size, bits=KV.k_bits)
        layer.keys, layer.values = cache.quantized(cache.offset)
        layer.offset = cache.offset
        layers.append(layer)
    save_prompt_cache(str(path), layers)


def load_mlx_lm_cache(path: Path, evaluate: bool = False) -> list:
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    cache = load_prompt_cache(str(path))
    if evaluate:
        mx.eval([a for layer in cache for a in (*layer.keys, *layer.values)])
    return cache


def rpc_steps(
    store: StoreClient, fp: str, agent: str, keys: list[bytes], passes: int
) -> dict[str, list[float]]:
    """The store calls of a locate restore, one by one, then read_blocks_local whole."""
    request = pb.LocateBlocksRequest(namespace=NS, fingerprint=fp, keys=keys)
    leases: list[str] = []
    return {
        "get_agent": repeat(lambda: store.get_agent(NS, agent, fingerprint=fp), passes),
        "locate": repeat(
            lambda: leases.append(store.call("LocateBlocks", request).lease_id), passes
        ),
        "release": repeat(
            lambda: store.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=leases.pop())),
            passes,
        ),
        "read_blocks_local": repeat(lambda: store.read_blocks_local(NS, fp, keys), passes),
        "get_blocks": repeat(lambda: list(store.get_blocks(NS, fp, keys)), passes),
    }


def mlx_steps(
    model: Any, blocks: list, tail: list[int], raw: RawReader, cache_file: Path, passes: int
) -> tuple[dict[str, list[float]], float]:
    """MLX steps of a restore, mlx-lm's load, raw read + decode; and how far mlx-lm's decode
    logits are from agentkv's on the same bytes (max |difference|)."""
    import mlx.core as mx

    from inference_worker.blocks import caches_from_blocks

    restored: list[list] = []
    steps = {
        "caches_from_blocks": repeat(
            lambda: restored.append(caches_from_blocks(blocks, len(model.layers), KV)), passes
        )
    }
    fresh = iter(restored)
    steps["first_forward"] = repeat(lambda: forward(model, next(fresh), tail), passes)
    grown = restored[-1]
    steps["forward"] = repeat(lambda: forward(model, grown, tail), passes)
    steps["decode"] = repeat(lambda: forward(model, grown, tail[-1:]), passes)
    steps["raw_decode"] = repeat(lambda: (raw.read(), forward(model, grown, tail[-1:])), passes)
    save_mlx_lm_cache(grown, cache_file)
    steps["mlx_lm_load"] = repeat(lambda: load_mlx_lm_cache(cache_file, evaluate=True), passes)
    steps["mlx_lm"] = repeat(
        lambda: forward(model, load_mlx_lm_cache(cache_file), tail[-1:]), passes
    )
    theirs = forward(model, load_mlx_lm_cache(cache_file), tail[-1:])
    ours = forward(model, grown, tail[-1:])
    return steps, mx.abs(theirs - ours).max().item()


def in_process(
    svc: Services, model: Any, fp: str, run: ContextRun, root: Path, passes: int
) -> None:
    """Fills run.inproc from the agent's stored blocks, measured in this process."""
    manifest = svc.store.get_agent(NS, run.agent, fingerprint=fp)
    keys = list(manifest.block_keys)
    run.context_tokens = sum(manifest.block_num_tokens)
    k = round(statistics.median(s.usage["prefilled_tokens"] for s in run.turns["warm (locate)"]))
    tail = list(manifest.token_ids[-k:])
    run.inproc |= rpc_steps(svc.store, fp, run.agent, keys, passes)
    request = pb.LocateBlocksRequest(namespace=NS, fingerprint=fp, keys=keys, lease_seconds=600)
    located = svc.store.call("LocateBlocks", request)
    try:
        raw = RawReader(located.blocks)
        run.inproc |= {"read": repeat(raw.read, passes), "xxh3": repeat(raw.verify, passes)}
        blocks = svc.store.read_blocks_local(NS, fp, keys)
        cache_file = root / f"mlx-lm-{run.nominal}.safetensors"
        steps, diff = mlx_steps(model, blocks, tail, raw, cache_file, passes)
    finally:
        svc.store.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=located.lease_id))
    run.inproc |= steps
    run.notes.append(
        f"{label(run.nominal)} in-process rows: {run.context_tokens} cached tokens, "
        f"{raw.num_bytes / 1e6:.1f} MB of blocks, k = {k} tokens; "
        f"mlx-lm vs agentkv decode logits: max |diff| {diff:.3g}"
    )


# a model, start to end


def model_path(name: str, args: argparse.Namespace, root: Path) -> Path:
    if name == "default":
        return model_dir(args.model)
    say(f"building the Llama-3.1-8B-shaped model ({args.layers} layers, float32)")
    return build_llama8b_shape(root, args.layers, max(args.contexts))


def model_info(info: Any, path: Path) -> dict[str, Any]:
    config = json.loads((path / "config.json").read_text())
    return MessageToDict(info, preserving_proto_field_name=True) | {
        "dtype": config.get("torch_dtype") or info.dtype,
        "layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "max_context": max_context(path),
        "weights_bytes": sum(p.stat().st_size for p in path.glob("*.safetensors")),
        "description": describe_model(path),
    }


def headroom(passes: int, decode_tokens: int) -> int:
    """Tokens the longest agent adds to a context's user text, at most: ~31 of chat template
    and the cold turn's token, ~32 a pass (a hot and a warm turn) if every pass reuses one
    agent, ~32 of its stream twin's, and a decode fork's restore turn, prompt and reply."""
    return 96 + 32 * passes + decode_tokens


def fit_contexts(contexts: Sequence[int], window: int, room: int) -> list[tuple[int, str]]:
    """(context, note) for each of `contexts` that fits the model's window with `room`
    tokens left for the turns; one that does not is cut to the window less `room` (or
    dropped, if that context is measured anyway), and its note says so."""
    most, fitted, seen = window - room, [], set()
    for n in contexts:
        note = ""
        if n > most:
            note = (
                f"{label(n)} asked, but the model's window is {window} tokens and the turns "
                f"need up to {room}: ran {most} tokens of user text (the table's 'tok' is the "
                "whole prompt)"
            )
            n = most
        if n in seen or n < 16:
            continue
        seen.add(n)
        fitted.append((n, note))
    return fitted


def run_model(name: str, args: argparse.Namespace, root: Path) -> ModelRun:
    from mlx_lm import load

    path = model_path(name, args, root)
    run = ModelRun(name, str(path))
    tokenizer = load_tokenizer(path)
    decode = args.decode_tokens if name == "default" else 0  # the real model's decode rate
    room = headroom(args.passes, decode)
    contexts = fit_contexts(args.contexts, max_context(path), room)
    if len(contexts) < len(args.contexts):
        run.notes.append(
            f"contexts {', '.join(map(label, args.contexts))} asked; only "
            f"{', '.join(label(n) for n, _ in contexts)} fit the model's "
            f"{max_context(path)}-token window less {room} for the turns"
        )
    with running_services(path, root / name) as svc:
        info = svc.locate.info()
        run.info = model_info(info, path)
        say(f"{name}: {run.info['description']}")
        say(f"{name}: workers up ({run.info['blas']}); warming up")
        warm_up(svc, context_text(tokenizer, 300))
        for n, note in contexts:
            text = context_text(tokenizer, n)
            run.contexts.append(run_context(svc, text, n, args, decode, note))
        if any(s.usage["cache_state"] == "hot" for c in run.contexts for s in c.turns["cold"]):
            kept = sorted(
                {s.usage["reused_hot_tokens"] for c in run.contexts for s in c.turns["cold"]}
            )
            run.notes.append(
                "the worker labels each cold turn 'hot' (usage.cache_state): CreateAgent left "
                f"only the chat template's stable prefix cached ({', '.join(map(str, kept))} "
                "tokens); every token after it was prefilled"
            )
        say(f"{name}: in-process rows (mlx-lm, raw read, breakdown)")
        model, _ = load(str(path))
        for ctx in run.contexts:
            in_process(svc, model, info.fingerprint, ctx, root / name, args.passes)
    return run


# reporting


def label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def paper_context(n: int) -> int | None:
    """The paper's context for ours: the same, or (a context cut to fit a model's window,
    such as 8000 for 8K) the next power of two within 5%."""
    known = {k for m in PAPER.values() for k in m}
    if n in known:
        return n
    above = [k for k in known if n < k <= n * 1.05]
    return min(above) if above else None


def paper_cell(n: int) -> str:
    k = paper_context(n)
    cells = [f"{m[0]} {PAPER[m][k][0] / PAPER[m][k][1]:.1f}x" for m in PAPER if k in PAPER[m]]
    if cells and k != n:
        cells[0] = f"({label(k)}) {cells[0]}"
    return ", ".join(cells) or "-"


def prompt_tokens(c: ContextRun) -> int:
    return int(c.turns["cold"][0].usage["prompt_tokens"])


def summary_table(run: ModelRun) -> str:
    lines = [
        "| context | cold ms | warm locate ms | warm stream ms | hot ms | mlx-lm load ms"
        " | raw read + decode ms | cold/warm ratio | paper cold/warm |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in run.contexts:
        keys = ("cold", "warm (locate)", "warm (stream)", "hot", "mlx_lm", "raw_decode")
        cold, warm = c.median("cold"), c.median("warm (locate)")
        lines.append(
            f"| {label(c.nominal)} ({prompt_tokens(c)} tok) | "
            + " | ".join(ms(c.median(k)) for k in keys)
            + f" | {cold / warm:.1f}x | {paper_cell(c.nominal)} |"
        )
    return "\n".join(lines)


def decode_table(run: ModelRun) -> str:
    lines = [
        "| context | passes | tokens generated | decode tok/s median | min | max | ms/token"
        " | prompt |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in run.contexts:
        if not c.decode:
            continue
        rates = spread(c.decode_tps())
        tokens = statistics.median(s.usage["generated_tokens"] for s in c.decode)
        lines.append(
            f"| {label(c.nominal)} ({prompt_tokens(c)} tok) | {len(c.decode)} | {tokens:.0f} | "
            f"{rates['median']:.1f} | {rates['min']:.1f} | {rates['max']:.1f} | "
            f"{ms(1e3 / rates['median'] if rates['median'] else None)} | {c.decode_prompt} |"
        )
    return "\n".join(lines)


def detail_table(run: ModelRun) -> str:
    lines = [
        "| context | path | passes | min ms | median ms | max ms | client wall median ms |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for c in run.contexts:
        for name in (*TURNS, "mlx_lm", "raw_decode"):
            values = [s.server_ms for s in c.turns[name]] if name in TURNS else c.inproc[name]
            wall = [s.client_ms for s in c.turns[name]] if name in TURNS else []
            s = spread(values)
            lines.append(
                f"| {label(c.nominal)} | {STEPS.get(name, name)} | {len(values)} | {s['min']:.1f}"
                f" | {s['median']:.1f} | {s['max']:.1f}"
                f" | {ms(statistics.median(wall) if wall else None)} |"
            )
    return "\n".join(lines)


def breakdown_rows(c: ContextRun) -> dict[str, float | None]:
    """Median ms of every in-process step, and what restoring costs the worker over RAM."""
    rows: dict[str, float | None] = {STEPS[k]: c.median(k) for k in STEPS}
    parts = ("get_agent", "read_blocks_local", "caches_from_blocks")
    warm, hot = c.median("warm (locate)") or 0.0, c.median("hot") or 0.0
    wall = statistics.median(s.client_ms for s in c.turns["warm (locate)"])
    rows["restore, in-process: GetAgent + read_blocks_local + caches_from_blocks"] = sum(
        c.median(k) or 0.0 for k in parts
    )
    rows["worker: warm (locate) TTFT"] = warm
    rows["worker: warm (locate) minus hot TTFT (restoring, over RAM)"] = warm - hot
    stream, stream_hot = c.median("warm (stream)") or 0.0, c.median("hot (stream worker)") or 0.0
    rows["worker: warm (stream) minus warm (locate) TTFT"] = stream - warm
    rows["stream worker: warm (stream) minus its own hot TTFT"] = stream - stream_hot
    rows["client wall minus server TTFT (gRPC, streaming)"] = wall - warm
    return rows


def breakdown_table(run: ModelRun) -> str:
    heads = [f"{label(c.nominal)} ms" for c in run.contexts]
    lines = ["| warm (locate) step | " + " | ".join(heads) + " |"]
    lines.append("|---|" + "---:|" * len(heads))
    columns = [breakdown_rows(c) for c in run.contexts]
    for row in columns[0]:
        lines.append(f"| {row} | " + " | ".join(ms(col[row]) for col in columns) + " |")
    return "\n".join(lines)


def judge(
    run: ModelRun, c: ContextRun, base: float | None, factor: float | None, what: str
) -> dict[str, Any]:
    """warm (locate) against `base` ms at one context; met is None for a reference line."""
    warm, base = c.median("warm (locate)") or 0.0, base or float("nan")
    ratio = warm / base
    out = {
        "model": run.name,
        "context": c.nominal,
        "target": f"warm (locate) within {factor}x of {what}" if factor else f"warm vs {what}",
        "measured": f"{ratio:.2f}x ({warm:.1f} vs {base:.1f} ms)",
        "met": None if factor is None else ratio <= factor,
    }
    if factor and not out["met"]:
        out["missed_by"] = (
            f"{ratio / factor:.2f}x the bound: {warm - factor * base:.1f} ms over "
            f"{factor * base:.1f} ms"
        )
    return out


# Table 3 of the paper (TTFT ms, cold / warm, median of 6): the best cold/warm ratio it
# reports at each context (Gemma 3 12B; DeepSeek's are lower).
PAPER_TABLE3 = {
    1024: (3964, 475),
    2048: (7119, 495),
    4096: (15736, 577),
    8192: (35009, 626),
    16384: (74219, 795),
    32768: (172096, 1819),
}


def paper_ratio(run: ModelRun, c: ContextRun) -> dict[str, Any] | None:
    """Our cold/warm against the paper's Table 3 at the same context (8000 against 8K)."""
    k = paper_context(c.nominal)
    if k not in PAPER_TABLE3:
        return None
    cold, warm = c.median("cold"), c.median("warm (locate)")
    paper_cold, paper_warm = PAPER_TABLE3[k]
    ours, theirs = (cold or 0.0) / (warm or float("nan")), paper_cold / paper_warm
    return {
        "model": run.name,
        "context": c.nominal,
        "target": "cold/warm TTFT at least the paper's (Table 3, Gemma 3"
        + (f", {label(k)})" if k != c.nominal else ")"),
        "measured": f"{ours:.1f}x ({cold:.1f} / {warm:.1f} ms) vs the paper's {theirs:.1f}x "
        f"({paper_cold} / {paper_warm} ms)",
        "met": ours >= theirs,
    }


def targets(run: ModelRun) -> list[dict[str, Any]]:
    """The two targets at each context, judged on medians, a like-for-like reference, and
    the paper's ratio."""
    goals = []
    for c in run.contexts:
        if (paper := paper_ratio(run, c)) is not None:
            goals.append(paper)
        like = (c.median("read") or 0.0) + (c.median("forward") or 0.0)
        goals += [
            judge(run, c, c.median("raw_decode"), RAW_TARGET, STEPS["raw_decode"]),
            judge(run, c, c.median("mlx_lm"), MLX_TARGET, STEPS["mlx_lm"]),
            judge(run, c, like, None, "raw read + forward of the turn's k tokens (not a target)"),
        ]
    return goals


def print_model(run: ModelRun) -> None:
    info = run.info
    print(f"## {run.name}: {run.path}")
    if not run.contexts:
        print("\n".join(run.notes))
        return
    print(info["description"])
    print(
        f"{info['layers']} layers, hidden {info['hidden_size']}, {info['dtype']}, "
        f"{info['weights_bytes'] / 1e6:.0f} MB of weights, KV {info['kv_format']}, "
        f"block {info['block_tokens']} tokens, device {info['device']}, BLAS {info['blas']}"
    )
    sections = [("TTFT, median ms", summary_table(run))]
    if any(c.decode for c in run.contexts):
        sections.append(
            ("decode on a hot agent (usage.decode_tokens_per_second)", decode_table(run))
        )
    sections += [
        ("every series: min / median / max", detail_table(run)),
        ("where warm (locate) time goes (in-process medians)", breakdown_table(run)),
    ]
    for title, text in sections:
        print(f"\n### {title}\n\n{text}")
    print()
    for goal in targets(run):
        extra = f"; missed by {goal['missed_by']}" if "missed_by" in goal else ""
        status = {True: "PASS", False: "MISS", None: "INFO"}[goal["met"]]
        print(
            f"{status}  {run.name} {label(goal['context'])}: {goal['target']}: "
            f"{goal['measured']}{extra}"
        )
    for note in [n for c in run.contexts for n in c.notes] + run.notes:
        print(f"note: {note}")
    print()


def machine(runs: list[ModelRun]) -> dict[str, object]:
    import mlx.core as mx
    from mlx_lm import __version__ as mlx_lm_version

    try:
        with open("/proc/cpuinfo", errors="replace") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    blas = next((r.info["blas"] for r in runs if r.info), "")
    return {
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": names[0] if names else platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "load_average_1m": round(os.getloadavg()[0], 2),  # other work skews a 2-core box
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm_version,
        "blas": blas,  # as the worker's GetWorkerInfo reports it
    }


def plot(runs: list[ModelRun], header: dict[str, object], path: Path) -> str:
    """Median TTFT against context, one panel per model, min..max whiskers; says what it did."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: chart skipped (pip install matplotlib)"
    runs = [r for r in runs if r.contexts]
    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4.8), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        xs = [c.nominal for c in run.contexts]
        for name in (*PATHS, "mlx_lm", "raw_decode"):
            series = [
                [s.server_ms for s in c.turns[name]] if name in PATHS else c.inproc[name]
                for c in run.contexts
            ]
            mid = [statistics.median(v) for v in series]
            err = [
                [m - min(v) for m, v in zip(mid, series, strict=True)],
                [max(v) - m for m, v in zip(mid, series, strict=True)],
            ]
            ax.errorbar(xs, mid, yerr=err, marker="o", capsize=3, label=STEPS.get(name, name))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, [label(x) for x in xs])
        ax.set_xlabel("context, tokens")
        ax.set_ylabel("TTFT, ms (median; whiskers min..max)")
        ax.set_title(f"{run.name}: {run.info['layers']} layers, {run.info['dtype']}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"agentkv TTFT, {header['date']}; {header['cpu']}, {header['cores']} cores, "
        f"MLX {header['mlx']}, BLAS {header['blas']}",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def report(runs: list[ModelRun], args: argparse.Namespace, out: Path) -> None:
    header = machine(runs) | {
        "model": args.model,
        "passes": args.passes,
        "contexts": args.contexts,
        "decode_tokens": args.decode_tokens,
    }
    print(", ".join(f"{k}: {v}" for k, v in header.items()))
    print()
    for run in runs:
        print_model(run)
    print("TTFT is the worker's usage.time_to_first_token_ms, from the Turn's arrival. 'mlx-lm")
    print("load' is load_prompt_cache + one decode step (mlx-lm's in-process TTFT); it and raw")
    print("read + decode are measured in this process on the same stored Q4 bytes.")
    print("Paper cold/warm: Shkolnikov 2026 on an M4 Pro, G = Gemma 3 12B, D = DeepSeek-Coder-")
    print("V2-Lite (Table 3), L = Llama 3.1 8B (Table 5). The page cache is warm throughout.")
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"ttft-{datetime.now():%Y%m%d-%H%M%S}"
    document = {
        "header": header,
        "models": [
            {
                "name": r.name,
                "path": r.path,
                "info": r.info,
                "contexts": [c.as_dict() for c in r.contexts],
                "targets": targets(r),
                "notes": r.notes,
            }
            for r in runs
        ],
    }
    stem.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {stem.with_suffix('.json')}")
    print(plot(runs, header, stem.with_suffix(".png")))


# main


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas: {text!r}"
        ) from None
    if not values or min(values) < 16:
        raise argparse.ArgumentTypeError(f"expected contexts of at least 16 tokens: {text!r}")
    return values


def model_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = set(names) - set(MODELS)
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"models are {', '.join(MODELS)}; got {text!r}")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_argument(p)
    p.add_argument("--models", type=model_list, default=list(MODELS), help="default means --model")
    p.add_argument(
        "--contexts",
        type=int_list,
        default=[1024, 2048, 4096, 8192],
        help="tokens; one too long for a model's window is cut to fit it (SmolLM2: 8K to 7968)",
    )
    p.add_argument("--passes", type=int, default=3)
    p.add_argument(
        "--decode-tokens",
        type=int,
        default=32,
        help="max_tokens of each decode turn (0: no decode rows)",
    )
    p.add_argument("--layers", type=int, default=2, help="layers of the llama8b-shape model")
    p.add_argument(
        "--cold-budget",
        type=float,
        default=90.0,
        help="seconds per context for cold passes after the first (fewer passes if slower)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: contexts 512,1024, 1 pass")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.passes = [512, 1024], 1
    if args.passes < 1 or args.layers < 1 or args.decode_tokens < 0:
        p.error("--passes and --layers must be at least 1, --decode-tokens at least 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_optimized_blas()  # before anything here imports mlx; each worker loads its own
    root = Path(tempfile.mkdtemp(prefix="agentkv-ttft-"))
    runs = []
    try:
        for name in args.models:
            say(f"model {name}")
            runs.append(run_model(name, args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(runs, args, args.out)


if __name__ == "__main__":
    main()
