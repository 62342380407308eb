"""OpenAI's tool_choice "allowed_tools" end to end, through the gateway to a real store and
worker on tests/model_kit.py's scripted model, which calls get_weather whenever it may: with
only set_mode allowed it calls no get_weather, while the conversation keeps both tools, so
the next turn resumes its cache. Narrowing the tools list instead, as clients did before
allowed_tools, changes the prompt near its start and loses the cache. A strict tool's calls
are held to its schema the same way."""

from __future__ import annotations

import json

import openai
import pytest

from tests.model_kit import WEATHER_TOOL
from tests.test_structured_output import SET_MODE
from tests.test_tools import MODEL, ToolStack

ASK = [{"role": "user", "content": "Is it raining in Paris?"}]
BOTH = [WEATHER_TOOL, SET_MODE]
RESULT = '{"done": true}'
OPTIONS = {"model": MODEL, "temperature": 0, "max_tokens": 64}


def allowed(mode: str, *names: str) -> dict:
    tools = [{"type": "function", "function": {"name": name}} for name in names]
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = ToolStack(tmp_path_factory.mktemp("allowed"))
    yield stack
    stack.stop()


def turn(client: openai.OpenAI, session: str, messages: list[dict], tools: list, **more):
    """A chat completion of `session`, and the messages with its reply and its calls'
    results after them."""
    headers = {"X-Session-ID": session}
    reply = client.chat.completions.create(
        messages=messages, tools=tools, extra_headers=headers, **OPTIONS, **more
    )
    message = reply.choices[0].message
    said = message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": RESULT}
        for call in message.tool_calls or ()
    ]
    return reply, [*messages, said, *results]


def names(reply) -> list[str]:
    return [call.function.name for call in reply.choices[0].message.tool_calls or ()]


def test_calls_of_the_allowed_tools_only_and_the_cache_kept(stack):
    client, then = stack.client(), {"role": "user", "content": "And in Lyon?"}
    free, _ = turn(client, "free", ASK, BOTH)
    assert names(free) == ["get_weather"]  # the model's own choice

    first, said = turn(client, "kept", ASK, BOTH, tool_choice=allowed("auto", "set_mode"))
    assert "get_weather" not in names(first) and "get_weather" not in (
        first.choices[0].message.content or ""
    )
    second, _ = turn(client, "kept", [*said, then], BOTH, tool_choice=allowed("auto", "set_mode"))
    assert "get_weather" not in names(second)
    kept = second.usage.prompt_tokens_details.cached_tokens
    assert kept >= first.usage.prompt_tokens  # all of the first turn's prompt, at least

    _, said = turn(client, "narrowed", ASK, BOTH)
    second, _ = turn(client, "narrowed", [*said, then], [SET_MODE])  # the old way
    assert second.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens // 2


def test_a_required_call_of_the_allowed_tools_is_one_of_them(stack):
    choice = allowed("required", "set_mode")  # the first call ends the reply: one call
    reply, _ = turn(
        stack.client(), "required", ASK, BOTH, tool_choice=choice, parallel_tool_calls=False
    )
    assert names(reply) and set(names(reply)) == {"set_mode"}
    assert reply.choices[0].finish_reason == "tool_calls"


def test_the_responses_route_takes_its_flat_form_and_echoes_it(stack):
    flat = [{"type": "function", **tool["function"]} for tool in BOTH]
    only = [{"type": "function", "name": "set_mode"}]
    choice = {"type": "allowed_tools", "mode": "auto", "tools": only}
    response = stack.client().responses.create(
        model=MODEL, input=ASK, tools=flat, tool_choice=choice, temperature=0,
        max_output_tokens=24, extra_headers={"X-Session-ID": "responses"},
    )  # fmt: skip
    called = [item.name for item in response.output if item.type == "function_call"]
    assert "get_weather" not in called
    assert response.tool_choice.model_dump(exclude_none=True) == choice


def test_allowed_tools_the_request_lacks_are_a_400(stack):
    """A tool the request lacks is a 400 naming it; none allowed with a call required too."""
    client = stack.client()
    for choice, param in ((allowed("auto", "get_time"), "tool_choice.allowed_tools.tools"),
                          (allowed("required"), "tool_choice.allowed_tools.tools")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as refused:
            turn(client, "refused", ASK, BOTH, tool_choice=choice)
        assert refused.value.body["param"] == param


def test_a_strict_tool_s_calls_are_held_to_its_schema(stack):
    """The scripted model calls get_weather with unit "celsius": a tool that takes only
    "kelvin" gets that call as written, unless it is strict (the Agents SDK's default)."""
    properties = {"city": {"enum": ["Paris"]}, "unit": {"enum": ["kelvin"]}}
    kelvin = {"type": "object", "properties": properties, "required": ["city", "unit"]}
    kelvin["additionalProperties"] = False
    for strict, unit in ((False, "celsius"), (True, "kelvin")):
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": kelvin}}
        tool["function"]["strict"] = strict
        reply, _ = turn(stack.client(), f"strict-{strict}", ASK, [tool])
        arguments = [json.loads(c.function.arguments) for c in reply.choices[0].message.tool_calls]
        assert [a["unit"] for a in arguments] == [unit]
