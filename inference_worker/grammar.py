"""Structured output: a turn's required form (a JSON Schema, any JSON object, a regex or a
Lark grammar) compiled by llguidance into a matcher that, token by token, masks the logits
to the tokens that keep the reply a beginning of the form, and lets the reply end (its end
of sequence) only where the form is complete: constrained decoding.

With tools in the conversation a reply may be tool calls instead (the model decides, as
OpenAI's response_format with tools): the grammar is the form, or a call. A required tool
call (tool_choice "required", or one named) is the call alone. Where the model's calls are
JSON between markers (mlx-lm's json_tools: Qwen's, Hermes') and the request names its
tools, the first call is a call of one of them (the named one) with arguments its
parameters' schema accepts (references within it, "#/$defs/...", resolved); where no
grammar holds those schemas, a call of one of them with any object (a named one is
refused); otherwise only the call's opening is enforced. A named call is
the whole reply (as OpenAI's); after any other first call, the rest stays the model's. A
forbidden call (tool_choice "none") is its opening token masked at every step, where that
opening is a special token; the reply's text is then not read for calls. Calls allowed of
some tools only (tool_choice "allowed_tools", the conversation keeping all its tools so that
its cached prefix holds) are every call of the reply, where the calls are JSON and open with
a special token: the text between them may neither write that token nor spell it in
ordinary tokens (the other tokens llguidance reads as special it may). So are the calls of a
conversation whose tools include a strict one (OpenAI's "strict": true), where nothing else
restricts them: each is a call of one of its tools that the tool's schema accepts; on a
model whose calls cannot be held so, or tools whose grammar llguidance cannot hold, strict
is taken and not enforced, as before, and a strict constraint that fails mid-reply is
dropped (masks.Constraint.optional).

Forms are compiled at submit, on the RPC thread (llguidance drops the GIL while it builds),
so a bad one is refused before the turn queues; the MLX thread masks and advances, and
compiles only for an agent's own tools (a turn that sends none: known at its start).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from agentkv.errors import FailedPrecondition, InvalidArgument, ModelLacks
from inference_worker.llg import Compiler
from inference_worker.masks import Constraint
from inference_worker.tools import JSON_CALLS, MAX_TOOLS_DEPTH, ToolFormat, loads, nesting

KINDS = ("json_schema", "json_object", "regex", "lark")
MAX_FORM_CHARS = 1 << 20
LOGGED_KEPT = 1024  # tool sets whose unenforced strict is logged once
log = logging.getLogger("agentkv.worker")
# Whitespace outside strings is not generated (a free model may write it for ever); a
# schema's own "x-guidance" options win.
JSON_OPTIONS = {"whitespace_flexible": False}
# A call's JSON as chat templates write calls (tojson, json.dumps): what the model learned.
# Keywords llguidance does not implement (a "format" it does not know) are left unchecked:
# OpenAI takes any schema in a function that is not strict.
CALL_JSON_OPTIONS = {**JSON_OPTIONS, "item_separator": ", ", "key_separator": ": "}
CALL_JSON_OPTIONS["lenient"] = True
CALL_REST = "rest: <[*]>*\n"  # any token, added ones included (llguidance's special)


@dataclass(frozen=True, slots=True)
class OutputForm:
    kind: str  # one of KINDS
    text: str  # the schema (JSON text), regex or grammar; "" for json_object


@dataclass(frozen=True, slots=True)
class Ask:
    """What a turn asks of its reply: a form, a tool call (`required`), of one tool (`name`),
    or none (`forbidden`); calls, if any, of some tools only (`allowed`)."""

    form: OutputForm | None = None
    required: bool = False
    name: str = ""
    forbidden: bool = False
    allowed: tuple[str, ...] = ()
    strict: bool = False  # allowed: all the tools, for a strict one among them

    @property
    def holds_form(self) -> bool:
        """Whether the reply must be a whole form or call, which a stop string would cut."""
        return self.form is not None or self.required or bool(self.name)


class Forms:
    """A turn's matcher, compiled for the tools the turn has: at submit where they are known
    (the request's; none, for a whole conversation without them), else at the turn's start
    (an agent's own tools, known only then; the form alone is checked at submit)."""

    def __init__(self, grammars: Grammars, ask: Ask, entry: dict | None) -> None:
        self._grammars, self.ask, self._entry = grammars, ask, entry
        self._compiled: dict[str, Any] = {}  # canonical tools -> matcher (None: free)
        self._written = ("", "")  # canonical tools, as the request wrote them

    def compile(self, tools: str, source: str = "") -> None:
        """Compiles for the conversation's `tools` (canonical), from `source` (the same
        tools as the request wrote them, their properties in its order) when given, or
        given for them before."""
        if source:
            self._written = (tools, source)
        written = self._written[1] if self._written[0] == tools else tools
        self._compiled = {tools: self._grammars.matcher(self.ask, self._entry, written)}

    def matcher(self, tools: str) -> Any:
        """A fresh matcher for a conversation with `tools` (each one is used once: it holds
        where its reply is)."""
        if tools not in self._compiled:
            self.compile(tools)
        return self._compiled.pop(tools)

    def constraint(self, tools: str, agent: str = "") -> Constraint | None:
        """The reply's constraint, for `agent`'s conversation with these tools."""
        matcher, optional = self.matcher(tools), self.ask.strict and not self.ask.holds_form
        if matcher is None:
            return None
        return Constraint(matcher, self._grammars.vocab, optional, agent)


class Grammars:
    """What writes the grammars of one model's turns, from its tool-call format, and has
    them compiled (llg.Compiler: its tokenizer as llguidance reads it)."""

    def __init__(self, tokenizer: Any, eos_ids: set[int], tool_format: ToolFormat | None):
        self._compiler, self._tool_format = Compiler(tokenizer, eos_ids), tool_format
        self._lock = threading.Lock()
        # The last LOGGED_KEPT tools (by hash) whose strict was logged as not enforced.
        self._logged: OrderedDict[int, None] = OrderedDict()

    @property
    def vocab(self) -> int:
        return self._compiler.vocab

    def forms(self, ask: Ask, tools: str | None, source: str = "") -> Forms | None:
        """The turn's forms, compiled at submit for `tools` (canonical; None: not known
        yet; `source`: as the request wrote them); None when it asks for none.
        InvalidArgument for a form llguidance cannot compile, with its reason;
        ModelLacks where the model cannot have one. The form is checked alone too,
        though a required call leaves it nothing to hold (the reply is the call)."""
        if (ask.required or ask.name) and ask.forbidden:
            raise InvalidArgument("a tool call cannot be both required and forbidden")
        if ask.allowed and (ask.name or ask.forbidden):
            raise InvalidArgument(
                "tool_call_allowed restricts calls: not with tool_call_name or tool_call_forbidden"
            )
        if ask.forbidden and (self._tool_format is None or tools == ""):
            ask = replace(ask, forbidden=False)  # no call to forbid: no tools, or no format
        if ask.allowed and tools and set(_functions(tools)) <= set(ask.allowed):
            ask = replace(ask, allowed=())  # every tool allowed: nothing to restrict
        held = self._strict(ask, tools)
        try:
            return self._forms(held, tools, source)
        except InvalidArgument as exc:  # the strict tools' grammar: llguidance cannot hold it
            if held is ask:
                raise
            self._unenforced(tools, exc)
        return self._forms(ask, tools, source)

    def settled(self, forms: Forms | None, tools: str) -> Forms | None:
        """`forms` (None: nothing asked) of a turn whose tools, its agent's own, are known
        only at its start (on the MLX thread): held to strict ones among them, as forms()
        holds a request's, compiled now; else `forms` as they were."""
        ask = forms.ask if forms is not None else Ask()
        held = self._strict(ask, tools)
        if held is ask:
            return forms
        strict = Forms(self, held, forms._entry if forms is not None else None)
        try:
            strict.compile(tools)
        except InvalidArgument as exc:
            self._unenforced(tools, exc)
            return forms
        return strict

    def warm(self, tools: str) -> None:
        """Compiles what an agent's strict tools hold its calls to, on the caller's thread
        (CreateAgent's RPC thread), so that its turns find it compiled."""
        self.forms(Ask(), tools or None)

    def _unenforced(self, tools: str, exc: InvalidArgument) -> None:
        """Logs, once for these tools, that their strict is taken and not enforced."""
        with self._lock:
            if hash(tools) in self._logged:
                return
            self._logged[hash(tools)] = None
            while len(self._logged) > LOGGED_KEPT:
                self._logged.popitem(last=False)
        log.info("strict tools taken, not enforced", extra={"why": exc.message})

    def _forms(self, ask: Ask, tools: str | None, source: str) -> Forms | None:
        """forms(), `ask` checked and settled."""
        if ask == Ask():
            return None
        if (ask.required or ask.name or ask.allowed) and self._tool_format is None:
            raise ModelLacks(
                "a required or restricted tool call needs a model whose tool-call format the "
                "worker knows; this model's chat template has none"
            )
        if ask.forbidden or ask.allowed:
            self._opening_token()  # refused now, not at the turn's start
        if ask.name or ask.allowed:
            self._json_calls(ask)
        self._compiler.ready()  # here, on an RPC thread, not on the MLX thread at a turn's start
        forms = Forms(self, ask, _entry(ask.form) if ask.form is not None else None)
        if ask.form is not None and (tools is None or ask.required or ask.name):
            self.matcher(Ask(ask.form), forms._entry, "")  # the form alone, checked now
        if tools is not None:
            forms.compile(tools, source)
        return forms

    def matcher(self, ask: Ask, entry: dict | None, tools: str) -> Any:
        """The matcher of `ask` in a conversation with `tools`; None where the reply is free."""
        required = ask.required or bool(ask.name)
        if required and not tools:
            raise InvalidArgument("a required tool call needs tools: this conversation has none")
        free = [entry] if entry and not required else []  # the reply may be the form
        if (not tools and not ask.allowed) or self._tool_format is None:
            return self._compiler.matcher({"grammars": free}) if free else None
        if ask.forbidden:  # the form, or anything but the call's opening token
            no_call = f"start: <[^{self._opening_token()}]>*\n"
            return self._compiler.matcher({"grammars": free or [{"lark_grammar": no_call}]})
        names = self._named(ask, _functions(tools))
        if not (free or required or names):
            return None  # every tool allowed: nothing to enforce
        call, body = self._call(names, tools, ask)
        if ask.name:  # the call is the whole reply, as OpenAI's
            lark = "start: call\n"
        elif names:  # text between calls of the allowed tools only
            first = "@form | call rest" if free else "call rest" if required else "rest"
            lark = f"start: {first}\nrest: text (call text)*\n{self._text()}"
        else:
            lark = f"start: {'@form | call rest' if free else 'call rest'}\n{CALL_REST}"
        lark += f"call: {call}\n"
        return self._compiler.matcher({"grammars": [{"lark_grammar": lark}, *free, *body]})

    def _named(self, ask: Ask, functions: dict[str, Any]) -> tuple[str, ...]:
        """The tools the reply's calls may be of: the named one, or those allowed (none of
        the conversation's left out: any). InvalidArgument for one the conversation lacks."""
        field, names = (
            ("tool_call_name", (ask.name,)) if ask.name else ("tool_call_allowed", ask.allowed)
        )
        for name in names:
            if name not in functions:
                raise InvalidArgument(
                    f"{field} {name!r} is not among the conversation's tools "
                    f"({', '.join(functions) or 'none'})"
                )
        return () if not (ask.name or ask.strict) and set(functions) <= set(names) else names

    def _strict(self, ask: Ask, tools: str | None) -> Ask:
        """`ask` with every call held to its tool's schema, where the conversation's tools
        (known now) include a strict one and nothing else restricts the calls, on a model
        whose calls can be held so (JSON between markers, opening with a special token);
        elsewhere `ask`: strict is taken, not enforced."""
        fmt = self._tool_format
        if not tools or ask.name or ask.forbidden or ask.allowed or fmt is None:
            return ask
        if fmt.name not in JSON_CALLS or not fmt.end or not _any_strict(tools):
            return ask
        try:
            self._opening_token()
        except FailedPrecondition:
            return ask
        return replace(ask, allowed=tuple(_functions(tools)), strict=True)

    def _call(self, names: tuple[str, ...], tools: str, ask: Ask) -> tuple[str, list[dict]]:
        """A call as a Lark rule, and the grammars it refers to: its JSON, of one of `names`
        (any tool: none), where the format's calls are JSON and the tools are known, else
        its opening (the rest left to the model)."""
        functions, fmt = _functions(tools), self._tool_format
        if fmt.name not in JSON_CALLS or not functions or not fmt.end:
            if names:
                self._json_calls(ask)
            return self._compiler.marker(fmt.start), []
        chosen = {n: p for n, p in functions.items() if not names or n in names}
        try:
            grammar = self._call_body(chosen)
        except InvalidArgument as exc:  # a tool's parameters llguidance cannot hold
            if names:
                whose = f"tool {ask.name}'s" if ask.name else "the allowed tools'"
                raise InvalidArgument(f"{whose} parameters: {exc.message}") from None
            # A call of one of the tools all the same (a required call, or a form's), its
            # arguments any object: never a tool the conversation lacks.
            grammar = self._call_body({name: {"type": "object"} for name in chosen})
        opening, closing = self._compiler.marker(fmt.start), self._compiler.marker(fmt.end)
        return f'{opening} "\\n"? @call_body "\\n"? {closing}', [grammar]

    def _call_body(self, functions: dict[str, Any]) -> dict:
        """The grammar of a call's JSON, of one of `functions` (name: parameters' schema),
        compiled once here: InvalidArgument for parameters llguidance cannot hold."""
        many = len(functions) > 1
        schemas = [
            _call_schema(name, params, f"#/anyOf/{i}" if many else "#")
            for i, (name, params) in enumerate(functions.items())
        ]
        body = {"anyOf": schemas} if many else schemas[0]
        grammar = {"name": "call_body", "json_schema": {**body, "x-guidance": CALL_JSON_OPTIONS}}
        self._compiler.matcher({"grammars": [grammar]})
        return grammar

    def _json_calls(self, ask: Ask) -> None:
        """ModelLacks unless the model's calls are JSON between markers: what a call
        named, or calls of some tools only, need."""
        fmt = self._tool_format
        if fmt.name not in JSON_CALLS or not fmt.end:
            what = "a named tool call needs" if ask.name else "calls of some tools only need"
            raise ModelLacks(
                f"{what} a model whose calls are JSON ({', '.join(JSON_CALLS)}); "
                f"this model's tool format is {fmt.name}"
            )

    def _text(self) -> str:
        """Lark rules for the text between calls: text that neither writes the calls'
        opening token nor spells it in ordinary tokens; the other tokens llguidance reads
        as special (bracketed added ones: <think>, <tool_response>), which no text matches,
        between its runs."""
        spelled = re.escape(self._tool_format.start).replace("/", "\\/")
        lexeme = f"TEXT: /(?s:.+)/ & ~/(?s:.*{spelled}.*)/\n"
        others = _ranges(sorted(self._compiler.special_ids() - {self._opening_token()}))
        between = f" (<[{others}]> TEXT?)*" if others else ""
        return f"text: TEXT?{between}\n{lexeme}"

    def _opening_token(self) -> int:
        """The special token a call opens with: what a reply without calls may not write."""
        token = self._compiler.special_token(self._tool_format.start)
        if token is None:
            raise ModelLacks(
                "a forbidden or restricted tool call needs a model whose calls open with a "
                f"special token; this model's open with {self._tool_format.start!r}, which "
                "text can spell"
            )
        return token


def _functions(tools: str) -> dict[str, Any]:
    """The canonical tools' parameters' schemas by name (an object, where a tool has none)."""
    functions = [tool["function"] for tool in (loads(tools) if tools else [])]
    return {f["name"]: f.get("parameters") or {"type": "object"} for f in functions}


def _ranges(ids: list[int]) -> str:
    """Sorted token ids as a Lark token range's items: runs as "a-b", comma separated."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


@functools.lru_cache(maxsize=64)
def _any_strict(tools: str) -> bool:
    """Whether one of the canonical tools is strict (OpenAI's "strict": true); kept, as an
    agent's own tools are asked each turn."""
    return any(tool["function"].get("strict") is True for tool in loads(tools))


def _call_schema(name: str, parameters: Any, at: str) -> dict:
    """A call's JSON, at `at` in the call's schema: the tool's name and its arguments. The
    parameters' own references ("#/$defs/X", as Pydantic writes nested models, or "#") are
    to their root: they are moved to where the parameters now sit."""
    at += "/properties/arguments"
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": _rebased(parameters, at)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # values, not schemas


def _rebased(schema: Any, at: str) -> Any:
    """`schema` with every local reference ("#...") taken as from `at`."""
    if isinstance(schema, list):
        return [_rebased(item, at) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = at + value[1:]
        elif key in DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebased(value, at)
    return out


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
        if (depth := nesting(schema)) > MAX_TOOLS_DEPTH:  # compiling it would recurse past
            raise InvalidArgument(  # Python's limit: INTERNAL, as tools so deep were
                f"output format json_schema is nested {depth} JSON levels deep; at most "
                f"{MAX_TOOLS_DEPTH} are taken"
            )
    options = schema.get("x-guidance")
    options = {**JSON_OPTIONS, **(options if isinstance(options, dict) else {})}
    return {"name": "form", "json_schema": {**schema, "x-guidance": options}}
