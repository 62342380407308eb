"""One benchmark command, one report: the paper's tables side by side with ours.

Runs each section script beside this file as its own process (`--quick`: small and once;
`--full`: hours on 2 cores), every one that runs a model with the directory --model SPEC
resolves to, and writes REPORT.md (headline targets first), report.json and the PNGs into one
directory. `agentkv bench` is this command.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GRACE = 60.0  # seconds a section's script gets to end once told to, before the next step


@dataclass(frozen=True)
class Section:
    name: str
    title: str
    script: str
    paper: str  # the paper's tables this reproduces
    quick: tuple[str, ...]
    full: tuple[str, ...] = ()
    model: bool = True  # it runs the model, so it takes --model
    derived: bool = False  # it reads the sections before it (--results: their raw JSON)


SECTIONS = (
    Section("ttft", "Time to first token: cold, warm, hot", "ttft.py", "Tables 3 and 13",
            ("--quick", "--models", "default"), ("--passes", "3")),  # 1K-8K (SmolLM2: 8K is 7968)
    Section("capacity", "Capacity from the planner: agents that fit, FP16 against Q4 against Q4 "
            "window-aware", "capacity.py", "Tables 2 and 14", ("--quick",), model=False),
    Section("windows", "Capacity measured: window-aware restore and hot bytes on a "
            "Gemma-3-shaped worker", "windows.py", "Table 14 (measured), sliding-window layers",
            ("--quick",), model=False),  # a Gemma-3-shaped random model of its own
    Section("throughput", "Single against concurrent throughput", "batching.py",
            "Table 4, Figure 3", ("--quick",)),
    Section("peers", "Peers on the same model: agentkv, llama.cpp, mlx-lm", "peers.py",
            "Table 5", ("--quick",)),
    Section("gateway", "Agents through OpenAI's API: agentkv's gateway, mlx-lm's and llama.cpp's "
            "servers", "gateway.py", "beyond the paper: its Table 5 peers, through their HTTP "
            "servers", ("--quick",)),
    Section("workflows", "Cross-phase injection and expert routing", "workflows.py",
            "Tables 7 and 8", ("--quick",)),
    Section("ablation", "Ablation: what each component buys", "ablation.py", "Table 6",
            ("--quick",), model=False, derived=True),
    Section("perplexity", "Perplexity through the real store: FP16, Q4, Q8, K8V4",
            "perplexity.py", "Table 9", ("--quick",), ("--tokens", "32000")),
    Section("object_tier", "Past one disk: warm restores from an S3 object store (SeaweedFS)",
            "object_tier.py", "beyond the paper: an object-store tier behind the store",
            ("--quick",)),
    Section("restore_path", "Restore paths against the machine's limit", "store_io.py",
            "Section 4 (restore bandwidth)", ("--quick", "--locate-target", "1.3"),
            ("--locate-target", "1.3"), model=False),  # store I/O only
)  # fmt: skip
TARGET = re.compile(r"^(MET|MISS|PASS|FAIL)\b\s*(.*)$")


@dataclass
class Result:
    section: str
    title: str
    paper: str
    command: list[str]
    returncode: int
    seconds: float
    tables: str = ""  # the Markdown it printed: headings and tables
    targets: list[tuple[str, str]] = field(default_factory=list)  # (MET|MISS, text)
    notes: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)  # copied into the report directory
    error: str = ""


class Ending:
    """A SIGTERM or SIGHUP (its CLI's, passed on; its parent's end, agentkv.tether; a closed
    terminal) ends the run as a Ctrl-C does, leaving --out as it was. While a section's
    script runs it is passed on (the script unwinds and stops its services; SIGKILL after
    GRACE s), and the report ends once the script has; elsewhere it unwinds at once, but
    not in a `deferred` block (a script starting, where `check` ends it after; the report
    being published, or its staging removed: then it ends as it would have)."""

    def __init__(self) -> None:
        self.signum = 0
        self.script: subprocess.Popen | None = None
        self.deferring = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) != signal.SIG_IGN:  # nohup's stays
                signal.signal(sig, self.caught)

    def caught(self, signum: int, _frame: object) -> None:
        if not self.signum:  # the first: the CLI's and the tether's may both come
            self.signum = signum
            if self.script is not None:
                self.watch(self.script)
            elif not self.deferring:
                raise SystemExit(128 + signum)

    def watch(self, script: subprocess.Popen) -> None:
        """`script` is the section's running: a signal caught before or after is its."""
        self.script = script
        if self.signum:
            script.terminate()
            kill = threading.Timer(GRACE, script.kill)
            kill.daemon = True  # nothing to wait for once the report ends
            kill.start()

    @contextmanager
    def deferred(self) -> Iterator[None]:
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False

    def check(self) -> None:
        """Ends the run here if a signal came while deferred."""
        if self.signum:
            raise SystemExit(128 + self.signum)


ENDING = Ending()


def resolve_model(spec: str | None) -> tuple[str, Path, str]:
    """(spec, directory, one line describing it) for --model SPEC (None: the worker's
    default), resolved as the worker resolves it (a GGUF imported once) by
    benchmarks/harness.py; exits with one line if SPEC names nothing."""
    for path in (str(ROOT), str(HERE)):
        if path not in sys.path:
            sys.path.insert(0, path)
    import harness

    from agentkv import defaults

    spec = spec or defaults.MODEL
    path = harness.model_dir(spec).absolute()  # the sections run in the source tree
    return spec, path, harness.describe_model(path, spec)


def machine(model: str) -> dict[str, str]:
    """What the report's numbers depend on (harness.machine's facts); `model` says which
    model the sections ran."""
    from harness import machine as facts

    kv = "Q4, group 64, fp16 scales (k4v4g64f16) unless a table says otherwise"
    return {k: str(v) for k, v in facts(model=model).items()} | {"kv format": kv}


def run_section(
    section: Section, full: bool, raw: Path, echo: bool, model: tuple[str, Path]
) -> Result:
    """Runs one benchmark script, echoing its progress, and keeps what it printed. A section
    that runs a model gets --model: the resolved directory (shown as the spec given)."""
    out = raw / section.name
    out.mkdir(parents=True, exist_ok=True)
    args = section.full if full else section.quick
    spec, path = model
    given = ("--model", str(path)) if section.model else ()
    given += ("--results", str(raw)) if section.derived else ()
    command = [sys.executable, str(HERE / section.script), *args, *given, "--out", str(out)]
    shown = [Path(command[0]).name, f"benchmarks/{section.script}", *args]
    shown += ["--model", spec] if section.model else []
    result = Result(section.name, section.title, section.paper, shown, -1, 0.0)
    if not (HERE / section.script).exists():
        result.error = f"benchmarks/{section.script} is missing"
        return result
    started = time.perf_counter()
    result.returncode, lines = run_script(command[1:], section.name if echo else "")
    result.seconds = time.perf_counter() - started
    parse_output(lines, result)
    if result.returncode != 0:
        result.error = "\n".join(lines[-30:]) or f"exited {result.returncode}, saying nothing"
    result.files = sorted(str(p.relative_to(raw.parent)) for p in out.glob("*.png"))
    return result


def run_script(target: list[str], echo: str) -> tuple[int, list[str]]:
    """Runs a section's script (`target`: its path and arguments) to its end: its exit code
    and the lines it printed, its progress lines echoed under the name `echo` ("": none). It
    is ENDING's until it has ended (Popen's exit waits for it), and gets SIGTERM once this
    process ends, killed outright: it unwinds as on a SIGTERM of ours."""
    from agentkv import tether

    command = tether.command(os.getpid(), signal.SIGTERM, target)
    lines: list[str] = []
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}  # the repo first, the user's kept
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    try:
        with (
            ENDING.deferred(),
            subprocess.Popen(
                command, **pipes, text=True, errors="replace", cwd=ROOT, env=env
            ) as proc,
        ):
            assert proc.stdout is not None
            ENDING.watch(proc)
            try:
                for line in proc.stdout:
                    lines.append(line.rstrip("\n"))
                    if echo and line.startswith("["):  # progress lines: "[  12.3s] ..."
                        print(f"  {echo}: {line.rstrip()}", flush=True)
            except KeyboardInterrupt:
                end_after_interrupt(proc)
                raise
    finally:
        ENDING.script = None
    ENDING.check()
    return proc.returncode, lines


def end_after_interrupt(script: subprocess.Popen, grace: float = GRACE) -> None:
    """Waits for a section's script to end: a Ctrl-C reaches it too (a terminal's goes to the
    whole process group, and `agentkv bench` passes one on to it), and it stops its services
    first. One that the Ctrl-C missed gets SIGTERM after `grace` seconds, SIGKILL after as
    many again: until it ends it may write into the directory about to be removed."""
    for stop in (lambda: None, script.terminate, script.kill):
        stop()
        try:
            script.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def parse_output(lines: list[str], result: Result) -> None:
    """Keeps the Markdown (### headings and | tables), target lines and notes."""
    kept: list[str] = []
    for line in lines:
        if m := TARGET.match(line):
            verdict = "MET" if m.group(1) in ("MET", "PASS") else "MISS"
            result.targets.append((verdict, m.group(2).strip()))
        elif line.startswith(("note:", "INFO")):
            result.notes.append(line.split(None, 1)[1].strip() if " " in line else line)
        elif line.startswith(("|", "###")):
            if line.startswith("###") and kept:
                kept.append("")
            kept.append(line)
            if line.startswith("###"):
                kept.append("")
    result.tables = "\n".join(kept).strip()


def render(results: list[Result], facts: dict[str, str], mode: str) -> str:
    out = [
        "# agentkv benchmark report",
        "",
        f"Mode `{mode}`, made by `python benchmarks/report.py --{mode}` (or `agentkv bench "
        f"--{mode}`). Absolute times are this machine's; compare the ratios.",
        *(["", f"**{SMOKE}**"] if mode == "quick" else []),
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in facts.items()),
        "",
        "## Targets",
        "",
        "| section | paper | verdict | target and measurement |",
        "|---|---|---|---|",
    ]
    for r in results:
        for verdict, text in r.targets:
            out.append(f"| {r.section} | {r.paper} | **{verdict}** | {text} |")
        if r.error:
            out.append(f"| {r.section} | {r.paper} | **FAILED TO RUN** | see below |")
    for r in results:
        out += ["", f"## {r.title} ({r.paper})", ""]
        out.append(f"`{' '.join(r.command)}`: {r.seconds:.0f} s, exit {r.returncode}.")
        out.append("")
        if r.error:
            out += ["```", r.error, "```", ""]
        if r.tables:
            out += [r.tables, ""]
        for verdict, text in r.targets:
            out.append(f"- **{verdict}** {text}")
        for note in r.notes:
            out.append(f"- {note}")
        for png in r.files:
            out += ["", f"![{r.section}]({png})"]
    return "\n".join(out).rstrip() + "\n"


SMOKE = (
    "Quick mode is a smoke run: every section small and once. It shows that each section "
    "runs end to end; its MET/MISS verdicts are not comparable with the paper's figures. "
    "Run --full for those."
)


def plots() -> str:
    """Whether the sections can draw their plots, and how to make them if not."""
    if importlib.util.find_spec("matplotlib"):
        return "written beside each section's results"
    return "skipped: matplotlib is not installed (pip install -e '.[bench]')"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="agentkv bench", description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="every section, small (default)")
    mode.add_argument("--full", action="store_true", help="every section at full size")
    p.add_argument("--only", action="append", choices=[s.name for s in SECTIONS], default=[])
    p.add_argument(
        "--model",
        metavar="SPEC",
        help="the model every section that runs one gets: a shipped name, a .gguf file or an "
        "mlx-lm model directory, as agentkv-worker --model takes (default: the worker's "
        "default, smollm2-135m-instruct)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "results" / "report",
        help="directory for report.md, its JSON and plots (default: benchmarks/results/report "
        "in the source tree)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    args.out = args.out.absolute()  # the sections run in the source tree
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out} is a file: give a directory (made, or its report replaced)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the sections into a staging directory beside --out, which replaces --out once the
    report is written: an interrupted or failed run leaves --out as it was (a run killed
    outright leaves the staging directory, .NAME.PID.partial). With --only into an existing
    report, reruns just those sections and keeps the others' results."""
    args = parse_args(argv)
    ENDING.install()
    spec, path, described = resolve_model(args.model)  # before anything is written
    mode = "full" if args.full else "quick"
    sections = [s for s in SECTIONS if not args.only or s.name in args.only]
    previous = kept_results(args.out, mode) if args.only else {}
    staging = args.out.with_name(f".{args.out.name}.{os.getpid()}.partial")
    try:
        try:
            stage(staging, args.out, [name for name in previous if name not in args.only])
        except OSError as exc:  # a folder that does not take it: nothing was run
            said = f"{exc.strerror} ({exc.filename})" if exc.strerror else str(exc)
            print(f"agentkv bench: error: --out {args.out}: {said}", file=sys.stderr)
            return 2
        facts = machine(described)
        facts["plots"] = plots()
        print(f"model: {facts['model']}\nplots: {facts['plots']}", flush=True)
        if mode == "quick":
            print(SMOKE, flush=True)
        for i, section in enumerate(sections, 1):
            print(
                f"[{i}/{len(sections)}] {section.title} (benchmarks/{section.script})", flush=True
            )
            result = run_section(section, args.full, staging / "raw", not args.quiet, (spec, path))
            status = "failed" if result.error else f"{len(result.targets)} targets"
            print(f"    done in {result.seconds:.0f} s: {status}", flush=True)
            previous[section.name] = result
        results = [previous[s.name] for s in SECTIONS if s.name in previous]
        write_report(staging, results, facts, mode)
        with ENDING.deferred():  # the report is whole: it ends as it would have
            publish(staging, args.out)
    finally:
        with ENDING.deferred():  # a signal now does not leave half of it
            shutil.rmtree(staging, ignore_errors=True)  # gone already once published
    return summary(results, args.out, mode)


def kept_results(out: Path, mode: str) -> dict[str, Result]:
    """The sections of the report in `out`, when it is one of this mode."""
    if not (out / "report.json").exists():
        return {}
    try:
        old = json.loads((out / "report.json").read_text())
        if old.get("mode") != mode:
            return {}
        for r in old["sections"]:
            r["targets"] = [tuple(t) for t in r["targets"]]
        return {r["section"]: Result(**r) for r in old["sections"]}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        # cut short, or an older version's fields: its sections are not kept, not a traceback
        print(f"{out / 'report.json'} cannot be read ({exc!r}): its sections are not kept")
        return {}


def stage(staging: Path, out: Path, kept: list[str]) -> None:
    """`staging`, a new directory beside `out` to write the report in, holding the raw results
    in `out` of the `kept` sections (hard links where the file system has them: no copy)."""
    shutil.rmtree(staging, ignore_errors=True)  # a run of the same pid, killed outright
    staging.mkdir(parents=True)
    for name in kept:
        if (out / "raw" / name).is_dir():
            shutil.copytree(out / "raw" / name, staging / "raw" / name, copy_function=link)
    (staging / "raw").mkdir(exist_ok=True)


def link(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def write_report(staging: Path, results: list[Result], facts: dict[str, str], mode: str) -> None:
    (staging / "REPORT.md").write_text(render(results, facts, mode))
    whole = {"mode": mode, "machine": facts, "sections": [asdict(r) for r in results]}
    (staging / "report.json").write_text(json.dumps(whole, indent=2))


def publish(staging: Path, out: Path) -> None:
    """`staging` becomes `out`; the report that was there is removed."""
    if out.exists():
        old = staging.with_suffix(".old")
        out.rename(old)
        staging.rename(out)
        shutil.rmtree(old)
    else:
        staging.rename(out)


def summary(results: list[Result], out: Path, mode: str) -> int:
    """Says what was written; 1 if a section failed to run."""
    met = sum(v == "MET" for r in results for v, _ in r.targets)
    missed = sum(v == "MISS" for r in results for v, _ in r.targets)
    failed = [r.section for r in results if r.error]
    print(f"wrote {out / 'REPORT.md'}: {met} targets met, {missed} missed", end="")
    print(f", failed to run: {', '.join(failed)}" if failed else "")
    if mode == "quick":
        print("(quick mode: a smoke run; run --full for verdicts to compare)")
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # a Ctrl-C reached the section's script and services too
        print("interrupted", file=sys.stderr)
        sys.exit(130)
