"""What a worker's start remembers of its model files (inference_worker.model_cache): the
fingerprint and a GGUF's digest come back equal to the ones computed, a rewrite is seen even
with the file's size and modification time put back, a file written just before its reading
is not remembered, and a cache that cannot be written costs nothing but the reading."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from agentkv.layers import KVFormat
from inference_worker import fingerprint, gguf_import, model_cache
from inference_worker.fingerprint import model_fingerprint


def unread(*_args: object) -> None:
    raise AssertionError("a file was read: the digest was not remembered")


@pytest.fixture
def model(tiny_model_dirs, tmp_path, monkeypatch) -> Path:
    """A copy of the tiny llama, and a model cache of this test's own."""
    monkeypatch.setenv("AGENTKV_MODEL_CACHE", str(tmp_path / "cache"))
    return Path(shutil.copytree(tiny_model_dirs["llama"], tmp_path / "model"))


def test_a_remembered_fingerprint_is_the_one_computed_until_a_file_changes(model, monkeypatch):
    """The second start reads no file and gets the same fingerprint; a weight rewritten with
    its size and modification time put back is read again and changes it."""
    monkeypatch.setattr(model_cache, "RACY_SECONDS", 0.0)  # the copy counts as settled
    first = model_fingerprint(model, KVFormat(), 256)
    assert (model.parent / "cache" / model_cache.DIGESTS).is_file()
    with monkeypatch.context() as m:
        m.setattr(fingerprint, "_hash_file", unread)
        assert model_fingerprint(model, KVFormat(), 256) == first
    weights = model / "model.safetensors"
    before = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_size == before.st_size
    changed = model_fingerprint(model, KVFormat(), 256)
    assert changed != first
    assert model_fingerprint(model, KVFormat(8, 4), 256) != changed  # its format is its own
    assert model_fingerprint(model, KVFormat(), 256, "float32") != changed  # its dtype
    assert model_fingerprint(model, KVFormat(), 256, "", "{{ x }}") != changed  # its template
    shutil.copy(weights, model / "model-2.safetensors")  # a shard more: hashed too
    assert model_fingerprint(model, KVFormat(), 256) != changed


def test_the_samples_tell_apart_files_alike_in_every_other_fact(tmp_path):
    """Where the kernel keeps no change time (an image, a FUSE object store), two files of one
    size and modification time at one path and inode differ in their samples."""
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(8 << 20))
    before = model_cache._facts(path)
    with open(path, "r+b") as f:
        f.seek((5 << 20) + (256 << 10))  # in no window (64 KiB at each 16th of the file)
        f.write(b"\1")
    assert model_cache._facts(path).samples == before.samples
    with open(path, "r+b") as f:
        f.seek(4 << 20)  # the start of the window at half the file
        f.write(b"\1")
    assert model_cache._facts(path).samples != before.samples


def test_what_is_not_remembered(model, monkeypatch):
    """A file changed while it was read, or one whose change time has no nanoseconds (kept by
    no kernel: it may be the same after a rewrite), leaves no digest behind."""
    monkeypatch.setattr(model_cache, "RACY_SECONDS", 0.0)
    store = model.parent / "cache" / model_cache.DIGESTS
    weights = model / "model.safetensors"
    compute = model_cache.remembered

    def rewritten() -> str:
        weights.write_bytes(weights.read_bytes())
        return "a digest of bytes that are gone"

    assert compute("x", [weights], rewritten) == "a digest of bytes that are gone"
    assert not store.exists()
    facts = model_cache._facts

    def whole_seconds(path: Path) -> model_cache.Facts:
        found = facts(path)
        return found._replace(ctime=found.ctime // 10**9 * 10**9)

    monkeypatch.setattr(model_cache, "_facts", whole_seconds)
    assert compute("x", [weights], lambda: "d") == "d"
    assert not store.exists()


def test_a_file_written_just_before_its_reading_is_not_remembered(model, monkeypatch):
    """Times move in coarse ticks: a digest of a file changed within RACY_SECONDS could be
    of the bytes before a second write in the same tick, so it is not kept."""
    written = (model / "model.safetensors").stat().st_ctime_ns / 1e9
    monkeypatch.setattr(model_cache.time, "time", lambda: written + 1.0)
    model_fingerprint(model, KVFormat(), 256)
    assert not (model.parent / "cache" / model_cache.DIGESTS).exists()


def test_a_cache_that_cannot_be_written_costs_only_the_reading(model, monkeypatch, tmp_path):
    monkeypatch.setattr(model_cache, "RACY_SECONDS", 0.0)
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("AGENTKV_MODEL_CACHE", str(tmp_path / "afile"))
    fresh = model_fingerprint(model, KVFormat(), 256)
    assert model_fingerprint(model, KVFormat(), 256) == fresh
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_damaged_digest_file_is_read_as_empty(model, monkeypatch):
    monkeypatch.setattr(model_cache, "RACY_SECONDS", 0.0)
    fresh = model_fingerprint(model, KVFormat(), 256)
    store = model.parent / "cache" / model_cache.DIGESTS
    too_large = json.dumps({f"k{i}": "v" * 200 for i in range(6000)})
    for damage in ('{"cut short', '["a list"]', '{"key": 7}', "[" * 100_000, too_large):
        store.write_text(damage)
        assert model_fingerprint(model, KVFormat(), 256) == fresh
    assert fresh in json.loads(store.read_text()).values()  # remembered anew
    key = next(iter(json.loads(store.read_text())))
    store.write_text(json.dumps({key: ""}))  # an empty digest is none
    assert model_fingerprint(model, KVFormat(), 256) == fresh
    store.unlink()
    os.mkfifo(store)  # no regular file: not read (opening a FIFO to read would block)
    assert model_fingerprint(model, KVFormat(), 256) == fresh


def test_no_home_directory_costs_only_the_reading(model, monkeypatch):
    monkeypatch.delenv("AGENTKV_MODEL_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", lambda: (_ for _ in ()).throw(RuntimeError("no home")))
    assert model_fingerprint(model, KVFormat(), 256).startswith("llama-")


def test_a_gguf_digest_is_remembered_in_the_cache_it_imports_into(tmp_path, monkeypatch):
    monkeypatch.setattr(model_cache, "RACY_SECONDS", 0.0)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    cache = tmp_path / "cache"
    digest = gguf_import.gguf_digest(gguf, cache)
    assert digest == gguf_import.file_hash(gguf)
    monkeypatch.setattr(gguf_import, "file_hash", unread)
    assert gguf_import.gguf_digest(gguf, cache) == digest
