"""A worker's stop is bounded, through real store and worker processes.

- A worker stopped while its store hangs (SIGSTOP) with a write queued gives that write
  --stop-write-seconds after the drain, then cuts it and exits by itself, saying so; every
  acknowledged durable turn is in the store, and a fresh worker restores it.
"""

from __future__ import annotations

import os
import signal

import grpc
import pytest

from agentkv.client.worker import WorkerClient
from agentkv.launch import worker_process
from tests.helpers import freeze, long_turn, read_tokens

SYSTEM = "You are the archivist of the old library, and you index every scroll. " * 6
Q1 = [("user", "Which scrolls came in today?")]
Q2 = [("user", "Index them by century.")]
Q3 = [("user", "Which century has the most?")]
# Ample for a busy machine; that --stop-write-seconds, not the store client's 20 s keepalive,
# ended the stuck write is read in the log ("cut").
EXIT_SECONDS = 60


def test_a_worker_stopped_with_a_write_to_a_hung_store_exits_and_keeps_its_durable_turns(
    tiny_model_dirs, store_process, launched, tmp_path
):
    """SIGTERM with a non-durable turn's write stuck on a frozen store: the worker exits 0
    once --stop-write-seconds cut the write, logging that turns were not stored (before: its
    stop waited on the write, ~25 s or more); a fresh worker restores the agent at its
    durable turn."""
    model = str(tiny_model_dirs["llama"])
    args = ["--block-tokens", "64", "--drain-seconds", "0", "--stop-write-seconds", "2"]
    proc = launched(
        worker_process(model, store_process.address, tmp_path / "w1.log", extra_args=args)
    )
    w = WorkerClient(proc.address, timeout=60)
    w.create_agent("ns", "a", SYSTEM)
    w.turn("ns", "a", Q1, max_tokens=4, durable=True)
    durable = w.describe("ns", "a")
    assert durable.persisted_tokens > 0
    freeze(store_process.proc.pid)
    try:
        hot = w.turn("ns", "a", Q2, max_tokens=4)  # the 2 s store check times out: RAM answers
        assert hot.usage.cache_state == "hot"
        assert w.describe("ns", "a").num_tokens > durable.persisted_tokens
        w.close()
        proc.proc.send_signal(signal.SIGTERM)
        code = proc.proc.wait(timeout=EXIT_SECONDS)
    finally:
        os.kill(store_process.proc.pid, signal.SIGCONT)
    log = proc.log_tail(100_000)
    assert code == 0, log
    assert "stopped with turns not in the store" in log and "Traceback" not in log, log
    assert '"cut": true' in log, log  # past the bound, the store client was closed
    assert "the store client was closed" in log, log  # which ended the write, not a keepalive

    fresh = launched(
        worker_process(model, store_process.address, tmp_path / "w2.log", extra_args=args)
    )
    w = WorkerClient(fresh.address, timeout=60)
    state = w.describe("ns", "a")
    assert (state.tier, state.num_tokens) == ("warm", durable.num_tokens), (state, durable)
    again = w.turn("ns", "a", Q3, max_tokens=4)
    assert again.usage.cache_state == "warm"
    assert again.usage.reused_store_tokens == durable.persisted_tokens
    w.close()


def test_a_turn_cut_by_the_stop_is_not_logged_as_a_lost_write(
    tiny_model_dirs, store_process, launched, tmp_path
):
    """SIGTERM past the drain with a turn generating, its store well: the turn ends with
    UNAVAILABLE, and "stopped with turns not in the store" (said of acknowledged turns the
    store did not take) is not logged. Which way the turn ends is a race: cut by the stop
    (logged so; the store keeps the agent as before it), or ended by gRPC's cancelling of
    the call first, as a turn its client left (it keeps what it generated, written)."""
    model = str(tiny_model_dirs["llama"])
    args = ["--block-tokens", "64", "--drain-seconds", "0"]
    proc = launched(
        worker_process(model, store_process.address, tmp_path / "w.log", extra_args=args)
    )
    w = WorkerClient(proc.address, timeout=60)
    w.create_agent("ns", "a", SYSTEM)
    w.turn("ns", "a", Q1, max_tokens=4, durable=True)
    before = w.describe("ns", "a").num_tokens
    call = long_turn(w, "ns", "a", Q2)
    read_tokens(call, 8, [])
    proc.proc.send_signal(signal.SIGTERM)
    with pytest.raises(grpc.RpcError) as cut:
        read_tokens(call, 1 << 30, [])
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
    w.close()
    assert proc.proc.wait(timeout=EXIT_SECONDS) == 0
    log = proc.log_tail(100_000)
    assert "Traceback" not in log and "stopped with turns not in the store" not in log, log
    with store_process.client() as store:
        stored = len(store.get_agent("ns", "a").token_ids)
    if "turns cut by the stop" in log:
        assert stored == before
    else:
        assert stored > before + 8
