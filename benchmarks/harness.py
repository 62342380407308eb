"""What every benchmark section shares: its command line, the model it runs (--model SPEC,
resolved as agentkv-worker resolves it), the store and worker processes it starts, a raw read
of located block bytes (this machine's limit), timing and statistics, machine facts, and its
report (Markdown tables, MET/MISS lines, notes, JSON and a plot)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
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
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

import xxhash

# the benchmarks build their model shapes with tests/model_kit.py, so the repo root goes on the path
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agentkv import defaults  # noqa: E402
from agentkv.launch import ServiceProcess, store_process, worker_process  # noqa: E402
from agentkv.v1 import store_pb2 as pb  # noqa: E402

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


class Parser(argparse.ArgumentParser):
    """argparse's parser, but with --quick the `quick` values replace what was parsed."""

    def __init__(self, quick: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.quick = quick

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, rest = super().parse_known_args(args, namespace)
        if parsed.quick:
            vars(parsed).update(self.quick)
        return parsed, rest


def parser(
    doc: str,
    *,
    model: bool = True,
    contexts: Sequence[int] = (),
    passes: int = 0,
    quick: Mapping[str, Any] | None = None,
    quick_help: str = "a smoke run",
) -> Parser:
    """--model (when the section runs one), --contexts and --passes (when given defaults),
    --quick (its settings, listed in its help) and --out; a SIGTERM or SIGHUP unwinds."""
    unwind_on_signals()  # from the start: a script makes temporary files before services
    quick = dict(quick or {})
    p = Parser(quick, description=doc.splitlines()[0])
    if model:
        text = (
            "a shipped model name, a .gguf file or an mlx-lm model directory, as "
            "agentkv-worker --model takes (default: %(default)s)"
        )
        p.add_argument("--model", metavar="SPEC", default=defaults.MODEL, help=text)
    if contexts:
        p.add_argument("--contexts", type=int_list, default=list(contexts), help="tokens")
    if passes:
        p.add_argument("--passes", type=int, default=passes)
    settings = ", ".join(f"{k.replace('_', ' ')} {shown(v)}" for k, v in quick.items())
    text = f"{quick_help}: {settings}" if settings else quick_help
    p.add_argument("--quick", action="store_true", help=text)
    p.add_argument(
        "--out", type=Path, default=Path("benchmarks/results"), help="directory for its results"
    )
    return p


def shown(value: Any) -> str:
    """A --quick setting as its help says it: a list comma-separated."""
    return ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


# the model every benchmark runs: --model SPEC, resolved as agentkv-worker resolves it


def usage_error(message: str) -> NoReturn:
    """Ends a benchmark given what it cannot use (a model, a text) as the CLI does: one
    line, "error: ...", exit 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def model_dir(spec: str | os.PathLike[str] | None = None) -> Path:
    """The local mlx-lm model directory for `--model SPEC` (None: the default model), as
    the worker resolves it: a shipped name or a .gguf file is imported once into the model
    cache (weights "auto": float32 on a CPU). Exits with one line if SPEC names nothing.
    Pass the returned path, not SPEC, to worker processes: they then load these exact files.
    The device is found without importing MLX (load_optimized_blas() must come first):
    Metal on macOS, else the CPU (unless MLX is already imported)."""
    from inference_worker.models import ModelError, resolve_model

    spec = str(spec) if spec is not None else defaults.MODEL
    if "mlx.core" in sys.modules:
        device = sys.modules["mlx.core"].default_device().type.name
    else:
        device = "gpu" if sys.platform == "darwin" else "cpu"
    try:
        return resolve_model(spec, "auto", device).resolve()
    except ModelError as exc:
        usage_error(f"--model {spec}: {exc}")


def load_tokenizer(path: Path):
    """The model directory's own tokenizer (a `tokenizers.Tokenizer`: .encode(text).ids,
    .decode(ids)), from its tokenizer.json; the same vocabulary mlx_lm.tokenizer_utils.load
    gives the worker."""
    from tokenizers import Tokenizer

    if not (path / "tokenizer.json").exists():
        usage_error(f"{path} has no tokenizer.json (the benchmarks need one)")
    return Tokenizer.from_file(str(path / "tokenizer.json"))


def open_model(args: argparse.Namespace) -> Any:
    """Loads the optimized BLAS (before anything imports MLX), resolves --model as the
    workers will (args.path; args.described, one line), and returns its tokenizer."""
    from inference_worker.blas import load_optimized_blas

    load_optimized_blas()
    args.path = model_dir(args.model)
    args.described = describe_model(args.path)
    say(describe_model(args.path, args.model))
    return load_tokenizer(args.path)


def parameter_count(path: Path) -> int:
    """Parameters in the directory's *.safetensors files, from their headers."""
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total


def describe_model(path: Path, spec: str | None = None) -> str:
    """One line for a report: which model ran, its shape and weights, and from where."""
    config = json.loads((path / "config.json").read_text())
    gguf = config.get("agentkv_gguf") or {}
    name = Path(gguf["file"]).stem if gguf.get("file") else path.name
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // max(1, heads or 1)
    weights = gguf.get("weights") or config.get("torch_dtype") or "?"
    source = f"GGUF imported as {weights}" if gguf else f"{weights} weights"
    given = f"--model {spec}: " if spec and spec != str(path) else ""
    return (
        f"{given}{name} ({parameter_count(path) / 1e6:.1f}M-parameter "
        f"{config.get('model_type', '?')}, {config.get('num_hidden_layers')} layers, hidden "
        f"{config.get('hidden_size')}, {heads} heads, {kv} KV heads of {head_dim}, max context "
        f"{config.get('max_position_embeddings')}; {source}) at {path}"
    )


def max_context(path: Path) -> int:
    """The model's context window, tokens (its config's max_position_embeddings)."""
    config = json.loads((path / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 1 << 17)


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
        """`service` started, and stopped at the end; killed with the script, when started
        by its main thread (a killed thread would take it along)."""
        service.tied = threading.current_thread() is threading.main_thread()
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
) -> Iterator[Services]:
    """A store, then one worker of `model` per name in `workers` (name: its extra flags);
    their files under `root` (None: a temporary directory, removed at the end)."""
    from agentkv.client.store import StoreClient

    with ExitStack() as stack:
        if root is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agentkv-bench-")))
        svc = Services(root, stack)
        store = svc.start(store_process(root / "data", root / "store.log"))
        svc.store_address, svc.store = store.address, StoreClient(store.address)
        stack.callback(svc.store.close)
        for name, args in (workers or {}).items():
            svc.start_worker(name, model, args)
        yield svc


ENDINGS = (signal.SIGTERM, signal.SIGHUP)


def unwind_on_signals() -> None:
    """SIGTERM and SIGHUP (a killed benchmark, its report's end, a closed terminal) unwind
    like an error, so its processes stop and its files go; not where ignored (nohup)."""
    if threading.current_thread() is threading.main_thread():
        for sig in ENDINGS:
            if signal.getsignal(sig) != signal.SIG_IGN:
                signal.signal(sig, _unwind)


def _unwind(signum: int, _frame: object) -> NoReturn:
    for sig in ENDINGS:  # a second (its group's and its parent's) does not cut that short
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(128 + signum)


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
        elif response.HasField("usage"):
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


# raw reads


class RawReader:
    """preadv of located segments into one preallocated buffer: what no client can beat."""

    def __init__(self, locations: Sequence[pb.BlockLocation]) -> None:
        self.plan = [(loc.path, list(loc.segments)) for loc in locations]
        self.num_bytes = sum(s.num_bytes for _, segs in self.plan for s in segs)
        self.buffer = memoryview(bytearray(self.num_bytes))  # zero-filled, so already faulted in

    def read(self, verify: bool = False) -> int:
        pos = 0
        for path, segments in self.plan:
            fd = os.open(path, os.O_RDONLY)
            try:
                for offset, size in merged_runs(segments):
                    if os.preadv(fd, [self.buffer[pos : pos + size]], offset) != size:
                        raise RuntimeError(f"{path} is short at {offset}")
                    pos += size
            finally:
                os.close(fd)
            if verify:
                self.check(segments, pos - sum(s.num_bytes for s in segments))
        return pos

    def verify(self) -> None:
        """Checks every segment's xxh3 over what the last read() left in the buffer."""
        pos = 0
        for _, segments in self.plan:
            self.check(segments, pos)
            pos += sum(s.num_bytes for s in segments)

    def check(self, segments: Sequence[pb.Segment], pos: int) -> None:
        for s in segments:
            if xxhash.xxh3_64_intdigest(self.buffer[pos : pos + s.num_bytes]) != s.checksum:
                raise RuntimeError(f"checksum mismatch in layer {s.layer}")
            pos += s.num_bytes


@contextmanager
def located(store: Any, ns: str, fp: str, keys: list[bytes], lease_s: int = 600) -> Iterator:
    """A RawReader of the blocks' locations, under a lease released when the block ends."""
    request = pb.LocateBlocksRequest(namespace=ns, fingerprint=fp, keys=keys, lease_seconds=lease_s)
    reply = store.call("LocateBlocks", request)
    try:
        yield RawReader(reply.blocks)
    finally:
        store.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=reply.lease_id))


def merged_runs(segments: Sequence[pb.Segment]) -> list[tuple[int, int]]:
    """(offset, size) of each run of adjacent segments: one preadv each."""
    runs: list[tuple[int, int]] = []
    for s in segments:
        if runs and sum(runs[-1]) == s.offset:
            runs[-1] = (runs[-1][0], runs[-1][1] + s.num_bytes)
        else:
            runs.append((s.offset, s.num_bytes))
    return runs


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
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
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


def plot(path: Path, header: Mapping, title: str, draw: Callable, *data: Any, **figure) -> None:
    """draw(*data, axes) on one row of panels (figure: ncols, figsize), titled with the
    machine's facts and saved to path; skipped, said once, without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not _said_no_plots:
            print("plots skipped: install agentkv[bench]")
            _said_no_plots.append(True)
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


def versus(ours: float, theirs: float, unit: str = " ms", digits: int = 0) -> str:
    """A target's measurement of ours against theirs: 'ours / theirs unit = ratio'."""
    return f"{ours:.{digits}f} / {theirs:.{digits}f}{unit} = {ours / theirs:.2f}x"


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
        status = {True: "MET ", False: "MISS", None: "INFO"}[goal["met"]]
        print(f"{status}  {goal['target']}: {goal['measured']}")
    for note in notes:
        print(f"note: {note}")
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{name}-{datetime.now():%Y%m%d-%H%M%S}"
    whole = {"header": header, **(document or {}), "targets": list(goals), "notes": list(notes)}
    stem.with_suffix(".json").write_text(json.dumps(whole, indent=2, default=plain) + "\n")
    print(f"wrote {stem.with_suffix('.json')}")
    return stem.with_suffix(".png")
