"""Agents through OpenAI's API: N agents take turns round-robin, each call resending its
whole history, on agentkv's gateway, mlx-lm's server and llama.cpp's server (llama-cpp-python),
the same model and the same RAM for KV caches, then one more round after every server restarts.

    python benchmarks/gateway.py [--agents 8,16] [--context 4096] [--step 384] [--kv-ram 96M]

Each agent has its own persona and reads its own part of a document, `--step` tokens a turn,
answering in `--reply` tokens, until its context passes `--context`. Per call: time to the
first content token (TTFT) as the client sees it, and the prompt tokens the server says it
had cached. The peers keep what fits their prompt caches (`--prompt-cache-bytes`, llama.cpp's
`--cache_size`) and re-prefill the rest; agentkv keeps its hot tier in the same bytes and
restores the rest from the store. The gateway's own cost: the same hot turns through the
gateway and through the SDK, alternated, `--overhead-calls` pairs.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import harness as h
from peers import gguf_file

SYSTEMS = ("agentkv", "mlx-lm", "llama.cpp")
# mlx-lm's server with the optimized BLAS the worker loads (without it MLX's CPU matmul is
# 10-17x slower here): a fair peer.
WITH_BLAS = (
    "import runpy, sys; from inference_worker.blas import load_optimized_blas; "
    "load_optimized_blas(); sys.argv = ['mlx_lm.server', *sys.argv[1:]]; "
    "runpy.run_module('mlx_lm.server', run_name='__main__')"
)
MODEL_ID = "agentkv-bench"
PERSONAS = (
    "a careful analyst",
    "a skeptical reviewer",
    "a patient teacher",
    "a terse engineer",
    "a curious student",
    "a product manager",
    "a security auditor",
    "a historian",
)
LLAMA_FLAGS = "--n_threads 2 --n_threads_batch 2 --flash_attn True --cache True --verbose False"


@dataclass
class Call:
    system: str
    agent: int
    round: int
    phase: str  # "run", or "restart": the round after every server restarted
    ttft_ms: float
    prompt_tokens: int | None
    cached_tokens: int | None

    @property
    def prefilled(self) -> int | None:
        if self.prompt_tokens is None or self.cached_tokens is None:
            return None
        return self.prompt_tokens - self.cached_tokens


@dataclass
class Server:
    """One system's OpenAI endpoint: started, stopped and started again by `restart`."""

    name: str
    start: Callable[[], str]  # returns the base URL
    stop: Callable[[], None]
    model: str
    url: str = ""

    def restart(self) -> None:
        self.stop()
        self.url = self.start()


@dataclass
class Conversation:
    persona: str
    slices: list[str]
    messages: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        system = f"You are {self.persona}. Read each part of the document and answer briefly."
        self.messages = [{"role": "system", "content": system}]


def http_process(command: list[str], log: Path, url: str, ready_path: str) -> subprocess.Popen:
    """Starts a server process and waits until `url + ready_path` answers 200."""
    import urllib.request

    from agentkv import tether

    tied = tether.command(os.getpid(), signal.SIGKILL, ["--exec", *command])  # dies with us
    proc = subprocess.Popen(tied, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{log.stem} exited {proc.returncode}: see {log}")
        try:
            with urllib.request.urlopen(url + ready_path, timeout=5) as answer:
                if answer.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{log.stem} did not answer within 600 s")


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_server(name: str, args: argparse.Namespace, root: Path, kv_ram: int) -> Server:
    port, held = free_port(), {}
    url = f"http://127.0.0.1:{port}"
    if name == "mlx-lm":
        command = [
            sys.executable,
            "-c",
            WITH_BLAS,
            "--model",
            str(args.path),
            "--port",
            str(port),
            "--prompt-cache-bytes",
            str(kv_ram),
            "--prompt-cache-size",
            "1000",
        ]
        model = "default_model"
    else:
        command = [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(args.gguf),
            "--port",
            str(port),
            "--n_ctx",
            str(args.n_ctx),
            "--cache_size",
            str(kv_ram),
            *LLAMA_FLAGS.split(),
        ]
        model = args.gguf.name

    def start() -> str:
        held["proc"] = http_process(command, root / f"{name}.log", url, "/v1/models")
        return url + "/v1"

    return Server(name, start, lambda: stop_process(held["proc"]), model)


def agentkv_server(svc: Any, args: argparse.Namespace, root: Path, worker_args: list) -> Server:
    from agentkv.launch import gateway_process

    held = {}

    def start() -> str:
        if not svc.processes["agentkv"].running:
            svc.start_worker("agentkv", args.path, worker_args)
        flags = ["--model-name", MODEL_ID]
        gateway = gateway_process(
            [svc.addresses["agentkv"]], root / "gateway.log", svc.store_address, extra_args=flags
        )
        gateway.tied = True
        held["gateway"] = gateway.start(timeout=120)
        return f"http://{held['gateway'].address}/v1"

    def stop() -> None:
        held["gateway"].stop()
        svc.workers["agentkv"].close()
        svc.processes["agentkv"].stop()  # SIGTERM: a deploy's restart, writes finished

    return Server("agentkv", start, stop, MODEL_ID)


def one_call(client: Any, model: str, messages: list[dict], reply: int) -> tuple[float, str, Any]:
    """Streams one call: (ms to the first content token, the reply's text, the usage)."""
    started, first, pieces, usage = time.perf_counter(), None, [], None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        stream=True,
        temperature=0,
        max_tokens=reply,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            pieces.append(chunk.choices[0].delta.content)
        usage = getattr(chunk, "usage", None) or usage
    first = first or time.perf_counter()
    return (first - started) * 1e3, "".join(pieces), usage


def one_round(server: Server, client: Any, conversations: list, r: int, phase: str, reply: int):
    """Round r: every conversation's next part, one call each; its Calls."""
    calls = []
    for i, conv in enumerate(conversations):
        text = conv.slices[r % len(conv.slices)]
        conv.messages.append({"role": "user", "content": f"Part {r + 1}:\n{text}"})
        ttft, answer, usage = one_call(client, server.model, conv.messages, reply)
        conv.messages.append({"role": "assistant", "content": answer or "."})
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        cached = getattr(details, "cached_tokens", None) if details else None
        prompt = usage.prompt_tokens if usage else None
        calls.append(Call(server.name, i, r, phase, ttft, prompt, cached))
    ms = h.fmt(h.median([c.ttft_ms for c in calls]), 0)
    h.say(f"{server.name}: round {r + 1} ({phase}), median TTFT {ms} ms")
    return calls


def run_system(server: Server, conversations: list, args: argparse.Namespace, rounds: int) -> list:
    """Every round on the server, then one more after it restarts."""
    import openai

    calls = []
    server.url = server.start()
    try:
        for phase, span in (("run", range(rounds)), ("restart", range(rounds, rounds + 1))):
            if phase == "restart":
                h.say(f"{server.name}: restarting")
                server.restart()
            client = openai.OpenAI(
                base_url=server.url, api_key="bench", max_retries=0, timeout=3600
            )
            for r in span:
                calls += one_round(server, client, conversations, r, phase, args.reply)
    finally:
        server.stop()
    return calls


def via_gateway(connection: Any, history: list[dict]) -> tuple[float, str]:
    """One call through the gateway by plain HTTP (no client library's own cost): (seconds to
    the first event, which the gateway sends once the first token is in; the reply)."""
    import json

    body = {
        "model": MODEL_ID,
        "messages": history,
        "stream": True,
        "temperature": 0,
        "max_tokens": 1,
    }
    headers = {"Content-Type": "application/json", "X-Agent-Id": "via-gateway"}
    started, first, text = time.perf_counter(), None, ""
    connection.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    for line in connection.getresponse():
        first = first or time.perf_counter()
        if line.startswith(b"data: {"):
            choices = json.loads(line[6:]).get("choices") or [{}]
            text += choices[0].get("delta", {}).get("content") or ""
    return (first or time.perf_counter()) - started, text


def via_sdk(agent: Any, history: list[dict]) -> tuple[float, str]:
    """One call through the SDK: (seconds until `say` returns, once the first token is in)."""
    pairs = [(m["role"], m["content"]) for m in history]
    ms, reply = h.timed(lambda: agent.say(pairs, max_tokens=1, whole_conversation=True))
    return ms / 1e3, reply.text


def gateway_overhead(svc: Any, gateway_url: str, path_calls: int) -> dict[str, float]:
    """Hot turns through the gateway and through the SDK (until `say` returns: once the first
    token is in), alternated on twin agents: the same conversation, the same worker. Each call
    appends one short message and asks for one token."""
    import http.client
    from urllib.parse import urlsplit

    from agentkv.client.memory import AgentMemory

    where = urlsplit(gateway_url)
    memory = AgentMemory(svc.addresses["agentkv"], namespace="default")
    system = {"role": "system", "content": "You are a terse assistant."}
    histories = {"via-gateway": [system], "via-sdk": [system]}
    memory.agent("via-sdk", system=system["content"])
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=600)
    ms: dict[str, list[float]] = {name: [] for name in histories}
    for n in range(path_calls + 2):  # the first two make and warm the agents
        order = list(histories.items())  # alternately first: drift cancels out
        for name, history in order if n % 2 else order[::-1]:
            history.append({"role": "user", "content": f"Say the number {n}."})
            if name == "via-gateway":
                elapsed, text = via_gateway(connection, history)
            else:
                elapsed, text = via_sdk(memory.agent(name), history)
            ms[name] += [elapsed * 1e3] if n >= 2 else []
            history.append({"role": "assistant", "content": text or "."})
    connection.close()
    memory.close()
    through, direct = ms["via-gateway"], ms["via-sdk"]
    diffs = [g - s for g, s in zip(through, direct, strict=True)]
    return {
        "gateway_ms": h.median(through),
        "sdk_ms": h.median(direct),
        "overhead_ms": h.median(diffs),
        "overhead_p90_ms": h.percentile(diffs, 90),
    }


def has_llama_server() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) for m in ("llama_cpp", "fastapi", "sse_starlette"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    quick = {"agents": "4", "context": 1024, "step": 256, "overhead_calls": 10}
    p = h.parser(__doc__, quick=quick)
    p.add_argument("--agents", default="8,16", help="agent counts, comma-separated")
    p.add_argument("--context", type=int, default=4096, help="tokens each context grows to")
    p.add_argument("--step", type=int, default=384, help="document tokens each turn adds")
    p.add_argument("--reply", type=int, default=16, help="tokens each reply has at most")
    p.add_argument("--kv-ram", default="96M", help="RAM for KV caches, every system the same")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--overhead-calls", type=int, default=40)
    args = p.parse_args(argv)
    args.agents = [int(a) for a in args.agents.split(",")]
    args.systems = [s for s in args.systems.split(",") if s]
    return args


def in_phase(calls: list[Call], system: str, phase: str) -> list[Call]:
    """A system's calls in a phase, a run's first round left out (it makes every agent: cold
    everywhere)."""
    return [
        c
        for c in calls
        if c.system == system and c.phase == phase and (phase == "restart" or c.round > 0)
    ]


def phase_median(calls: list[Call], system: str, phase: str) -> float | None:
    return h.median([c.ttft_ms for c in in_phase(calls, system, phase)])


def summary(calls: list[Call], agents: int) -> list[list[str]]:
    rows = []
    for system in dict.fromkeys(c.system for c in calls):
        for phase in ("run", "restart"):
            mine = in_phase(calls, system, phase)
            ttft = [c.ttft_ms for c in mine]
            prefilled = [c.prefilled for c in mine if c.prefilled is not None]
            tokens = h.fmt(h.median(prefilled), 0) if prefilled else "n/a"
            rows.append(
                [
                    str(agents),
                    system,
                    phase,
                    h.fmt(h.median(ttft), 0),
                    h.fmt(h.percentile(ttft, 90), 0),
                    tokens,
                    str(len(mine)),
                ]
            )
    return rows


def measure_agentkv(svc: Any, args: Any, root: Path, conversations: list, overhead: dict) -> list:
    """agentkv's rounds; the gateway's own cost too, the first time."""
    worker_args = ["--hot-budget", str(args.kv_ram_bytes)]
    server = agentkv_server(svc, args, root, worker_args)
    calls = run_system(server, conversations, args, args.rounds)
    if not overhead:
        url = server.start()
        try:
            overhead |= gateway_overhead(svc, url, args.overhead_calls)
        finally:  # the gateway is not one of svc's processes
            server.stop()
    return calls


def measure(args: Any, tokenizer: Any, root: Path) -> tuple[list, list, dict]:
    """(table rows, (agents, Call) of every call, the gateway's overhead)."""
    rows, all_calls, overhead, rounds = [], [], {}, args.rounds
    for agents in args.agents:
        slices = h.source_slices(tokenizer, args.step, agents * rounds)
        for system in args.systems:
            conversations = [
                Conversation(
                    PERSONAS[i % len(PERSONAS)] + f" (agent {i})",
                    slices[i * rounds : (i + 1) * rounds],
                )
                for i in range(agents)
            ]
            h.say(f"{system}: {agents} agents, {rounds} rounds")
            if system == "agentkv":
                workers = {"agentkv": ["--hot-budget", str(args.kv_ram_bytes)]}
                with h.services(root / f"agentkv-{agents}", args.path, workers) as svc:
                    calls = measure_agentkv(svc, args, root, conversations, overhead)
            else:
                server = peer_server(system, args, root, args.kv_ram_bytes)
                calls = run_system(server, conversations, args, rounds)
            all_calls += [(agents, c) for c in calls]
            rows += summary(calls, agents)
    return rows, all_calls, overhead


def main(argv: list[str] | None = None) -> None:
    import importlib.util
    import tempfile

    args = parse_args(argv)
    if importlib.util.find_spec("openai") is None:  # every system's client: before any starts
        sys.exit("benchmarks/gateway.py needs the openai package: pip install -e '.[bench]'")
    tokenizer = h.open_model(args)
    from agentkv.units import parse_bytes

    args.gguf = gguf_file(args.model, args.path)
    if "llama.cpp" in args.systems and (args.gguf is None or not has_llama_server()):
        h.say(
            "llama.cpp left out: it needs a GGUF model and pip install 'llama-cpp-python[server]'"
        )
        args.systems.remove("llama.cpp")
    args.n_ctx = args.context + 2 * args.step + 256
    args.kv_ram_bytes = parse_bytes(args.kv_ram)
    args.rounds = max(1, args.context // (args.step + args.reply + 16))
    with tempfile.TemporaryDirectory(prefix="agentkv-gateway-bench-") as tmp:
        measured = measure(args, tokenizer, Path(tmp))
    write(args, *measured)


def targets(args: Any, all_calls: list, overhead: dict) -> list[dict]:
    goals = []
    for agents in args.agents:
        mine = [c for a, c in all_calls if a == agents]
        med = partial(phase_median, mine)
        ours, peers = med("agentkv", "run"), [med(s, "run") for s in args.systems if s != "agentkv"]
        if ours and (best := min((p for p in peers if p), default=None)):
            what = f"{agents} agents: agentkv's median TTFT 3x lower than the best peer's"
            measured = f"{h.fmt(ours, 0)} ms against {h.fmt(best, 0)} ms ({h.ratio(best, ours)})"
            goals.append(h.goal(what, measured, best / ours >= 3))
        after = med("agentkv", "restart")
        last = max((c.round for c in mine if c.phase == "run"), default=0)
        before = h.median([c.ttft_ms for c in mine if c.system == "agentkv" and c.round == last])
        if before and after:  # the round after the restart against the one before it
            what = (
                f"{agents} agents: agentkv unchanged across a restart "
                "(within 1.5x of the round before it)"
            )
            goals.append(h.goal(what, h.versus(after, before), after <= 1.5 * before))
    if overhead:
        o = {k: h.fmt(v, 2 if k.startswith("overhead") else 1) for k, v in overhead.items()}
        measured = f"{o['overhead_ms']} ms (p90 {o['overhead_p90_ms']}; gateway "
        measured += f"{o['gateway_ms']} ms, SDK {o['sdk_ms']})"
        what = "gateway overhead over the SDK under 5 ms per call (median)"
        goals.append(h.goal(what, measured, overhead["overhead_ms"] < 5))
    return goals


HEADERS = [
    "agents",
    "system",
    "calls",
    "median TTFT ms",
    "p90 TTFT ms",
    "prefilled / call (median)",
    "n",
]


def write(args: Any, rows: list, all_calls: list, overhead: dict) -> None:
    header = h.machine(
        model=str(args.model),
        kv_ram=args.kv_ram,
        context=args.context,
        step=args.step,
        reply=args.reply,
        rounds=args.rounds,
    )
    notes = [
        "calls: run = every round after the first (which makes every agent, cold everywhere); "
        "restart = the round after every server (agentkv: worker and gateway) restarted",
        "prefilled / call: prompt tokens less the cached tokens the server reported "
        "(n/a: it reports none)",
        f"KV RAM {args.kv_ram} for every system: agentkv --hot-budget, mlx-lm "
        "--prompt-cache-bytes, llama.cpp --cache_size",
    ]
    document = {"calls": [dict(agents=a, **vars(c)) for a, c in all_calls], "overhead": overhead}
    sections = [("Agents through OpenAI's API", h.table(HEADERS, rows))]
    goals = targets(args, all_calls, overhead)
    h.report("gateway", args.out, header, sections, goals, notes, document)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
