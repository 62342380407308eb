"""Tool calling on a real worker, through the raw gRPC contract (worker.proto): tools rendered
with the model's own chat template, a reply's tool calls parsed out of its text, and a
conversation that carries on from them warm. The model is tests.model_kit's scripted one:
Qwen 2.5's template, answering every conversation with TOOL_CALL by greedy decoding."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from agentkv.worker.v1 import worker_pb2 as pb
from agentkv.worker.v1 import worker_pb2_grpc
from inference_worker.tools import ReplyCalls, ToolFormat
from tests.model_kit import QWEN25_CHAT_TEMPLATE, TOOL_CALL, WEATHER_TOOL, build_tool_model

NS = "tools"
WEATHER = WEATHER_TOOL
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
SYSTEM = "You answer with tools."


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return build_tool_model(tmp_path_factory.mktemp("tool-model") / "qwen")


@pytest.fixture
def stub(start_worker, tool_model):
    worker = start_worker(tool_model)
    with grpc.insecure_channel(worker.address) as channel:
        yield worker_pb2_grpc.InferenceWorkerStub(channel)


def _turn(stub, agent_id: str, messages: list[pb.Message], tools=(WEATHER,), **fields):
    """(text, token ids, tool calls, usage) of one greedy turn (16 tokens at most, unless
    `fields` give another sampling)."""
    fields.setdefault("sampling", pb.SamplingParams(max_tokens=16))
    request = pb.TurnRequest(
        namespace=NS,
        agent_id=agent_id,
        messages=messages,
        tools=tools if isinstance(tools, str) else json.dumps(list(tools)) if tools else "",
        **fields,
    )
    text, ids, calls, usage = [], [], [], None
    for response in stub.Turn(request, timeout=60):
        kind = response.WhichOneof("item")
        if kind == "tokens":
            text.append(response.tokens.text)
            ids += response.tokens.token_ids
        elif kind == "tool_call":
            calls.append(response.tool_call)
        elif kind == "usage":
            usage = response.usage
    return "".join(text), ids, calls, usage


def _create(stub, agent_id: str, tools=(WEATHER,)) -> pb.CreateAgentResponse:
    request = pb.CreateAgentRequest(
        namespace=NS, agent_id=agent_id, system_prompt=SYSTEM, tools=json.dumps(list(tools))
    )
    return stub.CreateAgent(request, timeout=60)


def _rendered(model_dir, messages: list[dict], tools) -> list[int]:
    """The model's own tokenizer's rendering of the whole conversation, ready for a reply."""
    from mlx_lm import load

    _, tokenizer = load(str(model_dir))
    text = tokenizer.apply_chat_template(
        messages, tools=list(tools), add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_reply_s_tool_call_comes_parsed_and_not_as_text(stub):
    _create(stub, "a")
    text, ids, calls, usage = _turn(stub, "a", [pb.Message(role="user", content="Paris?")])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (TOOL_CALL["name"], TOOL_CALL["arguments"])
    ]
    assert calls[0].id.isalnum() and len(calls[0].id) == 9  # as Mistral's templates ask
    assert text == ""  # the call's text went out as the call
    assert usage.finish_reason == "tool_calls"
    assert len(ids) == usage.generated_tokens == 4  # <tool_call>, the JSON, </tool_call>, EOS


def test_the_conversation_goes_on_from_the_call_warm_and_as_rendered(stub, tool_model):
    _create(stub, "b")
    first = [pb.Message(role="system", content=SYSTEM), pb.Message(role="user", content="Paris?")]
    _, _, calls, usage = _turn(stub, "b", first, whole_conversation=True)
    before = usage.prompt_tokens + usage.generated_tokens  # the context after the reply
    answered = pb.Message(role="assistant", content="", tool_calls=calls)
    result = pb.Message(role="tool", content='{"celsius": 21}', tool_call_id=calls[0].id)
    _, _, again, usage = _turn(stub, "b", [*first, answered, result], whole_conversation=True)

    assert usage.cache_state == "hot"
    assert usage.reused_hot_tokens >= before - 1  # a reply's last token is fed next turn
    assert usage.prefilled_tokens == usage.prompt_tokens - usage.reused_hot_tokens
    as_dicts = _paris_loop(calls[0], '{"celsius": 21}')
    assert usage.prompt_tokens == len(_rendered(tool_model, as_dicts, [WEATHER]))
    assert [c.name for c in again] == [TOOL_CALL["name"]]


def test_count_tokens_is_the_prompt_a_fresh_agent_gets_and_keeps_nothing(stub, tool_model):
    first = [pb.Message(role="system", content=SYSTEM), pb.Message(role="user", content="Paris?")]
    tools = json.dumps([WEATHER])
    counted = stub.CountTokens(pb.CountTokensRequest(messages=first, tools=tools), timeout=60)
    _create(stub, "counted")
    _, _, calls, usage = _turn(stub, "counted", first, whole_conversation=True)
    assert counted.prompt_tokens == usage.prompt_tokens
    answered = pb.Message(role="assistant", content="", tool_calls=calls)
    result = pb.Message(role="tool", content='{"celsius": 21}', tool_call_id=calls[0].id)
    loop = [*first, answered, result]
    counted = stub.CountTokens(pb.CountTokensRequest(messages=loop, tools=tools), timeout=60)
    as_dicts = _paris_loop(calls[0], '{"celsius": 21}')
    assert counted.prompt_tokens == len(_rendered(tool_model, as_dicts, [WEATHER]))
    assert stub.GetWorkerInfo(pb.GetWorkerInfoRequest()).num_hot_agents == 1  # "counted"
    with pytest.raises(grpc.RpcError) as caught:  # bad tools: the turn's refusal
        stub.CountTokens(pb.CountTokensRequest(messages=first, tools="[{]"), timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    huge = [pb.Message(role="user", content="x" * (1 << 20))]  # refused before it renders
    with pytest.raises(grpc.RpcError) as caught:
        stub.CountTokens(pb.CountTokensRequest(messages=huge), timeout=60)
    assert caught.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "however they tokenize" in caught.value.details()
    reserved = pb.CreateAgentRequest(namespace=NS, agent_id="reserved", metadata={
        "agentkv.toolsz.0": "garbage"})  # fmt: skip
    with pytest.raises(grpc.RpcError) as caught:  # the worker's own keys
        stub.CreateAgent(reserved, timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the worker's own" in caught.value.details()


def test_a_reply_may_end_at_its_first_call_and_the_conversation_goes_on_from_it(stub):
    _create(stub, "k")
    ask = [pb.Message(role="system", content=SYSTEM), pb.Message(role="user", content="Paris?")]
    _, ids, calls, usage = _turn(stub, "k", ask, whole_conversation=True, max_tool_calls=1)
    assert len(calls) == 1 and usage.finish_reason == "tool_calls"
    assert usage.generated_tokens == len(ids) == 3  # ended at </tool_call>, before its EOS
    said = pb.Message(role="assistant", content="", tool_calls=calls)
    result = pb.Message(role="tool", content="21", tool_call_id=calls[0].id)
    _, _, _, again = _turn(stub, "k", [*ask, said, result], whole_conversation=True)
    assert again.cache_state == "hot"
    assert again.reused_hot_tokens == usage.prompt_tokens + usage.generated_tokens - 1


def test_an_agent_keeps_its_tools_through_the_store(stub, tool_model):
    _create(stub, "c")
    _, _, calls, _ = _turn(stub, "c", [pb.Message(role="user", content="Paris?")], tools=())
    assert stub.EvictAgent(pb.EvictAgentRequest(namespace=NS, agent_id="c")).evicted
    result = pb.Message(role="tool", content="21", tool_call_id=calls[0].id)
    _, _, again, usage = _turn(stub, "c", [result], tools=())  # appended: the agent's tools

    assert usage.cache_state == "warm" and not usage.restore_failure
    as_dicts = _paris_loop(calls[0], "21")
    assert usage.prompt_tokens == len(_rendered(tool_model, as_dicts, [WEATHER]))
    assert len(again) == 1


def test_other_tools_start_the_conversation_over_as_a_fresh_agent_s(stub, tool_model):
    first = [pb.Message(role="system", content=SYSTEM), pb.Message(role="user", content="Paris?")]
    _create(stub, "d")
    _turn(stub, "d", first, whole_conversation=True)
    both = (WEATHER, TIME)
    _, ids, _, usage = _turn(stub, "d", first, tools=both, whole_conversation=True)
    _create(stub, "e", tools=both)
    _, fresh_ids, _, fresh = _turn(stub, "e", first, tools=both, whole_conversation=True)
    assert ids == fresh_ids
    as_dicts = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Paris?"}]
    assert usage.prompt_tokens == fresh.prompt_tokens == len(_rendered(tool_model, as_dicts, both))
    assert usage.reused_hot_tokens < usage.prompt_tokens // 2  # the tools come early
    assert fresh.reused_hot_tokens > usage.reused_hot_tokens  # its stable prefix had them


def test_bad_tools_and_misplaced_calls_are_refused_and_change_nothing(stub):
    _create(stub, "f")
    cases = {
        "tools is not JSON": dict(tools="[{"),
        "not {": dict(tools=json.dumps([{"type": "web_search"}])),
        "has no function name": dict(tools=json.dumps([{"type": "function", "function": {}}])),
        "at most 65536 characters of them compressed": dict(
            tools=json.dumps([_noise_tool(150_000)])
        ),
    }
    say = [pb.Message(role="user", content="Paris?")]
    for words, fields in cases.items():
        with pytest.raises(grpc.RpcError) as caught:
            _turn(stub, "f", say, **fields)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in caught.value.details()
    call = pb.ToolCall(id="x", name="get_weather", arguments="{}")
    with pytest.raises(grpc.RpcError) as caught:
        _turn(stub, "f", [pb.Message(role="user", content="hi", tool_calls=[call])])
    assert "only an assistant's calls tools" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        _turn(stub, "f", say, tools=(TIME,))  # appending, with tools not the agent's
    assert "has other tools" in caught.value.details()
    state = stub.DescribeAgent(pb.DescribeAgentRequest(namespace=NS, agent_id="f")).agent
    assert state.num_tokens == _create_tokens(stub)


def test_a_second_tool_result_after_a_mark_on_the_first_starts_over_as_a_fresh_agent(stub):
    """Qwen's template merges tool results that follow one another into one block: a resent
    conversation resuming at a mark after the first cannot append the second to it."""
    first = [pb.Message(role="system", content=SYSTEM), pb.Message(role="user", content="Two?")]
    _create(stub, "h")
    _, _, calls, _ = _turn(stub, "h", first, whole_conversation=True)
    said = pb.Message(role="assistant", content="", tool_calls=calls)
    one = pb.Message(role="tool", content="21", tool_call_id=calls[0].id)
    two = pb.Message(role="tool", content="22", tool_call_id=calls[0].id)
    request = dict(whole_conversation=True, sampling=pb.SamplingParams(max_tokens=0))
    _turn(stub, "h", [*first, said, one], **request)  # a mark after the first result
    _, ids, _, usage = _turn(stub, "h", [*first, said, one, two], whole_conversation=True)
    _create(stub, "i")
    _, fresh_ids, _, fresh = _turn(stub, "i", [*first, said, one, two], whole_conversation=True)
    assert (ids, usage.prompt_tokens) == (fresh_ids, fresh.prompt_tokens)


def test_new_tools_that_leave_no_room_in_the_agent_s_metadata_are_refused(stub):
    request = pb.CreateAgentRequest(
        namespace=NS, agent_id="j", system_prompt=SYSTEM, metadata={"notes": "n" * 4000}
    )
    for i in range(21):  # 22 before marks' names and calls had a value of their own
        request.metadata[f"notes{i}"] = "n" * 4000
    stub.CreateAgent(request, timeout=60)
    big = _noise_tool(8000)  # two metadata values, packed
    with pytest.raises(grpc.RpcError) as caught:
        _turn(
            stub,
            "j",
            [pb.Message(role="user", content="hi")],
            tools=(big,),
            whole_conversation=True,
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "keeps for an agent with this system prompt and tools" in caught.value.details()
    _, _, _, usage = _turn(stub, "j", [pb.Message(role="user", content="hi")], (), durable=True)
    assert usage.generated_tokens  # the agent still saves


def test_json_nested_too_deeply_is_the_caller_s_error_not_the_worker_s(stub):
    """Python's JSON parser gives up past ~1,000 levels (RecursionError): tools so deep are
    refused, and a resent call's arguments so deep are rendered as the text they are."""
    deep = "[" * 1500 + "]" * 1500
    say = [pb.Message(role="user", content="Paris?")]
    with pytest.raises(grpc.RpcError) as caught:
        _turn(stub, "n", say, tools=deep)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tools is not JSON: JSON nested too deeply" in caught.value.details()
    _create(stub, "n")
    call = pb.ToolCall(id="abc123XYZ", name="get_weather", arguments=deep)
    said = pb.Message(role="assistant", content="", tool_calls=[call])
    result = pb.Message(role="tool", content="21", tool_call_id="abc123XYZ")
    try:
        _, _, calls, _ = _turn(stub, "n", [*say, said, result], whole_conversation=True)
        assert len(calls) == 1
    except grpc.RpcError as exc:  # the text may not fit the tiny model's context
        assert exc.code() == grpc.StatusCode.OUT_OF_RANGE, exc.details()


def test_a_tool_schema_nested_past_what_rendering_takes_is_refused(stub):
    """The red team's case: a tool whose parameters nest 300 objects (about 600 JSON levels,
    under the parser's limit) crashed every call that rendered it (RecursionError: INTERNAL,
    a traceback in the worker's log). Such tools are now refused, and nothing is made."""
    schema: dict = {"type": "object"}
    for _ in range(300):
        schema = {"type": "object", "properties": {"a": schema}}
    deep = {"type": "function", "function": {"name": "deep", "parameters": schema}}
    say = [pb.Message(role="user", content="Paris?")]
    for call in (
        lambda: _create(stub, "deep", tools=(deep,)),
        lambda: _turn(stub, "d", say, (deep,)),
    ):
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tools are nested 604 JSON levels deep; at most 256" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        stub.DescribeAgent(pb.DescribeAgentRequest(namespace=NS, agent_id="deep"), timeout=60)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    _create(stub, "d")  # the worker goes on: an agent with sound tools, and a call of one
    assert len(_turn(stub, "d", say)[2]) == 1


def _create_tokens(stub) -> int:
    return _create(stub, "f-twin").usage.prompt_tokens


def test_a_model_without_a_tool_format_refuses_tools(start_worker, tiny_model_dirs):
    worker = start_worker(tiny_model_dirs["llama"], name="plain")
    with grpc.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.InferenceWorkerStub(channel)
        assert stub.GetWorkerInfo(pb.GetWorkerInfoRequest()).tool_parser == ""
        result = pb.Message(role="tool", content="21", tool_call_id="abc")
        for tools, said in (((WEATHER,), "hi"), ((), result)):
            message = (
                said if isinstance(said, pb.Message) else pb.Message(role="user", content=said)
            )
            with pytest.raises(grpc.RpcError) as caught:
                _turn(stub, "g", [message], tools=tools)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "no tool-call format" in caught.value.details()
            request = pb.CountTokensRequest(messages=[message], tools=json.dumps(list(tools)))
            with pytest.raises(grpc.RpcError, match="no tool-call format"):
                stub.CountTokens(request, timeout=60)


def test_the_worker_names_its_model_s_tool_format(stub):
    assert stub.GetWorkerInfo(pb.GetWorkerInfoRequest()).tool_parser == "json_tools"


def _paris_loop(call: pb.ToolCall, result: str) -> list[dict]:
    """The system prompt, "Paris?", the model's call and the tool's `result`, as the
    tokenizer's own template takes them."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [_template(call)]},
        {"role": "tool", "content": result, "tool_call_id": call.id},
    ]


def _template(call: pb.ToolCall) -> dict:
    arguments = json.loads(call.arguments)
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }


def _noise_tool(size: int) -> dict:
    """A tool whose description is `size` characters that do not compress (hex digits of
    random bytes: zlib and base64 leave them about as long)."""
    noise = random.Random(size).randbytes(size // 2).hex()
    return {**WEATHER, "function": {**WEATHER["function"], "description": noise}}


# Tools as the agent's metadata keeps them (metadata.chat_metadata), sans I/O


def _stdlib_tools() -> list[dict]:
    """Function tools as agent frameworks write them: one per public function of a few
    standard modules, its docstring the description, its parameters a JSON schema."""
    import inspect
    import logging
    import os
    import shutil
    import subprocess
    import tempfile
    import textwrap

    tools = []
    for module in (os, shutil, textwrap, json, inspect, logging, subprocess, tempfile):
        for name, fn in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isfunction(fn) or not fn.__doc__:
                continue
            params = list(inspect.signature(fn).parameters)
            properties = {p: {"type": "string", "description": f"the {p}"} for p in params}
            schema = {"type": "object", "properties": properties, "required": params[:1]}
            function = {"name": f"{module.__name__}_{name}", "description": fn.__doc__,
                        "parameters": schema}  # fmt: skip
            tools.append({"type": "function", "function": function})
    return tools


def test_a_large_tool_list_is_kept_packed_and_comes_back_whole():
    from inference_worker.conversation import ChatState
    from inference_worker.metadata import chat_metadata, chat_state, check_metadata
    from inference_worker.tools import canonical_tools

    tools = canonical_tools(json.dumps(_stdlib_tools()))
    assert len(tools) > 96 << 10  # past what the store keeps of an agent's metadata
    check_metadata({}, "You are a helpful agent. " * 400, tools)  # a long system prompt too
    chat = ChatState(system="sys", opened=False, digest="d", tools=tools)
    metadata = chat_metadata(chat)
    assert chat_state(metadata).tools == tools and chat_state(metadata).system == "sys"
    # an agent saved before tools were packed keeps them as plain text
    plain = {k: v for k, v in metadata.items() if not k.startswith("agentkv.toolsz.")}
    plain |= {f"agentkv.tools.{i}": tools[i * 4096 : (i + 1) * 4096] for i in range(40)}
    assert chat_state(plain).tools == tools


def test_tools_a_worker_before_packing_could_read_stay_text_and_bad_packs_are_corrupt():
    import base64
    import zlib

    from agentkv.errors import CorruptRecord
    from inference_worker.conversation import ChatState
    from inference_worker.metadata import chat_metadata, chat_state
    from inference_worker.tools import canonical_tools

    small = canonical_tools(json.dumps([WEATHER]))
    kept = chat_metadata(ChatState(tools=small))
    assert kept["agentkv.tools.0"] == small and not any("toolsz" in k for k in kept)
    big = canonical_tools(json.dumps(_stdlib_tools()))
    assert chat_metadata(ChatState(tools=big))["agentkv.toolsz.0"].startswith("z1:")
    bomb = "z1:" + base64.b64encode(zlib.compress(b"\0" * (4 << 20), 9)).decode()
    for bad in ("garbage", "z1:!!!", "z9:abc", bomb):  # no worker wrote these
        with pytest.raises(CorruptRecord, match="stored tools cannot be read"):
            chat_state({"agentkv.toolsz.0": bad})


# ReplyCalls alone: text pieces as a detokenizer gives them.

JSON_FORMAT = ToolFormat("json_tools", "<tool_call>", "</tool_call>", lambda t, _: json.loads(t))


F = {"type": "function", "function": {"name": "f"}}


def _split(pieces: list[str]) -> tuple[str, list, str]:
    calls = ReplyCalls(JSON_FORMAT, [WEATHER, F])
    out = [calls.feed(p)[0] for p in pieces]
    return "".join(out), calls.calls, calls.flush()[0]


def test_markers_split_over_pieces_are_found():
    text, calls, rest = _split(
        ["Sure. <tool", '_call>\n{"name": "f", ', '"arguments": {}}</tool_', "call>"]
    )
    assert (text, [(c.name, c.arguments) for c in calls], rest) == ("Sure. ", [("f", "{}")], "")


def test_a_call_the_parser_refuses_goes_out_as_text():
    text, calls, _ = _split(["<tool_call>not json</tool_call> after"])
    assert (text, calls) == ("<tool_call>not json</tool_call> after", [])


@pytest.mark.parametrize(
    "arguments",
    ['"Paris"', "[1, 2]", '"{not json"', "7", '{"x": NaN}', '{"y": 1e999}',
     '{"s": "\\ud800"}'],  # the last three: no JSON a client can read, or no UTF-8
)  # fmt: skip
def test_a_call_whose_arguments_are_no_json_object_goes_out_as_text(arguments):
    """Clients read a call's arguments as an object (Anthropic's tool_use input is one)."""
    said = f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>'
    assert _split([said]) == (said, [], "")


def test_a_call_with_null_arguments_is_one_without_parameters():
    _, calls, _ = _split(['<tool_call>{"name": "f", "arguments": null}</tool_call>'])
    assert [(c.name, c.arguments) for c in calls] == [("f", "{}")]


def test_a_call_cut_before_its_end_is_flushed_as_text():
    text, calls, rest = _split(['a <tool_call>{"name": "f"'])
    assert (text, calls, rest) == ("a ", [], '<tool_call>{"name": "f"')


def test_a_format_whose_calls_end_with_the_reply_gets_its_call_at_the_end():
    mistral = ToolFormat("mistral", "[TOOL_CALLS]", "", lambda t, _: json.loads(t))
    calls = ReplyCalls(mistral, [])
    assert calls.feed('ok [TOOL_CALLS] {"name": "f", ') == ("ok ", [])
    assert calls.feed('"arguments": {"a": 1}}') == ("", [])
    text, made = calls.flush()
    assert (text, [(c.name, json.loads(c.arguments)) for c in made]) == ("", [("f", {"a": 1})])


def test_only_the_opening_s_special_token_opens_a_call_not_its_spelling():
    """The reviewer's: a call the model spelled in ordinary tokens (quoting a page whose
    <tool_call> the prompt escaped) was taken for a real one. Where the opening is one
    special token, only that token opens a call (the batcher marks it)."""
    calls = ReplyCalls(JSON_FORMAT, [F], opening=7)
    said = 'The page says: <tool_call>{"name": "f", "arguments": {}}</tool_call> end'
    assert calls.feed(calls.marked(said, 8)) == (said, [])  # spelled: text, as quoted
    assert calls.feed(calls.marked(" <tool_call>", 7)) == (" ", [])  # its special token
    text, made = calls.feed('{"name": "f", "arguments": {}}</tool_call>')
    assert text == "" and [c.name for c in made] == ["f"]


def test_a_call_of_a_tool_never_declared_goes_out_as_text():
    """The reviewer's: with no allowed list, any name was a call (a client's agent raises
    "tool not found"); the declared tools are the allowed ones."""
    said = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert _split([said]) == (said, [], "")


def test_a_reply_limited_to_one_call_makes_one_whatever_one_parse_returns():
    """The reviewer's: parallel_tool_calls false still made two calls where one parse
    returned a list (mistral's, a JSON array)."""
    mistral = ToolFormat("mistral", "[TOOL_CALLS]", "", lambda t, _: json.loads(t))
    calls = ReplyCalls(mistral, [F], limit=1)
    calls.feed('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "f"}]')
    assert [json.loads(c.arguments) for c in calls.flush()[1]] == [{"a": 1}]
    two = 'x<tool_call>{"name": "f", "arguments": {}}</tool_call>y' * 2
    calls = ReplyCalls(JSON_FORMAT, [F], limit=1)
    text, made = calls.feed(two)
    assert (text, len(made), calls.full, calls.flush()) == ("x", 1, True, ("", []))


def test_an_end_marker_inside_a_json_string_does_not_end_the_call():
    """The reviewer's: {"s": "a</tool_call>b"} was cut at the marker inside the string, and
    the call went out as text."""
    body = json.dumps({"name": "f", "arguments": {"s": 'a</tool_call>b\\"</tool_call>'}})
    text, calls, rest = _split(["<tool_call>", body[:20], body[20:], "</tool_call> after"])
    assert (text, rest) == (" after", "")
    assert json.loads(calls[0].arguments) == {"s": 'a</tool_call>b\\"</tool_call>'}


def test_a_long_call_split_over_many_pieces_is_found_whole():
    body = json.dumps({"name": "f", "arguments": {"s": "x" * 5000}})
    pieces = ["<tool_call>", *body, "</tool_", "call>"]  # one character a piece
    text, calls, rest = _split(pieces)
    assert (text, rest) == ("", "") and json.loads(calls[0].arguments) == {"s": "x" * 5000}


def test_text_that_only_looks_like_a_marker_start_is_sent_once_it_is_not_one():
    calls = ReplyCalls(JSON_FORMAT, [])
    assert calls.feed("x <tool") == ("x ", [])
    assert calls.feed("box") == ("<toolbox", [])


def test_a_chat_template_given_to_a_worker_replaces_the_model_s_own(
    start_worker, tiny_model_dirs, tmp_path
):
    """--chat-template: the tiny llama (whose own template has no tools) with Qwen 2.5's,
    from its tokenizer_config.json: its tool-call format is inferred, its turns render with
    it, and its fingerprint is another model's (the tokens differ)."""
    from transformers import AutoTokenizer

    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": QWEN25_CHAT_TEMPLATE}))
    model, tools = tiny_model_dirs["llama"], json.dumps([WEATHER])
    plain = start_worker(model, name="plain")
    templated = start_worker(model, "--chat-template", str(config), name="templated")
    infos = []
    for worker in (plain, templated):
        with grpc.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.InferenceWorkerStub(channel)
            infos.append(stub.GetWorkerInfo(pb.GetWorkerInfoRequest()))
            if worker is templated:
                stub.CreateAgent(pb.CreateAgentRequest(namespace=NS, agent_id="t", tools=tools))
                say = [pb.Message(role="user", content="Paris?")]
                _, _, _, usage = _turn(stub, "t", say, whole_conversation=True)
    assert (infos[0].tool_parser, infos[1].tool_parser) == ("", "json_tools")
    assert infos[0].fingerprint != infos[1].fingerprint
    ids = AutoTokenizer.from_pretrained(str(model)).apply_chat_template(
        [{"role": "user", "content": "Paris?"}],
        tools=[WEATHER],
        chat_template=QWEN25_CHAT_TEMPLATE,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert usage.prompt_tokens == len(ids)


def test_a_worker_names_no_tool_format_where_its_template_renders_tools_anew(
    start_worker, tiny_model_dirs
):
    """Mistral v0.3's template: mlx-lm infers its parser, but the tools come back before
    each user message, so the worker refuses tools, and says it has no tool format."""
    fixture = Path(__file__).parent / "fixtures" / "chat_templates" / "mistral.json"
    worker = start_worker(tiny_model_dirs["llama"], "--chat-template", str(fixture))
    with grpc.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.InferenceWorkerStub(channel)
        assert stub.GetWorkerInfo(pb.GetWorkerInfoRequest()).tool_parser == ""
        with pytest.raises(grpc.RpcError) as caught:
            _turn(stub, "m", [pb.Message(role="user", content="hi")])
    assert "no tool-call format" in caught.value.details()


def test_a_chat_template_file_that_holds_none_stops_the_worker_in_one_line(
    tiny_model_dirs, tmp_path
):
    empty = tmp_path / "tokenizer_config.json"
    empty.write_text("{}")
    for path, words in ((tmp_path / "missing.jinja", "No such file"), (empty, "KeyError")):
        done = subprocess.run(
            [sys.executable, "-m", "inference_worker", "--model", str(tiny_model_dirs["llama"]),
             "--store", "127.0.0.1:1", "--chat-template", str(path)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        line = done.stderr.strip().splitlines()[-1]  # after the log's JSON line
        assert line.startswith("agentkv-worker: error: --chat-template") and words in line
        assert "Traceback" not in done.stderr
