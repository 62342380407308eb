"""One store per data directory: an exclusive flock held for the store process's life.

LMDB's own lock file is not enough: a second store on the same directory would sweep the
first one's uploads in flight and collect blocks it has leased, and an operator who deletes
a "stale" `index/lock.mdb` lets two writers corrupt the index. The kernel drops a flock when
its holder exits, however it exits, so a crashed store never leaves the directory locked.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from agentkv.errors import FailedPrecondition

LOCK_NAME = "store.lock"


class DataDirInUse(FailedPrecondition):
    """Another live process holds the data directory."""


class DataDirLock:
    """Holds `data_dir/store.lock` exclusively; the file names the holder's pid."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / LOCK_NAME
        self._fd = -1

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirInUse(
                f"data dir {self.path.parent} is in use by another agentkv-store (pid {holder}, "
                f"holding {self.path}); stop that store first, or give this one its own --data-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing drops the flock; the file stays, harmlessly
            self._fd = -1
