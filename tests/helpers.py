"""Building blocks for store tests: Q4-shaped random blocks and a store process."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agentkv.client import synthetic
from agentkv.client.blocks import Block
from agentkv.client.routing import rank
from agentkv.client.store import StoreClient
from agentkv.errors import Unavailable
from agentkv.launch import ServiceProcess, store_process
from agentkv.worker.v1 import worker_pb2 as worker_pb
from cache_store.config import StoreConfig
from cache_store.store import CacheStore
from cache_store.uploads import PutHeader

FP = "tiny-llama:q4g64:test0001"
NS = "default"


q4_tensors = synthetic.q4_tensors


def freeze(pid: int, group: bool = False) -> None:
    """Stops a process (its process group, with `group`) with SIGSTOP and waits until every
    thread of it (of the group's leader, with `group`) is stopped: the kernel stops them
    when each next runs, and a loopback call made at once was seen answered (1 run in ~10,
    the SIGSTOP still pending). SIGCONT ends it."""
    (os.killpg if group else os.kill)(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while not all(state in "Tt" for state in _thread_states(pid)):
        assert time.monotonic() < deadline, f"process {pid} did not stop within 60 s"
        time.sleep(0.001)


def _thread_states(pid: int) -> list[str]:
    """Each thread's state letter (R, S, T, ...) from /proc; a thread gone since is left out."""
    tasks = Path(f"/proc/{pid}/task")
    assert tasks.is_dir(), f"freeze() reads /proc/{pid}/task (Linux): it is not there"
    states = []
    for stat in tasks.glob("*/stat"):
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue
    return states


def make_chain(
    token_ids: list[int], block_tokens: int = 64, fingerprint: str = FP, seed: int = 0, **shape
) -> tuple[list[Block], list[bytes]]:
    """Q4-shaped random blocks (and keys) covering token_ids in spans of block_tokens."""
    return synthetic.make_chain(token_ids, fingerprint, block_tokens, seed, **shape)


def put_items(
    namespace: str, fingerprint: str, blocks: list[Block]
) -> Iterator[PutHeader | memoryview]:
    """What the store's PutBlocks servicer hands its domain for `blocks`: per block, a
    PutHeader then the tensors' bytes (for tests of the in-process CacheStore)."""
    for b in blocks:
        specs = [(t.name, t.dtype, list(t.shape)) for t in b.tensors]
        yield PutHeader(namespace, fingerprint, b.parent_key, list(b.token_ids), specs)
        for t in b.tensors:
            yield memoryview(t.data).cast("B")


def local_store(data_dir: Path, **config) -> CacheStore:
    """The store's domain in this process, for races no client can steer; close() it."""
    return CacheStore(StoreConfig(data_dir=data_dir, gc_idle_seconds=0, **config))


def metric(proc: ServiceProcess, name: str) -> float:
    """A metric's value (an unlabelled one) on the process's --metrics-listen page; 0 if absent."""
    address = proc._find_event("serving", 0)["metrics"]
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def long_turn(w, ns: str, agent: str, messages=(("user", "Talk."),), max_tokens: int = 3000):
    """A greedy turn's raw stream that goes on until cancelled or `max_tokens` (the tiny
    model never says "\\x00")."""
    request = worker_pb.TurnRequest(
        namespace=ns,
        agent_id=agent,
        messages=[worker_pb.Message(role=r, content=c) for r, c in messages],
        sampling=worker_pb.SamplingParams(max_tokens=max_tokens, stop=["\x00"]),
    )
    return w.stub.Turn(request, timeout=120)


def read_tokens(call, at_least: int, into: list[int], texts: list[str] | None = None) -> None:
    """Reads the stream until `into` holds at least `at_least` token ids (their text
    pieces into `texts`, when given)."""
    while len(into) < at_least:
        response = next(call)
        into += response.tokens.token_ids
        if texts is not None:
            texts.append(response.tokens.text)


def until(condition: Callable[[], object], what: str, timeout: float = 60.0) -> object:
    """Polls `condition` until it is truthy; fails naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def answers(call: Callable) -> bool:
    """Whether a call gets through (UNAVAILABLE: not yet), for until() and its like: a
    restarted server, or a client's channel to one, may refuse a while."""
    try:
        call()
        return True
    except Unavailable:
        return False


def homed_at(home: str, workers: list[str], namespace: str, prefix: str = "a") -> str:
    """An agent id the SDK routes to `home` first among `workers` (rendezvous order)."""
    return next(
        f"{prefix}{i}"
        for i in itertools.count()
        if rank(workers, f"{namespace}/{prefix}{i}")[0] == home
    )


def same_bytes(a: Block, b) -> bool:
    return [(t.name, t.dtype, tuple(t.shape), bytes(t.data)) for t in a.tensors] == [
        (t.name, t.dtype, tuple(t.shape), bytes(t.data)) for t in b.tensors
    ]


@dataclass
class StoreProcess:
    """`agentkv-store` started the way a user starts it, as a separate process."""

    data_dir: Path
    log_path: Path
    extra_args: list[str] = field(default_factory=list)
    listen: str = "127.0.0.1:0"
    service: ServiceProcess | None = None

    def start(self, timeout: float = 30.0) -> StoreProcess:
        self.service = store_process(self.data_dir, self.log_path, self.listen, self.extra_args)
        self.service.start(timeout)
        return self

    @property
    def address(self) -> str:
        return self.service.address

    @property
    def proc(self):
        return self.service.proc

    def log_text(self) -> str:
        return self.service.log_path.read_text(errors="replace")  # whole: a tail may miss it

    def kill9(self) -> None:
        self.service.kill9()

    def stop(self) -> int:
        return self.service.stop() if self.service else 0

    def client(self, **kwargs) -> StoreClient:
        return StoreClient(self.address, **kwargs)


def cli(*args: str, store: str = "", timeout: float = 120.0) -> subprocess.CompletedProcess:
    """`agentkv ARGS[0] [--store STORE] ARGS[1:]` as a user runs it. One that runs past
    `timeout` (keep it below the test's own, so this fires first) fails with what it printed
    and the tails of the logs in the folder it named ("data in DIR"): CI said only
    "Timeout (>300.0s)" when the walkthrough hung."""
    prefix = ["--store", store] if store else []
    try:
        return subprocess.run(
            [sys.executable, "-m", "agentkv.cli", args[0], *prefix, *args[1:]],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as hung:  # its output is bytes, whatever text= says
        said = b"".join(out or b"" for out in (hung.stdout, hung.stderr)).decode(errors="replace")
        folders = re.findall(r"data in (\S+)", said)
        logs = [log for folder in folders for log in sorted(Path(folder).glob("*.log"))]
        tails = "".join(f"\n--- {log}:\n{log.read_text(errors='replace')[-3000:]}" for log in logs)
        raise AssertionError(
            f"agentkv {args[0]} ran past {timeout} s:\n{said[-5000:]}{tails}"
        ) from None


# Ports a test picks for a server it starts by address. Each pytest-xdist worker (and a run
# without xdist, as the only worker) has its own share of 10000-19999, and the +10000 twins
# that weed's gRPC ports need in 20000-29999: below Linux's ephemeral range (32768-60999), so
# neither another worker nor the kernel (for an outgoing connection or a port-0 bind) takes
# one between the check here and the server's bind.


def _worker_ports() -> range:
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    share = 10000 // max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    return range(10000 + worker * share, 10000 + (worker + 1) * share)


_own_ports = _worker_ports()
_ports = itertools.cycle(_own_ports)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int, twins: bool = False) -> list[int]:
    """n of this worker's ports free now (with `twins`, their +10000 free too)."""
    ports: list[int] = []
    for _ in _own_ports:
        p = next(_ports)
        if _bindable(p) and (not twins or _bindable(p + 10000)):
            ports.append(p)
            if len(ports) == n:
                return ports
    raise RuntimeError(f"fewer than {n} of this test worker's ports are free")


def free_address() -> str:
    """A loopback HOST:PORT free now: for a server that must restart on the same address."""
    return f"127.0.0.1:{free_ports(1)[0]}"


def assert_store_consistent(
    client: StoreClient, data_dir: Path, namespace: str = NS, sent: dict | None = None
) -> None:
    """Whole files only and no leftovers, refcounts match the manifests, every block
    checksums; with `sent` (key -> Block), every indexed block reads back bit-exact."""
    from agentkv.v1 import store_pb2 as pb

    assert not client.call("VerifyBlocks", pb.VerifyBlocksRequest()).corrupt
    assert not list((data_dir / "tmp").iterdir())
    indexed = {b.key: b.refcount for b in client.list_blocks(namespace)}
    files = {p.stem for p in (data_dir / "blocks").rglob("*.safetensors")}
    assert files == {k.hex() for k in indexed}
    refs = Counter(
        k
        for a in client.list_agents(namespace)
        for k in client.get_agent(namespace, a.agent_id).block_keys
    )
    assert {k: refs.get(k, 0) for k in indexed} == indexed
    for key in indexed if sent is not None else ():
        (back,) = client.get_blocks(namespace, FP, [key])
        assert same_bytes(sent[key], back)


def make_certs(d: Path, server_names: str = "IP:127.0.0.1,DNS:localhost") -> Path:
    """A test CA (ca.pem), a server certificate for `server_names` (server.pem/.key) and a
    client certificate (client.pem/.key) in `d`; skips where openssl is missing."""
    import pytest

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make test certificates")
    d.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "2", "-subj", "/CN=agentkv test CA", cwd=d,
    )  # fmt: skip
    for name, extra in (
        ("server", f"subjectAltName={server_names}"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        _openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
            "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d,
        )  # fmt: skip
        (d / f"{name}.ext").write_text(extra + "\n")
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
            cwd=d,
        )  # fmt: skip
    return d


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


class TcpProxy:
    """A loopback TCP proxy to `target` that holds every chunk `delay` seconds each way (a
    slow link), and drops a connection while nothing listens at `target` (a proxy whose
    backend is not up yet). Its address is `address`; close() (or `with`) stops it."""

    def __init__(self, target: str, delay: float = 0.0) -> None:
        host, port = target.rsplit(":", 1)
        self.target, self.delay = (host, int(port)), delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:  # closed
                return
            try:
                far = socket.create_connection(self.target)
            except OSError:  # nothing listens there yet
                near.close()
                continue
            self.sockets += [near, far]
            for source, sink in ((near, far), (far, near)):
                threading.Thread(target=self._pass, args=(source, sink), daemon=True).start()

    def _pass(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                time.sleep(self.delay)
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:  # the other end closed
            pass

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self.listener.close()
        for s in self.sockets:
            s.close()
