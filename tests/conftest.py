from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentkv.client.store import StoreClient
from inference_worker.blas import load_optimized_blas
from tests.helpers import StoreProcess

# OpenBLAS's idle threads spin for ~0.1 s after every call before they sleep: in the demo that
# was 74 of its 251 CPU seconds, in system time, taken from the suite's other processes (-n
# auto runs a pytest worker per core and one more). Threads that sleep at once keep the same
# thread count and the same sums. Read when OpenBLAS loads: here and in every process a test
# starts.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
load_optimized_blas()  # before anything imports mlx

# A command a shell starts in the background (`cmd &`, nohup, some CI runners) ignores SIGINT,
# and so does every process it starts: the Ctrl-C tests' commands would never see theirs. A
# handler goes back to the default at exec, an ignored signal does not: take Python's back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that declare a timeout over the default (the demo, the bench smoke run: minutes
    each) go first, so that a parallel run (scripts/test.sh: -n auto) starts them at once
    instead of ending on one while the other cores are idle. The rest keep their order."""
    items.sort(key=lambda item: -max((m.args[0] for m in item.iter_markers("timeout")), default=0))


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

    def launch(proc, timeout: float | None = None):  # None: the process's own start_timeout
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
