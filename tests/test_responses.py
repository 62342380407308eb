"""OpenAI's Responses API on the gateway, driven by the official `openai` package and the
OpenAI Agents SDK's default model (OpenAIResponsesModel), in front of a real store and
worker (each a separate process): on a tiny random llama for text, on tests/model_kit.py's
scripted Qwen 2.5-style model for function calls.

The three APIs are one path: the same conversation sent as Responses input items or as chat
messages goes to the same agent and gets the same greedy reply; resent input reads its past
from the cache (cached_tokens) and prefills only what is new; a streamed reply's events add
up to the whole Response. The sans-IO checks come first, without a server."""

from __future__ import annotations

import concurrent.futures
import copy
import json
import time
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
from openai._models import construct_type
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from agentkv.client.store import StoreClient
from agentkv.client.worker import WorkerClient
from agentkv.errors import AgentBusy
from agentkv.gateway.errors import HTTPError
from agentkv.gateway.protocol import parse_chat
from agentkv.gateway.response_reply import ResponseReply
from agentkv.gateway.responses import parse_responses, response_id
from agentkv.launch import ServiceProcess, gateway_process, store_process
from agentkv.worker.v1 import worker_pb2 as pb
from tests.helpers import until
from tests.model_kit import TOOL_CALL, WEATHER_TOOL, build_tiny_model, tiny_tokenizer
from tests.test_tools import ToolStack, check_weather_agent

SYSTEM = "You are the archivist of the old library, and you index every scroll."
RESULT = '{"temperature": 21, "unit": "celsius"}'
WEATHER = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses API's flat form
GREEDY = {"temperature": 0}
WEATHER_NAMED = {"type": "function", "name": "get_weather"}
TWO = [WEATHER, {"type": "function", "name": "get_time"}]  # tools, one of them allowed


# The wire format, sans I/O


def responses_body(**extra) -> dict:
    """A tool loop as the Agents SDK sends it: instructions, items, a function's output."""
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                     {"type": "input_text", "text": "Paris?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_01", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call_output", "call_id": "call_01", "output": RESULT},
        {"role": "user", "content": "Thanks!"},
    ]  # fmt: skip
    body = {"model": "m", "instructions": SYSTEM, "input": items, "tools": [WEATHER]}
    return copy.deepcopy(body | {"user": "u1", "store": False, "include": []} | extra)


def chat_body() -> dict:
    """The same conversation as the chat-completions API takes it."""
    call = {"id": "call_01", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_01", "content": RESULT},
        {"role": "user", "content": "Thanks!"},
    ]
    return {"model": "m", "messages": messages, "tools": [WEATHER_TOOL], "user": "u1"}


def test_a_conversation_is_the_same_call_through_either_openai_api():
    ours, theirs = parse_responses(responses_body(), 8), parse_chat(chat_body(), 8)
    assert ours.messages == theirs.messages
    assert ours.tools == theirs.tools and ours.scope == theirs.scope
    assert ours.anonymous_id() == theirs.anonymous_id()  # so it reaches the same agent
    assert ours.sampling == {"temperature": 1.0, "fit_max_tokens": True, "max_tokens": 8}


def test_a_format_and_a_tool_choice_are_the_chat_route_s():
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    form = {"type": "json_schema", "name": "v", "schema": schema, "strict": True}
    named = {"type": "function", "name": "get_weather"}
    ours = parse_responses(responses_body(text={"format": form}, tool_choice=named), 8)
    inner = {key: value for key, value in form.items() if key != "type"}  # chat's wrapping
    chat = chat_body() | {"response_format": {"type": "json_schema", "json_schema": inner}}
    function = {"type": "function", "function": {"name": "get_weather"}}  # chat's form
    theirs = parse_chat(chat | {"tool_choice": function}, 8)
    assert ours.output_format == theirs.output_format == {"json_schema": json.dumps(schema)}
    assert ours.tool_call_name == theirs.tool_call_name == "get_weather"
    assert ours.echo["tool_choice"] == named and ours.echo["text"]["format"] == form
    required = parse_responses(responses_body(tool_choice="required"), 8)
    assert required.tool_call_required and not required.tool_call_name
    assert parse_responses(responses_body(tool_choice="none"), 8).tool_call_forbidden
    assert parse_responses(responses_body(text={"format": None}), 8).echo["text"]["format"] == {
        "type": "text"
    }  # null: left out, as OpenAI reads it
    with pytest.raises(HTTPError) as refused:
        parse_responses(responses_body(tool_choice={"type": "function", "name": "now"}), 8)
    assert refused.value.param == "tool_choice.name"
    flat = {"type": "allowed_tools", "mode": "required", "tools": [named]}
    ours = parse_responses(responses_body(tool_choice=flat, tools=TWO), 8)
    nested = {"mode": "required", "tools": [function]}  # chat's form
    two = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TWO
    ]
    choice = {"type": "allowed_tools", "allowed_tools": nested}
    theirs = parse_chat(chat | {"tool_choice": choice, "tools": two}, 8)
    assert ours.tool_call_allowed == theirs.tool_call_allowed == ("get_weather",)
    assert ours.tool_call_required and theirs.tool_call_required and ours.tools == theirs.tools
    assert ours.echo["tool_choice"] == flat


def test_a_string_input_is_one_user_message_and_hints_are_taken():
    call = parse_responses(
        {"model": "m", "input": "Hi", "max_output_tokens": 5, "top_p": 0, "parallel_tool_calls":
         False, "reasoning": {"effort": "low", "summary": "auto", "context": "x"},
         "metadata": {"k": "v"},
         "text": {"format": {"type": "text"}, "verbosity": "low"}, "truncation": "disabled",
         "include": ["reasoning.encrypted_content"], "prompt_cache_retention": "24h",
         "prompt_cache_key": "team", "stream": True, "prompt_cache_options": {"x": 1},
         "stream_options": {"include_obfuscation": False}},
        8,
    )  # fmt: skip
    assert call.messages == [{"role": "user", "content": "Hi"}] and call.max_tool_calls == 1
    assert call.sampling["max_tokens"] == 5 and call.sampling["temperature"] == 0.0
    assert call.scope == ("team", "", "") and call.echo["metadata"] == {"k": "v"}


@pytest.mark.parametrize(
    "change, param, words",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "not the id of a response"),
        ({"conversation": "conv_1"}, "conversation", "keeps no conversation objects"),
        ({"truncation": "auto"}, "truncation", "only None or 'disabled'"),
        ({"background": True}, "background", "only None or False"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 7}}},
         "text.format.schema", "must be an object"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type", "not one of"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"title": "\ud800"}}}},
         "text.format.schema", "lone surrogate"),
        ({"stream": True, "stream_options": {"include_usage": True}},
         "stream_options.include_usage", "unsupported parameter"),  # chat's, not this API's
        ({"stream": True, "stream_options": {"include_obfuscation": "no"}},
         "stream_options.include_obfuscation", "must be"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]", "not supported"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "the model decides"),
        ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [
            {"type": "function", "name": "get_time"}]}}, "tool_choice.tools", "not among"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
        ({"tools": [{"type": "function", "name": "a b"}]}, "tools[0].name", "1 to 64"),
        ({"max_output_tokens": 0}, "max_output_tokens", "[1, 2^32)"),
        # the red team's: echoed as given (OpenAI's limits: 16 pairs of strings)
        ({"metadata": {"k": 7}}, "metadata.k", "must be a string"),
        ({"metadata": {f"k{i}": "v" for i in range(1000)}}, "metadata", "at most 16"),
        ({"metadata": {"k" * 65: "v"}}, "metadata." + "k" * 64, "64 characters"),
        ({"temperature": 3}, "temperature", "in [0, 2]"),
        ({"frequency_penalty": 1}, "frequency_penalty", "unsupported parameter"),
        ({"input": []}, "input", "a string or a non-empty array"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "'reasoning' items"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0]", "only text"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0]", "role 'tool'"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
         "input[0].call_id", "answers a function_call before it"),
        ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c",
                     "name": "f", "arguments": "{}"}]}, "input[1]", "no function_call_output"),
        ({"input": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
         "input[1]", "does not continue a partial reply"),
        ({"input": [{"role": "user", "content": "x", "name": "n"}]}, "input[0].name",
         "unsupported parameter"),
    ],
)  # fmt: skip
def test_what_agentkv_does_not_do_is_refused_naming_the_field(change, param, words):
    with pytest.raises(HTTPError) as refused:
        parse_responses(responses_body(**change), 8)
    assert refused.value.status == 400 and refused.value.param == param
    assert words in refused.value.message


def test_a_previous_response_id_names_its_agent_and_point():
    """A response's id names the agent and the point its reply ends at; a call continuing
    it sends only its new items (no system message: the agent's conversation begins with
    it), and may begin with the outputs of the previous response's calls."""
    body = responses_body()
    first = parse_responses(body, 8)
    rid = response_id("anon-1", first.mark_name, SYSTEM, first.tools)
    outputs = [{"type": "function_call_output", "call_id": c, "output": "x"} for c in "ab"]
    then = {"previous_response_id": rid, "input": [*outputs, {"role": "user", "content": "Hi"}]}
    call = parse_responses(body | then, 8)
    assert call.after == ("anon-1", first.mark_name) and len(first.mark_name) == 12
    assert [m["role"] for m in call.messages] == ["tool", "tool", "user"]
    assert call.mark_name != first.mark_name and call.echo["previous_response_id"] == rid
    for change, words in [
        ({"instructions": "Another system prompt."}, "send the same ones"),
        ({"tools": []}, "send the same ones"),
        ({"previous_response_id": rid[:-4]}, "not the id of a response agentkv made"),
        ({"previous_response_id": "resp_" + "0" * 12 + "bm90IGpzb24"}, "not the id"),
        ({"previous_response_id": "resp_../../../../" + rid[17:]}, "not the id"),  # its mark
        ({"input": [*outputs, outputs[0]]}, "answers a function_call before it"),
    ]:
        with pytest.raises(HTTPError, match=words) as refused:
            parse_responses(body | then | change, 8)
        assert refused.value.param in ("previous_response_id", "input[2].call_id")
    without = {"input": outputs}  # not continuing: the outputs answer no call before them
    with pytest.raises(HTTPError, match="answers a function_call before it"):
        parse_responses(body | without, 8)


def usage(finish: str = "stop", prompt: int = 10, generated: int = 3) -> pb.Usage:
    return pb.Usage(prompt_tokens=prompt, prefilled_tokens=4, generated_tokens=generated,
                    finish_reason=finish)  # fmt: skip


def replayed(events: list, finish: str = "stop") -> tuple[dict, Any, list[str]]:
    """The whole Response, the streamed one as the openai package's own stream accumulator
    adds its events up (its completed Response; the last event's for an incomplete one),
    and the stream's event types."""
    call = parse_responses(responses_body(), 8)
    whole = ResponseReply.of(call).whole(events, usage(finish), {"x": 1})
    Response.model_validate(whole)  # every field as the openai package types it
    reply = ResponseReply.of(call)
    sent = reply.opening()
    for item in events:
        sent += reply.text(item) if isinstance(item, str) else reply.call(item)
    sent += reply.closing(usage(finish), {"x": 1}, False)
    data = [json.loads(s.split("data: ", 1)[1]) for s in sent]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert all(s.startswith(f"event: {d['type']}\n") for s, d in zip(sent, data, strict=True))
    state = ResponseStreamState(input_tools=[WEATHER], text_format=omit)
    for d in data:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=d))
    added = state._completed_response or Response.model_validate(data[-1]["response"])
    return whole, added, [d["type"] for d in data]


def as_sent(response: Any) -> list[tuple]:
    """A Response's output as (type, status, text or name and arguments), ids left out."""
    out = []
    for item in response.output:
        said = item.content[0].text if item.type == "message" else (item.name, item.arguments)
        out.append((item.type, item.status, said))
    return out


CALLS = [pb.ToolCall(id=f"call_{i}", name="get_weather", arguments='{"city": "Paris"}')
         for i in range(2)]  # fmt: skip


@pytest.mark.parametrize(
    "events, kinds",
    [
        (["Hello", " there."], ["message"]),
        (["\n", CALLS[0]], ["function_call"]),  # white space before a call is no message
        (["Let me look.", CALLS[0], "\n"], ["message", "function_call"]),
        (CALLS, ["function_call", "function_call"]),
        ([], ["message"]),  # an empty reply is an empty message
    ],
)
def test_the_streamed_response_adds_up_to_the_whole_one(events, kinds):
    whole, added, types = replayed(events)
    parsed = Response.model_validate(whole)
    assert [item.type for item in parsed.output] == kinds
    assert as_sent(added) == as_sent(parsed)
    assert added.usage == parsed.usage and added.status == parsed.status
    assert parsed.status == "completed" and parsed.incomplete_details is None
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    calls = [i for i, e in enumerate(events) if not isinstance(e, str)]
    said = "".join(e for e in events[: calls[0] if calls else None] if isinstance(e, str))
    expected = [said] if said.strip() or not calls else []
    assert [item.content[0].text for item in parsed.output if item.type == "message"] == expected


def test_a_reply_cut_short_is_incomplete():
    whole, added, types = replayed(["Hel"], finish="length")
    assert whole["status"] == added.status == "incomplete"
    assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert types[-1] == "response.incomplete"
    assert as_sent(added) == [("message", "incomplete", "Hel")]
    assert whole["usage"] == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 6, "cache_write_tokens": 4},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 13,
    }


def test_an_error_once_streaming_is_the_next_event_then_response_failed():
    reply = ResponseReply.of(parse_responses(responses_body(), 8))
    sent = reply.opening() + reply.text("Hel")
    sent += [reply.error(HTTPError(503, "the gateway is stopping", code="unavailable"))]
    events = [json.loads(line[6:]) for s in sent for line in s.splitlines() if line[:6] == "data: "]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "unavailable"
    failed = Response.model_validate(events[-1]["response"])
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert failed.error.message == "the gateway is stopping"


def test_function_outputs_are_put_in_their_calls_order():
    items = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        *({"type": "function_call", "call_id": f"c{i}", "name": "get_weather",
           "arguments": "{}"} for i in (1, 2)),
        {"type": "function_call_output", "call_id": "c2", "output": "rome"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "par"}, {"type": "input_text", "text": "is"}],
         "caller": None, "name": "get_weather"},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip
    messages = parse_responses({"model": "m", "input": items}, 8).messages
    assert [(m["role"], m.get("tool_call_id"), m["content"]) for m in messages[2:4]] == [
        ("tool", "c1", "paris"),
        ("tool", "c2", "rome"),
    ]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert [m["role"] for m in messages[4:]] == ["system", "user"]


def test_items_an_sdk_dumps_with_its_nulls_are_taken_as_without_them():
    """The openai package's model_dump() writes every field its types know, null where unset
    (`async_`, `async` with aliases, `caller`): those were refused as unknown parameters."""
    from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage

    call = ResponseFunctionToolCall(
        type="function_call", call_id="c1", name="get_weather", arguments='{"city": "Paris"}'
    )
    said = ResponseOutputMessage.model_validate(
        {"type": "message", "id": "m1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]}
    )  # fmt: skip
    output = {"type": "function_call_output", "call_id": "c1", "output": RESULT}
    for dump in ({}, {"by_alias": True}, {"exclude_none": True}):
        items = [{"role": "user", "content": "Weather in Paris?"}, said.model_dump(**dump)]
        items += [call.model_dump(**dump), output]
        parsed = parse_responses({"model": "m", "input": items}, 8).messages
        assert [m["role"] for m in parsed] == ["user", "assistant", "tool"]  # one reply
        assert parsed[1]["content"] == "Let me look."
        assert parsed[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    with pytest.raises(HTTPError) as refused:  # a value there is still refused
        parse_responses({"model": "m", "input": [{**call.model_dump(), "caller": "x"}]}, 8)
    assert refused.value.param == "input[0].caller"


@pytest.mark.parametrize(
    "item, param",
    [
        ({"type": ["message"]}, "input[0].type"),
        ({"role": ["user"], "content": "x"}, "input[0]"),
        ({"role": "user", "content": [{"type": {}, "text": "x"}]}, "input[0].content[0]"),
        ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}",
          "namespace": "mcp"}, "input[0]"),
    ],
)  # fmt: skip
def test_malformed_items_are_a_400_not_a_500(item, param):
    with pytest.raises(HTTPError) as refused:
        parse_responses({"model": "m", "input": [item, {"role": "user", "content": "x"}]}, 8)
    assert refused.value.status == 400 and refused.value.param == param


def test_two_calls_with_one_id_are_refused():
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    answer = {"type": "function_call_output", "call_id": "c", "output": "x"}
    with pytest.raises(HTTPError, match="two function calls have one call_id"):
        parse_responses({"model": "m", "input": [call, call, answer, answer]}, 8)
    with pytest.raises(HTTPError) as refused:
        parse_responses({"model": "m", "input": "x", "include": [{}]}, 8)
    assert refused.value.param == "include[0]"


# Against real processes: text on a tiny random llama


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("responses")
    model = build_tiny_model("llama", root / "llama", tiny_tokenizer())
    stack = ToolStack(root, model, "tiny")  # a store, a worker on the tiny llama, a gateway
    yield stack
    stack.stop()


def create(client: openai.OpenAI, items, agent: str, **options):
    return client.responses.create(
        model="tiny", instructions=SYSTEM, input=items, max_output_tokens=8,
        extra_headers={"X-Agent-Id": agent}, **GREEDY, **options,
    )  # fmt: skip


def test_a_response_answers_as_chat_and_resent_input_reads_its_past_from_the_cache(stack):
    client = stack.client()
    first = create(client, "Which scrolls came in today?", "responder")
    assert first.id.startswith("resp_") and first.object == "response"
    assert first.status == "incomplete"  # the random model never ends: max_output_tokens
    assert first.incomplete_details.reason == "max_output_tokens"
    [message] = first.output
    assert message.type == "message" and message.role == "assistant" and first.output_text
    chat = client.chat.completions.create(
        model="tiny", max_tokens=8, **GREEDY, extra_headers={"X-Agent-Id": "chatter"},
        messages=[{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": "Which scrolls came in today?"}],
    )  # fmt: skip
    assert first.output_text == chat.choices[0].message.content
    assert first.usage.input_tokens == chat.usage.prompt_tokens
    assert first.usage.output_tokens == 8 and first.usage.input_tokens_details.cached_tokens == 0
    items = [{"role": "user", "content": "Which scrolls came in today?"}]
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items += [{"role": "user", "content": "Index them."}]
    second = create(client, items, "responder")
    held = first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens_details.cached_tokens == held
    assert second.model_extra["agentkv"]["cache_state"] == "hot"


def test_a_streamed_response_adds_up_to_the_whole_one(stack):
    client = stack.client()
    whole = create(client, "Which scrolls came in today?", "whole-one")
    with client.responses.stream(
        model="tiny", instructions=SYSTEM, input="Which scrolls came in today?",
        max_output_tokens=8, extra_headers={"X-Agent-Id": "streamed-one"}, **GREEDY,
    ) as stream:  # fmt: skip
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1].response
    assert deltas == last.output_text == whole.output_text
    assert last.usage == whole.usage and last.status == whole.status
    assert [e.sequence_number for e in events] == list(range(len(events)))


def continued(client: openai.OpenAI, previous, text: str, instructions: str = SYSTEM):
    return client.responses.create(
        model="tiny", instructions=instructions, input=text, max_output_tokens=8,
        previous_response_id=previous.id, **GREEDY,
    )  # fmt: skip


def agent_of(response) -> str:
    return response.model_extra["agentkv"]["agent_id"]


def test_a_previous_response_id_continues_its_agent_and_branches_keep(stack):
    """Only the new input is sent: the reply is the one the whole input resent gets, read
    from the cache up to the previous reply. Continuing an earlier response than the
    agent's last goes on in a fork, so both branches can be continued; an evicted agent is
    restored from the store."""
    client = stack.client()
    first = create(client, "Which scrolls came in today?", "chained")
    second = continued(client, first, "Index them.")
    assert second.previous_response_id == first.id and agent_of(second) == "chained"
    held = first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens_details.cached_tokens == held
    items = [{"role": "user", "content": "Which scrolls came in today?"}]
    items += [item.model_dump(exclude_none=True) for item in first.output]

    def resent(agent: str, text: str):
        """The same conversation, the whole input resent each call, on another agent."""
        assert create(client, items[0]["content"], agent).output_text == first.output_text
        return create(client, [*items, {"role": "user", "content": text}], agent)

    want = resent("resender", "Index them.")
    assert second.output_text == want.output_text
    assert second.usage.input_tokens == want.usage.input_tokens

    branch = continued(client, first, "Burn them.")  # from the first again: a fork
    assert agent_of(branch).startswith("chained-b")
    assert branch.usage.input_tokens_details.cached_tokens == held
    want = resent("burner", "Burn them.")
    assert branch.output_text == want.output_text
    assert branch.usage.input_tokens == want.usage.input_tokens

    WorkerClient(stack.worker.address).evict("default", "chained")
    third = continued(client, second, "Thank you.")  # the first branch, still there
    assert agent_of(third) == "chained" and third.model_extra["agentkv"]["cache_state"] == "warm"
    assert third.usage.input_tokens_details.cached_tokens == (
        second.usage.input_tokens + second.usage.output_tokens - 1
    )
    with client.responses.stream(
        model="tiny", instructions=SYSTEM, input="Thank you.", max_output_tokens=8,
        previous_response_id=second.id, **GREEDY,
    ) as stream:  # fmt: skip
        events = list(stream)
    created, last = events[0].response, events[-1].response
    assert created.id == last.id != third.id and last.output_text == third.output_text
    assert continued(client, last, "Bye.").status in ("completed", "incomplete")


def test_callers_whose_conversations_open_alike_keep_each_other_s_response_ids(stack):
    """Calls without identity that open alike (instructions, first message) share an agent:
    the second caller's call left it before the first one's point, which was dropped, and
    the first caller's previous_response_id was then refused (400, not found). Now a call
    that would drop a point a response's id names goes on in a branch, and both go on."""
    client = stack.client()
    opener = "Which scrolls are the oldest?"

    def anonymous():
        return client.responses.create(
            model="tiny", instructions=SYSTEM, input=opener, max_output_tokens=8, **GREEDY
        )

    a, b = anonymous(), anonymous()
    assert agent_of(b).startswith(f"{agent_of(a)}-b") and b.output_text == a.output_text
    a2, b2 = continued(client, a, "Index them."), continued(client, b, "Burn them.")
    assert (agent_of(a2), agent_of(b2)) == (agent_of(a), agent_of(b))  # each its last point
    own = create(client, opener, "on-its-own")
    assert a2.output_text == continued(client, own, "Index them.").output_text
    assert b2.output_text == continued(client, own, "Burn them.").output_text
    chat = client.chat.completions.create(  # no name: a branch of its own, not kept
        model="tiny", max_tokens=8, **GREEDY,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": opener}],
    )  # fmt: skip
    assert chat.choices[0].message.content == a.output_text
    assert continued(client, a2, "Thank you.").status in ("completed", "incomplete")
    with StoreClient(stack.store.address) as store:
        kept = lambda: {x.agent_id for x in store.list_agents("default")}  # noqa: E731
        until(lambda: kept() >= {agent_of(a), agent_of(b)}, "both conversations' agents")
        until(lambda: len({x for x in kept() if x.startswith(agent_of(a))}) == 2, "no other")


def test_a_conversation_resent_whole_after_it_left_its_agent_goes_on_warm_in_one_branch(stack):
    """A client that resends its whole input (the Agents SDK's default), whose conversation
    left the agent that another one's responses name the points of: it went on in a branch
    of its own on every call (a fork, and all past the shared point prefilled again, each
    time). Now its next call finds the branch that its reply names, and reads its past
    from the cache; the other conversation's ids still go on."""
    client = stack.client()
    opener = {"role": "user", "content": "Which scrolls are the most fragile?"}

    def anonymous(items):
        return client.responses.create(
            model="tiny", instructions=SYSTEM, input=items, max_output_tokens=8, **GREEDY
        )

    first = anonymous([opener])
    said = [item.model_dump(exclude_none=True) for item in first.output]
    kept = anonymous([opener, *said, {"role": "user", "content": "Index them."}])
    assert agent_of(kept) == agent_of(first)  # the first conversation, named by its ids
    history = [opener, *said, {"role": "user", "content": "Burn them."}]
    agents, cached, replies = [], [], []
    for text in ("Now?", "And then?", "Why?"):
        other = anonymous(history)  # the other conversation: it left the first one's points
        agents.append(agent_of(other))
        cached.append(other.usage.input_tokens_details.cached_tokens)
        replies.append(other)
        history += [item.model_dump(exclude_none=True) for item in other.output]
        history.append({"role": "user", "content": text})
    assert agents[0].startswith(f"{agent_of(first)}-b")  # no reply of its own yet: its own
    assert agents[1] == agents[2] and agents[1].startswith(f"{agent_of(first)}-c")
    held = replies[1].usage.input_tokens + replies[1].usage.output_tokens - 1
    assert cached[2] == held  # its past, from the branch's cache
    assert create(client, [opener], "alone").output_text == first.output_text  # turn by turn
    own = create(client, [opener, *said, {"role": "user", "content": "Burn them."}], "alone")
    assert replies[0].output_text == own.output_text
    assert continued(client, kept, "Thank you.").status in ("completed", "incomplete")


def test_conversations_alike_through_their_branch_s_reply_keep_each_other_s_ids_there(stack):
    """Conversations resent whole, alike through the reply that names their branch (canned
    questions, greedy replies), then apart: the later ones dropped the first one's points
    on that branch. A branch found is held to its own named points as the agent is: each
    goes on in a branch of it, named by its own next reply, and keeps going warm there."""
    client = stack.client()
    opener = {"role": "user", "content": "Which scrolls need copying?"}

    def anonymous(items):
        return client.responses.create(
            model="tiny", instructions=SYSTEM, input=items, max_output_tokens=8, **GREEDY
        )

    def said(response) -> list:
        return [item.model_dump(exclude_none=True) for item in response.output]

    first = anonymous([opener])
    anonymous([opener, *said(first), {"role": "user", "content": "Index them."}])
    shared = [opener, *said(first), {"role": "user", "content": "Copy them."}]
    shared += said(anonymous(shared))  # apart from the first: a branch of its own
    one = anonymous([*shared, {"role": "user", "content": "Now?"}])
    assert agent_of(one).startswith(f"{agent_of(first)}-c")  # alike through this reply
    branches = []
    for ask in ("Later?", "Sooner?"):  # two more alike through it, then apart
        history = [*shared, {"role": "user", "content": ask}]
        calls = []
        for _ in range(3):
            calls.append(anonymous(history))
            history += [*said(calls[-1]), {"role": "user", "content": "Go on."}]
        assert agent_of(calls[0]).startswith(f"{agent_of(one)}-b")  # no reply of its own
        assert agent_of(calls[1]) == agent_of(calls[2])  # then its own, found again
        assert agent_of(calls[1]).startswith(f"{agent_of(one)}-c")
        held = calls[1].usage.input_tokens + calls[1].usage.output_tokens - 1
        assert calls[2].usage.input_tokens_details.cached_tokens == held
        branches.append(agent_of(calls[1]))
    assert branches[0] != branches[1]
    assert continued(client, one, "Go on.").status in ("completed", "incomplete")  # kept


def test_bad_requests_get_openai_errors(stack):
    client = stack.client()
    with pytest.raises(openai.BadRequestError) as refused:
        create(client, "x", "bad", previous_response_id="resp_1")
    assert refused.value.body["param"] == "previous_response_id"
    assert refused.value.body["code"] == "previous_response_not_found"
    gone = create(client, "Which scrolls came in today?", "deleted-later")
    WorkerClient(stack.worker.address).delete("default", "deleted-later")
    with pytest.raises(openai.BadRequestError, match="not found") as refused:
        continued(client, gone, "Index them.")
    assert refused.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError, match="send the same ones"):
        continued(client, gone, "Index them.", instructions="Be brief.")
    with pytest.raises(openai.NotFoundError, match="does not exist here"):
        client.responses.create(model="gpt-5", input="x")
    for kept in (
        client.responses.retrieve,
        client.responses.delete,
        client.responses.input_items.list,
    ):
        with pytest.raises(openai.NotFoundError, match="keeps no response objects"):
            kept(gone.id)


def test_two_calls_continuing_one_response_at_once_both_get_their_reply(stack):
    """The second waits for the first's turn to end, then goes on in a fork (OpenAI takes
    both; it was a 409, "in progress")."""
    client = stack.client()
    first = create(client, "Which scrolls came in today?", "twins")
    with client.responses.stream(
        model="tiny", instructions=SYSTEM, input="Index them.", max_output_tokens=3000,
        previous_response_id=first.id, **GREEDY,
    ) as stream:  # fmt: skip
        events = iter(stream)
        assert next(events).type == "response.created"  # sent once its first token is in
        busy = WorkerClient(stack.worker.address)
        with pytest.raises(AgentBusy):  # the turn is under way (3,000 tokens: about 8 s here)
            busy.turn("default", "twins", [], max_tokens=0)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            second = pool.submit(continued, stack.client(), first, "Burn them.")
            long = [*events][-1].response  # incomplete: max_output_tokens
            burnt = second.result(timeout=300)
    assert agent_of(long) == "twins" and long.usage.output_tokens == 3000
    assert agent_of(burnt).startswith("twins-b")
    held = first.usage.input_tokens + first.usage.output_tokens - 1
    assert burnt.usage.input_tokens_details.cached_tokens == held
    assert burnt.output_text == continued(client, first, "Burn them.").output_text


def test_a_worker_from_before_after_mark_is_not_asked_to_continue(stack, tmp_path):
    """An older worker drops after_mark (proto3) and would add the input at the agent's
    end, or tool_call_allowed and let any tool be called: the gateway asks the agent's
    worker what it does first, and refuses (501)."""
    store = store_process(tmp_path / "data", tmp_path / "store.log").start()
    args = ["--model", str(stack.model), "--store", store.address, "--listen", "127.0.0.1:0"]
    old = ServiceProcess("tests.faulty_worker", args, tmp_path / "old.log", {"OLD_WORKER": "1"})
    old.start()
    flags = ["--model-name", "tiny"]
    gateway = gateway_process([old.address], tmp_path / "gw.log", store.address, extra_args=flags)
    gateway.start()
    try:
        url = f"http://{gateway.address}/v1"
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        first = create(client, "Which scrolls came in today?", "old-timer")
        before = WorkerClient(old.address).describe("default", "old-timer").num_tokens
        with pytest.raises(openai.APIStatusError, match="predates previous_response_id") as no:
            continued(client, first, "Index them.")
        assert no.value.status_code == 501
        assert WorkerClient(old.address).describe("default", "old-timer").num_tokens == before
        only = {"type": "allowed_tools", "mode": "auto", "tools": [WEATHER_NAMED]}
        with pytest.raises(openai.APIStatusError, match="predates tool_choice allowed_tools") as no:
            client.responses.create(model="tiny", input="Hi", tools=TWO, tool_choice=only)
        assert (no.value.status_code, no.value.body["param"]) == (501, "tool_choice")
    finally:
        for process in (gateway, old, store):
            process.stop()


def test_a_branch_whose_turn_fails_is_not_kept(stack):
    """A call continuing an earlier response forks its agent; when the fork's turn is
    refused (here its context would overflow), the fork is deleted, once."""
    client = stack.client()
    first = create(client, "Which scrolls came in today?", "overflowed")
    continued(client, first, "Index them.")
    with pytest.raises(openai.BadRequestError) as refused:
        continued(client, first, "scroll " * 5000)
    assert refused.value.body["code"] == "context_length_exceeded"
    assert "agent 'overflowed-b" in refused.value.message  # the fork's turn was refused

    def branches() -> list[str]:
        with urllib.request.urlopen(f"http://{stack.gateway.address}/v1/agents") as answer:
            listed = json.load(answer)["data"]
        return [a["agent_id"] for a in listed if a["agent_id"].startswith("overflowed-b")]

    deadline = time.monotonic() + 60
    while branches():  # deleted once its refused turn has ended
        assert time.monotonic() < deadline, branches()
        time.sleep(0.05)
    assert continued(client, first, "Burn them.").status in ("completed", "incomplete")
    assert len(branches()) == 1


# Against real processes: function calls on the scripted model


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    stack = ToolStack(tmp_path_factory.mktemp("responses-tools"))
    yield stack
    stack.stop()


def test_a_function_call_loop_resumes_warm_and_streams_the_same_call(tools):
    client = tools.client()
    items: list = [{"role": "user", "content": "What is the weather in Paris?"}]

    def turn(agent: str = "looper"):
        return client.responses.create(
            model="qwen-tools", instructions="You are a weather assistant.", input=items,
            tools=[WEATHER], max_output_tokens=32, extra_headers={"X-Agent-Id": agent}, **GREEDY,
        )  # fmt: skip

    first = turn()
    assert first.status == "completed"
    [call] = [item for item in first.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == (TOOL_CALL["name"], TOOL_CALL["arguments"])
    assert call.call_id and call.id.startswith("fc_") and call.status == "completed"
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items += [{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    second = turn()
    held = first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens_details.cached_tokens == held
    assert second.model_extra["agentkv"]["cache_state"] == "hot"
    with client.responses.stream(
        model="qwen-tools", instructions="You are a weather assistant.", input=items[:1],
        tools=[WEATHER], max_output_tokens=32, extra_headers={"X-Agent-Id": "streamer"}, **GREEDY,
    ) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert final.status == "completed"
    shape = ("type", "name", "arguments", "status")
    assert [[getattr(i, k, None) for k in shape] for i in final.output] == [
        [getattr(i, k, None) for k in shape] for i in first.output
    ]


@pytest.mark.parametrize("streamed, by_id", [(False, False), (True, False), (False, True)])
def test_an_openai_agents_sdk_agent_on_its_default_model_calls_its_tool_and_resumes_warm(
    tools, streamed, by_id
):
    """OpenAI's Agents SDK, unchanged, with its default Responses model over the gateway,
    streamed and not, the second run resending its history or continuing the first's last
    response by id (check_weather_agent says what is checked)."""
    check_weather_agent(str(tools.client().base_url), "OpenAIResponsesModel", streamed, by_id)


def test_a_number_json_cannot_carry_back_is_refused_before_the_turn(tools):
    """A tool's schema holding a number past a double's range (1e999), or Python's NaN and
    Infinity: its echo in the reply could not be JSON (a 500 once the turn had run), so
    the body is refused as it is read, and the tool taken as sent next."""
    url = f"http://{tools.gateway.address}/v1/responses"
    for number in ("1e999", "NaN", "-Infinity"):
        maximum = {"type": "object", "properties": {"n": {"type": "number", "maximum": 0}}}
        tool = {**WEATHER, "parameters": maximum}
        body = json.dumps({"model": "qwen-tools", "input": "Hi", "tools": [tool], **GREEDY})
        body = body.replace('"maximum": 0', f'"maximum": {number}')
        ask = urllib.request.Request(url, body.encode(), {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(ask, timeout=120)
        said = json.loads(refused.value.read())["error"]["message"]
        assert refused.value.code == 400 and number in said, (number, said)
    tool = {**WEATHER, "parameters": {"type": "object", "properties": {"n": {"maximum": 1e300}}}}
    reply = tools.client().responses.create(
        model="qwen-tools", input="Hi", tools=[tool], max_output_tokens=4, **GREEDY
    )
    assert (
        reply.status in ("completed", "incomplete")
        and reply.tools[0].parameters == tool["parameters"]
    )


def test_a_function_call_s_result_continues_its_response_by_id(tools):
    """Only the function's output is sent, after the response that made the call: the reply
    is the one the whole input resent gets."""
    client = tools.client()
    ask = "What is the weather in Paris?"

    def turn(items, agent: str = "", **options):
        return client.responses.create(
            model="qwen-tools", instructions="You are a weather assistant.", input=items,
            tools=[WEATHER], max_output_tokens=32, **GREEDY, **options,
            extra_headers={"X-Agent-Id": agent} if agent else None,
        )  # fmt: skip

    first = turn(ask, "by-id")
    [call] = [item for item in first.output if item.type == "function_call"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    for wrong in ([result | {"call_id": "call_nope"}], [{"role": "user", "content": "Hm?"}]):
        with pytest.raises(openai.BadRequestError, match=f"made the tool calls .*{call.call_id}"):
            turn(wrong, previous_response_id=first.id)  # refused, the agent as it was
    second = turn([result], previous_response_id=first.id)
    held = first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens_details.cached_tokens == held
    items = [{"role": "user", "content": ask}]
    items += [item.model_dump(exclude_none=True) for item in first.output]
    assert turn(ask, "resent").output_text == first.output_text
    whole = turn([*items, result], "resent")
    shape = ("type", "name", "arguments", "text")
    assert [[getattr(i, k, None) for k in shape] for i in second.output] == [
        [getattr(i, k, None) for k in shape] for i in whole.output
    ]
    assert second.usage.input_tokens == whole.usage.input_tokens
