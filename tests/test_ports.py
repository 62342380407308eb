"""One server a port: a service started on an address another one serves refuses to start,
in one line, instead of sharing the port (gRPC sets SO_REUSEPORT) and taking part of the
first one's connections, past its tokens if it has none."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from agentkv.client.store import StoreClient
from agentkv.errors import Unauthenticated


def start(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=120
    )


def test_a_store_on_a_port_in_use_refuses_to_start(store_process, tmp_path):
    taken = store_process.address
    second = start("cache_store", "--data-dir", str(tmp_path / "second"), "--listen", taken)
    assert second.returncode == 2 and "Traceback" not in second.stderr
    assert second.stderr.strip().splitlines()[-1] == (
        f"agentkv-store: error: could not bind {taken}: Address already in use"
    )
    assert "add_port" not in second.stderr  # gRPC's own log line is never reached
    assert not (tmp_path / "second").exists()  # it checked the port before it made its data


def test_a_worker_on_a_port_in_use_says_so_before_it_waits_for_its_store(tmp_path):
    """Before, a worker whose --store did not answer waited for it (10 s) and loaded its
    model, then found its own port taken."""
    import socket

    with socket.socket() as held, socket.socket() as silent:
        held.bind(("127.0.0.1", 0))
        held.listen()
        silent.bind(("127.0.0.1", 0))  # bound, never listening: a store that refuses
        taken = f"127.0.0.1:{held.getsockname()[1]}"
        store = f"127.0.0.1:{silent.getsockname()[1]}"
        worker = start(
            "inference_worker", "--model", "nosuchmodel", "--store", store, "--listen", taken
        )
    assert worker.returncode == 2 and "Traceback" not in worker.stderr, worker.stderr
    last = worker.stderr.strip().splitlines()[-1]
    assert last == f"agentkv-worker: error: could not bind {taken}: Address already in use"


def test_a_store_on_an_address_of_another_host_says_so(tmp_path):
    """Not "in use, or not an address of this host": which of the two, in the system's
    words (192.0.2.1 is TEST-NET-1, never an address of this host)."""
    args = ("--data-dir", str(tmp_path / "d"), "--allow-unauthenticated")
    for listen, why in (
        ("192.0.2.1:50999", os.strerror(errno.EADDRNOTAVAIL)),
        ("nosuchhost.invalid:50999", ""),  # the resolver's words differ by system
    ):
        run = start("cache_store", *args, "--listen", listen)
        assert run.returncode == 2 and "add_port" not in run.stderr, run.stderr
        last = run.stderr.strip().splitlines()[-1]
        assert last.startswith(f"agentkv-store: error: could not bind {listen}: {why}"), last
        assert "in use" not in last


def test_a_worker_on_a_port_in_use_refuses_to_start(store_process, tiny_model_dirs):
    taken = store_process.address
    model = str(tiny_model_dirs["llama"])
    worker = start("inference_worker", "--model", model, "--store", taken, "--listen", taken)
    assert worker.returncode == 2 and "Traceback" not in worker.stderr
    assert "add_port" not in worker.stderr
    assert (
        worker.stderr.strip()
        .splitlines()[-1]
        .startswith(f"agentkv-worker: error: could not bind {taken}")
    )


def test_a_metrics_port_in_use_is_one_line_naming_the_flag(store_process, tmp_path):
    """--metrics-listen on a port another server holds: the store says which flag, not a
    bare "[Errno 98] Address already in use"."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = f"127.0.0.1:{held.getsockname()[1]}"
        second = start(
            *("cache_store", "--data-dir", str(tmp_path / "s"), "--listen", "127.0.0.1:0"),
            *("--metrics-listen", taken),
        )
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
    assert second.stderr.strip().splitlines()[-1] == (
        f"agentkv-store: error: could not serve metrics on {taken} (--metrics-listen): "
        "Address already in use"
    )


def test_a_second_store_on_a_unix_socket_in_use_refuses_and_leaves_it(tmp_path):
    from agentkv.launch import store_process as new_store

    path = tmp_path / "store.sock"
    first = new_store(tmp_path / "first", tmp_path / "first.log", f"unix:{path}").start()
    try:
        second = start(
            "cache_store", "--data-dir", str(tmp_path / "s2"), "--listen", f"unix:{path}"
        )
        assert second.returncode == 2 and "a server is listening there" in second.stderr
        with StoreClient(f"unix:{path}") as client:
            assert client.stats() is not None  # the first one still answers on its socket
    finally:
        first.stop()


def test_a_unix_socket_in_a_missing_directory_says_so(tmp_path):
    """It said "in use, or not an address of this host", and gRPC logged a line of its own."""
    path = tmp_path / "nodir" / "store.sock"
    run = start("cache_store", "--data-dir", str(tmp_path / "data"), "--listen", f"unix:{path}")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last == f"agentkv-store: error: could not bind unix:{path}: no directory {path.parent}"


def test_tokens_hold_when_another_store_is_started_on_the_port(tmp_path):
    """The reviewer's case: a store with tokens, then one without on its port; before, 2 of
    12 clients without a token reached the second one."""
    from agentkv.launch import store_process as new_store

    table = tmp_path / "tokens.json"
    entry = '{"name": "a", "token": "token-a-0123456789", "namespaces": ["*"]}'
    table.write_text(f'{{"tokens": [{entry}]}}')
    table.chmod(0o600)
    args = ["--auth-tokens", str(table)]
    secured = new_store(tmp_path / "sec", tmp_path / "sec.log", extra_args=args).start()
    try:
        start("cache_store", "--data-dir", str(tmp_path / "open"), "--listen", secured.address)
        for _ in range(12):
            with StoreClient(secured.address) as client, pytest.raises(Unauthenticated):
                client.stats()
    finally:
        secured.stop()
