"""Starting agentkv services as separate processes, the way a user does, and waiting for them."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from agentkv import tether


class ServiceExited(RuntimeError):
    """A service exited before it served; `reason` is the error line it left in its log."""

    def __init__(self, module: str, code: int, log_tail: str) -> None:
        super().__init__(f"{module} exited {code}:\n{log_tail}")
        lines = [line.strip() for line in log_tail.splitlines() if line.strip()]
        errors = [line for line in lines if ": error: " in line and not line.startswith("{")]
        self.reason = (errors or lines or [f"{module} exited {code}"])[-1]


@dataclass
class ServiceProcess:
    """A service started as `python -m MODULE ARGS`; ready once it logs the "serving" event."""

    module: str
    args: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    address: str = ""
    prefix: Sequence[str] = ()  # e.g. ("ip", "netns", "exec", NAME): run it elsewhere
    start_timeout: float = 60.0  # a service that fails exits, which start() sees at once
    # In a session of its own, as a command starts one for a user: a Ctrl-C at the terminal
    # reaches the command alone, which passes it on (stop(interrupted=True)). It is tied too.
    own_session: bool = False
    # SIGKILLed when the thread that started it ends: a command or a benchmark killed
    # outright takes it along (a SIGTERM would have it drain to a store going too). Not one
    # started through a prefix (agentkv.tether).
    tied: bool = False

    def start(self, timeout: float | None = None) -> ServiceProcess:
        timeout = self.start_timeout if timeout is None else timeout
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.touch()
        offset = self.log_path.stat().st_size
        env = {**os.environ, **(self.env or {})}
        target = ["-m", self.module, *self.args]
        command = [*self.prefix, sys.executable, *target]
        if (self.own_session or self.tied) and not self.prefix:  # no preexec_fn, no fork
            command = tether.command(os.getpid(), signal.SIGKILL, target)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=log, env=env, start_new_session=self.own_session
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            serving = self._find_event("serving", offset)
            if serving is not None:
                self.address = serving["address"]
                return self
            if self.proc.poll() is not None:
                raise ServiceExited(self.module, self.proc.returncode, self.log_tail())
            time.sleep(0.05)
        self.kill9()
        lines = [line.strip() for line in self.log_tail().splitlines() if line.strip()]
        said = f": its log ends {lines[-1]!r}" if lines else " (it logged nothing)"
        raise TimeoutError(f"{self.module} did not start within {timeout}s{said}")

    def _find_event(self, event: str, offset: int) -> dict | None:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            for line in f.read().decode(errors="replace").splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if isinstance(entry, dict) and entry.get("event") == event:
                    return entry
        return None

    def log_tail(self, chars: int = 5000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        if self.running:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 30.0, interrupted: bool = False) -> int:
        """Asks the service to stop, gives it `timeout` seconds to end, then SIGKILLs it;
        returns the exit code. The ask is SIGTERM; `interrupted` (the command got a Ctrl-C,
        which a service in a session of its own did not) passes the Ctrl-C on: SIGINT, on
        which one serving drains as on SIGTERM, and one still starting (a model import)
        cleans up, which a SIGTERM would cut short."""
        if self.proc is None:
            return 0
        self.proc.send_signal(signal.SIGINT if interrupted else signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
        return self.proc.returncode


@contextlib.contextmanager
def stopping(services: Collection[ServiceProcess], interrupted: bool = False) -> Iterator[None]:
    """Stops `services`, the last started first, then runs the block: the command's own
    clean-up. A Ctrl-C meanwhile (a user's second) SIGKILLs every service still running
    rather than cutting the stops or the clean-up short, and is raised after them unless the
    command was interrupted already. Call it from the main thread (it handles SIGINT)."""
    insisted: list[int] = []

    def insist(sig: int, _frame: object) -> None:
        insisted.append(sig)
        for service in services:  # no wait here: the main thread may be waiting on it
            if service.proc is not None:
                service.proc.send_signal(signal.SIGKILL)

    previous = signal.getsignal(signal.SIGINT)
    if previous != signal.SIG_IGN:  # nohup's, or a script's background job: it stays ignored
        signal.signal(signal.SIGINT, insist)
    try:
        for service in reversed(list(services)):
            service.stop(interrupted=interrupted)
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if insisted and not interrupted:
        raise KeyboardInterrupt


@contextlib.contextmanager
def running(services: dict[str, ServiceProcess], root: Path, keep: bool) -> Iterator[None]:
    """Runs a command's block, which starts `services` (each added as it starts); whatever
    ends it (a Ctrl-C, a service that never starts) then stops them (`stopping`) and keeps
    `root`, saying where, or removes it."""
    interrupted = False
    try:
        yield
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        with stopping(list(services.values()), interrupted):
            if keep:
                print(f"\ndata and logs kept in {root}")
            else:
                shutil.rmtree(root, ignore_errors=True)


def store_process(
    data_dir: Path,
    log_path: Path,
    listen: str = "127.0.0.1:0",
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
    own_session: bool = False,
) -> ServiceProcess:
    """An `agentkv-store` process (not yet started)."""
    args = ["--data-dir", str(data_dir), "--listen", listen, *extra_args]
    return ServiceProcess(
        "cache_store", args, log_path, env, prefix=prefix, own_session=own_session
    )


def worker_process(
    model: str,
    store: str,
    log_path: Path,
    listen: str = "127.0.0.1:0",
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    own_session: bool = False,
) -> ServiceProcess:
    """An `agentkv-worker` process (not yet started). Its first start on a large GGUF file
    imports it, which may take minutes, hence the long wait for it to serve."""
    args = ["--model", model, "--store", store, "--listen", listen, *extra_args]
    return ServiceProcess(
        "inference_worker", args, log_path, env, start_timeout=900.0, own_session=own_session
    )


def gateway_process(
    workers: Sequence[str],
    log_path: Path,
    store: str = "",
    listen: str = "127.0.0.1:0",
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> ServiceProcess:
    """An `agentkv-gateway` process (not yet started); its address is HOST:PORT of HTTP."""
    args = [arg for w in workers for arg in ("--worker", w)]
    args += ["--store", store] if store else []
    return ServiceProcess(
        "agentkv.gateway", [*args, "--listen", listen, *extra_args], log_path, env
    )
