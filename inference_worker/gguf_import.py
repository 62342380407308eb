"""GGUF import: a llama.cpp model file as an mlx-lm model directory.

`import_gguf(file, out, weights)` writes config.json, model.safetensors, tokenizer.json and
tokenizer_config.json, which `mlx_lm.load` opens offline; the tensors and config come from
gguf_model.py, the tokenizer from gguf_tokenizer.py. The directory is written whole or not
at all (staged, then renamed into place). `cached_import` does it once per file, keyed by
the file's hash, which also enters the directory's config (and so the worker's fingerprint).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import xxhash

from agentkv.errors import in_one_line
from inference_worker.gguf_model import (
    GROUP_SIZE,
    ROPE_FREQS,
    architecture_of,
    check_tensor_types,
    convert_tensors,
    llama3_rope,
    model_config,
    read_gguf,
)
from inference_worker.gguf_tokenizer import GGUFError, build_tokenizer, tokenizer_config
from inference_worker.model_cache import cache_env, default_cache_dir, remembered

WEIGHTS = ("float32", "float16", "bfloat16", "native")
log = logging.getLogger("agentkv.worker")
# Bump when the output of an import changes: it names the cache directory and enters the
# model's config, so the fingerprint of every agent stored under it. Per weights choice, so
# that a change to one leaves the others' agents restorable (4: native keeps Q4_K; 5: and
# Q5_0, Q5_1 and Q5_K, as 5-bit layers).
FORMAT_VERSIONS = {"float32": 3, "float16": 3, "bfloat16": 3, "native": 5}


def format_version(weights: str) -> int:
    if weights not in FORMAT_VERSIONS:
        raise GGUFError(f"weights {weights!r} is not one of {', '.join(WEIGHTS)}")
    return FORMAT_VERSIONS[weights]


READ_CHUNK = 16 << 20
# Each imported file's size and xxh3: what a cached import is checked against when it is used
RECORD = "agentkv-import.json"
IMPORTED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    RECORD,
)
INSIDE = ".import."  # a staging directory inside --out (a mount point's)
LOCK = "import.lock"  # in the model cache: imports into it take turns on it


def file_hash(path: Path) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_digest(path: Path, cache_dir: Path) -> str:
    """The GGUF's xxh3_128, remembered in the model cache: a worker's start reads the file
    whole only when it is new there, or changed (model_cache.remembered)."""
    return remembered("gguf xxh3_128", [path], lambda: file_hash(path), cache_dir)


def import_gguf(path: Path, out: Path, weights: str = "float32") -> Path:
    """Writes an mlx-lm model directory for the GGUF at `path` to `out`, whole or not at all:
    beside it, then renamed into place. `out` may be new, empty, or an earlier import (which
    it replaces); a directory holding other files is refused before any work."""
    _check_out(out)
    if out.is_dir() and (os.path.ismount(out) or not os.access(out.parent, os.W_OK)):
        return _import_inside(path, out, weights)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = _staging(f".{out.name}.", out.parent)
    except OSError as exc:  # the import is staged beside --out: a folder that takes none
        message = f"--out {out}: nothing can be written in {out.parent} ({exc.strerror})"
        raise GGUFError(message) from None
    try:
        write_model(path, staging, weights)
        _replace(out, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _staging(prefix: str, parent: Path) -> Path:
    """A new directory in `parent` to write an import in and rename into place, of the mode
    mkdir gives (0777 less the umask), not mkdtemp's 0700: an import run as root (an image's
    build, `sudo agentkv model import`) is read by the service's user."""
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    staging.chmod(0o777 & ~_umask())
    return staging


def _umask() -> int:
    """The process's umask, read without setting it (os.umask would, for every thread)."""
    with contextlib.suppress(OSError, ValueError, StopIteration), open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    umask = os.umask(0o022)  # no /proc (macOS): set and put back at once
    os.umask(umask)
    return umask


def _import_inside(path: Path, out: Path, weights: str) -> Path:
    """The import into `out` where it cannot be renamed into place (a mount point, or a parent
    this user may not write): staged inside it, its files moved in one by one, config.json
    (what loaders open first) last, so a crash leaves no config.json without its weights."""
    for stale in out.glob(INSIDE + "*"):  # a killed import's (one --out, one import)
        shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=INSIDE, dir=out))
    try:
        write_model(path, staging, weights)
        (out / "config.json").unlink(missing_ok=True)  # the earlier import is whole no more
        for name in (*IMPORTED_FILES[1:], IMPORTED_FILES[0]):
            os.replace(staging / name, out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise GGUFError(f"{out} is a file, not a directory")
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise GGUFError(f"--out {out}: {above} is a file, not a directory")
    names = (
        {p.name for p in out.iterdir() if not p.name.startswith(INSIDE)} if out.is_dir() else set()
    )
    if not names <= set(IMPORTED_FILES) or (names and not _an_import(out)):
        raise GGUFError(
            f"{out} holds files of its own: give --out a new or empty directory, or an earlier "
            "import (replaced)"
        )


def _an_import(out: Path) -> bool:
    """Whether `out`, which holds only files of an import's names, is one: its config.json
    names the GGUF it came from (a model directory of those names is not replaced), or it
    has none, as an import into it in place (_import_inside) leaves one cut short."""
    if not (out / "config.json").exists():
        return True
    try:
        return "agentkv_gguf" in json.loads((out / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def _replace(out: Path, staging: Path) -> None:
    """`staging` renamed to `out`; an earlier import there is moved aside first, then
    removed, so `out` is never half of one and half of the other."""
    if out.is_dir() and any(out.iterdir()):
        earlier = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        out.rename(earlier / "old")
        staging.rename(out)
        shutil.rmtree(earlier, ignore_errors=True)
    else:
        staging.replace(out)  # an empty directory is replaced


def write_model(path: Path, out: Path, weights: str = "float32") -> None:
    """Writes the model directory's files (IMPORTED_FILES) into the directory `out`."""
    import mlx.core as mx

    if weights not in WEIGHTS:
        raise GGUFError(f"weights {weights!r} is not one of {', '.join(WEIGHTS)}")
    try:
        hf, tokenizer, tokenizer_json, config = _convert(path, weights)
    except (GGUFError, OSError):
        raise
    except Exception as exc:  # metadata of the wrong type or value, as numpy or tokenizers meet it
        raise GGUFError(
            f"GGUF {path} holds metadata this import cannot use: {in_one_line(exc)}"
        ) from exc
    target = out / "model.safetensors"
    try:
        mx.save_safetensors(str(target), hf, metadata={"format": "mlx"})
    except RuntimeError as exc:  # MLX's words for a failed write ("Unable to write N bytes")
        free = shutil.disk_usage(out).free
        raise OSError(f"{target}: {exc} ({free} bytes free there)") from exc
    try:
        tokenizer.save(str(out / "tokenizer.json"))
    except Exception as exc:  # the tokenizers library's words for a failed write
        free = shutil.disk_usage(out).free
        raise OSError(f"{out / 'tokenizer.json'}: {exc} ({free} bytes free there)") from exc
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_json, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _check_loads(path, out)  # before its record: one that does not load is no import
    files = {name: _file_facts(out / name) for name in IMPORTED_FILES if name != RECORD}
    (out / RECORD).write_text(json.dumps(files, indent=2) + "\n")


def _file_facts(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "xxh3": file_hash(path)}


def damage(model: Path) -> str:
    """Why an imported directory is not as its import wrote it ("" when it is, or when it
    is an import from before the record, which cannot be checked): a file missing, cut
    short, or changed. A file of its recorded size and modification time is taken as
    written (every start would read the weights twice otherwise: 32 GB for an 8B model in
    float32); one touched since is hashed."""
    try:
        recorded = json.loads((model / RECORD).read_text())
        files = {str(name): (int(f["bytes"]), f.get("mtime_ns"), str(f["xxh3"]))
                 for name, f in recorded.items()}  # fmt: skip
    except FileNotFoundError:
        return "" if (model / "config.json").exists() else "config.json is missing"
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        return f"{RECORD} cannot be read ({in_one_line(exc)})"
    for name, (size, mtime_ns, xxh3) in files.items():
        path = model / name
        if not path.is_file():
            return f"{name} is missing"
        stat = path.stat()
        if stat.st_size != size:
            return f"{name} is {stat.st_size} bytes, not the {size} imported"
        if stat.st_mtime_ns != mtime_ns and file_hash(path) != xxh3:
            return f"{name} is not the file imported (its xxh3 differs)"
    return ""


def _convert(path: Path, weights: str) -> tuple[dict, Any, dict, dict]:
    """The model's tensors, tokenizer, tokenizer config and config, from the GGUF."""
    tensors, meta = read_gguf(path, weights)
    architecture_of(meta)  # refuse before any work
    hf, quantization = convert_tensors(tensors, meta, weights)
    if "model.embed_tokens.weight" not in hf:
        raise GGUFError(f"GGUF {path} has no token_embd.weight (the token embeddings)")
    tokenizer, tokenizer_json = build_tokenizer(meta), tokenizer_config(meta)
    rows, count = int(hf["model.embed_tokens.weight"].shape[0]), len(meta["tokenizer.ggml.tokens"])
    if count > rows:  # its last tokens' ids would read past the embeddings
        raise GGUFError(
            f"GGUF {path} has {count} tokens (tokenizer.ggml.tokens) but token_embd.weight "
            f"has {rows} rows: one per token at least"
        )
    tied = "lm_head.weight" not in hf
    config = model_config(meta, rows, tied)
    if ROPE_FREQS in tensors:
        theta, head_dim = config["rope_theta"], config["head_dim"]
        config["rope_scaling"] = llama3_rope(tensors[ROPE_FREQS], head_dim, theta)
    if quantization:
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": 4, **quantization}
    _check_config(config, {name.split(".")[1] for name in tensors if name.startswith("blk.")})
    config["agentkv_gguf"] = {
        "file": path.name,
        "xxh3_128": file_hash(path),
        "weights": weights,
        "format": format_version(weights),
        "name": str(meta.get("general.name", "")),
        "license": str(meta.get("general.license", "")),
    }
    return hf, tokenizer, tokenizer_json, config


def _check_config(config: dict, blocks: set[str]) -> None:
    """Refuses metadata that is not a number where one is meant (NaN, infinite), or a layer
    count its tensors do not hold: built as it is, the first runs a model that says nothing
    but its end token, the second fails in mlx-lm (a 2^32-1 one builds layers until memory
    runs out)."""
    for key, value in config.items():
        values = value.values() if isinstance(value, dict) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise GGUFError(f"GGUF metadata gives {key} = {value}: not a finite number")
    layers = config.get("num_hidden_layers")
    if isinstance(layers, int) and (
        len(blocks) != layers or blocks != {str(i) for i in range(layers)}
    ):
        raise GGUFError(
            f"GGUF metadata gives {layers} layers (block_count), its tensors {len(blocks)}"
        )


def _check_loads(path: Path, out: Path) -> None:
    """The imported model as mlx-lm builds it from its config, every weight checked against
    the shape the config gives it (lazily: nothing is read): metadata that disagrees with
    the tensors (a head count, an embedding width) is the import's error, not the worker's."""
    from mlx_lm.utils import load_model

    try:
        load_model(out, lazy=True, strict=True)
    except Exception as exc:
        raise GGUFError(
            f"GGUF {path}: its metadata disagrees with its tensors: {in_one_line(exc)}"
        ) from exc


def cached_import(path: Path, weights: str = "float32", cache_dir: Path | None = None) -> Path:
    """The imported directory for `path`, made once per file content and weights choice.
    The import is written beside and renamed into place, so a crash leaves none or all.
    Imports into one cache take turns (an flock on the cache directory, which the kernel
    drops however its holder ends): the next one finds a file imported meanwhile, and knows
    that a staging directory of its own key left there is a killed import's, and removes it."""
    check_tensor_types(path)  # also for a file imported before agentkv refused its types
    named = "cache (env AGENTKV_MODEL_CACHE)" if not cache_dir and cache_env() else "cache"
    cache_dir = cache_dir or default_cache_dir()
    digest = gguf_digest(path, cache_dir)
    key = f"{path.stem[:48]}-{digest[:16]}-{weights}-v{format_version(weights)}"
    target = cache_dir / key
    if target.exists() and not damage(target):
        return target
    unwritable = (  # the cache's own trouble, not the import's (a full disk names its file)
        f"the model {named} {cache_dir} cannot hold imports: {{}} (set AGENTKV_MODEL_CACHE to "
        "a folder this user can write)"
    )
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(unwritable.format(exc.strerror)) from None
    try:
        with _taking_turns(cache_dir) as alone:
            return _import_into(path, weights, cache_dir, key, alone)
    except OSError as exc:
        if exc.filename is None or Path(exc.filename).parent not in (cache_dir, cache_dir.parent):
            raise
        raise OSError(unwritable.format(exc.strerror)) from None


def _import_into(path: Path, weights: str, cache_dir: Path, key: str, alone: bool) -> Path:
    """The import of `path` as `cache_dir / key`, while imports there take turns: one made
    meanwhile is taken, a damaged one set aside, and a staging directory of this key left
    by a killed import (when the turns are held: `alone`) removed."""
    target = cache_dir / key
    if target.exists():
        if not (why := damage(target)):  # another process imported it meanwhile
            return target
        log.warning(
            "cached import damaged: imported again", extra={"model": str(target), "why": why}
        )
        aside = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=cache_dir))
        with contextlib.suppress(FileNotFoundError):  # moved by another (no flock here)
            target.rename(aside / "damaged")
        shutil.rmtree(aside, ignore_errors=True)
    for stale in cache_dir.glob(f".{glob.escape(key)}.*") if alone else ():
        shutil.rmtree(stale, ignore_errors=True)
    staging = _staging(f".{key}.", cache_dir)
    try:
        write_model(path, staging, weights)
        staging.rename(target)
    except OSError as exc:  # another import landed first (turns not held: no flock here)
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or damage(target):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@contextmanager
def _taking_turns(directory: Path) -> Iterator[bool]:
    """Holds an exclusive flock on a lock file in `directory` (waiting for it; in it, so that
    every path to the cache, a link's or another mount's, takes turns on the one file, and
    the cache's parent need not be writable) while the block runs; yields whether it holds it. A
    filesystem without such locks (some NFS and SMB mounts refuse flock, or turn it into a
    byte-range lock, for which the file is opened to write) yields False: the import goes on,
    but must not take another's staging directory for a dead one's."""
    lock = directory / LOCK
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            _lock(fd, directory)
        except OSError as exc:
            if exc.errno not in (errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            yield False
            return
        yield True
    finally:
        os.close(fd)  # drops the flock


def _lock(fd: int, directory: Path) -> None:
    """An exclusive flock on `fd`, saying so when it waits for another import (a worker's
    start waited without a word, its log silent, however long the other took or hung)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.warning(
            "waiting for another import into the model cache to end",
            extra={"cache": str(directory)},
        )
        fcntl.flock(fd, fcntl.LOCK_EX)
