"""Peers on the same model and text: agentkv against llama.cpp and mlx-lm.

Per context (1K-8K) and repeat, every system in turn (interleaved): cold TTFT, hot TTFT (a
~15-token turn on the cache in RAM), warm TTFT after a restart (the cache read from disk by a
fresh process), KV bytes on disk per agent and decode tok/s; then SysTPS at 1/2/4/8 agents at
the smallest context. llama.cpp is llama-cpp-python from the optional extra agentkv[peers]
(without it, or without a GGUF file for --model, its rows are skipped with a note).
benchmarks/README.md explains the method. --quick: 1K, one repeat, batches 1 and 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness as h
from harness import fmt as ms
from paper import TTFT

from agentkv import tether
from inference_worker.blas import load_optimized_blas

NS = "peers"
SHORT = "Go on."
LONG = "Explain the code above in detail, line by line."  # decode turns: a long greedy reply
PHASES = ("cold", "hot", "warm")
WORKER_ARGS = ["--block-tokens", "256", "--hot-budget", "16G", "--restore-path", "locate"]
HEADROOM = 160  # tokens of the window a context leaves for its turn and the decode
PREFILL_STEP = 512  # every system prefills in chunks of this many tokens, as agentkv's worker
SELF = Path(__file__).resolve()
QUIET: dict[str, Any] = {}  # llama.cpp's log callback, kept alive while llama.cpp may call it


@dataclass(slots=True)
class Run:
    """One context's measurements, every system's series by name."""

    nominal: int
    text: str
    context_ids: list[int] = field(default_factory=list)  # the cold prompt (chat template)
    turn_ids: list[int] = field(default_factory=list)  # what the hot turn prefills
    ms: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # system: phase: ms
    decode: dict[str, list[float]] = field(default_factory=dict)  # system: tok/s
    num_bytes: dict[str, int] = field(default_factory=dict)  # KV on disk, by system
    tokens: dict[str, list[int]] = field(default_factory=dict)  # greedy first tokens
    raw_ms: list[float] = field(default_factory=list)  # raw read + arrays of agentkv's blocks

    def add(self, system: str, phase: str, value: float, token: int | None = None) -> None:
        self.ms.setdefault(system, {}).setdefault(phase, []).append(value)
        if token is not None:
            self.tokens.setdefault(f"{system} {phase}", []).append(token)

    def median(self, system: str, phase: str) -> float | None:
        values = self.ms.get(system, {}).get(phase)
        return statistics.median(values) if values else None


# the systems: each has cold, hot, save, restart (a fresh process), decode and systps


class LlamaCpp:
    """llama.cpp through llama-cpp-python's C API: one context, sequences decoded in batches
    of up to PREFILL_STEP tokens, greedy from the last logits of each sequence."""

    def __init__(self, gguf: Path, kv: str, n_ctx: int, n_seq: int = 1) -> None:
        import llama_cpp as L

        self.L = L
        L.llama_log_set(QUIET.setdefault("log", L.llama_log_callback(lambda *a: None)), None)
        L.llama_backend_init()
        model_params = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(str(gguf).encode(), model_params)
        params = L.llama_context_default_params()
        params.n_ctx, params.n_seq_max, params.kv_unified = n_ctx * n_seq, n_seq, True
        params.n_batch = params.n_ubatch = max(PREFILL_STEP, n_seq)
        params.type_k = params.type_v = {"f16": L.GGML_TYPE_F16, "q4_0": L.GGML_TYPE_Q4_0}[kv]
        params.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED  # quantized V needs it
        params.n_threads = params.n_threads_batch = os.cpu_count() or 1
        self.ctx = L.llama_init_from_model(self.model, params)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(params.n_batch, 0, n_seq)
        self.pos = [0] * n_seq
        self.history: list[int] = []  # sequence 0's tokens, for its state file

    def step(self, feeds: dict[int, Sequence[int]]) -> dict[int, int]:
        """Decodes each sequence's tokens; the greedy next token of each."""
        import numpy as np

        L, out = self.L, {}
        pending = [(s, t) for s, ids in feeds.items() for t in ids]
        for start in range(0, len(pending), self.batch_size):
            chunk, rows = pending[start : start + self.batch_size], []
            for i, (seq, token) in enumerate(chunk):
                self.batch.token[i], self.batch.pos[i] = token, self.pos[seq]
                self.batch.seq_id[i][0], self.batch.n_seq_id[i] = seq, 1
                last = start + i + 1 == len(pending) or pending[start + i + 1][0] != seq
                self.batch.logits[i] = last
                rows += [(i, seq)] if last else []
                self.pos[seq] += 1
            self.batch.n_tokens = len(chunk)
            if L.llama_decode(self.ctx, self.batch):
                raise RuntimeError("llama_decode failed")
            for i, seq in rows:
                logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), (self.n_vocab,))
                out[seq] = int(np.argmax(logits))
        self.history += list(feeds.get(0, ()))
        return out

    @property
    def batch_size(self) -> int:
        return max(PREFILL_STEP, len(self.pos))

    def clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        self.pos, self.history = [0] * len(self.pos), []

    def save(self, path: Path) -> int:
        tokens = (self.L.llama_token * len(self.history))(*self.history)
        self.L.llama_state_seq_save_file(self.ctx, str(path).encode(), 0, tokens, len(tokens))
        return path.stat().st_size

    def load(self, path: Path, capacity: int) -> None:
        import ctypes

        tokens, count = (self.L.llama_token * capacity)(), ctypes.c_size_t(0)
        self.clear()
        if not self.L.llama_state_seq_load_file(
            self.ctx, str(path).encode(), 0, tokens, capacity, ctypes.byref(count)
        ):
            raise RuntimeError(f"llama_state_seq_load_file {path} failed")
        self.pos[0], self.history = count.value, list(tokens[: count.value])

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)

    def copy_to_all(self) -> None:
        memory = self.L.llama_get_memory(self.ctx)
        for seq in range(1, len(self.pos)):
            self.L.llama_memory_seq_cp(memory, 0, seq, -1, -1)
            self.pos[seq] = self.pos[0]


class LlamaPeer:
    def __init__(self, gguf: Path, kv: str, n_ctx: int) -> None:
        self.gguf, self.kv, self.n_ctx = gguf, kv, n_ctx
        self.llama = LlamaCpp(gguf, kv, n_ctx)
        self.last = 0

    def cold(self, run: Run) -> tuple[float, int]:
        self.llama.clear()
        return h.timed(lambda: self.llama.step({0: run.context_ids})[0])

    def hot(self, run: Run) -> tuple[float, int]:
        took, self.last = h.timed(lambda: self.llama.step({0: run.turn_ids})[0])
        return took, self.last

    def save(self, path: Path) -> int:
        return self.llama.save(path)

    def restart(self, path: Path, run: Run) -> dict:
        return child({"peer": "llama.cpp", "gguf": str(self.gguf), "kv": self.kv,
                      "n_ctx": self.n_ctx, "file": str(path), "ids": run.turn_ids,
                      "capacity": len(run.context_ids)})  # fmt: skip

    def decode(self, n: int) -> float:
        token, start = self.last, time.perf_counter()
        for _ in range(n):
            token = self.llama.step({0: [token]})[0]
        return n / (time.perf_counter() - start)

    def systps(self, batch: int, run: Run, n: int) -> float:
        llama = LlamaCpp(self.gguf, self.kv, len(run.context_ids) + len(run.turn_ids) + n, batch)
        llama.step({0: run.context_ids})
        llama.copy_to_all()
        start = time.perf_counter()
        tokens = llama.step({s: run.turn_ids for s in range(batch)})
        for _ in range(n - 1):
            tokens = llama.step({s: [t] for s, t in tokens.items()})
        took = time.perf_counter() - start
        llama.close()
        return batch * n / took


def mlx_first_token(model: Any, cache: list, ids: Sequence[int], bits: int | None) -> int:
    """Prefills ids in chunks as mlx-lm's generate_step does (quantizing the cache after
    each chunk when bits is set); the greedy next token, with the cache evaluated."""
    import mlx.core as mx
    from mlx_lm.generate import maybe_quantize_kv_cache

    for start in range(0, len(ids), PREFILL_STEP):
        logits = model(mx.array([ids[start : start + PREFILL_STEP]]), cache=cache)
        maybe_quantize_kv_cache(cache, 0, 64, bits)
        mx.eval([c.state for c in cache])
    token = mx.argmax(logits[0, -1])
    mx.eval(token, [c.state for c in cache])
    return token.item()


class MlxLmPeer:
    """mlx-lm in this process: its KVCache (fp) or QuantizedKVCache (4-bit, group 64), its
    save_prompt_cache / load_prompt_cache files, generate_step and BatchGenerator."""

    def __init__(self, model: Any, path: Path, bits: int | None) -> None:
        self.model, self.path, self.bits = model, path, bits
        self.cache: list = []
        self.last = 0

    def cold(self, run: Run) -> tuple[float, int]:
        from mlx_lm.models.cache import make_prompt_cache

        self.cache = make_prompt_cache(self.model)
        return h.timed(lambda: mlx_first_token(self.model, self.cache, run.context_ids, self.bits))

    def hot(self, run: Run) -> tuple[float, int]:
        took, self.last = h.timed(
            lambda: mlx_first_token(self.model, self.cache, run.turn_ids, self.bits)
        )
        return took, self.last

    def save(self, path: Path) -> int:
        from mlx_lm.models.cache import save_prompt_cache

        save_prompt_cache(str(path), self.cache)
        return path.stat().st_size

    def restart(self, path: Path, run: Run) -> dict:
        return child({"peer": "mlx-lm", "model": str(self.path), "file": str(path),
                      "ids": run.turn_ids})  # fmt: skip

    def decode(self, n: int) -> float:
        """mlx-lm's own generate_step from the hot cache: tok/s after the first token."""
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        steps = generate_step(mx.array([self.last]), self.model, prompt_cache=self.cache,
                              max_tokens=n + 1, kv_bits=self.bits)  # fmt: skip
        next(steps)
        start = time.perf_counter()
        for _ in steps:
            pass
        return n / (time.perf_counter() - start)

    def systps(self, batch: int, run: Run, n: int, file: Path) -> float:
        """BatchGenerator with fp caches: each row continues the saved context."""
        from mlx_lm.generate import BatchGenerator
        from mlx_lm.models.cache import load_prompt_cache

        gen = BatchGenerator(self.model, max_tokens=n, completion_batch_size=batch,
                             prefill_batch_size=batch, prefill_step_size=PREFILL_STEP)  # fmt: skip
        caches = [load_prompt_cache(str(file)) for _ in range(batch)]
        start, made, done = time.perf_counter(), 0, 0
        gen.insert([run.turn_ids] * batch, [n] * batch, caches=caches)
        while done < batch:
            for response in gen.next_generated():
                made += 1
                done += response.finish_reason is not None
        took = time.perf_counter() - start
        gen.close()
        return made / took


class AgentkvPeer:
    """agentkv's store and a worker process: agents by turn text; the first pass takes the
    token ids every other system gets, from the store's manifest."""

    def __init__(self, svc: Any, name: str, model: Path, args: Sequence[str]) -> None:
        self.svc, self.name, self.model, self.args = svc, name, model, list(args)
        self.agent = self.twin = ""
        self.twins: dict[int, str] = {}  # by context: a stored fork of its cold context
        self.count = 0

    @property
    def worker(self) -> Any:
        return self.svc.workers[self.name]

    def cold(self, run: Run) -> tuple[float, int]:
        self.count += 1
        self.agent = f"{self.name.replace(' ', '-')}-{run.nominal}-{self.count}"
        self.twin = self.twins[run.nominal] = f"{self.agent}-twin"
        created = self.worker.create_agent(NS, self.agent).num_tokens
        turn = h.check(h.timed_turn(self.worker, NS, self.agent, [("user", run.text)]), "cold",
                     self.agent, created)  # fmt: skip
        self.worker.wait_durable(NS, self.agent)
        self.svc.store.fork_agent(NS, self.agent, self.twin)  # the same context, for warm
        if not run.context_ids:
            run.context_ids = list(self.manifest(self.agent).token_ids)[:-1]
        return turn.server_ms, self.manifest(self.agent).token_ids[-1]

    def manifest(self, agent: str) -> Any:
        return self.svc.store.get_agent(NS, agent, fingerprint=self.svc.info[self.name].fingerprint)

    def hot(self, run: Run) -> tuple[float, int]:
        turn = h.check(
            h.timed_turn(self.worker, NS, self.agent, [("user", SHORT)]), "hot", self.agent
        )
        self.worker.wait_durable(NS, self.agent)
        ids = list(self.manifest(self.agent).token_ids)
        if not run.turn_ids:
            run.turn_ids = ids[len(run.context_ids) : -1]
        return turn.server_ms, ids[-1]

    def save(self, path: Path) -> int:
        sizes = {b.key: b.num_bytes for b in self.svc.store.list_blocks(NS)}
        return sum(sizes[key] for key in self.manifest(self.twin).block_keys)

    def restart(self, path: Path, run: Run) -> dict:
        self.svc.restart_worker(self.name, self.model, self.args)
        turn = h.timed_turn(self.worker, NS, self.twin, [("user", SHORT)])
        h.check(turn, "warm (locate)", self.twin)
        self.worker.wait_durable(NS, self.twin)
        return {"ttft_ms": turn.server_ms, "token": self.manifest(self.twin).token_ids[-1]}

    def decode(self, n: int) -> float:
        """The worker's usage.decode_tokens_per_second (0 when the reply ended at EOS at once:
        no rate, left out of the medians; the peers' loops run past EOS)."""
        turn = h.timed_turn(self.worker, NS, self.agent, [("user", LONG)], max_tokens=n + 1)
        self.worker.wait_durable(NS, self.agent)
        return turn.usage["decode_tokens_per_second"]

    def raw_read(self) -> float:
        """A raw read of the twin's located block bytes into one buffer, then an MLX array
        over them: what a restore cannot beat."""
        import mlx.core as mx
        import numpy as np

        fp = self.svc.info[self.name].fingerprint
        keys = list(self.manifest(self.twin).block_keys)
        with h.located(self.svc.store, NS, fp, keys, 60) as raw:

            def read() -> None:
                raw.read()
                mx.eval(mx.array(np.frombuffer(raw.buffer, dtype=np.uint8)))

            return min(h.timed(read)[0] for _ in range(3))

    def systps(self, batch: int, run: Run, n: int) -> float:
        """`batch` hot forks of the context, sent at once; generated tokens per second."""
        agents = [f"{self.agent}-b{batch}-{i}" for i in range(batch)]
        for agent in agents:  # of this context's fork (not of the last context measured)
            self.svc.store.fork_agent(NS, self.twins[run.nominal], agent)
            h.timed_turn(self.worker, NS, agent, [("user", "Hello.")])  # restored, now hot
        made: list[int] = []

        def one(agent: str) -> None:
            turn = h.timed_turn(self.worker, NS, agent, [("user", LONG)], max_tokens=n)
            made.append(turn.usage["generated_tokens"])

        threads = [threading.Thread(target=one, args=(a,)) for a in agents]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.perf_counter() - start
        for agent in agents:
            self.worker.delete(NS, agent)
        return sum(made) / took


# restarts: a fresh process of this script, which loads the model, then times the restore


def child(spec: dict) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    command = tether.command(os.getpid(), signal.SIGKILL, [str(SELF), "--child", f.name])
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)  # dies with us
    finally:
        os.unlink(f.name)
    if done.returncode:
        raise RuntimeError(f"restart child exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_child(path: Path) -> None:
    """--child: loads the peer's model, then times its cache file's load and the turn."""
    spec = json.loads(path.read_text())
    if spec["peer"] == "llama.cpp":
        llama = LlamaCpp(Path(spec["gguf"]), spec["kv"], spec["n_ctx"])

        def turn() -> int:
            llama.load(Path(spec["file"]), spec["capacity"])
            return llama.step({0: spec["ids"]})[0]
    else:
        from mlx_lm import load
        from mlx_lm.models.cache import load_prompt_cache

        model, _ = load(spec["model"])

        def turn() -> int:
            return mlx_first_token(model, load_prompt_cache(spec["file"]), spec["ids"], None)

    took, token = h.timed(turn)
    print(json.dumps({"ttft_ms": took, "token": token}))


# one pass of every system at one context, then the batches


def one_pass(system: str, peer: Any, run: Run, root: Path, decode: int) -> None:
    took, token = peer.cold(run)
    run.add(system, "cold", took, token)
    file = root / f"{system.replace(' ', '-')}-{run.nominal}.safetensors"
    run.num_bytes[system] = peer.save(file)
    took, token = peer.hot(run)
    run.add(system, "hot", took, token)
    run.decode.setdefault(system, []).append(peer.decode(decode))
    out = peer.restart(file, run)
    run.add(system, "warm", out["ttft_ms"], out["token"])
    if system == "agentkv":
        run.raw_ms.append(peer.raw_read())
    h.say(f"  {h.label(run.nominal)} {system}: " + " / ".join(
        f"{run.ms[system][p][-1]:.0f}" for p in PHASES) + " ms (cold/hot/warm), "
        f"{run.decode[system][-1]:.1f} tok/s")  # fmt: skip


def make_peers(
    args: Any, path: Path, gguf: Path | None, model: Any, svc: Any, n_ctx: int
) -> tuple[dict, list[str]]:
    """The systems this run can measure, by name, and notes on those it cannot."""
    peers: dict[str, Any] = {"agentkv": AgentkvPeer(svc, "agentkv", path, WORKER_ARGS)}
    notes = []
    if gguf and args.w4_max:
        w4 = AgentkvPeer(svc, "agentkv w4", gguf, [*WORKER_ARGS, "--gguf-weights", "native"])
        svc.start_worker(w4.name, gguf, w4.args)
        peers[w4.name] = w4
    if importlib.util.find_spec("llama_cpp") is None:
        notes.append("llama.cpp skipped: pip install -e '.[peers]' (builds llama.cpp)")
    elif gguf is None:
        notes.append(f"llama.cpp skipped: --model {args.model} is not a GGUF file")
    else:
        peers |= {f"llama.cpp {kv}": LlamaPeer(gguf, kv, n_ctx) for kv in ("f16", "q4_0")}
    peers["mlx-lm"] = MlxLmPeer(model, path, None)
    peers["mlx-lm q4"] = MlxLmPeer(model, path, 4)
    return peers, notes


def gguf_file(spec: str, path: Path) -> Path | None:
    """The GGUF file behind --model: given, shipped, or the one the model directory was
    imported from (agentkv bench passes the directory), when it is a shipped one."""
    from inference_worker.models import SHIPPED, shipped_file

    if spec.endswith(".gguf"):
        return Path(spec).resolve()
    if spec in SHIPPED:
        return shipped_file(spec)
    config = json.loads((path / "config.json").read_text())
    imported = (config.get("agentkv_gguf") or {}).get("file")
    named = [name for name, shipped in SHIPPED.items() if shipped.file == imported]
    return shipped_file(named[0]) if named else None


def weights(systems: Sequence[str], path: Path, gguf: Path | None) -> dict[str, str]:
    """Each system's weight format, as its rows say it."""
    config = json.loads((path / "config.json").read_text())
    imported = (config.get("agentkv_gguf") or {}).get("weights") or config.get("torch_dtype")
    own = f"{gguf.stem.rsplit('.', 1)[-1]} (the GGUF's own)" if gguf else ""
    mlx = f"{imported} (imported from the GGUF)" if gguf else str(imported)
    return {s: own if s.startswith("llama.cpp") or s == "agentkv w4" else mlx for s in systems}


def run_all(args: Any, tokenizer: Any, root: Path) -> tuple[list[Run], dict, dict, list[str]]:
    from mlx_lm import load

    path, (model, _) = args.path, load(str(args.path))
    gguf = gguf_file(args.model, path)
    window = h.max_context(path)
    runs, batches = [], {}
    with h.services(root, path, {"agentkv": WORKER_ARGS}) as svc:
        details = h.model_info(svc.info["agentkv"], path)
        peers, notes = make_peers(args, path, gguf, model, svc, window)
        details["weights"] = weights(list(peers), path, gguf)
        warm_up(peers, tokenizer, root)
        for n, note in h.fit_contexts(args.contexts, window, HEADROOM):
            h.say(f"context {h.label(n)}")
            run = Run(n, h.context_text(tokenizer, n))
            notes += [note] if note else []
            for _ in range(args.passes):
                for system, peer in peers.items():
                    if n <= {"agentkv w4": args.w4_max, "mlx-lm q4": args.q4_max}.get(system, n):
                        one_pass(system, peer, run, root, args.decode)
            runs.append(run)
        batches = measure_batches(peers, runs[0], root, args)
    return runs, batches, details, notes


def warm_up(peers: dict, tokenizer: Any, root: Path) -> None:
    """One untimed short pass of every system (its first forward, the restart children)."""
    h.say("warming up")
    run = Run(256, h.context_text(tokenizer, 256))
    for system, peer in peers.items():
        one_pass(system, peer, run, root, 2)


def measure_batches(peers: dict, run: Run, root: Path, args: Any) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    file = root / f"mlx-lm-{run.nominal}.safetensors"  # the fp cache the last mlx-lm pass saved
    for batch in args.batches:
        for system, peer in peers.items():
            if system in ("agentkv w4", "mlx-lm q4", "llama.cpp q4_0"):
                continue  # one row per engine: its fastest KV
            extra = (file,) if system == "mlx-lm" else ()
            out.setdefault(system, {})[batch] = peer.systps(batch, run, args.decode, *extra)
            h.say(f"  SysTPS({batch}) {system}: {out[system][batch]:.1f} tok/s")
    return out


# reporting


def main_table(runs: list[Run], details: dict) -> str:
    heads = ["context", "system", "weights", "cold ms", "hot ms", "warm ms (restart)",
             "decode tok/s", "KV bytes on disk", "cold/warm"]  # fmt: skip
    rows = []
    for r in runs:
        for s in r.ms:
            cold, warm = r.median(s, "cold"), r.median(s, "warm")
            rows.append(
                [
                    f"{h.label(r.nominal)} ({len(r.context_ids)} tok)",
                    s,
                    details["weights"][s],
                    *(cell(r.ms[s].get(p)) for p in PHASES),
                    ms(rate(r.decode[s])),
                    f"{r.num_bytes[s]:,}",
                    h.ratio(cold, warm, "{:.1f}x"),
                ]
            )
    return h.table(heads, rows, "llllllrrr")


def rate(values: list[float]) -> float | None:
    """The median decode rate, of the turns that had one (0: the reply ended at once)."""
    had = [v for v in values if v > 0]
    return statistics.median(had) if had else None


def cell(values: list[float] | None) -> str:
    """median (min-max) when there are several."""
    if not values:
        return "--"
    if len(values) == 1:
        return ms(values[0], 0)
    s = h.spread(values)
    return f"{s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f})"


def batch_table(batches: dict[str, dict[int, float]]) -> str:
    sizes = sorted({b for per in batches.values() for b in per})
    heads = ["system", *(f"SysTPS({b})" for b in sizes), "SysTPS(max)/SysTPS(1)"]
    rows = [
        [s, *(f"{per.get(b, 0):.1f}" for b in sizes), h.ratio(per.get(sizes[-1]), per.get(1))]
        for s, per in batches.items()
    ]
    return h.table(heads, rows, "l" + "r" * (len(sizes) + 1))


def targets(runs: list[Run], batches: dict) -> list[dict[str, Any]]:
    goals = []
    for r in runs:
        at, warm = h.label(r.nominal), r.median("agentkv", "warm")
        for kv, bound in (("f16", 1.0), ("q4_0", 0.5)):
            peer = r.median(f"llama.cpp {kv}", "warm")
            if peer:
                what = f"{at}: agentkv warm TTFT <= {bound}x llama.cpp's restore from file"
                measured, met = h.versus(warm, peer), warm <= bound * peer
                goals.append(h.goal(f"{what} ({kv} KV)", measured, met))
        if "llama.cpp q4_0" in r.num_bytes:
            ours, theirs = r.num_bytes["agentkv"], r.num_bytes["llama.cpp q4_0"]
            goals.append(h.goal(f"{at}: agentkv KV bytes <= llama.cpp q4_0 state file",
                              f"{ours:,} / {theirs:,} B", ours <= theirs))  # fmt: skip
        hot, mlx = r.median("agentkv", "hot"), r.median("mlx-lm", "hot")
        what = f"{at}: agentkv hot TTFT within 1.1x of mlx-lm's (fp KV)"
        goals.append(h.goal(what, h.versus(hot, mlx), hot <= 1.1 * mlx))
        ours, theirs = (rate(r.decode[s]) or 0.0 for s in ("agentkv", "mlx-lm"))
        what = f"{at}: agentkv decode within 1.1x of mlx-lm's generate_step (fp KV)"
        goals.append(h.goal(what, f"{ours:.1f} / {theirs:.1f} tok/s", ours * 1.1 >= theirs))
        overhead, raw = warm - r.median("agentkv", "hot"), min(r.raw_ms)
        what = (
            f"{at}: restore overhead (warm - hot) within 1.3x of a raw read of the blocks "
            "+ an array over them"
        )
        measured = h.versus(overhead, raw, digits=1)
        goals.append(h.goal(what, measured, overhead <= 1.3 * raw))
        goals.append(paper_goal(r))
    if 4 in (b := batches.get("agentkv", {})):
        measured = h.versus(b[4], b[1], unit="", digits=1)
        goals.append(h.goal("agentkv SysTPS(4) >= 2.5x SysTPS(1)", measured, b[4] >= 2.5 * b[1]))
    return goals


def paper_goal(r: Run) -> dict[str, Any]:
    """agentkv's cold/warm against the paper's Llama 3.1 8B (Table 5), the others beside."""
    cold, warm = r.median("agentkv", "cold"), r.median("agentkv", "warm")
    near = [n for t in TTFT.values() for n in t if r.nominal <= n <= r.nominal * 1.05]
    at = min(near, default=r.nominal)  # a context cut to fit the window: the paper's 8K
    papers = {m: t[at][0] / t[at][1] for m, t in TTFT.items() if at in t}
    beside = ", ".join(f"{m} {x:.1f}x" for m, x in papers.items()) or "no paper row"
    return h.goal(f"{h.label(r.nominal)}: agentkv cold/warm at least the paper's (Llama)",
                f"{cold / warm:.1f}x ({cold:.0f} / {warm:.0f} ms); paper {beside}",
                cold / warm >= papers["Llama"] if "Llama" in papers else None)  # fmt: skip


def first_tokens(runs: list[Run]) -> list[str]:
    """Greedy first tokens per phase where systems agree, else each one's."""
    out = []
    for r in (r for r in runs if r.tokens):
        for phase in PHASES:
            seen = {k: sorted(set(v)) for k, v in r.tokens.items() if k.endswith(phase)}
            same = len({tuple(v) for v in seen.values()}) == 1
            out.append(f"{h.label(r.nominal)} {phase} first tokens: "
                       + (f"{next(iter(seen.values()))} everywhere" if same else
                          ", ".join(f"{k} {v}" for k, v in seen.items())))  # fmt: skip
    return out


def write(runs: list[Run], batches: dict, details: dict, notes: list[str], args: Any) -> None:
    header = h.machine(blas=details.get("blas", ""), model=args.model)
    header |= {"load_average_1m": " / ".join(f"{x:.2f}" for x in os.getloadavg())}
    header |= {"passes": args.passes, "decode_tokens": args.decode}
    notes = notes + [f"weights: {', '.join(f'{s} {w}' for s, w in details['weights'].items())}"]
    sections = [("cold, hot and warm TTFT (median (min-max)), decode and bytes",
                 main_table(runs, details)),
                (f"SysTPS at {h.label(runs[0].nominal)} context, {header['decode_tokens']} tokens "
                 "per agent", batch_table(batches))]  # fmt: skip
    notes = notes + first_tokens(runs)
    contexts = [{"nominal": r.nominal, "context_tokens": len(r.context_ids), "ms": r.ms,
                 "turn_tokens": len(r.turn_ids), "decode": r.decode, "bytes": r.num_bytes,
                 "raw_ms": r.raw_ms} for r in runs]  # fmt: skip
    document = {"model": details, "batches": batches, "contexts": contexts}
    h.report("peers", args.out, header, sections, targets(runs, batches), notes, document)


def parse_args(argv: list[str] | None) -> Any:
    quick = {"contexts": [1024], "passes": 1, "batches": [1, 2], "decode": 8}
    p = h.parser(__doc__, contexts=(1024, 2048, 4096, 8192), passes=3, quick=quick)
    p.add_argument("--decode", type=int, default=32, help="tokens per decode and batch row")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    p.add_argument("--w4-max", type=int, default=1024,
                   help="largest context for agentkv with the GGUF's 4-bit weights (MLX's CPU "
                   "quantized matmul prefills ~27x slower; 0: skip it)")  # fmt: skip
    p.add_argument("--q4-max", type=int, default=2048,
                   help="largest context for mlx-lm's Q4 cache (its prefill attends over Q4 by "
                   "quantized matmul: 63 s at 2K here, growing as the square)")  # fmt: skip
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        load_optimized_blas()  # before anything here imports mlx
        return run_child(args.child)
    tokenizer = h.open_model(args)
    with tempfile.TemporaryDirectory(prefix="agentkv-peers-") as root:
        runs, batches, details, notes = run_all(args, tokenizer, Path(root))
    write(runs, batches, details, notes, args)


if __name__ == "__main__":
    main()
