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

    def interrupted(signum: int, frame: object) -> None:
        print(f"{prog}: interrupted" if prog else "interrupted", file=sys.stderr)
        sys.exit(130)

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


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
