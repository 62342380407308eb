"""Structured output: a turn's required form (a JSON Schema, any JSON object, a regex or a
Lark grammar) compiled by llguidance into a matcher that, token by token, masks the logits
to the tokens that keep the reply a beginning of the form, and lets the reply end (its end
of sequence) only where the form is complete: constrained decoding.

With tools in the conversation a reply may be tool calls instead (the model decides, as
OpenAI's response_format with tools): the grammar is the form, or the model's tool-call
opening followed by anything. A required tool call (tool_choice "required") is the opening
alone. What a call holds after its opening stays the model's, as without a form.

Forms are compiled at submit, on the RPC thread (llguidance drops the GIL while it builds),
so a bad one is refused before the turn queues; the MLX thread only masks and advances.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from agentkv.errors import AgentKVError, FailedPrecondition, InvalidArgument
from inference_worker.tools import ToolFormat, loads

KINDS = ("json_schema", "json_object", "regex", "lark")
MAX_FORM_CHARS = 1 << 20
# Whitespace outside strings is not generated (a free model may write it for ever); a
# schema's own "x-guidance" options win.
JSON_OPTIONS = {"whitespace_flexible": False}
CALL_REST = "rest: <[*]>*\n"  # any token, added ones included (llguidance's special)


@dataclass(frozen=True, slots=True)
class OutputForm:
    kind: str  # one of KINDS
    text: str  # the schema (JSON text), regex or grammar; "" for json_object


@dataclass(frozen=True, slots=True)
class Forms:
    """A turn's compiled forms: one for a conversation without tools, one with them (the
    form, or a tool call); None where that reply is free."""

    plain: Any  # llguidance.LLMatcher | None
    with_tools: Any
    call_required: bool
    vocab: int  # the tokenizer's, as llguidance reads it

    def constraint(self, has_tools: bool) -> Constraint | None:
        """The reply's constraint, for a conversation with tools or without."""
        if self.call_required and not has_tools:
            raise InvalidArgument("a required tool call needs tools: this conversation has none")
        matcher = self.with_tools if has_tools else self.plain
        return None if matcher is None else Constraint(matcher, self.vocab)


class Grammars:
    """What compiles the forms of one model's turns: its tokenizer as llguidance reads it
    (built on the first constrained turn, about 0.4 s for 49K tokens) and its tool-call
    format."""

    def __init__(self, tokenizer: Any, eos_ids: set[int], tool_format: ToolFormat | None):
        self._hf, self._eos, self._tool_format = tokenizer, sorted(eos_ids), tool_format
        self._lock = threading.Lock()
        self._tokenizer: Any = None

    def compile(self, form: OutputForm | None, call_required: bool) -> Forms | None:
        """The turn's forms; None when it has none. InvalidArgument for a form llguidance
        cannot compile, with its reason; FailedPrecondition where the model cannot have one."""
        if form is None and not call_required:
            return None
        entry = _entry(form) if form is not None else None
        if call_required and self._tool_format is None:
            raise FailedPrecondition(
                "a required tool call needs a model whose tool-call format the worker knows; "
                "this model's chat template has none"
            )
        plain = self._matcher({"grammars": [entry]}) if entry and not call_required else None
        with_tools = None
        if self._tool_format is not None:
            start = f"start: {'call' if call_required or entry is None else '@form | call'}\n"
            lark = f"{start}call: {self._call_opening()} rest\n{CALL_REST}"
            grammars = [{"lark_grammar": lark}] + ([entry] if entry and not call_required else [])
            with_tools = self._matcher({"grammars": grammars})
        return Forms(plain, with_tools or plain, call_required, self._llg().vocab_size)

    def _matcher(self, grammar: dict) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(self._llg(), json.dumps(grammar), log_level=0)
        if matcher.is_error():
            raise InvalidArgument(f"output format: {matcher.get_error()}")
        return matcher

    def _call_opening(self) -> str:
        """The tool-call opening as a Lark item: its text, or its token when it is a special
        one (which no text spells)."""
        start = self._tool_format.start
        ids = self._llg().tokenize_str(start, parse_special=True)
        if len(ids) == 1 and self._llg().is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(start)

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


def _entry(form: OutputForm) -> dict:
    """The form as one of llguidance's grammars, named "form"."""
    if form.kind not in KINDS:
        raise InvalidArgument(f"output format kind {form.kind!r} is not one of {KINDS}")
    if len(form.text) > MAX_FORM_CHARS:
        raise InvalidArgument(
            f"output format {form.kind} is {len(form.text)} characters, limit {MAX_FORM_CHARS}"
        )
    if form.kind == "regex":
        import llguidance

        (regex,) = json.loads(llguidance.LLMatcher.grammar_from_regex(form.text))["grammars"]
        return {"name": "form", "lark_grammar": regex["lark_grammar"]}
    if form.kind == "lark":
        return {"name": "form", "lark_grammar": form.text}
    schema: Any = {"type": "object"}
    if form.kind == "json_schema":
        try:
            schema = loads(form.text)
        except ValueError as exc:
            raise InvalidArgument(f"output format json_schema is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise InvalidArgument("output format json_schema must be a JSON object")
    options = schema.get("x-guidance")
    options = {**JSON_OPTIONS, **(options if isinstance(options, dict) else {})}
    return {"name": "form", "json_schema": {**schema, "x-guidance": options}}


class Constraint:
    """One reply's matcher as it is generated: the mask for the next token, and each token
    taken."""

    def __init__(self, matcher: Any, vocab: int) -> None:
        self.matcher = matcher
        self.bits = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)

    def mask(self, logprobs: mx.array) -> mx.array:
        """The log-probabilities (vocab,) of only the tokens the form allows next,
        renormalized."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self.bits)
        self._check()
        allowed = np.unpackbits(self.bits.view(np.uint8), bitorder="little")
        allowed = allowed[: logprobs.shape[-1]].astype(bool)
        if not allowed.any():
            raise AgentKVError("output format: no token of the model can continue the reply")
        x = mx.where(mx.array(allowed), logprobs, -mx.inf)
        return x - mx.logsumexp(x, keepdims=True)

    def take(self, token: int) -> None:
        self.matcher.consume_token(token)
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise AgentKVError(f"output format: {self.matcher.get_error()}")
