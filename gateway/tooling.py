"""OpenAI's function tools, tool_choice and structured output formats, checked into what the
worker's TurnRequest takes: tools as compact JSON, the call required, named, forbidden or of
some tools only (allowed_tools), and a JSON Schema for the reply. The worker enforces the
choice and the format with constrained decoding (inference_worker/grammar.py); with
tool_choice "auto" the model decides whether to call a tool, which, and how many."""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from agentkv.gateway.errors import invalid
from agentkv.gateway.fields import known_only, typed, utf8

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
MODEL_DECIDES = "the model decides whether to call a tool, and which, unless asked"
NO_CONSTRAINTS = f"{MODEL_DECIDES}: agentkv enforces a call (any, or one named) or none"
OPENAI_CHOICES = (  # OpenAI's API also restricts calls to some tools (allowed_tools)
    f"{MODEL_DECIDES}: agentkv enforces a call (any, one named, or of the allowed_tools) or none"
)
FORMAT_KEYS = {"type", "name", "description", "schema", "strict"}  # a json_schema format


def output_format(form: Any, where: str, fields: str = "") -> dict[str, Any] | None:
    """A structured output format ({"type": "text" | "json_object" | "json_schema"}, a JSON
    Schema's name, description, schema and strict beside its type, or in `fields`) as the
    worker's OutputFormat fields; None for text. Every schema is enforced, strict or not
    (OpenAI enforces only strict ones); one without a schema is any JSON."""
    if form is None:
        return None
    if not isinstance(form, dict) or not isinstance(form.get("type"), str):
        raise invalid(f'{where} must be an object with a "type"', where)
    kind = form["type"]
    if kind in ("text", "json_object"):
        known_only(form, {"type"}, where)
        return {"json_object": True} if kind == "json_object" else None
    if kind != "json_schema":
        raise invalid(
            f"{where}.type {kind!r} is not one of text, json_object, json_schema",
            f"{where}.type",
            "unsupported_value",
        )
    where = fields or where
    known_only(form, FORMAT_KEYS, where)
    tool_name(form.get("name"), where)  # the same rule as a function's name
    typed(form, "description", str, None, where)
    typed(form, "strict", bool, None, where)
    schema = typed(form, "schema", dict, None, where)
    return schema_format({} if schema is None else schema, f"{where}.schema")


def schema_format(schema: dict, where: str) -> dict[str, str]:
    """A JSON Schema as the worker's OutputFormat field: JSON text, refused (a 400 naming
    `where`) where a lone surrogate escape in it could not go as UTF-8."""
    text = json.dumps(schema, ensure_ascii=False)
    utf8(text, where)
    return {"json_schema": text}


class ToolChoice(NamedTuple):
    """OpenAI's tool_choice, as the worker's TurnRequest takes it (tool_call_*)."""

    required: bool = False
    name: str = ""
    forbidden: bool = False
    allowed: tuple[str, ...] = ()


def tool_choice(choice: Any, inner: str = "") -> ToolChoice:
    """OpenAI's tool_choice as (a call required, the tool named, a call forbidden, the tools
    allowed): "auto" (or none given) lets the model decide, "required" makes the reply open
    with a call, {"type": "function", ...} with a call of the function named (under `inner`
    on the chat route, beside the type on the Responses route), "none" makes none;
    {"type": "allowed_tools", ...} lets its calls be of some tools only (allowed_tools)."""
    if choice in (None, "auto", "required", "none"):
        return ToolChoice(required=choice == "required", forbidden=choice == "none")
    if isinstance(choice, dict) and choice.get("type") == "function":
        known_only(choice, {"type", inner or "name"}, "tool_choice")
        named = _within(choice, inner, "tool_choice")
        where = f"tool_choice.{inner}" if inner else "tool_choice"
        known_only(named, {"name"} if inner else {"type", "name"}, where)
        return ToolChoice(required=True, name=tool_name(named.get("name"), where))
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return _allowed_tools(choice, "allowed_tools" if inner else "", inner)
    if not isinstance(choice, dict):
        raise invalid(
            f'tool_choice must be "auto", "none", "required" or an object, got {choice!r}',
            "tool_choice",
        )
    raise invalid(f"tool_choice={choice!r}: {OPENAI_CHOICES}", "tool_choice", "unsupported_value")


def _allowed_tools(choice: dict, outer: str, inner: str) -> ToolChoice:
    """allowed_tools' mode and function tools (under `outer` and each tool's `inner` on the
    chat route, beside the type on the Responses route). Allowing none is "none"."""
    known_only(choice, {"type", outer} if outer else {"type", "mode", "tools"}, "tool_choice")
    where = f"tool_choice.{outer}" if outer else "tool_choice"
    body = _within(choice, outer, "tool_choice")
    known_only(body, {"mode", "tools"} | (set() if outer else {"type"}), where)
    mode, tools = body.get("mode"), body.get("tools")
    if mode not in ("auto", "required"):
        raise invalid(f'{where}.mode must be "auto" or "required", got {mode!r}', f"{where}.mode")
    if not isinstance(tools, list):
        raise invalid(f"{where}.tools must be an array of tools", f"{where}.tools")
    names = []
    for i, tool in enumerate(tools):
        at = f"{where}.tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid(f"{at}: agentkv calls only function tools", at, "unsupported_value")
        known_only(tool, {"type", inner or "name"}, at)
        named = _within(tool, inner, at)
        names.append(tool_name(named.get("name"), f"{at}.{inner}" if inner else at))
    if not names and mode == "required":
        raise invalid(f"{where}.tools: a required call needs a tool allowed", f"{where}.tools")
    allowed = tuple(dict.fromkeys(names))
    return ToolChoice(required=mode == "required", forbidden=not names, allowed=allowed)


def _within(obj: dict, key: str, where: str) -> dict:
    """obj[key], an object, where the chat route nests a tool choice's fields under it
    (`key`); `obj` itself where the Responses route puts them beside its type (`key` "")."""
    return (typed(obj, key, dict, None, where) or {}) if key else obj


def tools_text(tools: list[dict[str, Any]]) -> str:
    """Function tools as the worker's canonical form: compact JSON, keys sorted ("" for
    none). Two of one name (a call could not say which), or parameters not of an object
    (a call's arguments are one), are refused, as OpenAI and Anthropic do."""
    names: set[str] = set()
    for i, tool in enumerate(tools):
        function, where = tool["function"], f"tools[{i}]"
        if function["name"] in names:
            raise invalid(f"{where}: a second tool named {function['name']!r}", where)
        names.add(function["name"])
        parameters = function.get("parameters") or {}
        if parameters.get("type", "object") != "object":
            raise invalid(f"{where}: its parameters' schema is not of an object", where)
    text = json.dumps(tools, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    utf8(text, "tools")
    return text if tools else ""


def check_tool(tool: Any, where: str) -> None:
    """One tool: {"type": "function", "function": {"name", "description", "parameters",
    "strict"}}, as OpenAI specifies it; other kinds of tool are refused. `strict` passes to
    the worker (OpenAI's Agents SDK sets it on every function tool), which holds every call
    to the tools' `parameters` where the model's calls can be held; a call's arguments are
    held so wherever the worker constrains the call (required, named, allowed, or beside a
    response_format), whatever `strict` says."""
    if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
        raise invalid(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
    if tool["type"] != "function":
        raise invalid(
            f"{where}: only function tools are supported, not {tool['type']!r} tools",
            f"{where}.type",
            "unsupported_value",
        )
    function = tool.get("function")
    if not isinstance(function, dict):
        raise invalid(f"{where}.function must be an object", f"{where}.function")
    known_only(tool, {"type", "function"}, where)
    where += ".function"
    known_only(function, FUNCTION_KEYS, where)
    tool_name(function.get("name"), where)
    for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
        typed(function, key, kind, None, where)


def tool_name(name: Any, where: str) -> str:
    """A function's name, as OpenAI's rule has it (1 to 64 letters, digits, _ or -)."""
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise invalid(
            f"{where}.name must be 1 to 64 letters, digits, _ or -, got {name!r}",
            f"{where}.name",
        )
    return name
