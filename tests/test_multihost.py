"""The store and the worker on separate hosts: the store in its own network namespace, joined
to the worker's by a veth pair, so restores stream over a real interface (not loopback), with
the bearer tokens and TLS that listening beyond loopback requires. Skipped, saying why,
where network namespaces cannot be made."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from agentkv.channels import ClientSecurity
from agentkv.client.store import StoreClient
from agentkv.client.worker import WorkerClient
from agentkv.launch import store_process, worker_process
from tests.helpers import make_certs

TOKEN = "multihost-token-0123456789"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def store_host():
    """(netns name, the store host's address, the worker side's veth name)."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed: cannot make network namespaces")
    tag = os.getpid() % 100000
    name, here, there, subnet = f"akv-store-{tag}", f"akv{tag}a", f"akv{tag}b", 77 + tag % 150
    try:
        ip("netns", "add", name)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"network namespaces are not allowed here: {exc.stderr.strip()}")
    try:
        ip("link", "add", here, "type", "veth", "peer", "name", there)
        ip("link", "set", there, "netns", name)
        ip("addr", "add", f"10.{subnet}.0.1/30", "dev", here)
        ip("link", "set", here, "up")
        ip("netns", "exec", name, "ip", "addr", "add", f"10.{subnet}.0.2/30", "dev", there)
        ip("netns", "exec", name, "ip", "link", "set", there, "up")
        ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield name, f"10.{subnet}.0.2", here
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def received(interface: str) -> int:
    return int(Path(f"/sys/class/net/{interface}/statistics/rx_bytes").read_text())


def test_restore_streams_across_hosts(store_host, tmp_path, tiny_model_dirs):
    netns, host, veth = store_host
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [{"token": TOKEN, "namespaces": ["*"]}]}))
    (tmp_path / "token").write_text(TOKEN)
    certs = make_certs(tmp_path / "certs", f"IP:{host}")  # tokens beyond loopback need TLS
    tls = ["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key")]
    store = store_process(
        tmp_path / "data",
        tmp_path / "store.log",
        listen=f"{host}:0",
        extra_args=["--auth-tokens", str(tokens), *tls],
        prefix=("ip", "netns", "exec", netns),
    ).start()
    worker = None
    try:
        assert store.address.startswith(host)
        worker = worker_process(
            str(tiny_model_dirs["llama"]),
            store.address,
            tmp_path / "worker.log",
            extra_args=[
                "--block-tokens",
                "64",
                "--store-token-file",
                str(tmp_path / "token"),
                "--store-tls-ca",
                str(certs / "ca.pem"),
            ],
        ).start()
        w = WorkerClient(worker.address)
        system = "You are the archivist of a distant library. " * 20
        for agent in ("moved", "stayed"):
            w.create_agent("ns", agent, system)
            w.turn("ns", agent, [("user", "What do you keep?")], max_tokens=8)
        w.wait_durable("ns", "moved")
        w.evict("ns", "moved")
        before = received(veth)
        moved = w.turn("ns", "moved", [("user", "And why?")], max_tokens=12)
        stayed = w.turn("ns", "stayed", [("user", "And why?")], max_tokens=12)
        assert moved.usage.cache_state == "warm" and moved.usage.restore_path == "stream"
        assert not moved.usage.restore_failure
        assert moved.token_ids == stayed.token_ids
        assert received(veth) - before >= moved.usage.restored_bytes > 0  # over the veth
        security = ClientSecurity(token=TOKEN, tls_ca=str(certs / "ca.pem"))
        remote = StoreClient(store.address, security=security)
        assert remote.get_agent("ns", "moved").agent_id == "moved"
    finally:
        if worker is not None:
            worker.stop()
        store.stop()
