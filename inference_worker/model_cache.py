"""The model cache: where imported models live, and what is remembered of model files there.

Besides the imports it holds `digests.json`: the digests a worker's start takes of whole files
(a GGUF's, which names its import; the model fingerprint, over every weight), each kept with
what the kernel says of those files (path, device, inode, size, modification and change
times) and samples of their bytes (SAMPLES windows of 64 KiB, ends included). A start that
finds them so takes the digest from there instead of reading every byte again (0.34 s of
SmolLM2's 1.95 s start here; a second per ~2 GB of weights). A file written since is read
again, even with its size and modification time put back: its change time moves, and only
the kernel sets that. Where it does not (squashfs and other images, FUSE object stores: a
change time with no nanoseconds, or 0), nothing is remembered; and the samples tell apart
two models whose files agree in every other fact (a fine-tune differs nearly everywhere). A
file changed within RACY_SECONDS of a reading is not remembered (git distrusts an index
entry as new as its index the same way): the times move in coarse ticks, and two writes
within one would look alike. Bit rot outside the samples goes unseen, as in
`gguf_import.damage`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import xxhash

log = logging.getLogger("agentkv.worker")

DIGESTS = "digests.json"
RACY_SECONDS = 2.0
KEPT = 1024  # digests remembered (~130 bytes each); the oldest go first
MAX_BYTES, MAX_VALUE = 1 << 20, 256  # a digests.json or a digest larger is none of ours
SAMPLES, SAMPLE = 17, 64 << 10  # windows of each file's bytes in its facts, and their size


def default_cache_dir() -> Path:
    """Where imported models live: $AGENTKV_MODEL_CACHE, else ~/.cache/agentkv/models."""
    env = cache_env()
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "agentkv" / "models"


def cache_env() -> str:
    return os.environ.get("AGENTKV_MODEL_CACHE", "")


def remembered(
    what: str, files: Sequence[Path], digest: Callable[[], str], cache_dir: Path | None = None
) -> str:
    """digest() of `files`, or the one remembered for them as they are now. `what` names the
    digest and whatever else it covers (a change to how it is computed must change it)."""
    settled = (time.time() - RACY_SECONDS) * 1e9  # ns: a change before this is not racy
    try:
        store = (cache_dir or default_cache_dir()) / DIGESTS
    except RuntimeError:  # no home directory to find a cache in: nothing remembered
        return digest()
    before = [_facts(path) for path in files]
    key = xxhash.xxh3_128_hexdigest(json.dumps([what, before]).encode())
    if (known := _read(store).get(key)) is not None:
        return known
    value = digest()
    if any(f.ctime % 10**9 == 0 or f.ctime >= settled for f in before):  # no kernel's, racy
        why = "a file changed just now, or keeps no change time"
        log.debug("digest not remembered", extra={"cache": str(store), "error": why})
    elif [_facts(path) for path in files] == before:  # not changed while it was read
        _remember(store, key, value)
    return value


class Facts(NamedTuple):  # a list in the key's JSON
    path: str
    resolved: str
    dev: int
    ino: int
    size: int
    mtime: int  # ns
    ctime: int  # ns
    samples: str  # xxh3_64 of the SAMPLES windows


def _facts(path: Path) -> Facts:
    """A file's Facts, from one open of it (stat and samples of the same file)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        sampled = xxhash.xxh3_64()
        last = max(st.st_size - SAMPLE, 0)
        offsets = {min(i * st.st_size // (SAMPLES - 1), last) for i in range(SAMPLES)}
        for offset in sorted(offsets) if stat.S_ISREG(st.st_mode) else ():
            sampled.update(os.pread(fd, SAMPLE, offset))
    finally:
        os.close(fd)
    where = (str(path), str(path.resolve()), st.st_dev, st.st_ino)
    return Facts(*where, st.st_size, st.st_mtime_ns, st.st_ctime_ns, sampled.hexdigest())


def _read(store: Path) -> dict[str, str]:
    """What `store` remembers: nothing where it is missing, no regular file, too large,
    unreadable or not what _remember writes."""
    try:
        fd = os.open(store, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO there would block
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
                return {}
            known = json.loads(f.read())
    except Exception:  # OSError, ValueError, RecursionError (nested deep): nothing
        return {}
    if not isinstance(known, dict):
        return {}
    return {
        k: v
        for k, v in known.items()
        if isinstance(k, str) and isinstance(v, str) and 0 < len(v) <= MAX_VALUE
    }


def _remember(store: Path, key: str, value: str) -> None:
    """Adds key: value, written beside and renamed over, so a reader sees the old file or the
    new one. Two processes remembering at once may lose one of the two: it is taken again.
    A cache it cannot write is left as it is (its imports say so themselves)."""
    known = _read(store)
    known.pop(key, None)
    known[key] = value
    kept = dict(list(known.items())[-KEPT:])
    staged = ""
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        fd, staged = tempfile.mkstemp(prefix=f".{DIGESTS}.", dir=store.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(kept, f)
        os.replace(staged, store)
        staged = ""
    except OSError as exc:
        log.debug("digest not remembered", extra={"cache": str(store), "error": str(exc)})
    finally:  # an error, a signal: no staged file is left
        if staged:
            with contextlib.suppress(OSError):
                os.unlink(staged)
