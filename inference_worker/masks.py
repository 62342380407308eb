"""Constrained decoding's step: each constrained row's matcher (grammar.py writes it, llg.py
compiles it) masks its logits to the tokens that keep the reply a beginning of its form, the
rows of a batch together, in llguidance's threads, under per-step limits, so that one
tenant's form cannot hold the others' rows for more than a few milliseconds."""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import numpy as np

from agentkv.errors import AgentKVError, InvalidArgument

MAX_REASON = 500  # characters of llguidance's reason a refusal quotes
log = logging.getLogger("agentkv.worker")


class Constraint:
    """One reply's matcher as it is generated: each token it takes, and whether the form is
    complete (no token may follow). An `optional` one holds what the caller did not ask for
    (strict tools' calls): where it fails, it is dropped and the reply goes on free. `agent`:
    whose reply it is (named in the log)."""

    def __init__(self, matcher: Any, vocab: int, optional: bool = False, agent: str = "") -> None:
        self.matcher, self.vocab = matcher, vocab  # vocab: the tokenizer's, llguidance's
        self.optional, self.agent = optional, agent

    def take(self, token: int) -> None:
        if self.matcher is not None:
            self.matcher.consume_token(token)
            self.check()

    def check(self) -> None:
        """InvalidArgument where the matcher failed; an optional one is dropped instead."""
        try:
            check(self.matcher)
        except InvalidArgument as exc:
            if not self.optional:
                raise
            self.drop(exc)

    def drop(self, why: AgentKVError) -> None:
        """An optional constraint that failed: the reply goes on free (logged, with why)."""
        log.warning(
            "strict tools' calls no longer held in a reply",
            extra={"agent": self.agent, "why": why.message},
        )
        self.matcher = None

    @property
    def done(self) -> bool:
        return self.matcher is not None and self.matcher.is_stopped()


def check(matcher: Any) -> None:
    """InvalidArgument (the form is the caller's) for a matcher in error: its reason on one
    line, at most MAX_REASON characters (llguidance may quote the whole grammar)."""
    if matcher.is_error():
        reason = " ".join(matcher.get_error().split())[:MAX_REASON]
        raise InvalidArgument(f"output format: {reason}")


def masked(logprobs: mx.array, constraints: list[Constraint | None]) -> tuple[mx.array, dict]:
    """The batch's log-probabilities (rows, vocab) with each constrained row's disallowed
    tokens at -inf (its masks computed together, in llguidance's threads; a free row stays
    bit for bit as it was), and the rows whose matcher failed, with why (an optional
    constraint that fails is dropped: its row is free from then on)."""
    from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

    held = [
        (c, row) for row, c in enumerate(constraints) if c is not None and c.matcher is not None
    ]
    if not held:
        return logprobs, {}
    rows = [(c.matcher, row) for c, row in held]
    vocab, width = held[0][0].vocab, logprobs.shape[-1]
    bits = np.full((len(constraints), (vocab + 31) // 32), -1, dtype=np.int32)
    failed: dict[int, AgentKVError] = {}
    try:
        fill_next_token_bitmask_par(_executor(), rows, bits)
    except Exception:  # a misuse (a row's matcher twice): row by row, failing only its rows
        for matcher, row in rows:
            try:
                fill_next_token_bitmask(matcher, bits, row)
            except Exception as exc:
                failed[row] = AgentKVError(f"output format: {type(exc).__name__}: {exc}")
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :width]
    if allowed.shape[1] < width:  # logits past the tokenizer's ids: none is allowed
        allowed = np.pad(allowed, ((0, 0), (0, width - allowed.shape[1])))
    for constraint, row in held:
        try:
            if row in failed:
                raise failed.pop(row)
            check(constraint.matcher)
            if not allowed[row].any():
                raise AgentKVError("output format: no token of the model can continue it")
        except AgentKVError as exc:
            allowed[row] = 1  # free from now on, or leaving the batch: no all -inf row (NaN)
            if constraint.optional:
                constraint.drop(exc)
            else:
                failed[row] = exc
    return mx.where(mx.array(allowed.astype(bool)), logprobs, -mx.inf), failed


_EXECUTOR: list = []


def _executor() -> Any:
    if not _EXECUTOR:
        import llguidance

        _EXECUTOR.append(llguidance.LLExecutor())
    return _EXECUTOR[0]


def limits() -> Any:
    """Per-step limits well under llguidance's defaults: one turn's mask must not hold the
    batch (every other tenant's rows) for more than a few milliseconds."""
    import llguidance

    return llguidance.LLParserLimits(
        step_lexer_fuel=50_000,  # ~3.5 ms
        step_max_items=20_000,  # ~1 ms
        max_lexer_states=50_000,
        max_grammar_size=100_000,
        verbose_errors=False,
    )
