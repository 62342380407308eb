"""`python -m tests.faulty_worker ARGS`: the worker process (agentkv-worker ARGS) with two
faults injected from outside, keyed by a turn's sampling seed, so that tests can make one
tenant's turn fail inside a batch as a bug or a bad input would:

- ROW_FAULT_SEED: the turn's own sampler raises on its third draw (its prefill and first
  decode went fine; a partial reply is in its context);
- STEP_FAULT_SEED: a decode step whose batch holds that turn raises for every row, as a
  failure of the shared forward would;
- SLOW_STEP_SEED: every decode step whose batch holds that turn takes SLOW_STEP_SECONDS more,
  as a big model's long step does (no fault: it only takes time);
- HELD_STEP_SEED: a decode step whose batch holds that turn writes HELD_STEP_GATE's path
  (from its environment) + ".held", then waits until that path exists: the MLX thread is
  held as long as a test likes, and the test knows when it is;
- BATCH_BYTES_LOG (an environment variable naming a file): each decode step appends the KV
  bytes the live batch holds and those the turns' agents hold beside it (their own caches,
  kept to undo their turns), as "rows bytes";
- STARTED_LOG (an environment variable naming a file): each turn appends its agent's id
  there once its RPC thread has handed it to the MLX thread, in that thread's queue (a held
  step keeps it from running);
- FINISHED_LOG (an environment variable naming a file): each turn that ends with a reply,
  not cancelled, appends its agent's id there as the MLX thread ends it, before its reply's
  last response goes out: the order turns were served in, which clients' threads, woken
  in their own time, need not record;
- CANCELLED_PREFILL_SEED: the prefill of a turn with that seed writes CANCELLED_PREFILL_MARK's
  path (from its environment), then waits until the turn's call is cancelled (its client
  gone) before it runs: the cancel comes during the step that prefills the turn and samples
  its first token, and is read at the next;
- WRITES_HELD (an environment variable naming a file): while that file exists, the worker's
  writes to the store wait (its agents stay in RAM, not yet durable);
- COMPILED_LOG (an environment variable naming a file): each grammar compiled (not found
  among those kept) appends the name of the thread that compiled it ("agentkv-mlx": every
  turn in flight waited for it);
- REPLY_LOST_PHASE: an injection or a turn into that phase is taken (and, durable,
  committed), or a fork into that phase is committed, then the process dies before its reply
  (a turn's first response) is sent, as a worker lost at that moment does.

Both errors carry SECRET, which no other turn may ever see. With OLD_WORKER=1 in its
environment the process acts as a worker from before TurnRequest.after_mark: it lists no
features and drops the fields it would not know (proto3 drops unknown fields).
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

from agentkv import logs
from inference_worker.__main__ import build_config
from inference_worker.blas import load_optimized_blas

ROW_FAULT_SEED = 666
STEP_FAULT_SEED = 667
SLOW_STEP_SEED = 668
SLOW_STEP_SECONDS = 3.0
HELD_STEP_SEED = 669
CANCELLED_PREFILL_SEED = 673
CANCELLED_PREFILL_MARK = "AGENTKV_TEST_CANCELLED_PREFILL_MARK"
WRITES_HELD = "AGENTKV_TEST_WRITES_HELD"
HELD_STEP_GATE = "AGENTKV_TEST_HELD_STEP_GATE"
FINISHED_LOG = "AGENTKV_TEST_FINISHED_LOG"
BATCH_BYTES_LOG = "AGENTKV_TEST_BATCH_BYTES_LOG"
STARTED_LOG = "AGENTKV_TEST_STARTED_LOG"
COMPILED_LOG = "AGENTKV_TEST_COMPILED_LOG"
REPLY_LOST_PHASE = "reply-lost"
SECRET = "tenant-a-secret-7f3e"


def log_compiles(path: Path) -> None:
    """Each grammar compiled appends its thread's name to `path` (COMPILED_LOG)."""
    import json
    import threading

    from inference_worker.llg import Compiler

    compile_matcher = Compiler.matcher

    def logged(self, grammar):
        with self._lock:
            kept = json.dumps(grammar) in self._kept
        if not kept:
            with open(path, "a") as log:
                log.write(f"{threading.current_thread().name}\n")
        return compile_matcher(self, grammar)

    Compiler.matcher = logged


def install() -> None:
    """Patches the faults in (after the BLAS is loaded: this imports mlx)."""
    from inference_worker.batching import Batcher
    from inference_worker.front import Front
    from inference_worker.persistence import Persister
    from inference_worker.sampling import Sampling
    from inference_worker.service import InferenceWorkerServicer

    def lost_reply(rpc):
        def dies_after(self, request, context):
            reply = rpc(self, request, context)
            if request.phase == REPLY_LOST_PHASE:
                os._exit(1)
            return reply

        return dies_after

    def lost_stream(rpc):
        def dies_before_first(self, request, context):
            if request.phase != REPLY_LOST_PHASE:  # streamed as it comes, as always
                yield from rpc(self, request, context)
                return
            for _ in rpc(self, request, context):  # the whole turn, committed
                pass
            os._exit(1)

        return dies_before_first

    InferenceWorkerServicer.Turn = lost_stream(InferenceWorkerServicer.Turn)
    if os.environ.get("OLD_WORKER") == "1":
        old_worker()
    InferenceWorkerServicer.InjectContext = lost_reply(InferenceWorkerServicer.InjectContext)
    InferenceWorkerServicer.ForkAgent = lost_reply(InferenceWorkerServicer.ForkAgent)

    sampler, decode = Sampling.sampler, Batcher._decode

    def faulty_sampler(self):
        sample = sampler(self)
        if self.seed != ROW_FAULT_SEED:
            return sample
        draws = itertools.count(1)

        def failing(logprobs):
            if next(draws) >= 3:
                raise RuntimeError(f"{SECRET}: injected fault in this turn's sampling")
            return sample(logprobs)

        return failing

    def faulty_decode(self):
        seeds = {self.active[r].job.sampling.seed for r in self.rows}
        if STEP_FAULT_SEED in seeds:
            raise RuntimeError(f"{SECRET}: injected fault in the shared decode step")
        if SLOW_STEP_SEED in seeds:
            time.sleep(SLOW_STEP_SECONDS)
        if HELD_STEP_SEED in seeds:
            hold_until(Path(os.environ[HELD_STEP_GATE]))
        if path := os.environ.get(BATCH_BYTES_LOG):
            held = sum(layer.nbytes for layer in self.batch)
            held += sum(turn.agent.nbytes for turn in self.active.values())
            with open(path, "a") as log:
                log.write(f"{len(self.rows)} {held}\n")
        return decode(self)

    if path := os.environ.get(COMPILED_LOG):
        log_compiles(Path(path))
    save = Persister._save

    def save_once_let(self, agent, snap):
        held = os.environ.get(WRITES_HELD)
        while held and Path(held).exists():
            time.sleep(0.02)
        return save(self, agent, snap)

    Persister._save = save_once_let
    prefill = Batcher._prefill

    def prefill_once_cancelled(self, turn, n: int) -> bool:
        if turn.job.sampling.seed == CANCELLED_PREFILL_SEED:
            Path(os.environ[CANCELLED_PREFILL_MARK]).touch()
            turn.job.cancelled.wait(120)
        return prefill(self, turn, n)

    finish = Batcher._finish

    def logged_finish(self, turn, reason: str) -> None:
        replied = reason != "cancelled" and turn.usage.generated_tokens  # not a create's
        if replied and (path := os.environ.get(FINISHED_LOG)):
            with open(path, "a") as log:
                log.write(turn.agent.agent_id + "\n")
        finish(self, turn, reason)

    mlx = Front._mlx

    def logged_mlx(self, fn, *args):
        if fn.__name__ != "start_turn" or not (path := os.environ.get(STARTED_LOG)):
            return mlx(self, fn, *args)
        handed = self.engine.submit(fn, *args)  # in the MLX thread's queue: then logged
        with open(path, "a") as log:
            log.write(args[0].agent_id + "\n")
        return handed.result()

    Front._mlx = logged_mlx
    Sampling.sampler = faulty_sampler
    Batcher._decode = faulty_decode
    Batcher._finish = logged_finish
    Batcher._prefill = prefill_once_cancelled


def hold_until(gate: Path) -> None:
    """Says it holds (gate.held), then waits for the gate."""
    gate.with_suffix(".held").touch()
    while not gate.exists():
        time.sleep(0.05)


def old_worker() -> None:
    """A worker from before after_mark: no features listed, its turn fields dropped."""
    import inference_worker.server
    from inference_worker.service import InferenceWorkerServicer

    inference_worker.server.FEATURES = ()
    turn = InferenceWorkerServicer.Turn

    def unaware(self, request, context):
        for name in ("after_mark", "after_mark_last", "mark_name"):
            request.ClearField(name)
        yield from turn(self, request, context)

    InferenceWorkerServicer.Turn = unaware


def main() -> None:
    """inference_worker.__main__.main, with the faults installed."""
    config = build_config()
    logs.configure(config.log_level)
    blas = load_optimized_blas()  # before anything imports mlx
    install()
    from inference_worker.server import serve

    serve(config, blas)


if __name__ == "__main__":
    main()
