"""What every benchmark section shares: its command line, the store and worker processes it
starts, timing and statistics, machine facts, and its report (Markdown tables, MET/MISS
lines, notes, JSON and a plot)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from common import add_model_argument, describe_model, load_tokenizer, max_context, model_dir

from agentkv.launch import ServiceProcess, store_process, worker_process

NEVER = "\x00"  # a stop string no reply contains: a turn runs to max_tokens (or EOS)
_T0 = time.perf_counter()


def say(message: str) -> None:
    """A progress line on stderr, stamped with seconds since the start."""
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


# the command line


def int_list(text: str) -> list[int]:
    """An argparse type: contexts, comma-separated integers of at least 16 (tokens)."""
    values = [int(v) for v in text.split(",") if v.strip().isdigit()]
    if len(values) != len([v for v in text.split(",") if v.strip()]) or min(values, default=0) < 16:
        raise argparse.ArgumentTypeError(f"expected contexts of at least 16 tokens: {text!r}")
    return values


def name_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names, each one of `choices`."""

    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        if not names or set(names) - set(choices):
            raise argparse.ArgumentTypeError(f"expected some of {', '.join(choices)}; got {text!r}")
        return names

    return parse


def parser(
    doc: str,
    *,
    model: bool = True,
    contexts: Sequence[int] = (),
    passes: int = 0,
    quick: str = "a smoke run",
) -> argparse.ArgumentParser:
    """--model (when the section runs one), --contexts and --passes (when given defaults),
    --quick and --out."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    if model:
        add_model_argument(p)
    if contexts:
        p.add_argument("--contexts", type=int_list, default=list(contexts), help="tokens")
    if passes:
        p.add_argument("--passes", type=int, default=passes)
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return p


# the processes


@dataclass
class Services:
    """A store and named workers, each its own process, stopped when the `services` block
    ends; a worker can be killed and started again against the same store."""

    root: Path
    stack: ExitStack
    store: Any = None  # StoreClient
    store_address: str = ""
    workers: dict[str, Any] = field(default_factory=dict)  # name: WorkerClient
    addresses: dict[str, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # name: GetWorkerInfoResponse
    processes: dict[str, ServiceProcess] = field(default_factory=dict)

    def start(self, service: ServiceProcess) -> ServiceProcess:
        self.stack.callback(service.stop)
        return service.start(timeout=600)

    def start_worker(self, name: str, model: Path | str, args: Sequence[str] = ()) -> Any:
        """A worker process serving `model` with these flags; its client once it answers."""
        from agentkv.client.worker import WorkerClient

        log = self.root / f"worker-{name}.log"
        process = self.start(worker_process(str(model), self.store_address, log, extra_args=args))
        client = WorkerClient(process.address)
        self.stack.callback(client.close)
        self.processes[name], self.addresses[name], self.workers[name] = (
            process,
            process.address,
            client,
        )
        self.info[name] = wait_ready(client)
        return client

    def restart_worker(self, name: str, model: Path | str, args: Sequence[str] = ()) -> float:
        """SIGKILLs the worker and starts a fresh one: ms from spawn until it answers."""
        self.workers[name].close()
        self.processes[name].kill9()
        start = time.perf_counter()
        self.start_worker(name, model, args)
        return (time.perf_counter() - start) * 1e3


@contextmanager
def services(
    root: Path | None,
    model: Path | str | None = None,
    workers: Mapping[str, Sequence[str]] | None = None,
    store_env: Mapping[str, str] | None = None,
) -> Iterator[Services]:
    """A store, then one worker of `model` per name in `workers` (name: its extra flags);
    their files under `root` (None: a temporary directory, removed at the end)."""
    from agentkv.client.store import StoreClient

    if threading.current_thread() is threading.main_thread():
        # SIGTERM (a killed benchmark) unwinds like an error, so the processes stop too.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with ExitStack() as stack:
        if root is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agentkv-bench-")))
        svc = Services(root, stack)
        env = dict(store_env) if store_env else None
        store = svc.start(store_process(root / "data", root / "store.log", env=env))
        svc.store_address, svc.store = store.address, StoreClient(store.address)
        stack.callback(svc.store.close)
        for name, args in (workers or {}).items():
            svc.start_worker(name, model, args)
        yield svc


def open_model(args: argparse.Namespace) -> Any:
    """Loads the optimized BLAS (before anything imports MLX), resolves --model as the
    workers will (args.path; args.described, one line), and returns its tokenizer."""
    from inference_worker.blas import load_optimized_blas

    load_optimized_blas()
    args.path = model_dir(args.model)
    args.described = describe_model(args.path)
    say(describe_model(args.path, args.model))
    return load_tokenizer(args.path)


def retry(fn: Callable[[], Any], timeout: float, pause: float) -> Any:
    """fn(), called again while it raises Unavailable, until `timeout` seconds have passed."""
    from agentkv.errors import Unavailable

    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except Unavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(pause)


def wait_ready(worker: Any, timeout: float = 120.0) -> Any:
    """The worker's GetWorkerInfo once it answers: on a busy 2-core machine the first connect
    can time out (UNAVAILABLE) though the worker logged "serving"."""
    return retry(worker.info, timeout, 0.5)


# turns


@dataclass(slots=True)
class Turn:
    server_ms: float  # usage.time_to_first_token_ms, from the request's arrival
    client_ms: float  # this client's wall time from sending the Turn to the first token
    text: str
    usage: dict[str, Any]


def usage_dict(usage: Any) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(
        usage, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def timed_turn(
    worker: Any, ns: str, agent: str, messages: list[tuple[str, str]], max_tokens: int = 1
) -> Turn:
    """One greedy Turn (by default of one token), timed by the worker and by this client."""
    start, first, text, usage = time.perf_counter(), 0.0, "", None
    for response in worker.stream_turn(ns, agent, messages, max_tokens=max_tokens, stop=[NEVER]):
        if response.HasField("tokens"):
            first = first or time.perf_counter()
            text += response.tokens.text
        else:
            usage = response.usage
    if usage is None or not first:
        raise RuntimeError(f"turn of {ns}/{agent} ended without a token and a usage")
    return Turn(usage.time_to_first_token_ms, (first - start) * 1e3, text, usage_dict(usage))


def check(turn: Turn, path: str, agent: str, created: int = 1) -> Turn:
    """Aborts unless the turn ran as `path` says: "cold", "hot", "warm", or "warm (locate)"
    and "warm (stream)" by that restore path; with no restore failure. A cold turn's agent
    held `created` tokens after CreateAgent."""
    u, problems = turn.usage, []
    state, _, how = path.partition(" (")
    if u["restore_failure"]:
        problems.append(f"restore failed: {u['restore_failure']}")
    if state == "cold":
        # CreateAgent left only its conversation's stable prefix in RAM (the BOS token, or a
        # template's default system prompt), so the worker may call this turn "hot"; what
        # makes it cold is that everything after that prefix is prefilled.
        if u["cache_state"] not in ("cold", "hot") or u["reused_store_tokens"]:
            problems.append(f"cache_state {u['cache_state']!r}, store tokens reused")
        if u["prefilled_tokens"] < u["prompt_tokens"] - max(1, created):
            problems.append(f"only {u['prefilled_tokens']} of {u['prompt_tokens']} prefilled")
    elif u["cache_state"] != state:
        problems.append(f"cache_state {u['cache_state']!r}, expected {state!r}")
    if state == "warm" and how and u["restore_path"] != how.rstrip(")"):
        problems.append(f"restore_path {u['restore_path']!r}")
    if problems:
        raise RuntimeError(f"{path} turn of {agent!r}: {'; '.join(problems)}; usage {u}")
    return turn


def source_slices(tokenizer: Any, num_tokens: int, count: int = 1) -> list[str]:
    """`count` different runs of num_tokens tokens of standard-library source, as text."""
    from tests import model_kit

    ids: list[int] = []
    for text in model_kit.read_texts(model_kit.stdlib_files()):
        ids += tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) >= num_tokens * count:
            break
    return [tokenizer.decode(ids[i * num_tokens : (i + 1) * num_tokens]) for i in range(count)]


def context_text(tokenizer: Any, num_tokens: int) -> str:
    return source_slices(tokenizer, num_tokens)[0]


def model_info(info: Any, path: Path) -> dict[str, Any]:
    config = json.loads((path / "config.json").read_text())
    return usage_dict(info) | {
        "dtype": config.get("torch_dtype") or info.dtype,
        "layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "max_context": max_context(path),
        "weights_bytes": sum(p.stat().st_size for p in path.glob("*.safetensors")),
        "description": describe_model(path),
    }


def fit_contexts(contexts: list[int], window: int, room: int) -> list[tuple[int, str]]:
    """(context, note) for each context that fits the model's window with `room` tokens left
    for the turns; one that does not is cut to the window less `room` (or dropped, if that
    context is measured anyway), and its note says so."""
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
        if n not in seen and n >= 16:
            seen.add(n)
            fitted.append((n, note))
    return fitted


# numbers


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(ms, fn())."""
    start = time.perf_counter()
    value = fn()
    return (time.perf_counter() - start) * 1e3, value


def repeat(fn: Callable[[], object], passes: int, warm_up: bool = True) -> list[float]:
    """ms of `passes` calls of fn, after one untimed call (unless not warm_up)."""
    if warm_up:
        fn()
    return [timed(fn)[0] for _ in range(passes)]


def fastest(fn: Callable[[], object], repeats: int) -> float:
    """ms of the fastest of `repeats` calls after one untimed call: what the operation costs
    without interference (on a shared 2-core VM a median drifts by 20% from run to run)."""
    return min(repeat(fn, repeats))


# text


def label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def ratio(a: float | None, b: float | None, form: str = "{:.2f}x") -> str:
    return "-" if a is None or not b else form.format(a / b)


def span(values: Sequence[float], digits: int = 1) -> str:
    """'min / median / max'."""
    s = spread(values)
    return " / ".join(f"{s[k]:.{digits}f}" for k in ("min", "median", "max"))


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str = "") -> str:
    """A Markdown table; `align` has an l or r a column (default: the first left, the rest
    right); a None cell prints as '-'."""
    align = align or "l" + "r" * (len(headers) - 1)
    marks = {"l": "---", "r": "---:"}
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(marks[a] for a in align) + "|"]
    for row in rows:
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in row) + " |")
    return "\n".join(lines)


def columns(
    items: Iterable[Any], spec: Mapping[str, Callable[[Any], object]], align: str = ""
) -> str:
    """A Markdown table of one row per item and one column per (header, its cell of an item)."""
    return table(list(spec), [[cell(item) for cell in spec.values()] for item in items], align)


# the machine


def machine(**extra: object) -> dict[str, object]:
    """What the numbers depend on, gathered without importing MLX, and `extra` facts."""
    from inference_worker.blas import find_openblas

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", errors="replace") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    blas = "Accelerate" if sys.platform == "darwin" else find_openblas() or "reference (none found)"
    facts = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "os": f"{platform.system()} {platform.release()}",
        "load_average_1m": round(os.getloadavg()[0], 2),  # other work skews a 2-core box
        "python": platform.python_version(),
        "blas": blas,
        "mlx": version("mlx"),
        "mlx-lm": version("mlx-lm"),
    }
    return facts | extra


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


# the report

_said_no_plots = []


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend; None, said once, where it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not _said_no_plots:
            print("plots skipped: install agentkv[bench]")
            _said_no_plots.append(True)
        return None
    return plt


def plot(path: Path, header: Mapping, title: str, draw: Callable, *data: Any, **figure) -> None:
    """draw(*data, axes) on one row of panels (figure: ncols, figsize), titled with the
    machine's facts and saved to path."""
    if (plt := pyplot()) is None:
        return
    ncols, size = figure.get("ncols", 1), figure.get("figsize", (6.5, 4.8))
    fig, axes = plt.subplots(1, ncols, figsize=size, squeeze=False)
    draw(*data, axes[0])
    facts = f"{header['cpu']}, {header['cores']} cores, MLX {header['mlx']}, BLAS {header['blas']}"
    fig.suptitle(f"agentkv {title}, {header['date']}; {facts}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def whiskers(ax: Any, xs: Sequence[float], series: Sequence[Sequence[float]], **style: Any) -> Any:
    """Medians against xs with min..max whiskers."""
    mid = [statistics.median(v) for v in series]
    low = [m - min(v) for m, v in zip(mid, series, strict=True)]
    high = [max(v) - m for m, v in zip(mid, series, strict=True)]
    return ax.errorbar(xs, mid, yerr=[low, high], marker="o", capsize=3, **style)


def context_axis(ax: Any, xs: Sequence[int], ylabel: str, log_y: bool = True) -> None:
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xticks(xs, [label(x) for x in xs])
    ax.set_xlabel("context, tokens")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)


def plain(value: Any) -> Any:
    """JSON for what json does not know: dataclasses as dicts, arrays as lists, the rest as text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value.tolist() if hasattr(value, "tolist") else str(value)  # numpy: lists


def goal(target: str, measured: str, met: bool | None, **extra: Any) -> dict[str, Any]:
    """A target for `report`: met True (MET), False (MISS) or None (INFO: a reference line)."""
    return {"target": target, "measured": measured, "met": met, **extra}


def verdict(goal: Mapping[str, Any]) -> str:
    """A target's line: MET, MISS, or INFO (a reference line, no target), then what."""
    status = {True: "MET ", False: "MISS", None: "INFO"}[goal["met"]]
    return f"{status}  {goal['target']}: {goal['measured']}"


def report(
    name: str,
    out: Path,
    header: Mapping[str, object],
    sections: Sequence[tuple[str, str]],
    goals: Sequence[Mapping[str, Any]] = (),
    notes: Sequence[str] = (),
    document: Mapping[str, Any] | None = None,
) -> Path:
    """Prints the header, every (title, Markdown table), the targets and notes; writes the
    JSON document (with header, targets and notes); returns the stem for a plot."""
    if header:
        print(", ".join(f"{k}: {v}" for k, v in header.items()))
    for title, text in sections:
        print(f"\n### {title}\n\n{text}")
    print()
    for goal in goals:
        print(verdict(goal))
    for note in notes:
        print(f"note: {note}")
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{name}-{datetime.now():%Y%m%d-%H%M%S}"
    whole = {"header": header, **(document or {}), "targets": list(goals), "notes": list(notes)}
    stem.with_suffix(".json").write_text(json.dumps(whole, indent=2, default=plain) + "\n")
    print(f"wrote {stem.with_suffix('.json')}")
    return stem.with_suffix(".png")
