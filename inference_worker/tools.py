"""Tool calling: the tools a conversation may call, checked into one canonical text, and a
reply's tool calls, taken out of its text as the model writes them and parsed with the
model's own format (mlx-lm's tool parser for its chat template, e.g. Qwen 2.5's
`<tool_call>{json}</tool_call>`).

Tool-call text the parser refuses, a call of a tool not declared, or one cut before its end,
goes out as text: nothing the model wrote is dropped (but calls past a reply's limit, which
ends it). Where a call opens with a special token, only that token opens one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import secrets
import string
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentkv.errors import InvalidArgument

# The agent keeps its tools in its store metadata: as text up to PLAIN_TOOLS_CHARS (what
# workers before packing read), past that compressed (pack_tools), at most MAX_PACKED_TOOLS
# characters so, of at most MAX_TOOLS_CHARS as compact JSON.
PLAIN_TOOLS_CHARS = 32 << 10
MAX_PACKED_TOOLS = 64 << 10
MAX_TOOLS_CHARS = 1 << 20
# JSON levels of the tools, the array's own included: well past real schemas, well short of
# what rendering them (recursive, in Python and in the chat template) can take
MAX_TOOLS_DEPTH = 256
PACKED = "z1:"  # the codec of a packed value: zlib, then base64
_packed: dict[str, str] = {}  # sha256 of tools: pack_tools's, for the saves of an agent
MAX_ARGUMENTS_CHARS = 1 << 20
_ID_CHARS = string.ascii_letters + string.digits


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def key(self) -> str:
        """What identifies the call in a conversation's digest: its name and arguments (the
        id is the worker's; a client resending the call may not keep its spelling)."""
        return f"{self.name}\0{_canonical(self.arguments)}"

    def template(self) -> dict:
        """The call as chat templates read it (arguments as an object, as HF's convention)."""
        try:
            arguments: Any = loads(self.arguments)
        except ValueError:
            arguments = self.arguments
        function = {"name": self.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function}


def checked_calls(calls: list[tuple[str, str, str]]) -> tuple[ToolCall, ...]:
    """A message's tool calls (id, name, arguments) from a request, checked."""
    out = []
    for i, (call_id, name, arguments) in enumerate(calls):
        if not name:
            raise InvalidArgument(f"tool call {i} has no name")
        if len(arguments) > MAX_ARGUMENTS_CHARS:
            raise InvalidArgument(
                f"tool call {i}'s arguments are {len(arguments)} characters, limit "
                f"{MAX_ARGUMENTS_CHARS}"
            )
        out.append(ToolCall(call_id, name, arguments))
    return tuple(out)


def canonical_tools(text: str) -> str:
    """A request's tools (a JSON array of OpenAI function tools) as compact JSON with sorted
    keys, the same text for the same tools however they were spelled; "" for none."""
    if not text.strip():
        return ""
    try:
        tools = loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"tools is not JSON: {exc}") from None
    if not isinstance(tools, list):
        raise InvalidArgument("tools must be a JSON array of function tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise InvalidArgument(f'tool {i} is not {{"type": "function", "function": {{...}}}}')
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidArgument(f"tool {i} has no function name")
    if (depth := nesting(tools)) > MAX_TOOLS_DEPTH:
        raise InvalidArgument(
            f"tools are nested {depth} JSON levels deep; at most {MAX_TOOLS_DEPTH} are taken"
        )
    out = json.dumps(tools, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    size = len(out.encode())
    packed = len(pack_tools(out)) if len(out) > PLAIN_TOOLS_CHARS and size <= MAX_TOOLS_CHARS else 0
    if size > MAX_TOOLS_CHARS or packed > MAX_PACKED_TOOLS:
        raise InvalidArgument(
            f"tools are {size} bytes as compact JSON{f', {packed} compressed' if packed else ''}"
            f"; an agent keeps at most {MAX_PACKED_TOOLS} characters of them compressed, of "
            f"at most {MAX_TOOLS_CHARS} bytes as JSON"
        )
    return out


def nesting(value: Any) -> int:
    """How many levels of arrays and objects `value` nests (0: a plain value), counted
    without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


def pack_tools(tools: str) -> str:
    """Canonical tools past PLAIN_TOOLS_CHARS as the agent's metadata keeps them: "z1:",
    then zlib-compressed and base64 (tool schemas compress about 4 times). Each agent's are
    packed once, not at every save."""
    key = hashlib.sha256(tools.encode()).hexdigest()
    packed = (
        _packed.get(key) or PACKED + base64.b64encode(zlib.compress(tools.encode(), 9)).decode()
    )
    if key not in _packed and len(packed) <= MAX_PACKED_TOOLS:  # only what an agent keeps
        if len(_packed) >= 64:
            _packed.pop(next(iter(_packed)))
        _packed[key] = packed
    return packed


def unpack_tools(packed: str) -> str:
    """pack_tools's tools; ValueError for a value it did not write, or one that would grow
    past MAX_TOOLS_CHARS bytes (written by no worker)."""
    if not packed.startswith(PACKED):
        raise ValueError(f"packed tools of an unknown codec {packed[:8]!r}")
    inflate = zlib.decompressobj()
    try:
        data = inflate.decompress(base64.b64decode(packed[len(PACKED) :]), MAX_TOOLS_CHARS + 1)
        if len(data) > MAX_TOOLS_CHARS or inflate.unconsumed_tail or not inflate.eof:
            raise ValueError(f"packed tools past {MAX_TOOLS_CHARS} bytes, or cut short")
        return data.decode()
    except (zlib.error, binascii.Error, UnicodeDecodeError) as exc:
        raise ValueError(f"packed tools that do not decode: {exc}") from None


def _canonical(arguments: str) -> str:
    try:
        return json.dumps(loads(arguments), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return arguments


def loads(text: str) -> Any:
    """json.loads, with a nesting too deep for Python's parser a ValueError too (a caller's
    JSON, not a bug of ours)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """A model's tool-call format: the text around a call, and the parser of what is inside."""

    name: str
    start: str
    end: str
    parser: Callable[[str, Any], Any]

    @classmethod
    def of(cls, tokenizer: Any) -> ToolFormat | None:
        """The format of an mlx-lm TokenizerWrapper, None when it knows none."""
        parser = getattr(tokenizer, "tool_parser", None)
        if parser is None or not getattr(tokenizer, "tool_call_start", None):
            return None
        name = parser.__module__.rsplit(".", 1)[-1]
        return cls(name, tokenizer.tool_call_start, tokenizer.tool_call_end, parser)


JSON_CALLS = ("json_tools",)  # formats whose call is {"name", "arguments"} between markers
OPENED = "\U000f0002"  # a call's opening, generated as its special token (ReplyCalls.marked)


@dataclass(slots=True)
class ReplyCalls:
    """Splits one reply's text, as it comes, into text to send and the tool calls in it.

    Where the format's opening is one special token (`opening`, Qwen's <tool_call>), only
    that token opens a call: the reply's text has it as OPENED (`marked`), and the same
    characters spelled in ordinary tokens (a page the model quotes, whose <tool_call> the
    prompt escaped) are text, as mlx-lm's server reads them."""

    format: ToolFormat
    tools: list[dict]
    limit: int = 0  # the reply ends after this many calls; 0: no limit
    # The tools its calls may be of (tool_call_allowed, or all, for strict tools; empty:
    # those declared, or any where none are): a call of another goes out as text. The grammar
    # makes none, but a reply whose strict constraint was dropped mid-reply is free.
    allowed: frozenset[str] = frozenset()
    opening: int | None = None  # the opening's special token, where it is one
    calls: list[ToolCall] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)  # the text that went out as text
    _held: str = ""  # outside a call: a marker's start, maybe; inside: its end's, maybe
    _call: list[str] = field(default_factory=list)  # the call's text so far (inside one)
    _in_call: bool = False

    def __post_init__(self) -> None:
        if not self.allowed:
            declared = {t.get("function", {}).get("name") for t in self.tools}
            self.allowed = frozenset(n for n in declared if isinstance(n, str))

    def marked(self, segment: str, token: int) -> str:
        """The detokenizer's text for `token`, its call opening OPENED where it is that
        special token."""
        start = self.format.start
        if token == self.opening and segment.endswith(start):
            return segment[: -len(start)] + OPENED
        return segment

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The text safe to send now, and the calls written whole by now."""
        held, out, made = self._held + text, [], []
        start, end = self.format.start, self.format.end
        opens = OPENED if self.opening is not None else start
        while True:
            if self.full:  # the reply ends at its last call: what follows is not sent
                held, self._in_call, self._call = "", False, []
                break
            if self._in_call:
                at = self._end_at(held) if end else -1  # no end: the call runs to the reply's
                if at < 0:  # kept aside, not searched again (a long call was quadratic)
                    keep = _partial_suffix(held, end) if end else 0
                    self._call.append(held[: len(held) - keep])
                    held = held[len(held) - keep :]
                    break
                body, self._call = "".join([*self._call, held[:at]]), []
                parsed = self._parse(body)
                made += parsed
                self.calls += parsed  # at once: a second call in this text counts the first
                out += [] if parsed else [start, body, end]
                held, self._in_call = held[at + len(end) :], False
                continue
            at = held.find(opens)
            if at < 0:
                keep = _partial_suffix(held, opens)
                out.append(held[: len(held) - keep])
                held = held[len(held) - keep :]
                break
            out.append(held[:at])
            held, self._in_call = held[at + len(opens) :], True
        self._held = held
        self.sent += out
        return "".join(out), made

    def _end_at(self, held: str) -> int:
        """Where the call's end marker is in `held` (-1: not yet): for JSON calls, not one
        inside a string of its JSON (an argument may hold "</tool_call>")."""
        end, at = self.format.end, held.find(self.format.end)
        if self.format.name not in JSON_CALLS:
            return at
        while at >= 0 and _in_string("".join([*self._call, held[:at]])):
            at = held.find(end, at + 1)
        return at

    def flush(self) -> tuple[str, list[ToolCall]]:
        """At the reply's end: what is still held, as text (a call cut before its end, with
        its opening text), or the last call (a format whose calls end with the reply)."""
        held = "".join([*self._call, self._held]) if self._in_call else self._held
        held = "" if self.full else held  # the reply ended at its last call
        self._held, self._call = "", []
        made = self._parse(held) if self._in_call and not self.format.end else []
        out = "" if made else (self.format.start if self._in_call else "") + held
        self._in_call = False
        self.calls += made
        self.sent.append(out)
        return out, made

    @property
    def full(self) -> bool:
        """Whether the reply made as many calls as it may."""
        return 0 < self.limit <= len(self.calls)

    @property
    def text(self) -> str:
        return "".join(self.sent)

    def _parse(self, text: str) -> list[ToolCall]:
        """The calls in one call's text, as many as the reply may still make (the reply
        ends there); none when the parser refuses it."""
        try:
            parsed = self.format.parser(text, self.tools)
            items = parsed if isinstance(parsed, list) else [parsed]
            calls = [_call(item) for item in items]
        except Exception:  # the model's text, not ours: it goes out as text
            return []
        if not all(call.name in self.allowed for call in calls) and self.allowed:
            return []
        return calls[: self.limit - len(self.calls)] if self.limit else calls  # not full yet


def _call(item: Any) -> ToolCall:
    name, arguments = item["name"], item.get("arguments")
    arguments = {} if arguments is None else arguments  # a tool without parameters
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call without a name")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    parsed = json.loads(arguments, parse_constant=_no_constant)  # NaN: no JSON to clients
    if not isinstance(parsed, dict):  # a client reads them as an object
        raise ValueError("a tool call's arguments are not a JSON object")
    json.dumps(parsed, allow_nan=False, ensure_ascii=False).encode()  # 1e999, "\ud800": no
    # 9 letters and digits: the ids Mistral's templates accept (OpenAI's have no format)
    return ToolCall("".join(secrets.choice(_ID_CHARS) for _ in range(9)), name, arguments)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is no JSON value")


def _in_string(text: str) -> bool:
    """Whether JSON text ends inside a string (its quotes, less the escaped ones, are odd)."""
    inside, escaped = False, False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = inside
        elif char == '"':
            inside = not inside
    return inside


def _partial_suffix(text: str, marker: str) -> int:
    """How many last characters of `text` begin `marker` (it may be split over tokens)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
