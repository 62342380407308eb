"""TLS and per-namespace bearer tokens on real store and worker processes.

A call without a valid token gets UNAUTHENTICATED; a token for namespace A never reads,
lists, forks or writes namespace B, nor sees the store's totals; deduplication never crosses
namespaces; TLS and mTLS connect only clients that trust the server (and that it trusts);
and a server never listens beyond loopback without tokens unless told so loudly.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from agentkv.auth import TokenTable
from agentkv.channels import ClientSecurity
from agentkv.client.store import StoreClient
from agentkv.client.synthetic import make_chain
from agentkv.errors import AgentKVError, PermissionDenied, Unauthenticated, Unavailable
from agentkv.launch import store_process
from agentkv.security import ServerSecurity
from tests.helpers import cli, make_certs

TEAM_A = "team-a-token-0123456789"
OPS = "ops-token-0123456789abcdef"


@pytest.fixture
def tokens_file(tmp_path) -> Path:
    path = tmp_path / "tokens.json"
    import hashlib

    path.write_text(
        json.dumps(
            {
                "tokens": [
                    {"name": "team-a", "token": TEAM_A, "namespaces": ["a"]},
                    {
                        "name": "ops",
                        "sha256": hashlib.sha256(OPS.encode()).hexdigest(),
                        "namespaces": ["*"],
                    },
                ]
            }
        )
    )
    return path


@pytest.fixture
def secured_store(tmp_path, tokens_file):
    proc = store_process(
        tmp_path / "data", tmp_path / "store.log", extra_args=["--auth-tokens", str(tokens_file)]
    ).start()
    yield proc
    proc.stop()


def put_agent(client: StoreClient, ns: str, agent_id: str, seed: int = 0):
    fp = "fp-security:k4v4g64f16:b16"
    tokens = list(range(1 + seed, 33 + seed))
    blocks, keys = make_chain(tokens, fp, 16, seed=seed, num_layers=2, kv_heads=1)
    put = client.put_blocks(ns, fp, blocks)
    client.commit_agent(
        namespace=ns,
        agent_id=agent_id,
        fingerprint=fp,
        token_ids=tokens,
        block_keys=keys,
        release_lease_id=put.lease_id,
    )
    return put


def namespaces(client: StoreClient) -> list[str]:
    from agentkv.v1 import store_pb2 as pb

    return sorted(
        n.name for n in client.call("ListNamespaces", pb.ListNamespacesRequest()).namespaces
    )


def test_tokens_scope_every_rpc_to_their_namespaces(secured_store):
    addr = secured_store.address
    anonymous = StoreClient(addr)
    wrong = StoreClient(addr, security=ClientSecurity(token="not-a-known-token-at-all"))
    team_a = StoreClient(addr, security=ClientSecurity(token=TEAM_A))
    ops = StoreClient(addr, security=ClientSecurity(token=OPS))

    for client in (anonymous, wrong):
        with pytest.raises(Unauthenticated):
            client.get_agent("a", "x")
        with pytest.raises(Unauthenticated):
            list(client.list_agents("a"))
        with pytest.raises(Unauthenticated):
            put_agent(client, "a", "x")

    put_agent(team_a, "a", "alice")
    put_agent(ops, "b", "bob")
    assert [a.agent_id for a in team_a.list_agents("a")] == ["alice"]
    for call in (
        lambda: team_a.get_agent("b", "bob"),
        lambda: list(team_a.list_agents("b")),
        lambda: team_a.fork_agent("b", "bob", "mine"),
        lambda: team_a.delete_agent("b", "bob"),
        lambda: put_agent(team_a, "b", "intruder"),
        lambda: list(team_a.list_blocks("b")),
        lambda: team_a.stats(),
    ):
        with pytest.raises(PermissionDenied):
            call()
    with pytest.raises(PermissionDenied, match="may not use namespace 'b'"):
        team_a.get_agent("b", "bob")
    assert namespaces(team_a) == ["a"]
    assert namespaces(ops) == ["a", "b"]
    assert ops.stats().num_agents == 2
    assert ops.get_agent("b", "bob").agent_id == "bob"  # nothing of b was touched


def test_aio_streams_carry_the_token(secured_store):
    """PutBlocks and GetBlocks through aio_channel: the token rides every call kind."""
    from agentkv.client.store import put_messages
    from agentkv.v1 import store_pb2 as pb

    fp = "fp-security:k4v4g64f16:b16"
    blocks, keys = make_chain(list(range(1, 17)), fp, 16, num_layers=1, kv_heads=1)

    async def put(token: str) -> pb.PutBlocksResponse:
        async with ClientSecurity(token=token).aio_channel(secured_store.address) as channel:
            call = channel.stream_unary(
                "/agentkv.v1.CacheStore/PutBlocks",
                request_serializer=None,
                response_deserializer=pb.PutBlocksResponse.FromString,
            )
            return await call(iter(put_messages("a", fp, blocks, 1 << 20)), timeout=10)

    async def get(token: str) -> list[bytes]:
        async with ClientSecurity(token=token).aio_channel(secured_store.address) as channel:
            call = channel.unary_stream(
                "/agentkv.v1.CacheStore/GetBlocks",
                request_serializer=pb.GetBlocksRequest.SerializeToString,
                response_deserializer=None,
            )
            request = pb.GetBlocksRequest(namespace="a", fingerprint=fp, keys=keys)
            return [raw async for raw in call(request, timeout=10)]

    reply = asyncio.run(put(OPS))
    assert [b.key for b in reply.blocks] == keys
    assert asyncio.run(get(OPS))  # a response stream carries it too
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(put("not-a-known-token-at-all"))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_deduplication_never_crosses_namespaces(secured_store):
    ops = StoreClient(secured_store.address, security=ClientSecurity(token=OPS))
    first = put_agent(ops, "a", "one", seed=7)
    again = put_agent(ops, "a", "two", seed=7)
    other = put_agent(ops, "b", "three", seed=7)
    assert not any(b.deduplicated for b in first.blocks)
    assert all(b.deduplicated for b in again.blocks)
    assert not any(b.deduplicated for b in other.blocks)  # same bytes, another namespace


def test_health_needs_no_token(secured_store):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(secured_store.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_token_tables_and_safe_defaults_are_checked(tmp_path):
    for body, message in (
        ({"tokens": [{"token": "short", "namespaces": ["a"]}]}, "at least 16"),
        ({"tokens": [{"sha256": "abc", "namespaces": ["a"]}]}, "64 hex digits"),
        ({"tokens": [{"token": TEAM_A, "namespaces": []}]}, "must list namespaces"),
        ({"tokens": []}, "non-empty list"),
        (
            {
                "tokens": [
                    {"name": "first", "token": TEAM_A, "namespaces": ["a"]},
                    {"token": TEAM_A, "namespaces": ["*"]},
                ]
            },
            r"tokens\[1\]: the same token as 'first'",
        ),
        (
            {"tokens": [{"sha256": "ab" * 32, "namespaces": ["a"]}] * 2},
            r"tokens\[1\]: the same token as 'token 0'",
        ),
        ({"tokens": [{"token": "caf\u00e9-token-0123456789", "namespaces": ["a"]}]}, "ASCII"),
        ({"tokens": [{"token": "with space 0123456789", "namespaces": ["a"]}]}, "no spaces"),
        ({"tokens": [{"token": TEAM_A, "namespaces": ["Team A"]}]}, "namespace 'Team A'"),
        ({"tokens": [{"token": TEAM_A, "namespaces": ["a", 7]}]}, r"tokens\[0\]: namespace 7"),
        ({"tokens": [{"token": 12345678901234567890, "namespaces": ["a"]}]}, "a string, not int"),
        (
            {"tokens": [{"token": TEAM_A, "namespaces": ["a"], "expires_at": 1}]},
            r"tokens\[0\]: unknown field\(s\) \['expires_at'\]",
        ),
    ):
        (tmp_path / "t.json").write_text(json.dumps(body))
        with pytest.raises(ValueError, match=message):
            TokenTable.load(tmp_path / "t.json")
    (tmp_path / "t.json").write_text('{"tokens": ' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(ValueError, match=r"auth tokens file .*t\.json: maximum recursion"):
        TokenTable.load(tmp_path / "t.json")  # nested too deeply: one line, no traceback
    with pytest.raises(ValueError, match="needs --auth-tokens"):
        ServerSecurity().check("0.0.0.0:50051", loopback=False)
    ServerSecurity(allow_unauthenticated=True).check("0.0.0.0:50051", loopback=False)
    ServerSecurity().check("127.0.0.1:50051", loopback=True)
    with pytest.raises(ValueError, match="go together"):
        ServerSecurity(tls_cert="c.pem").check("127.0.0.1:1", loopback=True)


@pytest.mark.parametrize(
    ("mode", "warned"),
    [
        (0o600, ""),
        (0o440, ""),  # Kubernetes mounts a Secret so for fsGroup: it was warned about
        (0o640, ""),
        (0o644, "TOKEN FILE READABLE BY OTHERS"),
        (0o660, "TOKEN FILE WRITABLE BY ITS GROUP"),
    ],
)
def test_a_token_file_may_be_read_by_its_group_not_by_others(tokens_file, mode, warned):
    tokens_file.chmod(mode)
    said = ServerSecurity(auth_tokens=str(tokens_file)).warnings("127.0.0.1:1", True, None)
    about = [w for w in said if "TOKEN FILE" in w]
    assert [w.split(":")[0] for w in about] == ([warned] if warned else [])
    assert all(f"{tokens_file} has mode {mode:o}; chmod " in w for w in about)


def test_a_weak_but_valid_certificate_is_taken_as_grpc_takes_it(tmp_path):
    """A 1024-bit RSA key is below Python's default TLS security level, not gRPC's: the flag
    check (which loads the files with ssl) took it for 'no unencrypted PEM private key'."""
    import subprocess

    cert, key = tmp_path / "weak.pem", tmp_path / "weak.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:1024", "-nodes", "-subj", "/CN=localhost",
         "-days", "2", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    ServerSecurity(tls_cert=str(cert), tls_key=str(key)).check("127.0.0.1:1", loopback=True)


def test_a_bad_token_file_stops_the_store_at_start(tmp_path):
    (tmp_path / "short.json").write_text(
        json.dumps({"tokens": [{"token": "x", "namespaces": ["a"]}]})
    )
    proc = store_process(
        tmp_path / "data",
        tmp_path / "log",
        extra_args=["--auth-tokens", str(tmp_path / "short.json")],
    )
    with pytest.raises(RuntimeError, match="at least 16 characters"):
        proc.start(timeout=30)


SERVICES = {
    "agentkv-store": ["cache_store", "--data-dir", "unused"],
    "agentkv-worker": ["inference_worker", "--model", "/no/model", "--store", "127.0.0.1:1"],
    "agentkv-gateway": ["agentkv.gateway", "--worker", "127.0.0.1:1"],
}


@pytest.mark.parametrize("service", SERVICES)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--auth-tokens", "{nope"], "auth tokens file"),
        (["--auth-tokens", "short"], "at least 16 characters"),
        (["--auth-tokens", "."], "--auth-tokens .: is a directory"),
        (["--auth-tokens", "missing.json"], "--auth-tokens missing.json: no such file"),
        (["--tls-cert", "missing.pem", "--tls-key", "short"], "--tls-cert missing.pem: no such"),
        (["--log-level", "bogus"], "invalid choice: 'bogus'"),
    ],
    ids=["bad-json", "short-token", "directory", "missing", "missing-cert", "log-level"],
)
def test_a_bad_security_or_log_flag_is_one_usage_line(tmp_path, service, flags, message):
    (tmp_path / "{nope").write_text("{nope")
    (tmp_path / "short").write_text(json.dumps({"tokens": [{"token": "x", "namespaces": ["a"]}]}))
    module, *args = SERVICES[service]
    cmd = [sys.executable, "-m", module, *args, *flags]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr  # before the model or the data dir is touched
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(f"{service}: error: "), proc.stderr
    assert message in proc.stderr.splitlines()[-1]
    assert not (tmp_path / "unused").exists()


def test_log_levels_are_logging_s_names_in_any_case():
    """Units and env files say INFO or warn; 2ca282f's choices had refused them."""
    from cache_store.__main__ import build_config

    for given, level in (("INFO", "info"), ("warn", "warn"), ("Critical", "critical")):
        assert build_config(["--data-dir", "d", "--log-level", given]).log_level == level


@pytest.fixture(scope="module")
def pem(tmp_path_factory) -> Path:
    """Test certificates, and junk.txt: a readable file that holds no PEM at all."""
    d = make_certs(tmp_path_factory.mktemp("pem"))
    (d / "junk.txt").write_text("store-1\n")
    return d


@pytest.mark.parametrize("service", SERVICES)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--tls-cert", "junk.txt", "--tls-key", "junk.txt"],
            "--tls-cert {d}/junk.txt: no PEM certificate in it",
        ),
        (
            ["--tls-cert", "server.pem", "--tls-key", "junk.txt"],
            "--tls-key {d}/junk.txt: no unencrypted PEM private key in it",
        ),
        (
            ["--tls-cert", "server.pem", "--tls-key", "client.key"],
            "--tls-key {d}/client.key is not the private key of --tls-cert {d}/server.pem",
        ),
        (
            ["--tls-cert", "server.pem", "--tls-key", "server.key", "--tls-client-ca", "junk.txt"],
            "--tls-client-ca {d}/junk.txt: no PEM certificate in it",
        ),
    ],
    ids=["junk-cert", "junk-key", "mismatched-key", "junk-client-ca"],
)
def test_a_malformed_tls_file_is_one_usage_line(tmp_path, pem, service, flags, message):
    """Not "could not bind" once the data dir or the model is loaded: gRPC reads the files
    only then, and reports a bad one as a port it could not bind."""
    module, *args = SERVICES[service]
    given = [f if f.startswith("--") else str(pem / f) for f in flags]
    cmd = [sys.executable, "-m", module, *args, *given]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == f"{service}: error: {message.format(d=pem)}"
    assert not (tmp_path / "unused").exists()


CLIENTS = {  # a client of a server, and the prefix of its flags for that server
    "agentkv": ("", ["agentkv.cli", "agents", "--store", "127.0.0.1:1"]),
    "agentkv-worker": ("store-", SERVICES["agentkv-worker"]),
    "agentkv-gateway": ("upstream-", SERVICES["agentkv-gateway"]),
}


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--{p}tls-ca", "missing.pem"], "--{p}tls-ca missing.pem: no such file or directory"),
        (
            ["--{p}tls-cert", "{d}/client.pem"],
            "--{p}tls-cert and --{p}tls-key go together: give both, or neither",
        ),
        (["--{p}tls-ca", "{d}/junk.txt"], "--{p}tls-ca {d}/junk.txt: no PEM certificate in it"),
        (
            ["--{p}tls-cert", "{d}/client.pem", "--{p}tls-key", "{d}/server.key"],
            "--{p}tls-key {d}/server.key is not the private key of --{p}tls-cert {d}/client.pem",
        ),
        (
            ["--{p}tls-cert", "{d}/client.pem", "--{p}tls-key", "{d}/junk.txt"],
            "--{p}tls-key {d}/junk.txt: no unencrypted PEM private key in it",
        ),
    ],
    ids=["missing-ca", "cert-without-key", "junk-ca", "mismatched-key", "junk-key"],
)
def test_a_clients_bad_tls_flag_is_one_line_naming_the_flag_given(
    tmp_path, pem, client, flags, message
):
    """The worker's --store-tls-* and the gateway's --upstream-tls-* are named as given, not
    as the CLI's --tls-* (the worker and the gateway have a --tls-cert of their own)."""
    prefix, (module, *args) = CLIENTS[client]
    given = [f.format(p=prefix, d=pem) for f in flags]
    cmd = [sys.executable, "-m", module, *args, *given]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.splitlines()[-1]
    assert line.endswith("error: " + message.format(p=prefix, d=pem)), proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("client", CLIENTS)
def test_a_bad_tls_file_from_the_environment_is_named_by_its_variable_and_flag(tmp_path, client):
    prefix, (module, *args) = CLIENTS[client]
    variable = "AGENTKV_" + prefix.upper().replace("-", "_") + "TLS_CA"
    env = {**os.environ, variable: "missing.pem"}
    cmd = [sys.executable, "-m", module, *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1].endswith(
        f"error: {variable} (--{prefix}tls-ca) missing.pem: no such file or directory"
    ), proc.stderr


# TLS


@pytest.fixture
def certs(tmp_path) -> Path:
    return make_certs(tmp_path / "certs")


def test_tls_and_mtls(tmp_path, certs):
    c = certs
    tls = store_process(
        tmp_path / "tls",
        tmp_path / "tls.log",
        extra_args=["--tls-cert", str(c / "server.pem"), "--tls-key", str(c / "server.key")],
    ).start()
    mtls = store_process(
        tmp_path / "mtls",
        tmp_path / "mtls.log",
        extra_args=[
            "--tls-cert",
            str(c / "server.pem"),
            "--tls-key",
            str(c / "server.key"),
            "--tls-client-ca",
            str(c / "ca.pem"),
        ],
    ).start()
    try:
        trusted = ClientSecurity(tls_ca=str(c / "ca.pem"))
        assert StoreClient(tls.address, security=trusted).stats().num_agents == 0
        with pytest.raises(Unavailable):
            StoreClient(tls.address, timeout=30).stats()  # plaintext to a TLS server
        with pytest.raises(Unavailable):
            StoreClient(mtls.address, timeout=30, security=trusted).stats()  # no client cert
        mutual = ClientSecurity(
            tls_ca=str(c / "ca.pem"), tls_cert=str(c / "client.pem"), tls_key=str(c / "client.key")
        )
        assert StoreClient(mtls.address, security=mutual).stats().num_agents == 0
        # The CLI says what went wrong, not "no store at": it is there.
        plain = cli("store", "stats", store=tls.address)
        assert plain.stderr.strip().splitlines()[-1] == (
            f"error: the store at {tls.address} closed the connection: does it serve TLS? "
            "(then pass --tls-ca)"
        )
        untrusted = cli("store", "--tls-ca", str(c / "client.pem"), "stats", store=tls.address)
        last = untrusted.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: TLS with the store at {tls.address} failed: Tls handshake")
        assert "CERTIFICATE_VERIFY_FAILED" in last and untrusted.returncode == 2
    finally:
        tls.stop()
        mtls.stop()


def test_the_health_port_serves_health_alone_in_plaintext(tmp_path, certs, tokens_file):
    """--health-listen: kubelet's plaintext grpc probe sees SERVING on an mTLS store with
    tokens, and that port answers nothing else."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    c = certs
    proc = store_process(
        tmp_path / "data",
        tmp_path / "store.log",
        extra_args=[
            *("--tls-cert", str(c / "server.pem"), "--tls-key", str(c / "server.key")),
            *("--tls-client-ca", str(c / "ca.pem"), "--auth-tokens", str(tokens_file)),
            *("--health-listen", "127.0.0.1:0"),
        ],
    ).start()
    try:
        health_at = proc._find_event("serving", 0)["health"]
        assert health_at.rpartition(":")[2] != proc.address.rpartition(":")[2]
        with grpc.insecure_channel(health_at) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "agentkv.v1.CacheStore"):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(Unavailable):
            StoreClient(proc.address, timeout=30).stats()  # the service port is still mTLS
        with pytest.raises(AgentKVError) as err:
            StoreClient(health_at, timeout=30, security=ClientSecurity(token=OPS)).stats()
        assert err.value.code == grpc.StatusCode.UNIMPLEMENTED
    finally:
        proc.stop()


def test_worker_enforces_tokens_and_reaches_a_secured_store(
    tmp_path, tokens_file, secured_store, tiny_model_dirs
):
    from agentkv.client.worker import WorkerClient
    from agentkv.launch import worker_process

    (tmp_path / "store.token").write_text(OPS + "\n")
    worker = worker_process(
        str(tiny_model_dirs["llama"]),
        secured_store.address,
        tmp_path / "worker.log",
        extra_args=[
            "--block-tokens",
            "64",
            "--auth-tokens",
            str(tokens_file),
            "--store-token-file",
            str(tmp_path / "store.token"),
        ],
    ).start()
    try:
        team_a = WorkerClient(worker.address, security=ClientSecurity(token=TEAM_A))
        team_a.create_agent("a", "alice", "You are Alice. " * 10)
        assert len(team_a.turn("a", "alice", [("user", "Hi")], max_tokens=4).token_ids) == 4
        with pytest.raises(PermissionDenied):
            team_a.create_agent("b", "bob", "You are Bob.")
        with pytest.raises(PermissionDenied):
            team_a.turn("b", "alice", [("user", "Hi")], max_tokens=4)
        with pytest.raises(Unauthenticated):
            WorkerClient(worker.address).describe("a", "alice")
        team_a.wait_durable("a", "alice")  # the worker's own token reached the store
        import asyncio

        from agentkv.client.aio import AsyncAgentMemory

        async def through_asyncio() -> tuple[int, str]:
            async with AsyncAgentMemory(
                worker.address, namespace="a", security=ClientSecurity(token=TEAM_A)
            ) as mem:
                state = await (await mem.agent("alice")).describe()
            async with AsyncAgentMemory(worker.address, namespace="a") as anonymous:
                try:
                    await (await anonymous.agent("alice")).describe()
                except Unauthenticated as exc:
                    return state.num_tokens, type(exc).__name__
            return state.num_tokens, "answered"

        tokens, refused = asyncio.run(through_asyncio())
        assert tokens > 0 and refused == "Unauthenticated"
        ops = StoreClient(secured_store.address, security=ClientSecurity(token=OPS))
        assert ops.get_agent("a", "alice").agent_id == "alice"
        # The reviewer's: GetWorkerInfo told any token the worker's whole hot tier; one of
        # some namespaces is told of their agents only, as the store's GetStats refuses it.
        admin = WorkerClient(worker.address, security=ClientSecurity(token=OPS))
        admin.create_agent("b", "bob", "You are Bob. " * 20)
        everyone, own = admin.info(), team_a.info()
        assert (everyone.num_hot_agents, own.num_hot_agents) == (2, 1)
        alice = team_a.describe("a", "alice")
        assert 0 < own.hot_bytes == alice.num_bytes < everyone.hot_bytes
        assert own.hot_budget_bytes == everyone.hot_budget_bytes
    finally:
        worker.stop()


@pytest.mark.parametrize("token", ["", "not-a-known-token-at-all"], ids=["none", "unknown"])
def test_a_worker_whose_store_refuses_its_token_stops_at_start(
    tmp_path, secured_store, tiny_model_dirs, token
):
    """Before, it said "store answers" (health needs no token) and served: every turn then
    failed UNAUTHENTICATED, which the gateway answered its own callers as a 401, as if
    their key were wrong."""
    from agentkv.launch import worker_process

    extra = ["--block-tokens", "64"]
    if token:
        (tmp_path / "store.token").write_text(token)
        extra += ["--store-token-file", str(tmp_path / "store.token")]
    worker = worker_process(
        str(tiny_model_dirs["llama"]), secured_store.address, tmp_path / "w.log", extra_args=extra
    )
    refused = "no bearer token" if not token else "the bearer token is not valid"
    with pytest.raises(RuntimeError, match=f"refuses this worker's token .*{refused}"):
        worker.start(timeout=120)


def test_a_worker_whose_store_address_is_no_store_stops_at_start(
    tmp_path, secured_store, tiny_model_dirs
):
    """A worker given another worker's address as its store (both answer grpc.health.v1)
    said "store answers" and served; every turn then failed UNIMPLEMENTED."""
    from agentkv.launch import worker_process

    (tmp_path / "store.token").write_text(OPS)
    model, extra = (
        str(tiny_model_dirs["llama"]),
        ["--store-token-file", str(tmp_path / "store.token")],
    )
    first = worker_process(model, secured_store.address, tmp_path / "a.log", extra_args=extra)
    first.start(timeout=120)
    try:
        second = worker_process(model, first.address, tmp_path / "b.log")
        with pytest.raises(RuntimeError, match=f"{first.address} is not an agentkv store"):
            second.start(timeout=120)
    finally:
        first.stop()


def test_cli_carries_a_token(secured_store, tmp_path):
    import os
    import sys

    def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "agentkv.cli", "store", "--store", secured_store.address, *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **env},
        )

    refused = cli("stats")
    assert refused.returncode == 2 and "UNAUTHENTICATED" in refused.stderr
    assert "(give the token: --token-file FILE, or env AGENTKV_TOKEN)" in refused.stderr
    assert cli("stats", AGENTKV_TOKEN=OPS).returncode == 0
    (tmp_path / "a.token").write_text(TEAM_A)
    denied = cli("--token-file", str(tmp_path / "a.token"), "agents", "-n", "b")
    assert denied.returncode == 2 and "PERMISSION_DENIED" in denied.stderr
    # A token no header can carry is the caller's usage error, named where it came from;
    # it was every call's INTERNAL "Invalid metadata".
    unsent = cli("stats", AGENTKV_TOKEN=OPS[:5] + "\n" + OPS[5:])
    assert unsent.returncode == 2, unsent.stderr
    assert "env AGENTKV_TOKEN holds a token with characters a header cannot carry" in unsent.stderr
    (tmp_path / "bad.token").write_text("t\u00f6k en-0123456789")
    unsent = cli("--token-file", str(tmp_path / "bad.token"), "stats")
    assert unsent.returncode == 2 and "Traceback" not in unsent.stderr, unsent.stderr
    assert "bad.token holds a token with characters a header cannot carry" in unsent.stderr


@pytest.mark.parametrize(
    ("address", "tls", "warned"),
    [
        ("10.1.2.3:50051", False, True),
        ("dns:///store.example:50051", False, True),
        ("127.0.0.1:50051", False, False),
        ("unix:/tmp/agentkv.sock", False, False),
        ("10.1.2.3:50051", True, False),
    ],
)
def test_a_client_warns_before_a_token_crosses_the_network_in_clear(
    tmp_path, caplog, address, tls, warned
):
    """A server beyond loopback takes tokens in clear only with --allow-plaintext-tokens; a
    client sending one there without TLS says so (sync and asyncio channels alike)."""
    ca = str(make_certs(tmp_path) / "ca.pem") if tls else ""
    security = ClientSecurity(token="t0ken-for-the-test", tls_ca=ca)

    async def aio() -> None:
        await security.aio_channel(address).close()

    for open_channel in (lambda: security.channel(address).close(), lambda: asyncio.run(aio())):
        caplog.clear()
        with caplog.at_level("WARNING", logger="agentkv.client"):
            open_channel()
        said = [r.getMessage() for r in caplog.records]
        assert bool(said) == warned, said
        if warned:
            assert f"bearer token sent in clear text to {address}" in said[0]
            assert "t0ken" not in said[0]
