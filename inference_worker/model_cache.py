"""The model cache: where imported models live, and what is remembered of model files there.

Besides the imports it holds `digests.json`: the digests a worker's start takes of whole files
(a GGUF's, which names its import; the model fingerprint, over every weight), each kept with
what the kernel says of those files: device, inode, size, and modification and change times.
A start that finds them so takes the digest from there instead of reading every byte again
(0.34 s of SmolLM2's 1.95 s start here; a second per ~2 GB of weights). A file written since
is read again, even with its size and modification time put back: its change time moves, and
only the kernel sets that. A file changed within RACY_SECONDS of a reading is not remembered
(git distrusts an index entry as new as its index the same way): the times move in coarse
ticks, and two writes within one would look alike. Bit rot, which moves no time, goes unseen
here, as in `gguf_import.damage`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import xxhash

log = logging.getLogger("agentkv.worker")

DIGESTS = "digests.json"
RACY_SECONDS = 2.0
KEPT = 256  # digests remembered; the oldest go first


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
    before = [_facts(path) for path in files]
    key = xxhash.xxh3_128_hexdigest(json.dumps([what, before]).encode())
    store = (cache_dir or default_cache_dir()) / DIGESTS
    if (known := _read(store).get(key)) is not None:
        return known
    settled = (time.time() - RACY_SECONDS) * 1e9  # ns: a change older than this is not racy
    value = digest()
    if [_facts(path) for path in files] == before and all(f[-1] < settled for f in before):
        _remember(store, key, value)
    return value


def _facts(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _read(store: Path) -> dict[str, str]:
    try:
        known = json.loads(store.read_text())
    except (OSError, ValueError):  # none yet, unreadable, or cut short: nothing remembered
        return {}
    if not isinstance(known, dict):
        return {}
    return {k: v for k, v in known.items() if isinstance(k, str) and isinstance(v, str)}


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
    except OSError as exc:
        log.debug("digest not remembered", extra={"cache": str(store), "error": str(exc)})
        if staged:
            with contextlib.suppress(OSError):
                os.unlink(staged)
