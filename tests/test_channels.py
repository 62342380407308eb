"""Client channels (agentkv.channels) across a slow link, as to a store in another region: the
CLI, the asyncio SDK and a worker reach it, in plaintext and over TLS."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agentkv.channels import ClientSecurity
from agentkv.launch import store_process, worker_process
from tests.helpers import TcpProxy, cli, make_certs

# Each way: a 300 ms round trip, a WAN link's. gRPC takes min_reconnect_backoff_ms as its
# least connect timeout too: at 100 ms, a client gave up before a store this far answered.
DELAY = 0.15


class SlowLink(TcpProxy):
    """A loopback TCP proxy to `target` that holds every chunk `delay` seconds each way."""

    def __init__(self, target: str, delay: float = DELAY) -> None:
        super().__init__(target, delay)


@pytest.fixture
def certs(tmp_path) -> Path:
    return make_certs(tmp_path / "certs")


def test_the_cli_and_the_asyncio_sdk_reach_a_store_across_a_slow_link(tmp_path, certs):
    tls_flags = ["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key")]
    plain = store_process(tmp_path / "plain", tmp_path / "plain.log").start()
    tls = store_process(tmp_path / "tls", tmp_path / "tls.log", extra_args=tls_flags).start()
    links = [SlowLink(plain.address), SlowLink(tls.address)]
    try:
        far_plain, far_tls = (link.address for link in links)
        ca = str(certs / "ca.pem")
        for args in (["store", "stats"], ["store", "--tls-ca", ca, "stats"]):
            proc = cli(*args, store=far_tls if "--tls-ca" in args else far_plain)
            assert proc.returncode == 0, proc.stderr
            assert "agents" in proc.stdout
        assert asyncio.run(health(far_plain, ClientSecurity()))
        assert asyncio.run(health(far_tls, ClientSecurity(tls_ca=ca)))
    finally:
        for service in (*links, plain, tls):
            (service.close if isinstance(service, SlowLink) else service.stop)()


async def health(address: str, security: ClientSecurity) -> bool:
    """Whether the store's grpc.health.v1 answers SERVING on an asyncio channel."""
    async with security.aio_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_worker_reaches_its_store_across_a_slow_link(tiny_model_dirs, store_process, tmp_path):
    """Its first health check opens the connection too: across a satellite's 800 ms round
    trip that took longer than the checks' 2 s, and a worker that reached its store said
    at start that it did not."""
    link = SlowLink(store_process.address, delay=0.4)
    worker = worker_process(str(tiny_model_dirs["llama"]), link.address, tmp_path / "worker.log")
    try:
        log = worker.start().log_tail()
        assert '"event": "store answers"' in log  # checked before "serving"
        assert "store does not answer" not in log
    finally:
        worker.stop()
        link.close()


def test_an_agent_moves_off_a_host_that_is_down_within_the_call_timeout():
    """A worker host that is down answers no connection attempt (a listener whose accept
    queue is full stands in). The SDK moves the agent to the next worker once the connect
    times out: 5 s (CONNECT_TIMEOUT_MS), within a 15 s call timeout; at gRPC's 20 s connect
    timeout the call failed DeadlineExceeded first."""
    from concurrent import futures

    import grpc

    from agentkv.channels import CONNECT_TIMEOUT_MS
    from agentkv.client import AgentMemory
    from agentkv.worker.v1 import worker_pb2 as pb
    from agentkv.worker.v1 import worker_pb2_grpc
    from client.routing import rank

    class Describer(worker_pb2_grpc.InferenceWorkerServicer):
        def DescribeAgent(self, request, context):
            return pb.DescribeAgentResponse(agent=pb.AgentState(agent_id=request.agent_id))

    server = grpc.server(futures.ThreadPoolExecutor(2))
    worker_pb2_grpc.add_InferenceWorkerServicer_to_server(Describer(), server)
    alive = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    down = socket.create_server(("127.0.0.1", 0), backlog=0)
    filler = socket.create_connection(down.getsockname())  # the queue is full from here on
    dead = f"127.0.0.1:{down.getsockname()[1]}"
    agent = next(f"a{i}" for i in range(1000) if rank([dead, alive], f"default/a{i}")[0] == dead)
    assert CONNECT_TIMEOUT_MS < 15_000
    try:
        with AgentMemory([dead, alive], timeout=15) as mem:
            assert mem.agent(agent).describe().agent_id == agent
    finally:
        server.stop(0)
        filler.close()
        down.close()


def test_a_call_quiet_for_long_is_not_ended_by_keepalive_pings():
    """A client pings every KEEPALIVE_TIME_MS while its call is open, to find a hung server.
    A live server quiet that long (a turn queued for a slot, a long prefill) answers them and
    keeps the call: gRPC's default ended the connection after two pings within 5 min of each
    other ("too_many_pings"), every call quiet for 20 s failing UNAVAILABLE."""
    import grpc

    from agentkv.rpc import KEEPALIVE_TIME_MS, bind, new_server

    def quiet(request: bytes, context) -> bytes:
        time.sleep(5 * KEEPALIVE_TIME_MS / 1000)  # the server's work, not a wait on the test
        return request

    server = new_server(2, 1 << 20, lambda code: None)
    work = grpc.unary_unary_rpc_method_handler(quiet)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("test.Quiet", {"Work": work}),)
    )
    address = bind(server, "127.0.0.1:0")
    server.start()
    channel = ClientSecurity().channel(address)
    try:
        assert channel.unary_unary("/test.Quiet/Work")(b"answered", timeout=120) == b"answered"
    finally:
        channel.close()
        server.stop(0)


def test_grpc_core_lines_stay_out_of_a_service_log(tmp_path):
    """A peer that goes away with calls on the wire makes gRPC's C core write "Got goaway" to
    stderr, between a service's JSON lines. A process that imports agentkv first, as each
    service does, logs JSON only. The peer here is a raw HTTP/2 server that waits for the call's
    HEADERS (a client sends its call only once the server's SETTINGS came: a GOAWAY before
    that finds no call, and the client may drop the connection unread, as it did once in CI),
    then answers with GOAWAY and a PING: the client's ack says it has read the GOAWAY."""
    script = tmp_path / "goaway.py"
    script.write_text(
        textwrap.dedent(
            """
            import logging, socket, struct, threading
            from agentkv import logs
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            logs.configure()

            def frame(kind, flags, payload=b""):
                size = struct.pack(">I", len(payload))[1:]
                return size + bytes([kind, flags]) + struct.pack(">I", 0) + payload

            def frames(peer):
                # the kind and flags of each frame the client sends, past its preface
                stream = peer.makefile("rb")
                stream.read(24)
                while len(head := stream.read(9)) == 9:
                    stream.read(int.from_bytes(head[:3], "big"))
                    yield head[3], head[4]

            listener, acked = socket.create_server(("127.0.0.1", 0)), threading.Event()

            def serve():
                peer, _ = listener.accept()
                peer.sendall(frame(4, 0))  # SETTINGS
                sent = frames(peer)
                assert any(kind == 1 for kind, _ in sent)  # the call's HEADERS: on the wire
                goaway = frame(7, 0, struct.pack(">II", 0, 2) + b"going away")
                peer.sendall(frame(4, 1) + goaway + frame(6, 0, b"8 bytes!"))  # ack, GOAWAY, PING
                if any(kind == 6 and flags & 1 for kind, flags in sent):  # the PING's ack
                    acked.set()

            threading.Thread(target=serve, daemon=True).start()
            channel = grpc.insecure_channel(f"127.0.0.1:{listener.getsockname()[1]}")
            call = health_pb2_grpc.HealthStub(channel).Check.future(
                health_pb2.HealthCheckRequest(), timeout=120
            )
            assert acked.wait(120)
            call.cancel()
            logging.getLogger("probe").info("after goaway")
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=240
    )
    assert done.returncode == 0, done.stderr
    assert not [line for line in done.stderr.splitlines() if not line.startswith("{")]
    assert [json.loads(line)["event"] for line in done.stderr.splitlines()] == ["after goaway"]


def test_a_peers_transport_error_says_which_peer_once():
    """A worker's answer for a transport error of its call to the store names the store,
    even where the store's address spells "store" (Kubernetes' agentkv-store); an error that
    already begins by naming it (the SDK's closed client) is not named twice."""
    from agentkv.client.store import CLOSED
    from agentkv.errors import DeadlineExceeded, Unavailable
    from agentkv.rpc import from_peer

    def of_store(error):
        error.peer = "store"
        return from_peer(error)

    down = "failed to connect to all addresses; last error: ipv4:agentkv-store:50051: refused"
    assert of_store(Unavailable(down)) == f"the store did not answer: {down}"
    assert of_store(DeadlineExceeded("Deadline Exceeded")).startswith("the store did not answer")
    assert of_store(Unavailable(CLOSED)) == CLOSED
    answered = Unavailable("not committed")
    answered.remote = True  # the store's own answer: its words as they are
    assert of_store(answered) == "not committed"
    assert from_peer(Unavailable(down)) == down  # this server's own error
