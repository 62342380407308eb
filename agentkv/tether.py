"""`python -m agentkv.tether PARENT SIGNAL (-m MODULE | SCRIPT) ARGS...` runs, in this
process, what `python -m MODULE ARGS` (or `python SCRIPT ARGS`) would, once it has asked the
kernel for SIGNAL when PARENT ends (Linux's PR_SET_PDEATHSIG; elsewhere it only checks that
PARENT is still its parent). `--exec PROGRAM ARGS` instead becomes PROGRAM (the request
outlives the exec): a server that is no Python module, or one started as `python -c`.

A command ties the services it starts in sessions of their own to itself this way: a kill -9
of the command, which no group kill carries to them, takes them along. The tie was a
subprocess preexec_fn, run between fork and exec. With one, subprocess forks with fork(),
which runs fork handlers (gRPC's could wait forever in a process with live channels: the
walkthrough hung in fork() restarting its worker). With none, on Linux it uses vfork(), which
runs none, and the child ties itself here. (Elsewhere subprocess forks anyway; agentkv's
package turns gRPC's handlers off, GRPC_ENABLE_FORK_SUPPORT.) A `prefix` that forks (sudo,
timeout) would be the parent here: ServiceProcess ties no service started through one.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import runpy
import signal
import sys
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def command(parent: int, sig: int, target: Sequence[str]) -> list[str]:
    """The command that runs `target` (python's arguments: "-m", MODULE, ... or SCRIPT, ...;
    or "--exec", PROGRAM, ...) tied to `parent`, the thread of it that starts the child
    (os.getpid() from the main one)."""
    return [sys.executable, "-m", "agentkv.tether", str(parent), str(int(sig)), *target]


def tie(parent: int, sig: int) -> None:
    """`sig` for this process once `parent` ends; at once if it has ended already."""
    with contextlib.suppress(OSError, AttributeError):  # no prctl: not Linux
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # it ended before the above took hold
        os.kill(os.getpid(), sig)


def main(argv: list[str]) -> None:
    parent, sig, *target = argv
    tie(int(parent), int(sig))
    if target[0] == "--exec":
        for name in ("SIGPIPE", "SIGXFSZ"):  # Python ignores them; an exec would keep that
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_DFL)
        try:
            os.execvp(target[1], target[1:])
        except OSError as exc:  # one line, as a shell says it
            sys.exit(f"{target[1]}: {exc.strerror}")
    if target[0] == "-m":
        sys.argv = target[1:]  # run_module puts the module's file first, as -m does
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = target
        sys.path[0] = os.path.dirname(os.path.abspath(target[0]))  # as python SCRIPT does
        runpy.run_path(target[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
