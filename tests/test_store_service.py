"""The store as a user runs it: health, reflection, metrics, logs, the CLI, the walkthrough."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from agentkv.client.worker import WorkerClient
from agentkv.errors import AgentKVError, AgentNotFound
from agentkv.launch import ServiceProcess
from agentkv.units import parse_bytes
from cache_store.__main__ import build_config
from tests.helpers import FP, NS, StoreProcess, cli, make_chain, until


def test_health_and_reflection(store_process):
    with grpc.insecure_channel(store_process.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "agentkv.v1.CacheStore"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = stub.ServerReflectionInfo(iter([request]), timeout=10)
        names = {s.name for s in reply.list_services_response.service}
        assert {"agentkv.v1.CacheStore", "grpc.health.v1.Health"} <= names


def test_a_worker_call_to_a_store_says_it_may_be_the_wrong_service(store_process):
    """gRPC's bare "Method not found!" (a worker's address mistaken for a store's) becomes a
    message that says what is likely wrong."""
    with WorkerClient(store_process.address) as w, pytest.raises(AgentKVError) as caught:
        w.info()
    assert caught.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert "a store's address where a worker's belongs" in caught.value.message
    assert "Method not found" in caught.value.message


def test_reflection_v1_answers_as_v1alpha_does(store_process):
    """grpcurl and other newer clients ask grpc.reflection.v1 first: same messages, new name."""
    from google.protobuf import descriptor_pb2

    with grpc.insecure_channel(store_process.address) as channel:
        v1 = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        asks = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="agentkv.v1.CacheStore"),
        ]
        listed, described = v1(iter(asks), timeout=10)
    names = {s.name for s in listed.list_services_response.service}
    assert {"agentkv.v1.CacheStore", "grpc.reflection.v1.ServerReflection"} <= names
    files = described.file_descriptor_response.file_descriptor_proto
    parsed = [descriptor_pb2.FileDescriptorProto.FromString(raw) for raw in files]
    assert any(s.name == "CacheStore" for f in parsed for s in f.service)


def test_metrics_endpoint_counts_what_happened(tmp_path):
    proc = StoreProcess(
        tmp_path / "data", tmp_path / "log", extra_args=["--metrics-listen", "127.0.0.1:0"]
    ).start()
    try:
        with proc.client() as c:
            blocks, keys = make_chain(list(range(100)), block_tokens=64)
            c.put_blocks(NS, FP, blocks)
            c.put_blocks(NS, FP, blocks)
            list(c.get_blocks(NS, FP, keys))
            c.longest_prefix(NS, FP, [123456])
            stored = c.stats().num_bytes
        serving = proc.service._find_event("serving", 0)
        text = urllib.request.urlopen(f"http://{serving['metrics']}/metrics", timeout=10).read()
        metrics = _samples(text.decode())
        assert metrics["agentkv_store_blocks"] == 2
        assert metrics["agentkv_store_bytes"] == stored
        assert metrics["agentkv_store_dedup_hits_total"] == 2
        assert metrics["agentkv_store_prefix_misses_total"] == 1
        assert metrics["agentkv_store_get_bytes_total"] > 0
        assert metrics["agentkv_store_put_seconds_count"] == 2
    finally:
        proc.stop()


def _samples(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_logs_are_json_lines_and_sigterm_stops_cleanly(store_process, store):
    store.stats()
    assert store_process.stop() == 0
    entries = [json.loads(line) for line in store_process.log_path.read_text().splitlines()]
    assert [e["event"] for e in entries][:2] == ["recovered", "serving"]
    assert entries[-1]["event"] == "stopping"
    assert all({"ts", "level", "logger", "event"} <= e.keys() for e in entries)


def test_sigterm_the_moment_serving_is_logged_still_stops_cleanly(tmp_path):
    """SIGTERM as soon as a store says "serving" (and after a few RPCs): every time, it
    drains and exits 0. A handler once set a threading.Event and could deadlock inside that
    Event's wait, and the handlers were installed after "serving" was logged."""
    for run in range(8):
        proc = StoreProcess(tmp_path / f"data{run}", tmp_path / f"store{run}.log").start()
        with proc.client() as c:
            assert [c.stats().num_agents for _ in range(run % 3)] == [0] * (run % 3)
        assert proc.stop() == 0, proc.service.log_tail()
        events = [json.loads(line)["event"] for line in proc.log_path.read_text().splitlines()]
        assert events[-1] == "stopping", events


def test_store_never_imports_mlx():
    code = (
        "import sys, cache_store.__main__, cache_store.server, agentkv.client.store, agentkv.cli;"
        "sys.exit(any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--listen", "0.0.0.0"], "HOST:PORT or unix:PATH"),
        (["--listen", "unix:"], "needs a path"),
        (["--quota", "-5"], "--quota: not a byte size: '-5'"),
        (["--metrics-listen", "9464"], "must be HOST:PORT"),
        (["--metrics-listen", "unix:/tmp/m.sock"], "--metrics-listen must be HOST:PORT"),
        # 0 made an idle store spin at 100% CPU and cancel every PutBlocks
        (["--stream-idle-seconds", "0"], "--stream-idle-seconds must be > 0, got 0.0"),
        (["--writer-lease-seconds", "-1"], "--writer-lease-seconds must be > 0"),
        (["--writer-lease-seconds", "nan"], "--writer-lease-seconds: not a finite number"),
        (["--gc-idle-seconds", "inf"], "--gc-idle-seconds: not a finite number: 'inf'"),
        (["--agent-idle", "soon"], "--agent-idle: not a duration: 'soon'"),
        (["--agent-idle=-1h"], "--agent-idle: not a duration: '-1h'"),
        (["--agent-idle", "590"], "--agent-idle must be 0 or at least 10 times --lease-seconds"),
        (["--agent-idle", "1e9d"], "--agent-idle: not a duration: '1e9d'"),
        (["--agent-idle", "1d", "--namespace-agent-idle", "*=2d"], "both set the retention"),
        (["--namespace-agent-idle", "a"], "expected NAMESPACE=DURATION or *=DURATION, got 'a'"),
        (["--namespace-agent-idle", "a=1y"], "invalid duration '1y' in 'a=1y'"),
        (["--namespace-agent-idle", "a=9m"], "--agent-idle for namespace 'a' must be 0 or"),
        (["--namespace-agent-idle", "a b=1d"], "agent retention for invalid namespace 'a b'"),
        # a traceback, or a store that started and said "unreachable" for ever
        (["--object-store", "s3://b/x", "--s3-endpoint", "notaurl"], "must be http(s)://"),
        (["--object-store", "s3://b/x", "--s3-endpoint", "ftp://h:21"], "must be http(s)://"),
        (["--object-store", "s3://b/x", "--s3-endpoint", "http://h:99999"], "out of range"),
        (["--object-store", "s3://b/x", "--s3-endpoint", "http://h:1/b2"], "no path or query"),
        (["--object-store", "s3://b/../d"], "an empty, '.' or '..' part"),
        (["--object-store", "s3://b/x?y=1"], "a query or fragment is not taken"),
        (["--workers", "8"], "with fewer --workers, lower --max-streams too"),
    ],
)
def test_bad_command_lines_are_refused(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        build_config(["--data-dir", str(tmp_path), *argv])
    assert message in capsys.readouterr().err


def test_sizes_parse():
    assert [parse_bytes(s) for s in ("1048576", "512M", "20G", "1.5GiB")] == [
        1 << 20,
        512 << 20,
        20 << 30,
        3 << 29,
    ]


def test_an_empty_metrics_or_health_address_is_none(tmp_path):
    """A unit file passes `--metrics-listen ${AGENTKV_METRICS_LISTEN}`: set to nothing, it
    turns metrics off (it was refused: "listen address must be HOST:PORT")."""
    argv = ["--data-dir", str(tmp_path), "--metrics-listen", "", "--health-listen", ""]
    config = build_config(argv)
    assert config.metrics_listen is None and config.health_listen is None


def test_default_bind_is_loopback(tmp_path):
    config = build_config(["--data-dir", str(tmp_path)])
    assert config.listen == "127.0.0.1:50051" and config.is_loopback


def test_cli_inspects_verifies_and_collects(store_process, store):
    blocks, keys = make_chain(list(range(100)), block_tokens=64)
    put = store.put_blocks(NS, FP, blocks)
    store.commit_agent(
        namespace=NS,
        agent_id="warden",
        fingerprint=FP,
        token_ids=list(range(64)),
        block_keys=keys[:1],
        release_lease_id=put.lease_id,
    )
    address = store_process.address
    agents = cli("store", "agents", store=address)
    assert agents.returncode == 0 and "warden" in agents.stdout
    agent = cli("store", "agent", "warden", store=address)
    assert keys[0].hex()[:16] in agent.stdout and "ok" in agent.stdout
    assert re.search(r"^blocks +2 *$", cli("store", "stats", store=address).stdout, re.M)
    assert "checked 2 blocks" in cli("store", "verify", store=address).stdout
    assert "deleted 1 unreferenced" in cli("store", "gc", store=address).stdout
    missing = cli("store", "agent", "nobody", store=address)
    assert missing.returncode == 2 and "AgentNotFound (NOT_FOUND)" in missing.stderr
    deleted = cli("store", "delete", "warden", "-n", NS, store=address)
    assert deleted.returncode == 0, deleted.stderr
    assert deleted.stdout.strip() == f"deleted {NS}/warden; released 1 block reference"
    with pytest.raises(AgentNotFound):
        store.get_agent(NS, "warden")
    again = cli("store", "delete", "warden", "-n", NS, store=address)
    assert again.returncode == 2 and "AgentNotFound (NOT_FOUND)" in again.stderr


def test_an_empty_or_malformed_namespace_flag_is_refused_and_deletes_nothing(store_process, store):
    """`agentkv store delete -n "$NS" ID` with NS unset: the store reads an empty namespace
    as the default one, so this deleted default/ID (and `verify -n ''` checked every one)."""
    blocks, keys = make_chain(list(range(64)), block_tokens=64)
    put = store.put_blocks("default", FP, blocks)
    store.commit_agent(
        namespace="default",
        agent_id="keeper",
        fingerprint=FP,
        token_ids=list(range(64)),
        block_keys=keys,
        release_lease_id=put.lease_id,
    )
    address = store_process.address
    for args in (("delete", "keeper"), ("verify",), ("agents",), ("gc",)):
        run = cli("store", *args, "-n", "", store=address)
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
        assert (
            run.stderr.strip()
            .splitlines()[-1]
            .endswith("argument -n/--namespace: an empty namespace: name one, or leave out -n")
        ), run.stderr
    bad = cli("store", "delete", "keeper", "-n", "Default", store=address)
    assert bad.returncode == 2 and "invalid namespace 'Default': must match" in bad.stderr
    assert store.get_agent("default", "keeper").agent_id == "keeper"  # nothing deleted
    assert "checked 1 block" in cli("store", "verify", store=address).stdout  # all, unchanged
    assert "keeper" in cli("store", "agents", store=address).stdout


def test_walkthrough_runs_end_to_end():
    run = cli("walkthrough", timeout=240)  # about 5 s here; pytest's own limit is 300 s
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "bit-exact on both paths: True" in out
    assert "2 already stored (deduplicated)" in out
    assert "512 of 515 tokens are cached" in out
    assert "ABORTED" in out and "DATA_LOSS" in out and "missing now 0" in out
    worker_rows = out.split("agentkv-worker serves", 1)[1].splitlines()
    states = [
        re.search(r"\s(hot|warm|cold)\s+[\d.]+\s+\d+\s+\d+", row).group(1)
        for row in worker_rows
        if row.startswith("What does")
    ]
    assert states == ["hot", "hot", "warm", "warm"]  # evicted, then after a restart


def test_a_walkthrough_whose_worker_cannot_start_ends_in_its_one_line(
    tmp_path, monkeypatch, capsys
):
    """An install without the repository's small model (a wheel) tours with the shipped
    default; should the worker not start, its own error is the walkthrough's one line."""
    from agentkv import cli, defaults
    from agentkv.client import walkthrough

    missing = tmp_path / "no-model"
    monkeypatch.setattr(walkthrough, "TOY_MODEL", tmp_path / "not-in-this-install")
    monkeypatch.setattr(defaults, "MODEL", str(missing))
    with pytest.raises(SystemExit) as exit:
        cli.main(["walkthrough"])
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"agentkv-worker: error: no model at {missing}")  # once
    assert "Traceback" not in "\n".join(err)


def test_service_process_reports_a_crash_at_start(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    proc = ServiceProcess("cache_store", ["--data-dir", str(tmp_path / "file")], tmp_path / "log")
    with pytest.raises(RuntimeError, match="exited"):
        proc.start(timeout=30)


def test_open_streams_anyone_may_start_leave_threads_for_every_call(tmp_path):
    """The reviewer's: a health Watch held an RPC thread for as long as its client kept it
    (the error interceptor's wrapper hid grpc's non-blocking Watch), and so did a reflection
    stream; both need no token, so --workers of them stopped every call. Watches hold no
    thread now, and reflection streams are a few at a time."""
    import queue

    flags = ["--workers", "4", "--max-streams", "2"]
    store = StoreProcess(tmp_path / "data", tmp_path / "log", flags)
    store.start()
    requests: queue.Queue = queue.Queue()
    try:
        with grpc.insecure_channel(store.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service="")
            watches = [health.Watch(request, timeout=120) for _ in range(6)]
            for watch in watches:  # each is served, and stays open
                assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=60)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with store.client(timeout=60) as client:
                assert list(client.list_agents(NS)) == []  # a call with work to do, answered
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            held = stub.ServerReflectionInfo(iter(requests.get, None))
            requests.put(reflection_pb2.ServerReflectionRequest(list_services=""))
            assert next(held).list_services_response.service  # one open reflection stream
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.ServerReflectionInfo(iter([request]), timeout=60))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "reflection streams" in refused.value.details()
            with store.client(timeout=60) as client:
                assert list(client.list_agents(NS)) == []
            requests.put(None)  # the held stream ends: its slot is free again
            assert list(held) == []
            # the slot is freed as the server's handler ends
            again = until(lambda: _reflected(stub, request), "a reflection slot")
            assert again and again[0].list_services_response.service
            for watch in watches:
                watch.cancel()
    finally:
        requests.put(None)
        store.stop()


def _reflected(stub, request):
    try:
        return list(stub.ServerReflectionInfo(iter([request]), timeout=60))
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return None
