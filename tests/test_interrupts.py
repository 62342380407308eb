"""Ctrl-C and stops, from the real CLI and processes: one line ("interrupted", exit 130) and
nothing left behind, wherever the signal lands. A Ctrl-C is sent as a terminal sends it: to
the command's whole process group."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentkv.launch import ServiceProcess
from agentkv.tether import command as tether_command

ROOT = Path(__file__).resolve().parent.parent
TOY_MODEL = ROOT / "models" / "agentkv-default"
# Installed into a command's PYTHONPATH: the service `python -m $AGENTKV_TEST_HANG` hangs at
# start (before any of its code runs), after touching $AGENTKV_TEST_HANG_MARK.
HANG = """\
import os, sys, time
argv = sys.orig_argv[1:]
argv = argv[4:] if argv[:2] == ["-m", "agentkv.tether"] else argv  # a command's own child
if argv[:2] == ["-m", os.environ.get("AGENTKV_TEST_HANG")]:
    open(os.environ["AGENTKV_TEST_HANG_MARK"], "w").close()
    time.sleep(600)
"""


def on_import(module: str, patch: str, when: str = "True") -> str:
    """A sitecustomize.py that, where `when` holds, runs `patch` (the source of a function
    patch(module)) on `module` once it is imported, before anything uses it."""
    return f"""\
import importlib.abc, importlib.util, os, sys, time
{patch}
class OnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != {module!r}:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def patched(module):
            run(module)
            patch(module)
        spec.loader.exec_module = patched
        return spec
argv = sys.orig_argv[1:]
argv = argv[4:] if argv[:2] == ["-m", "agentkv.tether"] else argv  # a command's own child
if {when}:
    sys.meta_path.insert(0, OnImport())
"""


# Installed into a command's PYTHONPATH: the import (`python -m inference_worker.model_import`,
# or the worker's own at its start, once mlx.core is imported: only after it loaded its BLAS)
# writes its weights, touches $AGENTKV_TEST_SAVED_MARK and waits, so a signal lands after the
# weights and before the config, whatever the machine's load (a signal sent once the staging
# directory appeared found the import done 1 run in ~15 on a busy machine: exit 0).
SAVED_THEN_WAIT = on_import(
    "mlx.core",
    """\
def patch(module):
    save = module.save_safetensors
    def saved_then_wait(*args, **kwargs):
        save(*args, **kwargs)
        open(os.environ["AGENTKV_TEST_SAVED_MARK"], "w").close()
        time.sleep(600)
    module.save_safetensors = saved_then_wait
""",
    'argv[:2] in (["-m", "inference_worker.model_import"], ["-m", "inference_worker"])',
)


class Job:
    """A command started as a shell starts a job: a process group of its own, its output
    read as it comes."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=lambda s=s, k=k: k.extend(s), daemon=True)
            for s, k in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for reader in self._readers:
            reader.start()

    def wait_for(self, ready, timeout: float = 120.0) -> None:
        """Until `ready()` is true; fails if the command ends first."""
        deadline = time.monotonic() + timeout
        while not ready():
            output = "".join(self.out + self.err)[-3000:]
            assert self.proc.poll() is None, f"exited {self.proc.returncode} first:\n{output}"
            assert time.monotonic() < deadline, f"not ready in {timeout} s:\n{output}"
            time.sleep(0.02)

    def says(self, text: str) -> bool:
        return any(text in line for line in self.out + self.err)

    def signal(self, sig: int = signal.SIGINT, group: bool = True) -> None:
        """SIGINT to the whole group: a terminal's Ctrl-C."""
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)

    def finish(self, timeout: float = 60.0) -> tuple[int, str, str]:
        code = self.proc.wait(timeout)
        for reader in self._readers:
            reader.join(10)
        return code, "".join(self.out), "".join(self.err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def job() -> Iterator:
    """job(ARGS, env) starts `python ARGS` as a job; whatever is left of it is killed after."""
    started: list[Job] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Job:
        started.append(Job(list(args), env))
        return started[-1]

    yield start
    for j in started:
        j.kill()


@pytest.fixture
def blackhole() -> Iterator:
    """A loopback address that takes connections and never answers: a call to it waits.
    `.accepted()` is true once some client has connected."""

    class Blackhole:
        def __init__(self) -> None:
            self.sock = socket.create_server(("127.0.0.1", 0))
            self.sock.setblocking(False)
            self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
            self.held: list[socket.socket] = []

        def accepted(self) -> bool:
            with contextlib.suppress(BlockingIOError):
                self.held.append(self.sock.accept()[0])  # kept open: the caller waits
            return bool(self.held)

    hole = Blackhole()
    yield hole
    for s in [*hole.held, hole.sock]:
        s.close()


def assert_interrupted(code: int, err: str) -> None:
    assert code == 130, err
    assert "Traceback" not in err and err.endswith("interrupted\n"), err
    assert err.count("\n") == 1, err  # that one line


def cli(*args: str) -> list[str]:
    return ["-m", "agentkv.cli", *args]


@pytest.mark.parametrize(
    "command",
    [
        ["run", "prisoners_dilemma", "--mode", "cold"],
        ["agents"],
        ["store", "stats"],
    ],
    ids=["run", "agents", "store-stats"],
)
def test_ctrl_c_while_a_command_waits_on_a_service_is_one_line(job, blackhole, command):
    flags = ["--store", blackhole.address]
    flags += ["--worker", blackhole.address] if command[0] != "store" else []
    command = [command[0], *flags, *command[1:]]
    cmd = job(*cli(*command))
    cmd.wait_for(blackhole.accepted)  # it is inside a call
    cmd.signal()
    code, _, err = cmd.finish()
    assert_interrupted(code, err)


# Installed into a program's PYTHONPATH: once agentkv.flags is imported (by the program's
# own imports: gRPC's and numpy's are under way), it touches $AGENTKV_TEST_IMPORTING_MARK
# and waits, so a Ctrl-C lands among the imports, whatever the machine's load.
IMPORTING_THEN_WAIT = on_import(
    "agentkv.flags",
    """\
def patch(module):
    open(os.environ["AGENTKV_TEST_IMPORTING_MARK"], "w").close()
    time.sleep(600)
""",
)


@pytest.mark.parametrize(
    "args",
    [
        ["-m", "cache_store", "--data-dir", "DATA"],
        ["-m", "inference_worker", "--store", "127.0.0.1:1"],
        ["-m", "agentkv.gateway", "--worker", "127.0.0.1:1"],
        ["-m", "agentkv.cli", "store", "stats"],
    ],
    ids=["store", "worker", "gateway", "cli"],
)
def test_ctrl_c_while_a_program_imports_is_one_line(job, tmp_path, args):
    """The reviewer's: a Ctrl-C in the first second of any program (its imports: gRPC,
    numpy, MLX) was a traceback of the import under way, exit -2 (SIGINT); after them, one
    line and exit 130, as the README says of every command."""
    site, mark = tmp_path / "site", tmp_path / "importing"
    site.mkdir()
    (site / "sitecustomize.py").write_text(IMPORTING_THEN_WAIT)
    env = {
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        "AGENTKV_TEST_IMPORTING_MARK": str(mark),
    }
    cmd = job(*[str(tmp_path / "data") if a == "DATA" else a for a in args], env=env)
    cmd.wait_for(mark.exists)
    cmd.signal()
    code, _, err = cmd.finish()
    assert_interrupted(code, err)
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("group", [True, False], ids=["ctrl-c", "sigint-to-the-cli-alone"])
def test_ctrl_c_in_model_import_leaves_no_directory_and_is_one_line(job, tmp_path, group):
    """The signal lands once the import has written its weights, before its config: the
    --out directory is there whole or not at all, with no staging directory left."""
    site, mark, work = tmp_path / "site", tmp_path / "saved", tmp_path / "work"
    site.mkdir()
    work.mkdir()
    (site / "sitecustomize.py").write_text(SAVED_THEN_WAIT)
    env = {
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        "AGENTKV_TEST_SAVED_MARK": str(mark),
    }
    out = work / "out"
    cmd = job(*cli("model", "import", "smollm2-135m-instruct", "--out", str(out)), env=env)
    cmd.wait_for(mark.exists)
    cmd.signal(group=group)
    code, _, err = cmd.finish()
    assert_interrupted(code, err)
    assert list(work.iterdir()) == []  # no out/model.safetensors without its config.json


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError):
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines())
            if int(fields["PPid"]) == pid:
                found.append(int(status.parent.name))
    return found


def ended(pid: int) -> bool:
    """Gone, or a zombie nobody reaps (a container's init may not)."""
    try:
        return "Z" in (Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1][:4])
    except OSError:
        return True


# Installed into a command's PYTHONPATH: a benchmark script, once its store serves, touches
# $AGENTKV_TEST_HELD_MARK and waits, so a signal lands while it runs, however fast its section
# is and however busy the machine.
HOLD_AFTER_STORE = on_import(
    "harness",
    """\
def patch(module):
    start = module.Services.start
    def held(self, service):
        started = start(self, service)
        if service.module == "cache_store":
            open(os.environ["AGENTKV_TEST_HELD_MARK"], "w").close()
            for _ in range(6000):  # in steps: a signal another thread takes is run between
                time.sleep(0.1)
        return started
    module.Services.start = held
""",
)


# Run as a command: starts what commands start (a service, a script) and prints how many
# fork()s ran the fork handlers (gRPC's hang), and what the script saw as its argv and path.
STARTS = """\
import os, sys
from pathlib import Path
from agentkv.cli import _run_child
from agentkv.launch import store_process
forks = []
os.register_at_fork(before=lambda: forks.append(1))
root = Path(sys.argv[1])
store_process(root / "data", root / "store.log", own_session=True).start().stop()
print(len(forks), flush=True)
script = "import os, sys; print(sys.argv, sys.path[0] == os.path.dirname(sys.argv[0]))"
(root / "script.py").write_text(script)
print(_run_child([str(root / "script.py"), "an", "arg"]), len(forks))
"""


def test_a_command_starts_its_children_without_fork_handlers(tmp_path):
    """A command tied its services and scripts to itself in a preexec_fn, so subprocess
    forked with fork(), which ran gRPC's fork handlers in a process with live channels: the
    walkthrough hung in fork() restarting its worker (CI, 300 s). The child ties itself now
    (agentkv.tether), and no fork handler runs; a script still sees its own argv and path."""
    run = subprocess.run(
        [sys.executable, "-c", STARTS, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert run.stdout.splitlines()[:1] == ["0"], run.stderr  # the service's start
    assert run.returncode == 0, run.stderr
    script = str(tmp_path / "script.py")
    assert run.stdout.splitlines()[1:] == [f"{[script, 'an', 'arg']} True", "0 0"]


# Run as a command: starts `sleep` tied to itself through an exec (agentkv.tether --exec),
# prints its pid, and waits
EXEC_TIED = """\
import os, signal, subprocess, time
from agentkv import tether
child = subprocess.Popen(tether.command(os.getpid(), signal.SIGKILL, ["--exec", "sleep", "600"]))
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="Linux's /proc and PR_SET_PDEATHSIG")
def test_a_program_tied_through_an_exec_ends_with_what_started_it(job):
    """A server that is no Python module (weed; a peer's, started with python -c) is tied by
    the tether becoming it: a kill -9 of what started it takes it along. A program that is
    not there is one line."""
    cmd = job("-c", EXEC_TIED)
    cmd.wait_for(lambda: cmd.out)
    pid = int(cmd.out[0])
    wait_until(lambda: command_line(pid).startswith("sleep 600"), "the tether did not exec")
    cmd.signal(signal.SIGKILL, group=False)
    wait_until(lambda: ended(pid), "the tied program outlived what started it")
    missing = tether_command(os.getpid(), signal.SIGKILL, ["--exec", "no-such-program", "x"])
    run = subprocess.run(missing, capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stderr) == (1, "no-such-program: No such file or directory\n")


# Run with GRPC_VERBOSITY=INFO: starts processes with fork(), as subprocess does outside
# Linux, while two threads call a gRPC server, as a command's may; gRPC's fork handlers log.
FORKS = """\
import subprocess
subprocess._USE_VFORK = False
import agentkv, threading, grpc
from concurrent import futures
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
server = grpc.server(futures.ThreadPoolExecutor(4))
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
stub = health_pb2_grpc.HealthStub(
    grpc.insecure_channel(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
)
server.start()
stop, failed = threading.Event(), []
def call():
    try:
        while not stop.is_set():
            stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
    except grpc.RpcError as e:
        failed.append(e)
callers = [threading.Thread(target=call) for _ in range(2)]
for caller in callers:
    caller.start()
for _ in range(100):
    subprocess.run(["true"], check=True)
stop.set()
for caller in callers:
    caller.join()
server.stop(None).wait()
print(f"a call failed: {failed[0]}" if failed else "forked")
"""


def test_an_agentkv_process_runs_no_grpc_fork_handler():
    """Where subprocess forks with fork() anyway (macOS), gRPC's fork handlers ran in a
    process with live channels, as they did in the walkthrough that hung. Here that failed
    4 runs in 4 within 100 starts: a child aborted (SIGABRT), the server's pool was shut
    down, or it hung. agentkv's package turns them off before grpc is imported. The script
    stops its callers and its server before it ends: left calling, its exit could hang in
    gRPC's shutdown on a busy machine (2 runs in 15 beside three busy loops; none in 45 since,
    and every run of it without agentkv's import still hangs)."""
    env = {**os.environ, "GRPC_VERBOSITY": "INFO"}
    env.pop("GRPC_ENABLE_FORK_SUPPORT", None)
    run = subprocess.run(
        [sys.executable, "-c", FORKS], capture_output=True, text=True, timeout=120, env=env
    )
    assert run.stdout == "forked\n", run.stderr
    assert [line for line in run.stderr.splitlines() if "fork" in line.lower()] == []


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="Linux's /proc and PR_SET_PDEATHSIG")
def test_a_cli_killed_outright_takes_its_import_with_it(job, tmp_path):
    """`kill -9` of the CLI's process group (a CI or supervisor timeout) reaches no child in
    a session of its own: the import went on, orphaned. It now ends with the CLI."""
    cmd = job(*cli("model", "import", "smollm2-135m-instruct", "--out", str(tmp_path / "out")))
    cmd.wait_for(lambda: children(cmd.proc.pid))
    (importing,) = children(cmd.proc.pid)
    cmd.signal(signal.SIGKILL)
    wait_until(lambda: ended(importing), "the import outlived the CLI")
    assert not (tmp_path / "out" / "config.json").exists()  # it did not run to its end


def wait_until(ready, failure: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, failure
        time.sleep(0.05)


def left_behind(mark: Path) -> list[int]:
    """Live processes whose environment holds AGENTKV_TEST_RUN=`mark`: whatever a command
    started with it, however deep, orphaned or not."""
    needle = f"\0AGENTKV_TEST_RUN={mark}\0".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            if needle in b"\0" + environ.read_bytes() and not ended(int(environ.parent.name)):
                found.append(int(environ.parent.name))
    return found


def running(mark: Path, module: str) -> bool:
    """Whether a process left_behind(mark) would list runs `module`."""
    return any(module in command_line(pid) for pid in left_behind(mark))


def command_line(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return ""


@pytest.fixture
def demo(job, tmp_path) -> Iterator:
    """demo() starts `agentkv demo` as a job and returns it once its scenario runs (its
    store and worker serve). What it starts carries AGENTKV_TEST_RUN=tmp_path, and its
    data directory is made in tmp_path/tmp; whatever of it is left is killed after."""

    def start() -> Job:
        (tmp_path / "tmp").mkdir()
        env = {"TMPDIR": str(tmp_path / "tmp"), "AGENTKV_TEST_RUN": str(tmp_path)}
        cmd = job(*cli("demo", "--model", str(TOY_MODEL), "--no-cold"), env=env)
        cmd.wait_for(lambda: cmd.says("  phase "), timeout=300)
        return cmd

    yield start
    for pid in left_behind(tmp_path):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="Linux's /proc")
@pytest.mark.parametrize(
    "signals",
    [["the group"], ["the CLI"], ["the CLI", "the CLI"]],
    ids=["ctrl-c", "sigint-to-the-cli-alone", "sigint-to-the-cli-twice"],
)
def test_ctrl_c_in_the_demo_stops_its_services_and_leaves_nothing(demo, tmp_path, signals):
    """The store and the worker, in sessions of their own, get the Ctrl-C from the CLI and
    drain at once (the CLI gave each 5 s to end on its own first: 10 s to return when the
    SIGINT went to it alone). A second SIGINT, once the worker has ended, SIGKILLs what still
    runs: it cut the stops short, leaving the store running and the data directory."""
    cmd = demo()
    (worker,) = [p for p in children(cmd.proc.pid) if "inference_worker" in command_line(p)]
    cmd.signal(group=signals[0] == "the group")
    if len(signals) == 2:
        wait_until(lambda: ended(worker), "the worker did not stop")  # the store's turn now
        cmd.signal(group=False)
    code, _, err = cmd.finish()
    assert_interrupted(code, err)
    assert left_behind(tmp_path) == []
    assert list((tmp_path / "tmp").glob("agentkv-demo-*")) == []  # (mlx keeps a cache there)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="Linux's /proc and PR_SET_PDEATHSIG")
@pytest.mark.parametrize(
    ("sig", "group"),
    [(signal.SIGKILL, True), (signal.SIGKILL, False), (signal.SIGTERM, False)],
    ids=["kill-9-of-its-group", "kill-9-of-the-cli", "sigterm-to-the-cli"],
)
def test_a_demo_ended_by_a_signal_takes_its_services_with_it(demo, tmp_path, sig, group):
    """However the CLI ends, its services end with it: a kill -9 or a SIGTERM of the CLI
    alone left them running. A SIGTERM stops them as an error does, and removes the data."""
    cmd = demo()
    cmd.signal(sig, group=group)
    code, _, err = cmd.finish()
    if sig == signal.SIGTERM:
        assert code == 128 + sig and "Traceback" not in err, err
        assert left_behind(tmp_path) == []
        assert list((tmp_path / "tmp").glob("agentkv-demo-*")) == []
    wait_until(lambda: not left_behind(tmp_path), "a service outlived the CLI")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="Linux's /proc")
@pytest.mark.parametrize("earlier", [True, False], ids=["over-a-report", "new"])
def test_ctrl_c_in_bench_is_one_line_and_leaves_out_as_it_was(job, tmp_path, earlier):
    """The sections write into a directory beside --out that replaces it once the report is
    written. A Ctrl-C left --out without its earlier report (removed at the start) and with
    the raw results begun; now --out is as it was (or not there), nothing else is left, and
    the section's script and its store have ended when the CLI returns."""
    out = tmp_path / "out"
    files = {
        out / "REPORT.md": "an earlier report\n",
        out / "report.json": json.dumps({"mode": "quick", "sections": []}),
        out / "raw" / "capacity" / "capacity.json": "{}",
    }
    files = files if earlier else {}
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    args = cli("bench", "--quick", "--only", "restore_path", "--out", str(out))
    cmd = job(*args, env={"AGENTKV_TEST_RUN": str(tmp_path)})
    cmd.wait_for(lambda: running(tmp_path, "cache_store"))  # the section's script and store
    cmd.signal()
    code, _, err = cmd.finish(120)
    assert_interrupted(code, err)
    assert {path: path.read_text() for path in out.rglob("*") if path.is_file()} == files
    assert list(tmp_path.iterdir()) == ([out] if earlier else [])
    assert left_behind(tmp_path) == []


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="Linux's /proc and PR_SET_PDEATHSIG")
@pytest.mark.parametrize(
    ("victim", "sig"),
    [
        ("agentkv.cli", signal.SIGTERM),
        ("agentkv.cli", signal.SIGHUP),
        ("agentkv.cli", signal.SIGKILL),
        ("report.py", signal.SIGKILL),
        ("store_io.py", signal.SIGKILL),
    ],
    ids=[
        "sigterm-to-the-cli",
        "sighup-to-the-cli",
        "kill-9-of-the-cli",
        "kill-9-of-the-report",
        "kill-9-of-the-section",
    ],
)
def test_a_bench_ended_by_a_signal_takes_what_it_started_with_it(job, tmp_path, victim, sig):
    """`agentkv bench` runs benchmarks/report.py, which runs each section's script, which
    starts its services. A SIGTERM, a SIGHUP or a kill -9 of the CLI ended the report at
    once, its staging directory left beside --out, and the script ran on; a kill -9 of the
    script left its store running, orphaned. Now each is tied to what started it, and a
    SIGTERM or SIGHUP unwinds: whichever ends, what it started ends, and what unwound leaves
    nothing but --out as it was (here: none, or the report of the section that failed) and
    no temporary directory. The script holds once its store serves (HOLD_AFTER_STORE): the
    signal lands while it runs, and it prints nothing that a closed pipe would end it on."""
    out, temp, site, held = (tmp_path / name for name in ("out", "tmp", "site", "held"))
    for directory in (temp, site):
        directory.mkdir()
    (site / "sitecustomize.py").write_text(HOLD_AFTER_STORE)
    args = cli("bench", "--quick", "--only", "restore_path", "--out", str(out))
    env = {"AGENTKV_TEST_RUN": str(tmp_path), "TMPDIR": str(temp), "PYTHONPATH": str(site)}
    ignored = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # nohup's SIG_IGN, if any, stays here
    try:
        cmd = job(*args, env={**env, "AGENTKV_TEST_HELD_MARK": str(held)})
    finally:
        signal.signal(signal.SIGHUP, ignored)
    try:
        cmd.wait_for(held.exists)  # the section's script, its store serving
        (pid,) = [p for p in left_behind(tmp_path) if victim in command_line(p)]
        os.kill(pid, sig)
        code, _, err = cmd.finish(180)
        wait_until(lambda: not left_behind(tmp_path), "a process outlived what started it", 120)
    finally:
        for pid in left_behind(tmp_path):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert "Traceback" not in err, err
    if victim == "store_io.py":  # the section failed; the report is written all the same
        assert code == 1, err
        assert "FAILED TO RUN" in (out / "REPORT.md").read_text()
        assert sorted(tmp_path.iterdir()) == [held, out, site, temp]  # its temp (kill -9)
        return
    assert list(temp.iterdir()) == []  # the script unwound
    if victim == "report.py":  # killed outright: its staging directory is left
        assert code == 128 + sig, err
        assert list(tmp_path.rglob("*.json")) == []  # the script ended before its results
    else:
        assert code == (-sig if sig == signal.SIGKILL else 128 + sig), err
        assert sorted(tmp_path.iterdir()) == [held, site, temp]


def test_a_worker_stopped_by_sigterm_while_it_imports_its_model_leaves_no_staging(
    job, tmp_path, blackhole
):
    """The red team's case: `docker stop` (SIGTERM) during a worker's first start, while it
    imported its GGUF, ended it with no word and left the import's 385 MB staging directory
    in the model cache. SIGTERM now unwinds as a Ctrl-C does until the worker serves: one
    line, exit 143, and nothing left in the cache."""
    site, mark, cache = tmp_path / "site", tmp_path / "saved", tmp_path / "cache"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SAVED_THEN_WAIT)
    env = {
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        "AGENTKV_TEST_SAVED_MARK": str(mark),
        "AGENTKV_MODEL_CACHE": str(cache),
    }
    cmd = job("-m", "inference_worker", "--model", "smollm2-135m-instruct",
              "--store", blackhole.address, "--listen", "127.0.0.1:0", env=env)  # fmt: skip
    cmd.wait_for(mark.exists)
    assert [p for p in cache.iterdir() if p.is_dir()]  # the staging directory, being written
    cmd.signal(signal.SIGTERM)
    code, _, err = cmd.finish()
    assert code == 143 and "Traceback" not in err, err
    assert err.endswith("agentkv-worker: stopped (SIGTERM)\n"), err
    assert [p for p in cache.iterdir() if p.is_dir()] == []


def test_ctrl_c_while_the_worker_loads_is_one_line(job, blackhole):
    """Before the worker serves, its signal handling is not installed yet: a Ctrl-C while it
    loads (here: while it asks a store that never answers) still ends in one line."""
    cmd = job("-m", "inference_worker", "--model", str(TOY_MODEL), "--store", blackhole.address,
              "--listen", "127.0.0.1:0")  # fmt: skip
    cmd.wait_for(blackhole.accepted)
    cmd.signal()
    code, _, err = cmd.finish()
    assert code == 130, err
    assert "Traceback" not in err and err.endswith("agentkv-worker: interrupted\n"), err


@pytest.mark.parametrize("command", ["walkthrough", "demo"])
def test_ctrl_c_while_a_service_starts_leaves_no_directory(job, tmp_path, command):
    """`agentkv walkthrough` and `demo` make a directory, then start services: a Ctrl-C while
    one starts removes the directory, and is one line."""
    hangs = tmp_path / "site"
    hangs.mkdir()
    (hangs / "sitecustomize.py").write_text(HANG)
    temp = tmp_path / "tmp"
    temp.mkdir()
    mark = tmp_path / "hanging"
    env = {
        "PYTHONPATH": os.pathsep.join([str(hangs), os.environ.get("PYTHONPATH", "")]),
        "AGENTKV_TEST_HANG": "cache_store" if command == "walkthrough" else "inference_worker",
        "AGENTKV_TEST_HANG_MARK": str(mark),
        "TMPDIR": str(temp),
    }
    args = ["demo", "--model", str(TOY_MODEL)] if command == "demo" else [command]
    cmd = job(*cli(*args), env=env)
    cmd.wait_for(mark.exists)
    cmd.signal()
    code, out, err = cmd.finish()
    assert_interrupted(code, err)
    assert list(temp.iterdir()) == []
    if command == "demo":  # its progress line ends there: not "failed"
        assert out.endswith(" ...\n") and "failed" not in out, out


def test_a_service_that_never_serves_times_out_in_one_line(tmp_path):
    """A service that neither serves nor exits: one line naming it and the last it logged."""
    service = ServiceProcess(
        "http.server", ["0", "--bind", "127.0.0.1"], tmp_path / "http.log", start_timeout=2.0
    )
    with pytest.raises(TimeoutError) as raised:
        service.start()
    assert not service.running
    message = str(raised.value)
    assert "\n" not in message and message.startswith("http.server did not start within 2.0s")


def gateway(*flags: str) -> list[str]:
    return ["-m", "agentkv.gateway", "--worker", "127.0.0.1:1", *flags]


@pytest.mark.parametrize(
    ("args", "sig"),
    [
        (gateway(), signal.SIGTERM),
        (gateway(), signal.SIGINT),
        (cli("gateway", "--worker", "127.0.0.1:1"), signal.SIGINT),
    ],
    ids=["sigterm", "ctrl-c", "agentkv-gateway-ctrl-c"],
)
def test_a_gateway_stopped_drains_and_leaves_no_address_file(job, tmp_path, args, sig):
    """As the store and the worker: SIGTERM or Ctrl-C stops it gracefully (exit 0, its
    "stopping" logged) and removes its --address-file."""
    address_file = tmp_path / "gateway.json"
    cmd = job(*args, "--listen", "127.0.0.1:0", "--address-file", str(address_file))
    cmd.wait_for(address_file.exists)
    assert json.loads(address_file.read_text())["address"]
    cmd.signal(sig)
    code, _, err = cmd.finish()
    assert code == 0, err
    assert "Traceback" not in err and '"event": "stopping"' in err, err
    assert not address_file.exists()


def test_a_gateway_whose_port_is_taken_says_so_in_one_line(job):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        cmd = job(*gateway("--listen", listen))
        code, _, err = cmd.finish()
    assert code == 2, err
    assert err.startswith(f"agentkv-gateway: error: could not bind {listen}: "), err
    assert err.count("\n") == 1, err


def test_services_stopped_under_an_ignored_sigint_leave_it_ignored():
    """The reviewer's: a command run where SIGINT is ignored (a script's background job,
    nohup) took it back while it stopped its services, and a stray SIGINT then SIGKILLed
    them mid-stop. (In one process: the handler it installs is what is asserted.)"""
    from agentkv.launch import stopping

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with stopping([]):
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
