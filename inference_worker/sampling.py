"""Sampling parameters, checked, and the samplers and stop-string matching they make."""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from agentkv.errors import InvalidArgument
from agentkv.ids import MAX_STOP_CHARS, MAX_TEMPERATURE

GREEDY_BELOW = 1e-6  # a temperature this small is greedy: its scale is past float16's range


@dataclass(slots=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    seed: int | None = None  # None: a random one per turn
    fit_max_tokens: bool = False  # max_tokens is a ceiling, lowered to the context's room

    def validate(self, max_stop_strings: int, vocab_size: int | None = None) -> Sampling:
        """Raises InvalidArgument for a parameter the turn could not run with, checked at
        submit so that it never fails inside a batch; `vocab_size` is the model's."""
        t = self.temperature
        if not math.isfinite(t) or not 0 <= t <= MAX_TEMPERATURE:
            raise InvalidArgument(f"temperature {t} must be in [0, {MAX_TEMPERATURE}]")
        if not math.isfinite(self.top_p) or not 0 <= self.top_p <= 1:
            raise InvalidArgument(f"top_p {self.top_p} must be in [0, 1] (0 turns it off)")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k {self.top_k} must be >= 0 (0 turns it off)")
        if vocab_size is not None and self.top_k > vocab_size:
            raise InvalidArgument(
                f"top_k {self.top_k} is over the model's vocabulary of {vocab_size} tokens"
            )
        if len(self.stop) > max_stop_strings:
            raise InvalidArgument(f"{len(self.stop)} stop strings, limit {max_stop_strings}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_CHARS:
                raise InvalidArgument(f"stop string {s[:40]!r} must have 1..{MAX_STOP_CHARS} chars")
        return self

    def sampler(self) -> Callable[[mx.array], int] | None:
        """Takes one sequence's log-probabilities (vocab,), returns a token id; None when
        greedy (the batch takes one argmax for all its greedy rows). A sampled request draws
        from its own random key (seeded, or not), so batching with others never changes what
        it draws."""
        if self.temperature < GREEDY_BELOW:
            return None
        key = mx.random.key(secrets.randbits(63) if self.seed is None else self.seed)
        filters = []
        if 0 < self.top_p < 1:
            filters.append(lambda x: apply_top_p(x, self.top_p))
        if self.top_k > 0:  # a top_k of the whole vocabulary keeps every token
            filters.append(lambda x: apply_top_k(x, self.top_k) if self.top_k < x.shape[-1] else x)

        def sample(logprobs: mx.array) -> int:
            nonlocal key
            x = logprobs[None]
            for keep in filters:
                x = keep(x)
            key, draw = mx.random.split(key)
            # Shifted so the likeliest is 0: a tiny temperature sends the rest to -inf, never
            # every logit (which would draw uniformly).
            x = (x - mx.max(x, axis=-1, keepdims=True)) / self.temperature
            return int(mx.random.categorical(x, key=draw).item())

        return sample


def vocab_size(model: Any) -> int:
    """How many logits the model gives per position: what top_k is checked against."""
    return int(model(mx.array([[0]])).shape[-1])


class StopMatcher:
    """Holds back just enough text that a stop string is never sent, even split over tokens."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.matched = ""  # the stop string reached, once one is

    def feed(self, piece: str) -> tuple[str, bool]:
        """Returns (text safe to send now, whether a stop string was reached)."""
        self.text += piece
        hits = [
            (i, s)
            for s in self.stops
            if (i := self.text.find(s, max(0, self.sent - self.hold))) >= 0
        ]
        if hits:
            end, self.matched = min(hits, key=lambda hit: hit[0])
            out, self.sent = self.text[self.sent : end], end
            return out, True
        safe = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent : safe], safe
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out
