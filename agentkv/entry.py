"""Where agentkv's programs start (the console scripts, and `python -m` each): a Ctrl-C
while their imports run (gRPC, numpy, MLX: up to a second of a start) ends as every agentkv
command's does, one line and exit 130, not a traceback. This module imports nothing heavy."""

from __future__ import annotations

import importlib
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def quiet_interrupt(prog: str) -> Iterator[None]:
    """While the block runs (a program's imports), SIGINT exits 130 saying it was
    interrupted; one ignored (nohup's, a script's background job) stays ignored."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        yield
        return

    def on_sigint(signum: int, frame: object) -> None:
        stop(prog, "interrupted", 130)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class Terminated(KeyboardInterrupt):
    """A SIGTERM before the process serves (docker stop, systemctl stop): it unwinds as a
    Ctrl-C does, so that an import under way removes what it was writing."""


def unwind_on_sigterm() -> None:
    """From now until the process installs its own handling: SIGTERM raises Terminated."""

    def terminated(signum: int, frame: object) -> None:
        raise Terminated

    signal.signal(signal.SIGTERM, terminated)


def interrupted(exc: BaseException) -> bool:
    """A Ctrl-C, also one that came while an extension module loaded: MLX's turns it into an
    ImportError ("Encountered an error while initializing the extension") caused by it."""
    return isinstance(exc, KeyboardInterrupt) or isinstance(exc.__cause__, KeyboardInterrupt)


def interrupted_exit(exc: BaseException, prog: str) -> None:
    """The one line and exit status of a process a Ctrl-C (130) or SIGTERM (143) ended."""
    if isinstance(exc, Terminated) or isinstance(exc.__cause__, Terminated):
        stop(prog, "stopped (SIGTERM)", 143)
    stop(prog, "interrupted", 130)


def stop(prog: str, why: str, status: int) -> None:
    print(f"{prog}: {why}" if prog else why, file=sys.stderr)
    sys.exit(status)


def _run(prog: str, module: str) -> None:
    with quiet_interrupt(prog):
        main = importlib.import_module(module).main
    main()


def agentkv() -> None:
    _run("", "agentkv.cli")


def store() -> None:
    _run("agentkv-store", "cache_store.__main__")


def worker() -> None:
    _run("agentkv-worker", "inference_worker.__main__")


def gateway() -> None:
    _run("agentkv-gateway", "agentkv.gateway.__main__")
