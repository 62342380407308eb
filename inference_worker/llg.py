"""One model's tokenizer as llguidance reads it, and the grammars compiled on it: a matcher
per grammar (its first mask computed, so that a grammar too costly for the limits is refused
before its turn queues), the last MATCHERS_KEPT kept and copied for the next turn that asks
for the same; the tokens llguidance reads as special; markers as Lark items. grammar.py
writes the grammars."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from agentkv.errors import FailedPrecondition, InvalidArgument
from inference_worker.masks import check, limits

MATCHERS_KEPT = 64  # grammars a worker keeps compiled (or failed), for the next turn


class Compiler:
    """llguidance for one model: its tokenizer (built on first use, about 0.4 s for 49K
    tokens) and the matchers compiled on it."""

    def __init__(self, tokenizer: Any, eos_ids: set[int]) -> None:
        self._hf, self._eos = tokenizer, sorted(eos_ids)
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        # grammar -> a fresh matcher, or the InvalidArgument it failed with
        self._kept: OrderedDict[str, Any] = OrderedDict()
        self._special: set[int] | None = None  # special_ids

    @property
    def vocab(self) -> int:
        return self._llg().vocab_size

    def ready(self) -> None:
        """Builds the tokenizer now (on an RPC thread, not at a turn's start)."""
        self._llg()

    def matcher(self, grammar: dict) -> Any:
        """The grammar's matcher, its first mask computed: a form too costly for the limits
        at its very start is refused here, before the turn queues."""
        import llguidance

        text = json.dumps(grammar)
        with self._lock:
            kept = self._kept.get(text)
            if kept is not None:
                self._kept.move_to_end(text)
                if isinstance(kept, InvalidArgument):
                    raise kept  # failed before: not compiled again on every turn
                return kept.deep_copy()  # a compiled grammar, at its start
        matcher = llguidance.LLMatcher(self._llg(), text, log_level=0, limits=limits())
        if not matcher.is_error():
            matcher.compute_bitmask()
        try:
            check(matcher)
        except InvalidArgument as exc:
            self._keep(text, exc)
            raise
        self._keep(text, matcher.deep_copy())
        return matcher

    def _keep(self, text: str, kept: Any) -> None:
        """Keeps a grammar's fresh matcher, or why it failed, among the last MATCHERS_KEPT."""
        with self._lock:
            self._kept[text] = kept
            while len(self._kept) > MATCHERS_KEPT:
                self._kept.popitem(last=False)

    def special_token(self, text: str) -> int | None:
        """The id of the one special token `text` is; None when it is not one."""
        llg = self._llg()
        ids = llg.tokenize_str(text, parse_special=True)
        return ids[0] if len(ids) == 1 and llg.is_special_token(ids[0]) else None

    def special_ids(self) -> set[int]:
        """The ids of the tokens llguidance reads as special (the tokenizer's bracketed
        added tokens, its end of sequence among them)."""
        llg = self._llg()
        with self._lock:
            if self._special is None:
                self._special = {i for i in range(llg.vocab_size) if llg.is_special_token(i)}
            return self._special

    def marker(self, text: str) -> str:
        """A tool call's marker as Lark items: its text, with each special token in it as
        that token (which no text spells)."""
        llg = self._llg()
        ids = llg.tokenize_str(text, parse_special=True)
        if not any(llg.is_special_token(i) for i in ids):
            return json.dumps(text)
        items, run = [], []
        for i in [*ids, None]:
            if i is None or llg.is_special_token(i):
                items += [json.dumps(llg.decode_str(run))] if run else []
                items += [f"<[{i}]>"] if i is not None else []
                run = []
            else:
                run.append(i)
        return " ".join(items)

    def _llg(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = _llg_tokenizer(self._hf, self._eos)
            return self._tokenizer


def _llg_tokenizer(tokenizer: Any, eos: list[int]) -> Any:
    import llguidance.hf

    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds it
    try:
        return llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=eos)
    except ValueError as exc:  # a slow (Python) tokenizer
        raise FailedPrecondition(
            f"structured output needs a fast tokenizer; this model has a {type(hf).__name__}"
            f" ({exc})"
        ) from None
