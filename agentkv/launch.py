"""Starting agentkv services as separate processes, the way a user does, and waiting for them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

INTERRUPT_GRACE = 5.0  # seconds a service that got the Ctrl-C too has to end on its own


class ServiceExited(RuntimeError):
    """A service exited before it served; `reason` is the error line it left in its log."""

    def __init__(self, module: str, code: int, log_tail: str) -> None:
        super().__init__(f"{module} exited {code}:\n{log_tail}")
        lines = [line.strip() for line in log_tail.splitlines() if line.strip()]
        errors = [line for line in lines if ": error: " in line and not line.startswith("{")]
        self.reason = (errors or lines or [f"{module} exited {code}"])[-1]


@dataclass
class ServiceProcess:
    """A service started with `python -m MODULE ARGS`; ready once it logs the "serving" event."""

    module: str
    args: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    address: str = ""
    prefix: Sequence[str] = ()  # e.g. ("ip", "netns", "exec", NAME): run it elsewhere
    start_timeout: float = 60.0  # a service that fails exits, which start() sees at once

    def start(self, timeout: float | None = None) -> ServiceProcess:
        timeout = self.start_timeout if timeout is None else timeout
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.touch()
        offset = self.log_path.stat().st_size
        env = {**os.environ, **(self.env or {})}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.prefix, sys.executable, "-m", self.module, *self.args],
                stdout=log,
                stderr=log,
                env=env,
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
        """SIGTERM, then wait for a graceful exit; returns the exit code. `interrupted`: a
        Ctrl-C reached the service too (a terminal sends it to the whole process group), so
        it gets INTERRUPT_GRACE seconds to end on its own first: one still starting (a
        model import) cleans up, where a SIGTERM right after would cut that short."""
        if self.proc is None:
            return 0
        if interrupted:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=INTERRUPT_GRACE)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill9()
        return self.proc.returncode


def store_process(
    data_dir: Path,
    log_path: Path,
    listen: str = "127.0.0.1:0",
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
) -> ServiceProcess:
    """An `agentkv-store` process (not yet started)."""
    args = ["--data-dir", str(data_dir), "--listen", listen, *extra_args]
    return ServiceProcess("cache_store", args, log_path, env, prefix=prefix)


def worker_process(
    model: str,
    store: str,
    log_path: Path,
    listen: str = "127.0.0.1:0",
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> ServiceProcess:
    """An `agentkv-worker` process (not yet started). Its first start on a large GGUF file
    imports it, which may take minutes, hence the long wait for it to serve."""
    args = ["--model", model, "--store", store, "--listen", listen, *extra_args]
    return ServiceProcess("inference_worker", args, log_path, env, start_timeout=900.0)


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
