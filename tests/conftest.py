from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentkv.client.store import StoreClient
from inference_worker.blas import load_optimized_blas
from tests.helpers import StoreProcess

load_optimized_blas()  # before anything imports mlx


@pytest.fixture
def store_process(tmp_path) -> Iterator[StoreProcess]:
    """A running store process on a free loopback port, stopped (SIGTERM) afterwards."""
    proc = StoreProcess(tmp_path / "data", tmp_path / "store.log").start()
    yield proc
    proc.stop()


@pytest.fixture
def small_disk(tmp_path) -> Iterator:
    """Mounts a tmpfs of a given size (e.g. "3m") and returns its path; skips where mounting
    is not allowed. Unmounted afterwards."""
    mounts = []

    def mount(size: str) -> Path:
        path = tmp_path / f"disk{len(mounts)}"
        path.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def store(store_process) -> Iterator[StoreClient]:
    with store_process.client() as client:
        yield client


ARCHS = ("llama", "gemma3_text", "deepseek_v2")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """One tiny random-weight model directory per architecture, built once per session."""
    from tests.model_kit import build_tiny_model, tiny_tokenizer

    root = tmp_path_factory.mktemp("models")
    tokenizer = tiny_tokenizer()
    return {arch: build_tiny_model(arch, root / arch, tokenizer) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_models(tiny_model_dirs):
    """(model, tokenizer) per architecture, loaded with mlx_lm.load."""
    from mlx_lm import load

    return {arch: load(str(path)) for arch, path in tiny_model_dirs.items()}


@pytest.fixture
def launched():
    """launched(proc) starts an agentkv.launch process and returns it; every one is stopped
    when the test ends, passed or failed, so no server outlives its test."""
    started = []

    def launch(proc, timeout: float = 60.0):
        started.append(proc)
        return proc.start(timeout)

    yield launch
    for proc in reversed(started):
        proc.stop()


@pytest.fixture
def start_worker(store_process, tmp_path):
    """Starts `agentkv-worker` processes against the test's store; stops them afterwards."""
    from agentkv.launch import worker_process

    started = []

    def start(model_dir: Path, *args: str, name: str = "worker"):
        proc = worker_process(
            str(model_dir),
            store_process.address,
            tmp_path / f"{name}.log",
            extra_args=["--block-tokens", "64", *args],
        )
        started.append(proc.start())
        return proc

    yield start
    for proc in started:
        proc.stop()
