"""Structured output on a real worker, through the raw gRPC contract (worker.proto's
OutputFormat): a reply constrained to a JSON Schema, any JSON object, a regex or a Lark grammar
is one, token by token, where the same model left free writes something else; tools stay
callable beside a form, and a required tool call is one; a form the worker cannot compile is
refused before the turn runs, and changes nothing."""

from __future__ import annotations

import json
import re
from typing import Literal

import grpc
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict

from agentkv.worker.v1 import worker_pb2 as pb
from agentkv.worker.v1 import worker_pb2_grpc
from tests.model_kit import TOOL_CALL, WEATHER_TOOL, build_tool_model
from tests.test_anthropic import client_of
from tests.test_tools import ToolStack

NS = "forms"
ASK = [pb.Message(role="user", content="Is it raining in Paris?")]
# A schema whose every value is bounded, so a random model's reply ends within max_tokens.
VERDICT = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "sure": {"type": "boolean"},
        "level": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "sure", "level"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return build_tool_model(tmp_path_factory.mktemp("tool-model") / "qwen")


def _stub(start_worker, model_dir, name="worker"):
    worker = start_worker(model_dir, name=name)
    channel = grpc.insecure_channel(worker.address)
    return worker_pb2_grpc.InferenceWorkerStub(channel)


@pytest.fixture
def llama(start_worker, tiny_model_dirs):
    return _stub(start_worker, tiny_model_dirs["llama"], "llama")


@pytest.fixture
def qwen(start_worker, tool_model):
    return _stub(start_worker, tool_model, "qwen")


def _turn(stub, agent_id, messages=ASK, max_tokens=48, tools=(), **fields):
    """(text, tool calls, usage) of one greedy turn, the agent created on its first."""
    _create(stub, agent_id)
    fields.setdefault("whole_conversation", bool(tools))  # tools: the conversation's
    request = pb.TurnRequest(
        namespace=NS,
        agent_id=agent_id,
        messages=messages,
        sampling=pb.SamplingParams(max_tokens=max_tokens, **fields.pop("sampling", {})),
        tools=json.dumps(list(tools)) if tools else "",
        **fields,
    )
    text, calls, usage = [], [], None
    for response in stub.Turn(request, timeout=120):
        kind = response.WhichOneof("item")
        if kind == "tokens":
            text.append(response.tokens.text)
        elif kind == "tool_call":
            calls.append(response.tool_call)
        elif kind == "usage":
            usage = response.usage
    return "".join(text), calls, usage


def _create(stub, agent_id: str) -> None:
    try:
        stub.CreateAgent(pb.CreateAgentRequest(namespace=NS, agent_id=agent_id), timeout=60)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
            raise


def _schema(schema) -> pb.OutputFormat:
    return pb.OutputFormat(json_schema=json.dumps(schema))


def test_a_json_schema_reply_is_json_the_schema_accepts(llama):
    free, _, _ = _turn(llama, "free")
    text, _, usage = _turn(llama, "json", format=_schema(VERDICT))

    jsonschema.validate(json.loads(text), VERDICT)  # raises for a reply the schema refuses
    assert usage.finish_reason == "stop"  # ended where the JSON did, not cut
    assert text == json.dumps(json.loads(text), separators=(",", ":"))  # compact
    with pytest.raises(ValueError):
        json.loads(free)  # the same model, free, writes no JSON


def test_a_sampled_reply_keeps_to_its_form_too(llama):
    for seed in range(3):
        sampling = {"temperature": 1.5, "top_p": 0.9, "seed": seed}
        text, _, usage = _turn(llama, f"hot-{seed}", format=_schema(VERDICT), sampling=sampling)
        jsonschema.validate(json.loads(text), VERDICT)
        assert usage.finish_reason == "stop"


def test_a_regex_and_a_lark_grammar_shape_the_whole_reply(llama):
    text, _, usage = _turn(llama, "regex", format=pb.OutputFormat(regex=r"(yes|no), [0-9]{3}"))
    assert re.fullmatch(r"(yes|no), [0-9]{3}", text) and usage.finish_reason == "stop"

    lark = 'start: "The answer is " WORD "."\nWORD: "red" | "green" | "blue"\n'
    text, _, usage = _turn(llama, "lark", format=pb.OutputFormat(lark=lark))
    assert re.fullmatch(r"The answer is (red|green|blue)\.", text)
    assert usage.finish_reason == "stop"


def test_a_form_cut_by_max_tokens_ends_length(llama):
    text, _, usage = _turn(llama, "cut", max_tokens=3, format=pb.OutputFormat(json_object=True))
    assert usage.finish_reason == "length" and usage.generated_tokens == 3
    assert text.startswith("{")


def test_a_constrained_row_in_a_batch_changes_no_other_row(llama):
    """Constrained and free turns decoded together: each reply is what it is alone."""
    alone_free, _, _ = _turn(llama, "alone-free", max_tokens=24)
    alone_json, _, _ = _turn(llama, "alone-json", format=_schema(VERDICT))
    for i in range(2):
        for name in ("free", "json"):
            _create(llama, f"{name}-{i}")
    streams = [
        llama.Turn(
            pb.TurnRequest(
                namespace=NS,
                agent_id=f"{name}-{i}",
                messages=ASK,
                sampling=pb.SamplingParams(max_tokens=48 if form else 24),
                format=form,
            ),
            timeout=120,
        )
        for i in range(2)
        for name, form in (("free", None), ("json", _schema(VERDICT)))
    ]
    texts = ["".join(r.tokens.text for r in s if r.WhichOneof("item") == "tokens") for s in streams]
    assert texts == [alone_free, alone_json] * 2


def test_tools_stay_callable_beside_a_form_and_a_form_without_tools_holds(qwen):
    """The scripted model calls get_weather whenever it may: with tools and a form it still
    does; without tools, the form is what it writes."""
    text, calls, usage = _turn(qwen, "t1", tools=(WEATHER_TOOL,), format=_schema(VERDICT))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (TOOL_CALL["name"], TOOL_CALL["arguments"])
    ]
    assert usage.finish_reason == "tool_calls" and text == ""

    text, calls, usage = _turn(qwen, "t2", format=_schema(VERDICT))
    jsonschema.validate(json.loads(text), VERDICT)
    assert not calls and usage.finish_reason == "stop"


def test_a_required_tool_call_begins_the_reply(start_worker, tmp_path):
    """A random-weight model with Qwen 2.5's template writes no call of itself; required, its
    reply opens with one (what follows is the model's, so it may not parse)."""
    from tests.model_kit import QWEN_CHAT, random_model, save_model, tiny_tokenizer, tool_config

    tokenizer = tiny_tokenizer(chat=QWEN_CHAT)
    config = tool_config(tokenizer.get_vocab_size())
    model_dir = save_model(tmp_path / "rq", random_model(config, 3), config, tokenizer, QWEN_CHAT)
    stub = _stub(start_worker, model_dir, "random-qwen")
    free, calls, _ = _turn(stub, "free", max_tokens=12, tools=(WEATHER_TOOL,))
    assert not calls and not free.startswith("<tool_call>")

    text, calls, usage = _turn(
        stub, "required", max_tokens=12, tools=(WEATHER_TOOL,), tool_call_required=True
    )
    assert calls or text.startswith("<tool_call>")  # a call, parsed or not
    assert usage.generated_tokens >= 1


BAD_FORMS = [
    (pb.OutputFormat(json_schema="{not json"), "json_schema is not JSON"),
    (pb.OutputFormat(json_schema="[1, 2]"), "must be a JSON object"),
    (pb.OutputFormat(json_schema='{"type": "nonsense"}'), "nonsense"),
    (pb.OutputFormat(regex="(("), "unclosed group"),
    (pb.OutputFormat(lark="start: nowhere"), "unknown name"),
    (pb.OutputFormat(json_object=False), "json_object must be true"),
]


@pytest.mark.parametrize("form,reason", BAD_FORMS, ids=[r for _, r in BAD_FORMS])
def test_a_form_the_worker_cannot_compile_is_refused_and_changes_nothing(llama, form, reason):
    _, _, before = _turn(llama, "kept", max_tokens=2)
    with pytest.raises(grpc.RpcError) as caught:
        _turn(llama, "kept", format=form)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in caught.value.details()
    described = llama.DescribeAgent(pb.DescribeAgentRequest(namespace=NS, agent_id="kept"))
    assert described.agent.num_tokens == before.prompt_tokens + before.generated_tokens
    text, _, _ = _turn(llama, "after", format=_schema(VERDICT))  # the worker goes on
    jsonschema.validate(json.loads(text), VERDICT)


def test_a_required_call_needs_tools_and_a_model_with_a_tool_format(llama, qwen):
    with pytest.raises(grpc.RpcError) as caught:
        _turn(llama, "r1", tool_call_required=True)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "tool-call format" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        _turn(qwen, "r2", tool_call_required=True)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "needs tools" in caught.value.details()


# Through the gateway, with the official clients' own structured-output helpers: each turns
# a Pydantic model into a strict JSON Schema, sends it in its API's form, and parses the reply.


class Verdict(BaseModel):
    """Every value bounded (an enum: Anthropic's SDK drops a number's bounds from the schema
    it sends), so a random model's reply ends within max_tokens."""

    model_config = ConfigDict(extra="forbid")
    answer: Literal["yes", "no", "maybe"]
    sure: bool
    level: Literal[1, 2, 3]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, tiny_model_dirs):
    stack = ToolStack(tmp_path_factory.mktemp("forms"), tiny_model_dirs["llama"], "tiny")
    yield stack
    stack.stop()


def test_openai_s_parse_helpers_get_replies_of_their_schema(gateway):
    client, ask = gateway.client(), [{"role": "user", "content": "Is it raining in Paris?"}]
    options = {"model": "tiny", "temperature": 0, "max_tokens": 48}
    free = client.chat.completions.create(messages=ask, **options).choices[0]
    with pytest.raises(ValueError):
        Verdict.model_validate_json(free.message.content)  # the model, free, writes no Verdict

    chat = client.chat.completions.parse(messages=ask, response_format=Verdict, **options)
    assert isinstance(chat.choices[0].message.parsed, Verdict)
    assert chat.choices[0].finish_reason == "stop"
    with client.chat.completions.stream(messages=ask, response_format=Verdict, **options) as stream:
        streamed = stream.get_final_completion()
    assert streamed.choices[0].message.parsed == chat.choices[0].message.parsed

    response = client.responses.parse(
        model="tiny", input=ask, text_format=Verdict, temperature=0, max_output_tokens=48
    )
    assert isinstance(response.output_parsed, Verdict) and response.status == "completed"
    assert response.text.format.type == "json_schema"  # the request's, repeated


def test_anthropic_s_parse_helper_gets_a_reply_of_its_schema(gateway):
    client = client_of(gateway.gateway.address)
    message = client.messages.parse(
        model="tiny",
        max_tokens=48,  # sampled at Anthropic's default temperature (the SDK sends none)
        messages=[{"role": "user", "content": "Is it raining in Paris?"}],
        output_format=Verdict,
    )
    assert isinstance(message.parsed_output, Verdict) and message.stop_reason == "end_turn"


def test_a_bad_schema_is_a_400_naming_why(gateway):
    client = gateway.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "nonsense"}},
            },
        )
    assert "nonsense" in caught.value.message
