"""A new user's mistakes get one line that says what to do, from the real CLI and processes."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from tests.helpers import TcpProxy, free_address, freeze


def agentkv(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "agentkv.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_no_store_is_one_line_that_says_how_to_point_at_one():
    nobody = free_address()
    for args in (["store", "stats", "--store", nobody], ["agents", "--store", nobody]):
        proc = agentkv(*args)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr == (
            f"error: no store at {nobody} (start agentkv-store, or pass --store / AGENTKV_STORE)\n"
        )


def test_a_store_named_by_host_name_is_still_the_one_blamed():
    port = free_address().rsplit(":", 1)[1]
    proc = agentkv("agents", "--store", f"localhost:{port}", "--worker", free_address())
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: no store at localhost:{port} ")


def test_a_host_name_that_does_not_resolve_is_one_line_naming_the_flag():
    """.invalid never resolves (RFC 2606): the CLI names the address and where it came from,
    with gRPC's reason, for the flag and for the environment variable alike."""
    for args, env in (
        (["store", "stats", "--store", "nohost.invalid:50051"], {}),
        (["agents"], {"AGENTKV_STORE": "nohost.invalid:50051"}),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "agentkv.cli", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **env},
        )
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith(
            "error: the store at nohost.invalid:50051: its host name does not resolve "
            "(check --store / AGENTKV_STORE; gRPC: "
        ), proc.stderr


def test_a_worker_host_name_that_does_not_resolve_is_one_line_naming_the_flag(store_process):
    """The reviewer's: a worker's was "no worker answers at ... (start agentkv-worker)", the
    reason dropped with the tries; and AGENTKV_WORKERS written "a:1, b:2" dialed " b:2"."""
    from tests.helpers import FP, make_chain

    blocks, _ = make_chain(list(range(64)))
    with store_process.client() as store:
        store.save_agent("crew", "lead", FP, list(range(64)), blocks)
    for args, env in (
        (["--worker", "nohost.invalid:50061"], {}),
        ([], {"AGENTKV_WORKERS": " nohost.invalid:50061"}),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "agentkv.cli", "agents", "-n", "crew", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "AGENTKV_STORE": store_process.address, **env},
        )
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith(
            "error: the worker at nohost.invalid:50061: its host name does not resolve "
            "(check --worker / AGENTKV_WORKERS; gRPC: "
        ), proc.stderr


def test_a_server_that_takes_the_connection_but_does_not_answer_is_not_called_absent(
    store_process, tmp_path
):
    """A hung store (SIGSTOP), a listener that never speaks (in plaintext and to TLS) and an
    HTTP server each took the connection: the CLI says so, with gRPC's reason, not "no store
    at". gRPC's connect timeout (20 s) ends the wait for one that says nothing."""
    import signal

    from tests.helpers import make_certs

    ca = str(make_certs(tmp_path / "certs") / "ca.pem")
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody reads
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _QuietHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    quiet = f"127.0.0.1:{silent.getsockname()[1]}"
    runs = {
        "hung": [store_process.address],
        "silent": [quiet],
        "silent-tls": [quiet, "--tls-ca", ca],
        "http": [f"127.0.0.1:{web.server_address[1]}"],
    }
    freeze(store_process.proc.pid)
    try:
        started = {
            name: subprocess.Popen(
                [sys.executable, "-m", "agentkv.cli", "store", "stats", "--store", *args],
                stderr=subprocess.PIPE,
                text=True,
            )
            for name, args in runs.items()
        }
        ended = {name: proc.communicate(timeout=120) for name, proc in started.items()}
    finally:
        os.kill(store_process.proc.pid, signal.SIGCONT)
        web.shutdown()
        silent.close()
    for name, (_, stderr) in ended.items():
        assert started[name].returncode == 2, stderr
        assert len(stderr.splitlines()) == 1, stderr
        assert stderr.startswith(
            f"error: the store at {runs[name][0]} took the connection but did not answer: "
            "is it hung, or not an agentkv gRPC server? (gRPC: "
        ), stderr
    assert "SETTINGS frame" in ended["hung"][1] and "HTTP/2" in ended["http"][1]


def test_a_worker_whose_store_address_is_an_http_server_stops_at_start(tiny_model_dirs, tmp_path):
    """An HTTP server at --store (the gateway's port, say) answers gRPC's preface in
    HTTP/1: one line, exit 2, before the model loads, as for a gRPC server that is no store.
    It logged "store does not answer" and served, waiting for it forever."""
    from agentkv.launch import ServiceExited, worker_process

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _QuietHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{web.server_address[1]}"
    worker = worker_process(str(tiny_model_dirs["llama"]), address, tmp_path / "worker.log")
    try:
        with pytest.raises(ServiceExited):
            worker.start(timeout=120)
    finally:
        worker.stop()
        web.shutdown()
    assert worker.proc.returncode == 2, worker.log_tail()
    log = worker.log_tail()
    assert log.splitlines()[-1].startswith(
        f"agentkv-worker: error: the server at --store {address} is not an agentkv store: it "
        "does not speak gRPC's HTTP/2 (gRPC: Failed parsing HTTP/2 "
    ), log
    assert '"event": "model loaded"' not in log and "Traceback" not in log, log


def test_a_worker_whose_store_is_behind_a_proxy_waits_for_it_to_start(tiny_model_dirs, tmp_path):
    """A TCP proxy takes the connection and drops it while its store is not up yet: that is
    a store not started, waited for (not a server that is no store), until it answers."""
    from agentkv.launch import store_process, worker_process
    from tests.helpers import until

    store_address = free_address()
    with TcpProxy(store_address) as proxy:
        model = str(tiny_model_dirs["llama"])
        worker = worker_process(model, proxy.address, tmp_path / "worker.log")
        worker.start(timeout=120)
        store = store_process(tmp_path / "data", tmp_path / "store.log", store_address)
        try:
            assert '"event": "store does not answer' in worker.log_tail(), worker.log_tail()
            store.start()
            answers = '"event": "store answers"'
            until(lambda: answers in worker.log_tail(), "the worker to see its store answer")
        finally:
            worker.stop()
            store.stop()


class _QuietHandler(http.server.BaseHTTPRequestHandler):
    """An HTTP/1 server that logs nothing (it answers gRPC's preface with an error)."""

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tls-cert", __file__], "--tls-cert and --tls-key go together"),
        (["--tls-ca", "/no/such/ca.pem"], "--tls-ca /no/such/ca.pem: no such file"),
        (["--token-file", "/no/such/token"], "--token-file /no/such/token: no such file"),
        (["--worker", "127.0.0.1:2", "--worker", "127.0.0.1:2"], "worker addresses repeat"),
    ],
    ids=["cert-without-key", "missing-ca", "missing-token-file", "repeated-worker"],
)
def test_a_clients_own_bad_flag_is_one_line(args, message):
    proc = agentkv("agents", "--store", free_address(), *args)
    assert proc.returncode == 2, proc.stderr  # not an abort (134) or a traceback (1)
    assert proc.stderr.startswith("error: ") and message in proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr


def test_store_flags_work_before_and_after_the_command(store_process):
    address = store_process.address
    after = agentkv("store", "namespaces", "--store", address)
    before = agentkv("store", "--store", address, "namespaces")
    assert after.returncode == 0 and before.returncode == 0, after.stderr + before.stderr
    assert after.stdout == before.stdout
    nobody = free_address()
    wrong_before = agentkv("store", "--store", nobody, "namespaces", "--store", address)
    assert wrong_before.returncode == 0, wrong_before.stderr  # the later flag wins


def test_a_store_on_port_0_writes_its_bound_addresses_to_the_address_file(tmp_path):
    from agentkv.client.store import StoreClient
    from agentkv.launch import store_process

    address_file = tmp_path / "store.json"
    flags = ["--address-file", str(address_file), "--metrics-listen", "127.0.0.1:0"]
    service = store_process(tmp_path / "data", tmp_path / "store.log", extra_args=flags).start()
    try:
        written = json.loads(address_file.read_text())  # written before "serving" is logged
        assert written["address"] == service.address and not written["address"].endswith(":0")
        assert not written["metrics"].endswith(":0")
        with StoreClient(written["address"]) as client:
            assert client.stats().num_agents == 0
        metrics = urllib.request.urlopen(f"http://{written['metrics']}/metrics", timeout=30)
        assert b"agentkv_store" in metrics.read()
    finally:
        assert service.stop() == 0
    assert not address_file.exists()  # a stopped store leaves no address behind


@pytest.mark.parametrize("program", ["cache_store", "agentkv.gateway"])
def test_an_address_file_that_is_no_address_file_is_refused_and_kept(program, tmp_path):
    """--address-file at a user's own file: removed at the start of every run, even one
    refused (the red team's keep.json). Refused now, in one line, the file kept; a folder,
    or a path under a file, is one line too (the gateway's was a traceback)."""
    kept = tmp_path / "keep.json"
    kept.write_text("keep")
    args = {
        "cache_store": ["--data-dir", str(tmp_path / "data")],
        "agentkv.gateway": ["--worker", free_address()],
    }[program] + ["--listen", "127.0.0.1:0"]
    (tmp_path / "address_file").mkdir()  # a folder named like the field: its path stays
    said = {
        str(kept): "holds a file that is no address file",
        str(tmp_path): "is a folder",
        f"{kept}/x": "is not a folder",
        str(tmp_path / "address_file"): f"{tmp_path / 'address_file'} is a folder",
    }
    for where, message in said.items():
        proc = subprocess.run(
            [sys.executable, "-m", program, *args, "--address-file", where],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        last = proc.stderr.splitlines()[-1]
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert ": error: --address-file " in last and message in last, proc.stderr
    assert kept.read_text() == "keep" and not (tmp_path / "data").exists()


def test_an_empty_address_file_made_for_the_service_is_taken(tmp_path):
    """`ADDR=$(mktemp); agentkv-store --address-file "$ADDR"`: an empty file is the script's
    own, made for the address (the review's: it was refused as no address file)."""
    from agentkv.launch import store_process

    address_file = tmp_path / "addr"
    address_file.touch()
    flags = ["--address-file", str(address_file)]
    store = store_process(tmp_path / "data", tmp_path / "store.log", extra_args=flags).start()
    try:
        assert json.loads(address_file.read_text())["address"] == store.address
    finally:
        store.stop()


@pytest.mark.parametrize("program", ["cache_store", "agentkv.gateway"])
def test_a_refused_second_start_leaves_the_running_service_s_address_file(program, tmp_path):
    """The reviewer's: a second start on the first's data dir or port, refused, removed the
    running one's --address-file as it began, and a script could no longer find it; and a
    stop removed the file even where another run had written its own since. An earlier
    run's file is removed only when nothing answers at its address; at the stop, only the
    file this run wrote."""
    from agentkv.launch import ServiceProcess

    address_file = tmp_path / "service.json"
    own = {  # the store's data dir, or the gateway's worker: the same for every start
        "cache_store": ["--data-dir", str(tmp_path / "data")],
        "agentkv.gateway": ["--worker", free_address()],
    }[program] + ["--address-file", str(address_file)]

    def start(listen: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", program, *own, "--listen", listen],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    first = ServiceProcess(program, [*own, "--listen", "127.0.0.1:0"], tmp_path / "first.log")
    first.start()
    try:
        written = address_file.read_text()
        second = start("127.0.0.1:0" if program == "cache_store" else first.address)
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
        assert address_file.read_text() == written  # the running one's, still there
        address_file.write_text(json.dumps({"address": "127.0.0.1:1"}))  # another run's
    finally:
        first.stop()
    assert json.loads(address_file.read_text()) == {"address": "127.0.0.1:1"}  # kept
    with socket.socket() as taken:  # refused on a port in use, as the second was; nothing
        taken.bind(("127.0.0.1", 0))  # answers at 127.0.0.1:1: that file is an earlier
        taken.listen()  # run's, which a script must not read, and goes
        refused = start(f"127.0.0.1:{taken.getsockname()[1]}")
    assert refused.returncode == 2 and not address_file.exists(), refused.stderr


def test_a_gateway_given_one_worker_twice_says_so_in_one_line():
    worker = free_address()
    proc = subprocess.run(
        [sys.executable, "-m", "agentkv.gateway", "--worker", worker, "--worker", worker],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr  # was 3
    assert proc.stderr.splitlines()[-1].endswith(f"--worker {worker} is given more than once")


def test_agents_in_an_empty_namespace_points_at_the_namespaces_that_have_some(store_process):
    from tests.helpers import FP, make_chain

    tokens = list(range(64))
    blocks, _ = make_chain(tokens)
    with store_process.client() as client:
        for agent_id in ("marco", "luca"):
            client.save_agent("team-a", agent_id, FP, tokens, blocks)
    proc = agentkv("agents", "--store", store_process.address, "--worker", free_address())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == (
        "no agents in namespace 'default'; agents are in: team-a (2) (pass -n NAME)"
    )
    listed = agentkv("store", "agents", "--store", store_process.address)  # the store's own
    assert listed.returncode == 0 and listed.stdout.splitlines()[-1] == (
        "no agents in namespace 'default'; agents are in: team-a (2) (pass -n NAME)"
    ), listed.stdout


def test_an_agent_asked_for_with_another_system_prompt_is_an_error_or_replaced(
    tiny_model_dirs, store_process, start_worker
):
    from agentkv.client.memory import AgentMemory
    from agentkv.errors import SystemPromptDiffers

    worker = start_worker(tiny_model_dirs["llama"])
    with AgentMemory(worker.address, store=store_process.address, namespace="prompts") as mem:
        first = mem.agent("marco", system="You are Marco.")
        assert first.created
        assert first.say("Hello.", max_tokens=2).usage.prompt_tokens > 0
        # in the worker's RAM; only in the store; restored by a turn and written again
        for stage in ("hot", "stored", "restored"):
            if stage == "stored":
                first.evict()
            if stage == "restored":
                assert first.say("Again.", max_tokens=2).usage.cache_state == "warm"
                first.evict()
            assert not mem.agent("marco", system="You are Marco.").created  # the same: reused
            with pytest.raises(SystemPromptDiffers, match="exists with another system prompt"):
                mem.agent("marco", system="You are Luca.")
        before = first.describe().num_tokens  # the system prompt and a turn
        replaced = mem.agent("marco", system="You are Luca.", replace=True)
        assert replaced.created
        fresh = mem.agent("fresh", system="You are Luca.")
        after = replaced.describe().num_tokens
        assert after == fresh.describe().num_tokens < before  # made anew, its turn gone
        # Written under another model: asked for with its own system prompt, it was "used
        # as it is" (created False), and every call on it then FingerprintMismatch; and
        # replace=True could not replace it (the red team's).
        other = "llama-0123456789abcdef0123456789abcdef:k4v4g64f16:b64"
        mem.store.commit_agent(
            namespace="prompts", agent_id="other", fingerprint=other, token_ids=[1, 2, 3]
        )
        with pytest.raises(SystemPromptDiffers, match="written under another model"):
            mem.agent("other", system="You are Luca.")
        made = mem.agent("other", system="You are Luca.", replace=True)
        assert made.created and made.say("Hello.", max_tokens=2).usage.prompt_tokens > 0


def test_a_worker_whose_store_does_not_answer_warns_and_says_so_in_health(
    tiny_model_dirs, tmp_path
):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from agentkv.launch import store_process, worker_process
    from inference_worker.store_health import STORE_HEALTH

    store_address = free_address()
    worker = worker_process(
        str(tiny_model_dirs["llama"]), store_address, tmp_path / "worker.log"
    ).start()
    store = None
    try:
        assert '"event": "store does not answer' in worker.log_path.read_text()  # before "serving"
        with grpc.insecure_channel(worker.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def status(service: str) -> int:
                request = health_pb2.HealthCheckRequest(service=service)
                return stub.Check(request, timeout=30).status

            assert status("") == health_pb2.HealthCheckResponse.SERVING
            assert status(STORE_HEALTH) == health_pb2.HealthCheckResponse.NOT_SERVING
            store = store_process(tmp_path / "data", tmp_path / "store.log", store_address)
            store.start()
            deadline = time.monotonic() + 120
            while status(STORE_HEALTH) != health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, "the worker never saw its store answer"
                time.sleep(0.1)
        assert '"event": "store answers"' in worker.log_path.read_text()
    finally:
        worker.stop()
        if store is not None:
            store.stop()


@pytest.mark.parametrize(
    ("flags", "warned"),
    [
        (["--allow-unauthenticated"], "LISTENING BEYOND LOOPBACK WITH NO AUTHENTICATION"),
        (["--auth-tokens", "TABLE", "--allow-plaintext-tokens"], "BEARER TOKENS IN CLEAR TEXT"),
    ],
    ids=["no-auth", "clear-tokens"],
)
def test_a_gateway_beyond_loopback_logs_what_it_exposes(tmp_path, flags, warned):
    """The reviewer's: the gateway dropped the first of its security warnings, whatever it
    was, so one listening to all with no authentication said nothing of it."""
    from agentkv.launch import ServiceProcess

    table = tmp_path / "tokens.json"
    token = {"name": "a", "token": "a" * 20, "namespaces": ["*"]}
    table.write_text(json.dumps({"tokens": [token]}))
    table.chmod(0o644)  # and readable by others: that is said too
    args = [f.replace("TABLE", str(table)) for f in flags]
    args += ["--worker", free_address(), "--listen", "0.0.0.0:0"]
    gateway = ServiceProcess("agentkv.gateway", args, tmp_path / "gateway.log").start()
    try:
        log = gateway.log_path.read_text()
        assert warned in log, log
        if "--auth-tokens" in flags:
            assert f"TOKEN FILE READABLE BY OTHERS: {table} has mode 644" in log, log
    finally:
        gateway.stop()
