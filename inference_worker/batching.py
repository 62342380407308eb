"""Turns in flight, advanced one model step at a time on the MLX thread.

Each step decodes one token for every agent in the batch (one batched forward over their
quantized caches), then runs the prefill chunks the scheduler granted; an agent whose
prefill completes takes its first token and joins the batch for the next step. An agent that
finishes, is cancelled or runs out of time leaves the batch with its cache extracted, bit for
bit what a single-agent turn would hold, and is handed back to be persisted.

A turn whose own work fails (its prefill, its sampling, its tokens) leaves the batch alone,
handed back through `on_failed`; the others go on. Only the shared decode forward, or the
batch's re-merge, failing raises out of `schedule` or `run`: then the caller fails every
turn (`fail_all`).
"""

from __future__ import annotations

import codecs
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx

from agentkv.errors import AgentKVError, DeadlineExceeded, ServerBusy
from agentkv.ids import AgentId
from inference_worker.agents import Agent, Checkpoint
from inference_worker.batch_cache import BatchQuantizedKV
from inference_worker.masks import Constraint, masked
from inference_worker.sampling import StopMatcher
from inference_worker.scheduler import Request, Scheduler, Step
from inference_worker.tools import ReplyCalls
from inference_worker.turns import StartEvent, TokenEvent, TurnJob, UsageEvent

log = logging.getLogger("agentkv.worker")
# What a turn hears when the batched step it was in failed for everyone: never the error's
# own text, which may quote another tenant's request.
STEP_FAILED = "the batched model step failed; this turn left no trace in its agent, retry it"


@dataclass(slots=True)
class ActiveTurn:
    job: TurnJob
    agent: Agent
    usage: UsageEvent
    request: Request
    pending: list[int]  # the tokens this turn prefills
    detok: Any
    sample: Callable[[mx.array], int] | None = field(init=False)  # None: greedy, batch argmax
    stops: StopMatcher = field(init=False)
    prefilled: int = 0
    own_turn: int = 0  # the first pending tokens, a turn of their own (a stable prefix)
    next_token: int = -1  # generated, not yet fed through the model
    first_at: float = 0.0
    undo: Checkpoint | None = None  # the agent before this turn, should it fail
    calls: ReplyCalls | None = None  # takes the reply's tool calls out of its text
    constraint: Constraint | None = None  # the reply's required form, if any

    def __post_init__(self) -> None:
        self.sample, self.stops = self.job.sampling.sampler(), StopMatcher(self.job.sampling.stop)


class Batcher:
    def __init__(
        self,
        model: Any,
        eos_ids: set[int],
        scheduler: Scheduler,
        quantized_query_max: int,
        on_done: Callable[[ActiveTurn], None],
        on_failed: Callable[[ActiveTurn, AgentKVError, str], None],  # the turn, why, its scope
        on_decode: Callable[[int], None] = lambda batch_size: None,
        vocab: int | None = None,  # logits past it are padding (Runtime.vocab_size)
    ) -> None:
        self.model, self.eos_ids, self.scheduler, self.vocab = model, eos_ids, scheduler, vocab
        self.qmax, self.on_done, self.on_decode = quantized_query_max, on_done, on_decode
        self.on_failed = on_failed
        self.active: dict[str, ActiveTurn] = {}
        self.rows: list[str] = []  # request ids, in batch order
        self.batch: list[BatchQuantizedKV] | None = None

    def add(self, turn: ActiveTurn) -> None:
        pushed = self.scheduler.submit(turn.request)  # raises ServerBusy when full
        self.active[turn.request.request_id] = turn
        if pushed is not None:  # a full queue is shared: it gave its place to `turn`
            self._fail(
                self.active[pushed.request_id],
                ServerBusy(
                    "worker busy: this turn's place in the queue went to a turn of another "
                    "namespace (a full queue is shared evenly); retry later"
                ),
            )

    def holds(self, agent: Agent) -> bool:
        return any(t.agent is agent for t in self.active.values())

    def busy(self) -> set[AgentId]:
        """The agents with a turn in flight."""
        return {t.agent.id for t in self.active.values()}

    def let_cancelled_go(self) -> None:
        """Turns whose callers cancelled them leave now, in the batch or waiting for it."""
        self._leave_all(
            [(t, "cancelled") for t in self.active.values() if t.job.cancelled.is_set()]
        )

    def schedule(self) -> Step:
        """Lets cancelled and expired turns go, then asks the scheduler for the next step."""
        self.let_cancelled_go()
        step = self.scheduler.schedule(time.monotonic())
        for request in step.expired:
            self._expire(self.active[request.request_id])
        return step

    def run(self, step: Step) -> None:
        """Decodes one token for the batch, then runs the step's prefill chunks."""
        if self.rows:
            self._decode()
        joining = []
        for request, n in step.prefill:
            turn = self.active.get(request.request_id)
            if turn is not None and self._prefill_alone(turn, n):
                joining.append(turn)
        if joining:
            self._join(joining)  # one re-merge for everyone whose prefill finished

    # decode and prefill

    def fail_all(self) -> None:
        """Fails every turn, in the batch or not, after a step failed for all of them: their
        caches as the batch held them are lost (each agent keeps its own from before it
        joined)."""
        turns = list(self.active.values())
        for turn in turns:
            self.scheduler.cancel(turn.request.request_id)
        self.active, self.rows, self.batch = {}, [], None
        for turn in turns:
            self.on_failed(turn, AgentKVError(STEP_FAILED), "batch")

    def _decode(self) -> None:
        self.on_decode(len(self.rows))
        turns = [self.active[rid] for rid in self.rows]
        tokens = mx.array([[t.next_token] for t in turns])
        logits = self.model(tokens, cache=self.batch)[:, -1, : self.vocab]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(logprobs)  # the shared forward fails here, before any row's own work
        refused: dict[int, AgentKVError] = {}  # rows whose form failed
        if any(t.constraint is not None for t in turns):  # their masks, computed together
            logprobs, refused = masked(logprobs, [t.constraint for t in turns])
        # Greedy rows share one argmax and one sync; sampled rows draw from their own keys.
        greedy = (
            mx.argmax(logprobs, axis=-1).tolist() if any(t.sample is None for t in turns) else []
        )
        finished, failed = [], []
        for row, turn in enumerate(turns):
            try:
                if row in refused:
                    raise refused[row]
                reason = self._accept(turn, _choose(turn, logprobs[row], greedy[row : row + 1]))
            except Exception as exc:  # this row's own failure: the others go on
                failed.append((turn, exc))
                continue
            if reason:
                finished.append((turn, reason))
        self._leave_all(finished, failed)  # one filter of the batch, however many rows leave

    def _prefill_alone(self, turn: ActiveTurn, n: int) -> bool:
        """_prefill, where a failure fails this turn only (its chunk ran on its own caches)."""
        try:
            return self._prefill(turn, n)
        except Exception as exc:
            if turn.request.request_id in self.active:
                self._leave_all([], [(turn, exc)])
            return False

    def _prefill(self, turn: ActiveTurn, n: int) -> bool:
        """Runs a prefill chunk; returns whether the turn now joins the batch to decode."""
        turn.agent.keep_undurable()
        end = turn.prefilled + n
        while turn.prefilled < end:
            stop = turn.own_turn if turn.prefilled < turn.own_turn < end else end
            chunk = turn.pending[turn.prefilled : stop]
            logits = self.model(mx.array([chunk]), cache=turn.agent.caches)
            mx.eval(logits)
            turn.prefilled = stop
            if stop == turn.own_turn:  # the rest attends it as stored, as a new agent's
                for cache in turn.agent.caches:
                    cache.end_turn()
                    cache.begin_turn()
        if turn.prefilled < len(turn.pending):
            return False
        if turn.request.max_tokens == 0:
            self._leave(turn, "none")
            return False
        last = logits[0, -1:, : self.vocab]
        logprobs = last - mx.logsumexp(last, axis=-1, keepdims=True)
        if turn.constraint is not None:
            logprobs, refused = masked(logprobs, [turn.constraint])
            if refused:
                raise refused[0]
        reason = self._accept(turn, _choose(turn, logprobs[0]))
        if reason:
            self._leave(turn, reason)
            return False
        return True

    def _accept(self, turn: ActiveTurn, token: int) -> str:
        """Records and sends one generated token; returns why the turn ends, or ""."""
        if turn.constraint is not None and token not in self.eos_ids:
            turn.constraint.take(token)
        turn.agent.tokens.append(token)
        u = turn.usage
        u.generated_tokens += 1
        if u.generated_tokens == 1:
            turn.first_at = time.perf_counter()
            u.time_to_first_token_ms = (turn.first_at - turn.job.started) * 1000
        reason = self._emit(turn, token)
        if not reason and turn.constraint is not None and turn.constraint.done:
            reason = "form"  # complete: only its end could follow, which it needs not
        if not reason and u.generated_tokens >= turn.request.max_tokens:
            reason = "length"
        turn.next_token = token
        return reason

    def _emit(self, turn: ActiveTurn, token: int) -> str:
        if token in self.eos_ids:
            self._send(turn, self._rest(turn), [token])
            return "stop"
        turn.detok.add_token(token)
        segment = turn.detok.last_segment
        if turn.calls is not None:  # a call opens with its special token, not its spelling
            segment = turn.calls.marked(segment, token)
        text, stopped = turn.stops.feed(segment)
        self._send(turn, text, [token])
        return "stop" if stopped or (turn.calls is not None and turn.calls.full) else ""

    @staticmethod
    def _rest(turn: ActiveTurn, cut: bool = False) -> str:
        """The text the detokenizer and the stop matcher still hold, up to a stop string. A
        reply `cut` short (its max_tokens, its deadline, a cancel) may end inside a
        character's bytes, which the detokenizer holds and would end in U+FFFD: that one is
        dropped (the reply's tokens keep its bytes); invalid bytes stay U+FFFD."""
        partial = cut and ends_inside_a_character(turn.detok)
        turn.detok.finalize()
        segment = turn.detok.last_segment
        text, stopped = turn.stops.feed(segment.removesuffix("\ufffd") if partial else segment)
        return text if stopped else text + turn.stops.flush()

    @staticmethod
    def _send(turn: ActiveTurn, text: str, tokens: list[int]) -> None:
        """One token's text (and tool calls); before the first, the prompt's usage."""
        calls = []
        if turn.calls is not None:
            text, calls = turn.calls.feed(text)
        if tokens and turn.usage.generated_tokens == 1:  # the prompt's cost, told at once
            # (with the first token: text held back for stop strings may follow, tokenless)
            turn.job.events.put(StartEvent(replace(turn.usage, finish_reason="")))
        turn.job.events.put(TokenEvent(text, tokens, calls))

    # joining and leaving the batch

    def _join(self, turns: list[ActiveTurn]) -> None:
        for turn in turns:  # its own caches now only undo a failure (Agent.rewind): the
            for cache in turn.agent.caches:  # fp16 copy of its prefill goes, not at its end
                cache.end_turn()
        per_layer = list(zip(*(t.agent.caches for t in turns), strict=True))
        if self.batch is None:
            self.batch = [BatchQuantizedKV.merge(list(caches), self.qmax) for caches in per_layer]
        else:
            for layer, caches in zip(self.batch, per_layer, strict=True):
                layer.extend(list(caches))
        self.rows += [t.request.request_id for t in turns]

    def _leave(self, turn: ActiveTurn, reason: str) -> None:
        self._leave_all([(turn, reason)])

    def _leave_all(
        self,
        finished: list[tuple[ActiveTurn, str]],
        failed: Sequence[tuple[ActiveTurn, Exception]] = (),
    ) -> None:
        """Extracts the caches of the finished turns in the batch, then filters it once; the
        failed ones leave without theirs (their agents go back to before the turn)."""
        if not finished and not failed:
            return
        gone = {t.request.request_id for t, _ in [*finished, *failed]}
        for turn, _ in finished:
            rid = turn.request.request_id
            if rid in self.rows:
                row = self.rows.index(rid)
                turn.agent.caches = [layer.extract(row) for layer in self.batch]
        if gone.intersection(self.rows):
            keep = [i for i, rid in enumerate(self.rows) if rid not in gone]
            self.rows = [self.rows[i] for i in keep]
            if self.rows:
                for layer in self.batch:
                    layer.filter(keep)
            else:
                self.batch = None
        for turn, reason in finished:
            self._finish(turn, reason)
        for turn, exc in failed:
            self._fail(turn, exc)

    def _fail(self, turn: ActiveTurn, exc: Exception) -> None:
        self.scheduler.cancel(turn.request.request_id)  # a no-op if it already left
        self.active.pop(turn.request.request_id, None)
        if not isinstance(exc, AgentKVError):  # a bug, or a bad input not caught at submit
            agent_id = turn.agent.agent_id
            log.error("turn failed", extra={"agent": agent_id, "error": repr(exc)})
            exc = AgentKVError(f"turn of agent {agent_id!r} failed: {type(exc).__name__}: {exc}")
        self.on_failed(turn, exc, "turn")

    def _finish(self, turn: ActiveTurn, reason: str) -> None:
        rid = turn.request.request_id
        if reason == "cancelled":
            self.scheduler.cancel(rid)  # from the queue or the batch; a no-op if gone
        elif not turn.request.done:
            self.scheduler.finish(turn.request)
        self.active.pop(rid, None)
        u = turn.usage
        held = u.generated_tokens and reason in ("length", "deadline", "cancelled", "form")
        if held and (rest := self._rest(turn, cut=reason != "form")):
            self._send(turn, rest, [])  # what was held back for stop strings
        calls = turn.calls
        if calls is not None and any(rest := calls.flush()):  # text, or a call ending here
            turn.job.events.put(TokenEvent(rest[0], [], rest[1]))
        reason = "stop" if reason == "form" else reason
        u.finish_reason = "tool_calls" if reason == "stop" and calls and calls.calls else reason
        u.stop_sequence = turn.stops.matched if u.finish_reason == "stop" else ""
        if u.generated_tokens > 1:
            elapsed = max(time.perf_counter() - turn.first_at, 1e-9)
            u.decode_tokens_per_second = (u.generated_tokens - 1) / elapsed
        self.on_done(turn)

    def _expire(self, turn: ActiveTurn) -> None:
        if turn.usage.generated_tokens or turn.prefilled:
            self._leave(turn, "deadline")
            return
        message = f"turn for agent {turn.agent.agent_id!r} did not start within its deadline"
        self._fail(turn, DeadlineExceeded(message))


def _choose(turn: ActiveTurn, logprobs: mx.array, greedy: list[int] = ()) -> int:
    """The turn's next token from its log-probabilities (vocab,), masked to its form if it
    has one; `greedy`: the batch's argmax for its row, if taken."""
    if turn.sample is None:
        return greedy[0] if greedy else int(mx.argmax(logprobs).item())
    if turn.constraint is not None:  # what the form allows, as a distribution (top_p's)
        logprobs = logprobs - mx.logsumexp(logprobs)
    return turn.sample(logprobs)


def ends_inside_a_character(detok: Any) -> bool:
    """Whether the bytes an mlx-lm streaming detokenizer holds end with an incomplete UTF-8
    character. It holds them in `_unflushed` (mlx-lm's own name, <0.33 as pinned): bytes
    (SentencePiece's), or byte-level BPE's characters for bytes, read back as its
    `_decode_bytes` does; a detokenizer that holds none there (the naive one) says no."""
    held = getattr(detok, "_unflushed", b"")
    if isinstance(held, str):
        table = gpt2_bytes()
        held = b"".join(bytes([table[c]]) if c in table else c.encode() for c in held)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(held)
    return bool(decoder.getstate()[0])  # what it holds back for the next bytes


@functools.cache
def gpt2_bytes() -> dict[str, int]:
    """Byte-level BPE's character for each byte, read back: GPT-2's table (bytes that print
    stand for themselves; the others take the characters from U+0100 on, in order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
