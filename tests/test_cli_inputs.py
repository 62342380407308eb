"""What the CLI is given and cannot use (an address, a config, a path) is a usage error naming
it, before anything connects; `agentkv agents` lists every agent even when some cannot be
described. From the real CLI, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import free_address


def agentkv(*args: str, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "agentkv.cli", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )


def no_internals(stderr: str) -> bool:
    return not any(s in stderr for s in ("Traceback", "Source Location", "Failed to create"))


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["store", "stats", "--store", ""], "--store"),
        (["store", "--store", "", "stats"], "--store"),
        (["store", "stats", "--store", "garbage"], "--store"),
        (["store", "stats", "--store", "unix:"], "--store"),
        (["agents", "--store", ""], "--store"),
        (["agents", "--worker", ""], "--worker"),
        (["run", "prisoners_dilemma", "--worker", "127.0.0.1:1", "--worker", "x"], "--worker"),
    ],
    ids=["store-empty", "store-empty-before", "store-garbage", "unix-no-path", "agents-store",
         "agents-worker", "run-worker"],
)  # fmt: skip
def test_a_malformed_address_is_a_usage_error_naming_its_flag(args, flag):
    proc = agentkv(*args)
    assert proc.returncode == 2, proc.stderr
    assert no_internals(proc.stderr), proc.stderr
    assert f"error: argument {flag}: " in proc.stderr.splitlines()[-1], proc.stderr


def test_a_malformed_address_in_the_environment_names_the_variable():
    proc = agentkv("store", "stats", AGENTKV_STORE="garbage")
    assert proc.returncode == 2 and no_internals(proc.stderr), proc.stderr
    assert "error: env AGENTKV_STORE: " in proc.stderr.splitlines()[-1], proc.stderr
    proc = agentkv("agents", "--store", free_address(), AGENTKV_WORKERS="127.0.0.1:1,,x")
    assert proc.returncode == 2 and "error: env AGENTKV_WORKERS: " in proc.stderr, proc.stderr


def test_an_empty_address_variable_counts_as_unset():
    nobody = free_address()
    proc = agentkv("agents", "--store", nobody, AGENTKV_WORKERS="")
    assert proc.returncode == 2 and no_internals(proc.stderr), proc.stderr
    assert proc.stderr.startswith(f"error: no store at {nobody} "), proc.stderr
    proc = agentkv("store", "stats", AGENTKV_STORE="")  # the default, 127.0.0.1:50051
    assert no_internals(proc.stderr) and "''" not in proc.stderr, proc.stderr
    assert proc.returncode == 0 or "127.0.0.1:50051" in proc.stderr, proc.stderr
