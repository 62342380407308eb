"""Structured output on a real worker, through the raw gRPC contract (worker.proto's
OutputFormat): a reply constrained to a JSON Schema, any JSON object, a regex or a Lark grammar
is one, token by token, where the same model left free writes something else; tools stay
callable beside a form, and a required tool call is one; a form the worker cannot compile is
refused before the turn runs, and changes nothing."""

from __future__ import annotations

import json
import re
import urllib.request
from time import sleep, time
from typing import Literal

import grpc
import jsonschema
import mlx.core as mx
import openai
import pytest
from pydantic import BaseModel, ConfigDict

from agentkv.errors import InvalidArgument
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


def _described(stub, agent_id: str) -> tuple[int, int]:
    """The agent's context length and generation, as the worker holds it once its last
    turn is in the store (written after the reply, it changes the generation)."""
    request, deadline = pb.DescribeAgentRequest(namespace=NS, agent_id=agent_id), time() + 60
    while (agent := stub.DescribeAgent(request).agent).persisted_tokens < agent.num_tokens - 1:
        assert time() < deadline, agent
        sleep(0.05)
    return agent.num_tokens, agent.generation


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


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_started_comes_once_before_the_first_token(llama, max_tokens):
    """worker.proto: `started` comes once, just before the first generated token. A turn
    that ended at its first token with text held back (for a stop string that might have
    begun) sent it twice, the second time after that token."""
    _create(llama, "once")
    request = pb.TurnRequest(
        namespace=NS,
        agent_id="once",
        messages=ASK,
        sampling=pb.SamplingParams(max_tokens=max_tokens, stop=["zzzzzzzz"]),
    )
    kinds = [r.WhichOneof("item") for r in llama.Turn(request, timeout=120)]
    assert kinds.count("started") == 1 and kinds.index("started") < kinds.index("tokens")
    assert kinds[-1] == "usage" and kinds.count("tokens") >= 1, kinds


def test_a_form_cut_by_max_tokens_ends_length(llama):
    text, _, usage = _turn(llama, "cut", max_tokens=3, format=pb.OutputFormat(json_object=True))
    assert usage.finish_reason == "length" and usage.generated_tokens == 3
    assert text.startswith("{")


# Too costly for the worker's per-step limits once past its first token (a row of 5,001
# items): it compiles, and fails at its first token taken.
COSTLY = pb.OutputFormat(lark="start: " + " | ".join(f'"w{i}"' for i in range(5000)))


def test_a_constrained_row_in_a_batch_changes_no_other_row(start_worker, tiny_model_dirs):
    """Constrained, free and failing turns decoded together: each reply is what it is alone,
    and the form too costly for the limits fails its own turn only, leaving its agent as it
    was."""
    proc = start_worker(tiny_model_dirs["llama"], "--metrics-listen", "127.0.0.1:0", name="b")
    llama = worker_pb2_grpc.InferenceWorkerStub(grpc.insecure_channel(proc.address))
    alone_free, _, _ = _turn(llama, "alone-free", max_tokens=24)
    alone_json, _, _ = _turn(llama, "alone-json", format=_schema(VERDICT))
    forms = (("free", None), ("json", _schema(VERDICT)), ("costly", COSTLY))
    for i in range(2):
        for name, _ in forms:
            _create(llama, f"{name}-{i}")
    created = _described(llama, "costly-0")
    streams = [
        llama.Turn(
            pb.TurnRequest(
                namespace=NS,
                agent_id=f"{name}-{i}",
                messages=ASK,
                sampling=pb.SamplingParams(max_tokens=24 if form is None else 48),
                format=form,
            ),
            timeout=120,
        )
        for i in range(2)
        for name, form in forms
    ]
    texts = []
    for stream in streams:
        try:
            texts.append("".join(r.tokens.text for r in stream if r.WhichOneof("item") == "tokens"))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "Current row has 5001 items" in exc.details() and len(exc.details()) < 600
            texts.append(None)
    assert texts == [alone_free, alone_json, None] * 2
    for i in range(2):  # the failed turns left nothing
        assert _described(llama, f"costly-{i}") == created
    serving = proc._find_event("serving", 0)
    text = urllib.request.urlopen(f"http://{serving['metrics']}/metrics", timeout=10).read()
    counts = {
        line.split()[0]: float(line.split()[-1])
        for line in text.decode().splitlines()
        if line.startswith(
            ('agentkv_worker_batch_size_bucket{le="1.0"}', "agentkv_worker_batch_size_count")
        )
    }
    single, total = (
        counts['agentkv_worker_batch_size_bucket{le="1.0"}'],
        counts["agentkv_worker_batch_size_count"],
    )
    assert single < total  # some steps decoded several rows together


def test_a_form_complete_at_max_tokens_ends_stop_and_a_stop_string_is_refused(llama):
    text, _, usage = _turn(llama, "exact", max_tokens=1, format=pb.OutputFormat(regex="x"))
    assert (text, usage.finish_reason) == ("x", "stop")  # complete, not cut
    with pytest.raises(grpc.RpcError) as caught:
        _turn(llama, "stops", format=_schema(VERDICT), sampling={"stop": ['"']})
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stop strings would cut" in caught.value.details()


def test_a_form_without_tools_holds_where_the_model_would_call(qwen):
    """The scripted model calls get_weather whenever it may; without tools, and a form, it
    writes the form."""
    _, calls, _ = _turn(qwen, "t1", tools=(WEATHER_TOOL,))
    assert [c.name for c in calls] == [TOOL_CALL["name"]]
    text, calls, usage = _turn(qwen, "t2", format=_schema(VERDICT))
    jsonschema.validate(json.loads(text), VERDICT)
    assert not calls and usage.finish_reason == "stop"


@pytest.fixture(scope="module")
def qwen_grammars(tool_model):
    """(Grammars, tokenizer) of Qwen 2.5's template and json_tools calls."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from inference_worker.chat import ChatFormat
    from inference_worker.grammar import Grammars

    tokenizer = load_tokenizer(tool_model)
    chat = ChatFormat(tokenizer)
    return Grammars(tokenizer, chat.eos_ids, chat.tool_format), tokenizer


def _takes(matcher, tokenizer, text: str) -> bool:
    """Whether the matcher takes all of `text` and may end there."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def _call(body: dict) -> str:
    return f"<tool_call>\n{json.dumps(body)}\n</tool_call>"


def test_with_tools_a_form_s_reply_may_be_a_call_its_tool_s_schema_accepts(qwen_grammars):
    """The grammars themselves, on Qwen 2.5's template and json_tools calls: with tools, the
    form or a call of one of them as the template writes it (its markers special tokens, its
    JSON spaced as tojson writes it); without them, only the form."""
    from inference_worker.grammar import Ask, OutputForm
    from inference_worker.tools import canonical_tools

    grammars, tokenizer = qwen_grammars
    tools = canonical_tools(json.dumps(TOOLS))
    form = OutputForm("json_schema", json.dumps(VERDICT))
    lyon = {"name": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius"}}
    verdict = '{"answer":"no","sure":true,"level":3}'

    def taken(with_tools: bool, text: str) -> bool:
        known = tools if with_tools else ""
        return _takes(grammars.forms(Ask(form), known).matcher(known), tokenizer, text)

    call = _call
    assert taken(True, verdict) and taken(False, verdict)
    assert taken(True, call(lyon)) and not taken(False, call(lyon))
    assert not taken(True, call({**lyon, "name": "get_time"}))  # no such tool
    assert not taken(True, call({**lyon, "arguments": {"unit": "kelvin"}}))  # not its schema
    assert not taken(True, "Sunny.")  # neither
    get = {"type": "function", "function": {"name": "get"}}  # within the name, not it
    tools = canonical_tools(json.dumps([*TOOLS, get]))
    for body, expected in (({"name": "get", "arguments": {}}, False), (lyon, True)):
        matcher = grammars.forms(Ask(name="get_weather"), tools).matcher(tools)
        ids = tokenizer.encode(call(body), add_special_tokens=False)
        assert (matcher.try_consume_tokens(ids) == len(ids)) is expected


PYDANTIC = {  # a nested model, as Pydantic writes it: its parts in $defs, by reference
    "type": "object",
    "properties": {"loc": {"$ref": "#/$defs/Location"}},
    "required": ["loc"],
    "additionalProperties": False,
    "$defs": {
        "Location": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "near": {"$ref": "#/$defs/Location"}},
            "required": ["city"],
            "additionalProperties": False,
        }
    },
}
TREE = {"type": "object", "properties": {"child": {"$ref": "#"}}, "additionalProperties": False}


def test_a_call_s_schema_resolves_its_own_references(qwen_grammars):
    """A tool's parameters that refer to their own parts ("#/$defs/...", "#") hold its
    call, alone or among others (a red team's Pydantic model was refused when named, and
    not enforced when required); a required call whose tools llguidance cannot hold is
    still a call of one of them."""
    from inference_worker.grammar import Ask
    from inference_worker.tools import canonical_tools

    grammars, tokenizer = qwen_grammars

    def function(name: str, parameters: dict) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": parameters}}

    tools = canonical_tools(json.dumps([function("lookup", PYDANTIC), function("tree", TREE)]))
    paris = {"loc": {"city": "Paris", "near": {"city": "Lyon"}}}
    for ask in (Ask(name="lookup"), Ask(required=True)):

        def taken(body: dict, ask=ask) -> bool:
            return _takes(grammars.forms(ask, tools).matcher(tools), tokenizer, _call(body))

        assert taken({"name": "lookup", "arguments": paris})
        assert not taken({"name": "lookup", "arguments": {"loc": {"near": {"city": "Lyon"}}}})
        assert not taken({"name": "get_weather", "arguments": {"city": "Paris"}})
    tree = {"name": "tree", "arguments": {"child": {"child": {}}}}
    required = grammars.forms(Ask(required=True), tools).matcher(tools)
    assert _takes(required, tokenizer, _call(tree))
    odd = canonical_tools(json.dumps([function("odd", {"type": "object", "properties": {
        "a": {"type": "nonsense"}}})]))  # fmt: skip
    required = grammars.forms(Ask(required=True), odd).matcher(odd)
    assert _takes(required, tokenizer, _call({"name": "odd", "arguments": {"a": 1}}))
    required = grammars.forms(Ask(required=True), odd).matcher(odd)
    assert not _takes(required, tokenizer, _call({"name": "get_weather", "arguments": {}}))


SET_MODE = {  # a tool whose every argument is bounded: a random model's call ends
    "type": "function",
    "function": {
        "name": "set_mode",
        "parameters": {
            "type": "object",
            "properties": {"mode": {"enum": ["on", "off", "auto"]}, "fast": {"type": "boolean"}},
            "required": ["mode", "fast"],
            "additionalProperties": False,
        },
    },
}
TOOLS = (WEATHER_TOOL, SET_MODE)


@pytest.fixture(scope="module")
def random_qwen(tmp_path_factory):
    """A random-weight model with Qwen 2.5's template (tools, json_tools calls): it writes no
    call of itself."""
    from tests.model_kit import QWEN_CHAT, random_model, save_model, tiny_tokenizer, tool_config

    tokenizer = tiny_tokenizer(chat=QWEN_CHAT)
    config = tool_config(tokenizer.get_vocab_size())
    path = tmp_path_factory.mktemp("random-qwen") / "model"
    return save_model(path, random_model(config, 3), config, tokenizer, QWEN_CHAT)


def test_a_required_or_named_call_is_one_its_tool_s_schema_accepts(start_worker, random_qwen):
    stub = _stub(start_worker, random_qwen, "random-qwen")
    free, calls, _ = _turn(stub, "free", max_tokens=40, tools=TOOLS)
    assert not calls and "<tool_call>" not in free

    schema = SET_MODE["function"]["parameters"]
    required = {"tool_call_required": True, "max_tool_calls": 1}
    allowed = {**required, "tool_call_allowed": ["set_mode"]}  # of TOOLS, only set_mode
    for name, fields in (("named", {"tool_call_name": "set_mode"}),  # the whole reply
                         ("required", required), ("allowed", allowed)):  # fmt: skip
        tools = (SET_MODE,) if name == "required" else TOOLS
        text, calls, usage = _turn(stub, name, max_tokens=120, tools=tools, **fields)
        assert [c.name for c in calls] == ["set_mode"], text
        jsonschema.validate(json.loads(calls[0].arguments), schema)
        assert usage.finish_reason == "tool_calls"


def test_a_named_call_needs_the_tool_and_a_json_call_format(start_worker, random_qwen, llama):
    stub = _stub(start_worker, random_qwen, "random-qwen")
    with pytest.raises(grpc.RpcError) as caught:
        _turn(stub, "unknown", tools=TOOLS, tool_call_name="get_time")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'get_time' is not among the conversation's tools (get_weather, set_mode)" in (
        caught.value.details()
    )
    with pytest.raises(grpc.RpcError) as caught:
        _turn(llama, "plain", tool_call_name="set_mode")
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


BAD_FORMS = [
    (pb.OutputFormat(regex="a" * 200_000 + "(("), "invalid regex"),  # its reason, cut short
    (pb.OutputFormat(json_schema="{not json"), "json_schema is not JSON"),
    (pb.OutputFormat(json_schema="[1, 2]"), "must be a JSON object"),
    (pb.OutputFormat(json_schema='{"type": "nonsense"}'), "nonsense"),
    (pb.OutputFormat(regex="(("), "unclosed group"),
    (pb.OutputFormat(lark="start: nowhere"), "unknown name"),
    (pb.OutputFormat(json_object=False), "json_object must be true"),
    # under the JSON parser's limit, past what compiling it takes: it was INTERNAL
    (pb.OutputFormat(json_schema='{"a": ' + "[" * 979 + "]" * 979 + "}"), "nested 980 JSON"),
]


@pytest.mark.parametrize("form,reason", BAD_FORMS, ids=[r for _, r in BAD_FORMS])
def test_a_form_the_worker_cannot_compile_is_refused_and_changes_nothing(llama, form, reason):
    _, _, before = _turn(llama, "kept", max_tokens=2)
    with pytest.raises(grpc.RpcError) as caught:
        _turn(llama, "kept", format=form)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in caught.value.details() and len(caught.value.details()) < 600
    described = llama.DescribeAgent(pb.DescribeAgentRequest(namespace=NS, agent_id="kept"))
    assert described.agent.num_tokens == before.prompt_tokens + before.generated_tokens
    text, _, _ = _turn(llama, "after", format=_schema(VERDICT))  # the worker goes on
    jsonschema.validate(json.loads(text), VERDICT)


def test_a_forbidden_call_is_not_made_where_the_model_would_make_one(qwen, llama):
    """The scripted model calls get_weather whenever it may: forbidden, it writes no call, or
    its form; a call both required and forbidden is refused; without tools there is nothing
    to forbid, on a model without a tool format too (not refused, the reply unchanged)."""
    text, calls, usage = _turn(qwen, "f1", tools=(WEATHER_TOOL,), tool_call_forbidden=True)
    assert not calls and "<tool_call>" not in text and usage.finish_reason != "tool_calls"
    text, calls, usage = _turn(
        qwen, "f2", tools=(WEATHER_TOOL,), tool_call_forbidden=True, format=_schema(VERDICT)
    )
    jsonschema.validate(json.loads(text), VERDICT)
    assert not calls and usage.finish_reason == "stop"
    with pytest.raises(grpc.RpcError) as caught:
        _turn(qwen, "f3", tools=(WEATHER_TOOL,), tool_call_forbidden=True, tool_call_required=True)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "both required and forbidden" in caught.value.details()
    free, _, _ = _turn(llama, "f4", max_tokens=8)
    assert _turn(llama, "f5", max_tokens=8, tool_call_forbidden=True)[0] == free


def test_a_call_of_a_tool_not_allowed_is_not_made_where_the_model_would_make_one(qwen, llama):
    """The scripted model calls get_weather whenever it may: with only set_mode allowed, the
    conversation keeping both tools, it makes no call of get_weather (a call it makes is of
    set_mode). A tool the conversation lacks is refused, the agent unchanged; a model
    without a tool format cannot restrict its calls."""
    _, calls, _ = _turn(qwen, "a1", tools=TOOLS)
    assert [c.name for c in calls] == ["get_weather"]
    text, calls, usage = _turn(qwen, "a2", tools=TOOLS, tool_call_allowed=["set_mode"])
    assert all(c.name == "set_mode" for c in calls) and "get_weather" not in text, text
    assert usage.finish_reason in ("stop", "length", "tool_calls")
    before = _described(qwen, "a2")
    with pytest.raises(grpc.RpcError) as caught:
        _turn(qwen, "a2", tools=TOOLS, tool_call_allowed=["set_mode", "get_time"])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tool_call_allowed 'get_time' is not among the conversation's tools" in (
        caught.value.details()
    )
    assert _described(qwen, "a2") == before
    with pytest.raises(grpc.RpcError) as caught:
        _turn(llama, "a3", tool_call_allowed=["set_mode"])
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "tool-call format" in caught.value.details()
    # A stop string cuts no required form here; every tool allowed restricts nothing.
    _, calls, _ = _turn(qwen, "a4", tools=TOOLS, tool_call_allowed=["set_mode", "get_weather"],
                        sampling={"stop": ["\n\n"]})  # fmt: skip
    assert [c.name for c in calls] == ["get_weather"]


def test_a_strict_tool_s_call_is_one_its_schema_accepts(qwen):
    """The scripted model calls get_weather with unit "celsius" whenever it may: a tool
    that takes only "kelvin" gets that call as written unless it is strict; strict, the
    call the reply makes is one the schema accepts."""
    kelvin = {"city": {"enum": ["Paris"]}, "unit": {"enum": ["kelvin"]}}  # bounded: it ends
    loose = {**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "parameters": {
        "type": "object", "properties": kelvin, "required": ["city", "unit"],
        "additionalProperties": False}}}  # fmt: skip
    _, calls, _ = _turn(qwen, "loose", tools=(loose,))
    assert [json.loads(c.arguments)["unit"] for c in calls] == ["celsius"]
    text, calls, _ = _turn(qwen, "strict", tools=(strict(loose),), max_tokens=64)
    assert [c.name for c in calls] == ["get_weather"], text
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris", "unit": "kelvin"}]


def test_an_agent_s_own_strict_tools_hold_its_calls(qwen, start_worker, tool_model):
    """A turn that sends no tools has its agent's: a strict one among them holds the
    reply's calls to its schema as a request's would (before, only tools sent with the turn
    were held), on the worker that made it and on one that restores it."""
    kelvin = {"city": {"enum": ["Paris"]}, "unit": {"enum": ["kelvin"]}}
    loose = {**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "parameters": {
        "type": "object", "properties": kelvin, "required": ["city", "unit"],
        "additionalProperties": False}}}  # fmt: skip
    units = {}
    for agent, tool in (("own-loose", loose), ("own-strict", strict(loose))):
        create = pb.CreateAgentRequest(namespace=NS, agent_id=agent, tools=json.dumps([tool]))
        qwen.CreateAgent(create, timeout=60)
        text, calls, _ = _turn(qwen, agent, max_tokens=64)
        assert [c.name for c in calls] == ["get_weather"], text
        units[agent] = json.loads(calls[0].arguments)["unit"]
    moved = pb.CreateAgentRequest(namespace=NS, agent_id="moved", tools=json.dumps([strict(loose)]))
    qwen.CreateAgent(moved, timeout=60)
    other = _stub(start_worker, tool_model, "other")  # restores it from the store
    text, calls, usage = _turn(other, "moved", max_tokens=64)
    assert usage.cache_state == "warm" and [c.name for c in calls] == ["get_weather"], text
    units["moved"] = json.loads(calls[0].arguments)["unit"]
    assert units == {"own-loose": "celsius", "own-strict": "kelvin", "moved": "kelvin"}


@pytest.mark.parametrize("where", ["hot", "restored"])
def test_a_form_on_an_agent_s_own_tools_is_compiled_off_the_mlx_thread(
    store_process, tool_model, tmp_path, where
):
    """A turn that sends no tools and asks for a form has it compiled with its agent's
    tools, known only once the agent is found. That was on the MLX thread, at the turn's
    start: every turn in flight waited (1.8 s for a 520 KB schema, the reviewer measured),
    again for every new schema. It is compiled on the turn's RPC thread now."""
    from agentkv.launch import ServiceProcess
    from tests.faulty_worker import COMPILED_LOG

    compiled = tmp_path / "compiled"
    args = ["--model", str(tool_model), "--store", store_process.address]
    args += ["--listen", "127.0.0.1:0", "--block-tokens", "64"]
    log = tmp_path / "faulty.log"
    worker = ServiceProcess("tests.faulty_worker", args, log, env={COMPILED_LOG: str(compiled)})
    worker.start()
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.InferenceWorkerStub(channel)
            tools = json.dumps([strict(WEATHER_TOOL)])
            made = pb.CreateAgentRequest(namespace=NS, agent_id="own", tools=tools)
            stub.CreateAgent(made, timeout=60)
            if where == "restored":
                stub.EvictAgent(pb.EvictAgentRequest(namespace=NS, agent_id="own"), timeout=60)
            compiled.write_text("")  # what the create compiled
            for n in range(2):  # a new schema each time: nothing kept to find
                verdict = {**VERDICT, "properties": {**VERDICT["properties"], f"n{n}": {}}}
                text, calls, usage = _turn(stub, "own", format=_schema(verdict))
                assert usage.generated_tokens and (calls or json.loads(text)), text
        threads = compiled.read_text().split()
        assert threads and "agentkv-mlx" not in threads, threads
    finally:
        worker.stop()


def test_the_agent_s_own_tools_are_allowed_at_the_turn_s_start(qwen):
    """A turn that sends no tools has its agent's: the tools allowed are checked against
    them once the turn starts, and a refusal there changes nothing."""
    create = pb.CreateAgentRequest(namespace=NS, agent_id="own", tools=json.dumps(TOOLS))
    qwen.CreateAgent(create, timeout=60)
    before = _described(qwen, "own")
    with pytest.raises(grpc.RpcError) as caught:
        _turn(qwen, "own", tool_call_allowed=["get_time"])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'get_time' is not among the conversation's tools (get_weather, set_mode)" in (
        caught.value.details()
    )
    assert _described(qwen, "own") == before
    text, calls, _ = _turn(qwen, "own", tool_call_allowed=["set_mode"])
    assert all(c.name == "set_mode" for c in calls) and "get_weather" not in text, text


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


def test_a_call_keeps_the_request_s_key_order_and_odd_tool_schemas_do_not_block_it(
    qwen_grammars,
):
    """A call's arguments in the order the request's schema gives them (canonical tools sort
    keys); a tool schema llguidance cannot hold leaves a required call its opening only, and
    refuses a call of that very tool with its name."""
    from inference_worker.grammar import Ask
    from inference_worker.tools import canonical_tools

    grammars, tokenizer = qwen_grammars
    source = json.dumps([SET_MODE])  # "mode" before "fast", as written
    call = _call({"name": "set_mode", "arguments": {"mode": "on", "fast": True}})
    required = Ask(required=True)
    as_written = grammars.forms(required, canonical_tools(source), source)
    assert _takes(as_written.matcher(canonical_tools(source)), tokenizer, call)
    sorted_only = grammars.forms(required, canonical_tools(source))
    assert not _takes(sorted_only.matcher(canonical_tools(source)), tokenizer, call)

    properties = {
        "when": {"type": "string", "format": "weird"},  # unknown to llguidance: unchecked
        "code": {"type": "string", "pattern": "(?=a)b"},  # a lookahead: no grammar holds it
    }
    parameters = {"type": "object", "properties": properties}
    odd = {"type": "function", "function": {"name": "odd", "parameters": parameters}}
    tools = canonical_tools(json.dumps([odd]))
    # a required call of tools llguidance cannot hold: one of them, its arguments any object
    for body, taken in (({"name": "odd", "arguments": {"code": "c"}}, True),
                        ({"name": "anything", "arguments": 1}, False)):  # fmt: skip
        matcher = grammars.forms(required, tools).matcher(tools)
        assert _takes(matcher, tokenizer, _call(body)) is taken
    with pytest.raises(InvalidArgument, match="tool odd's parameters"):
        grammars.forms(Ask(name="odd"), tools)
    del properties["code"]  # what is left: a format llguidance does not know, left unchecked
    tools = canonical_tools(json.dumps([odd]))
    named = grammars.forms(Ask(name="odd"), tools).matcher(tools)
    assert _takes(named, tokenizer, _call({"name": "odd", "arguments": {"when": "today"}}))


def test_a_marker_with_special_tokens_inside_and_a_matcher_used_once(qwen_grammars):
    from inference_worker.grammar import Ask, Grammars
    from inference_worker.masks import masked
    from inference_worker.tools import ToolFormat, canonical_tools

    _, tokenizer = qwen_grammars
    fmt = ToolFormat("custom", "<|im_start|>call", "", lambda text, tools: json.loads(text))
    grammars = Grammars(tokenizer, {2}, fmt)
    tools = canonical_tools(json.dumps([SET_MODE]))
    forms = grammars.forms(Ask(required=True), tools)
    first = forms.constraint(tools)
    assert _takes(first.matcher, tokenizer, '<|im_start|>call{"x": 1}')
    second = forms.constraint(tools)  # compiled anew: the first is where its reply is
    assert second.matcher is not first.matcher
    logprobs = mx.zeros((2, grammars.vocab))
    _, failed = masked(logprobs, [second, second])  # one matcher in two rows: no batch error
    assert not failed


@pytest.mark.parametrize("model_class", ["OpenAIChatCompletionsModel", "OpenAIResponsesModel"])
def test_an_agents_sdk_agent_with_an_output_type_gets_one(gateway, model_class):
    """OpenAI's Agents SDK, unchanged: an agent's output_type becomes a strict JSON Schema in
    the request (response_format, or text.format), and its final output is parsed into it."""
    import asyncio

    import agents

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"http://{gateway.gateway.address}/v1", api_key="-")
    agent = agents.Agent(
        name=f"judge-{model_class}",
        instructions="You judge questions.",
        output_type=Verdict,
        model=getattr(agents, model_class)(model="tiny", openai_client=client),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=48),
    )
    result = asyncio.run(agents.Runner.run(agent, "Is it raining in Paris?"))
    assert isinstance(result.final_output, Verdict)


def test_a_call_is_forbidden_only_where_a_special_token_opens_it(qwen_grammars):
    from agentkv.errors import FailedPrecondition
    from inference_worker.grammar import Ask, Grammars
    from inference_worker.tools import ToolFormat, canonical_tools

    _, tokenizer = qwen_grammars
    fmt = ToolFormat("custom", "CALL:", "", lambda text, tools: json.loads(text))
    tools = canonical_tools(json.dumps(TOOLS))
    for known in (tools, None):  # None: the agent's own tools, refused at submit all the same
        for ask in (Ask(forbidden=True), Ask(allowed=("set_mode",))):
            with pytest.raises(FailedPrecondition, match="open with 'CALL:', which text can"):
                Grammars(tokenizer, {2}, fmt).forms(ask, known)


def test_calls_allowed_of_some_tools_are_every_call_of_theirs(qwen_grammars):
    """tool_choice allowed_tools, in the grammars on Qwen 2.5's calls: every call of the
    reply is one of an allowed tool that its schema accepts; text may come before, between
    or instead of them, unless a call is required; with a form, the form or such calls. All
    the tools allowed restrict nothing; a tool the conversation lacks is refused."""
    from inference_worker.grammar import Ask, OutputForm
    from inference_worker.tools import canonical_tools

    grammars, tokenizer = qwen_grammars
    tools = canonical_tools(json.dumps(TOOLS))
    lyon = _call({"name": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius"}})
    on = _call({"name": "set_mode", "arguments": {"fast": True, "mode": "on"}})  # canonical
    bad = _call({"name": "set_mode", "arguments": {"fast": True, "mode": "up"}})

    def taken(ask: Ask, text: str) -> bool:
        return _takes(grammars.forms(ask, tools).matcher(tools), tokenizer, text)

    auto = Ask(allowed=("set_mode",))
    assert taken(auto, "Sunny.") and taken(auto, on) and taken(auto, f"I will.\n{on}\n{on}")
    assert not taken(auto, lyon) and not taken(auto, f"Let me look.\n{lyon}")
    assert not taken(auto, f"{on}\n{lyon}") and not taken(auto, bad)  # every call, its schema
    spelled = [i for c in "<tool_call>" for i in tokenizer.encode(c, add_special_tokens=False)]
    body = tokenizer.encode(lyon.removeprefix("<tool_call>"), add_special_tokens=False)
    matcher = grammars.forms(auto, tools).matcher(tools)
    assert matcher.try_consume_tokens(spelled + body) == len(spelled) - 1  # refused at ">"
    assert taken(auto, "Hi <tool_response> there") and taken(auto, f"<|im_start|>\n{on}")
    required = Ask(required=True, allowed=("set_mode",))
    assert taken(required, on) and taken(required, f"{on}\nDone.")
    assert not taken(required, "Sunny.") and not taken(required, lyon)
    form = Ask(OutputForm("json_schema", json.dumps(VERDICT)), allowed=("set_mode",))
    assert taken(form, '{"answer":"no","sure":true,"level":3}') and taken(form, on)
    assert not taken(form, lyon) and not taken(form, "Sunny.")
    assert taken(Ask(allowed=("get_weather",)), lyon)
    both = Ask(allowed=("set_mode", "get_weather"))
    assert grammars.forms(both, tools) is None  # all of them: free
    with pytest.raises(InvalidArgument, match="'get_time' is not among the conversation's"):
        grammars.forms(Ask(allowed=("get_time",)), tools)
    with pytest.raises(InvalidArgument, match="not with tool_call_name or tool_call_forbidden"):
        grammars.forms(Ask(name="set_mode", allowed=("set_mode",)), tools)


def strict(tool: dict, **parameters) -> dict:
    """The tool marked strict (OpenAI's "strict": true), its parameters' fields replaced."""
    function = tool["function"]
    merged = {**function["parameters"], **parameters}
    return {**tool, "function": {**function, "parameters": merged, "strict": True}}


def test_strict_tools_hold_every_call_to_a_tool_s_schema(qwen_grammars):
    """A strict tool among the conversation's (OpenAI's "strict": true): every call of the
    reply is one of its tools, with arguments its schema accepts; text may come before,
    between or instead of them. No strict tool, or a model whose calls cannot be held so:
    strict is taken, not enforced, and the reply is free."""
    from inference_worker.grammar import Ask, Grammars
    from inference_worker.tools import ToolFormat, canonical_tools

    grammars, tokenizer = qwen_grammars
    tools = canonical_tools(json.dumps([WEATHER_TOOL, strict(SET_MODE)]))
    forms = grammars.forms(Ask(), tools)
    assert forms is not None and forms.ask.strict and not forms.ask.holds_form
    lyon = _call({"name": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius"}})
    on = _call({"name": "set_mode", "arguments": {"fast": True, "mode": "on"}})  # canonical
    bad = _call({"name": "set_mode", "arguments": {"fast": True, "mode": "up"}})
    other = _call({"name": "get_time", "arguments": {}})
    for text, expected in ((lyon, True), (on, True), (f"I will.\n{on}\n{lyon}", True),
                           ("Sunny.", True), (bad, False), (other, False),
                           (f"{on}\n{bad}", False)):  # fmt: skip
        assert _takes(grammars.forms(Ask(), tools).matcher(tools), tokenizer, text) is expected
    assert grammars.forms(Ask(), canonical_tools(json.dumps(TOOLS))) is None  # none strict
    for fmt in (
        ToolFormat("custom", "CALL:", "", lambda text, tools: json.loads(text)),
        ToolFormat("json_tools", "CALL:", "END", lambda text, tools: json.loads(text)),
    ):
        assert Grammars(tokenizer, {2}, fmt).forms(Ask(), tools) is None  # cannot be held
    assert grammars.forms(Ask(), None) is None  # an agent's own tools: not known at submit
    lookahead = strict(WEATHER_TOOL, properties={"city": {"type": "string", "pattern": "(?<=a)b"}})
    assert grammars.forms(Ask(), canonical_tools(json.dumps([lookahead]))) is None  # nor so


def test_own_strict_tools_llguidance_cannot_hold_are_compiled_and_logged_once(
    qwen_grammars, monkeypatch, caplog
):
    """An agent's own tools are settled at each turn's start (on the MLX thread): a strict
    grammar llguidance cannot hold is compiled once and logged once, the reply free, not
    tried again every turn (a failed compile is kept as a compiled one is)."""
    import llguidance

    from inference_worker.tools import canonical_tools

    grammars, _ = qwen_grammars
    built, real = [], llguidance.LLMatcher
    monkeypatch.setattr(llguidance, "LLMatcher", lambda *a, **k: built.append(1) or real(*a, **k))
    odd = strict(WEATHER_TOOL, properties={"city": {"type": "string", "pattern": "(?<=x)y"}})
    tools = canonical_tools(json.dumps([odd]))
    with caplog.at_level("INFO", logger="agentkv.worker"):
        for _ in range(3):
            assert grammars.settled(None, tools) is None  # free, as before strict
    assert len(built) == 1
    assert len([r for r in caplog.records if "not enforced" in r.getMessage()]) == 1
    held = grammars.settled(None, canonical_tools(json.dumps([strict(SET_MODE)])))
    assert held is not None and held.ask.strict
    assert grammars.settled(None, canonical_tools(json.dumps(TOOLS))) is None  # none strict


def test_strict_tools_hold_the_calls_beside_a_required_call_or_a_form(qwen_grammars):
    """Strict tools hold every call where a call is required too (not only the first), and
    where the reply may be a form instead; the arguments in the request's own key order."""
    from inference_worker.grammar import Ask, OutputForm
    from inference_worker.tools import canonical_tools

    grammars, tokenizer = qwen_grammars
    source = json.dumps([WEATHER_TOOL, strict(SET_MODE)])  # set_mode's: mode, then fast
    tools = canonical_tools(source)
    on = _call({"name": "set_mode", "arguments": {"mode": "on", "fast": True}})
    other = _call({"name": "get_time", "arguments": {}})
    verdict = '{"answer":"no","sure":true,"level":3}'

    def taken(ask: Ask, text: str) -> bool:
        forms = grammars.forms(ask, tools, source)
        return _takes(forms.matcher(tools), tokenizer, text)

    required = Ask(required=True)
    assert taken(required, f"{on}\nDone.") and not taken(required, f"{on}\n{other}")
    form = Ask(OutputForm("json_schema", json.dumps(VERDICT)))
    assert taken(form, verdict) and taken(form, on) and not taken(form, other)
    assert not taken(form, "Sunny.")
    forms = grammars.forms(Ask(), tools, source)
    for _ in range(2):  # compiled again for the same tools: still in the request's order
        assert _takes(forms.matcher(tools), tokenizer, on)


def test_a_failed_optional_constraint_is_dropped_and_a_required_one_fails(qwen_grammars, caplog):
    """A strict tools' constraint holds what the caller did not ask for: where its matcher
    fails, the reply goes on free (logged, naming the agent); a form's failure fails the
    turn."""
    import mlx.core as mx

    from inference_worker.grammar import Ask
    from inference_worker.masks import masked
    from inference_worker.tools import canonical_tools

    grammars, tokenizer = qwen_grammars
    tools = canonical_tools(json.dumps([strict(SET_MODE)]))
    opening = tokenizer.convert_tokens_to_ids("<tool_call>")
    bad = tokenizer.encode("Sunny", add_special_tokens=False)[0]  # no call's JSON begins so
    optional = grammars.forms(Ask(), tools).constraint(tools, "kelvin")
    assert optional.optional
    optional.take(opening)
    with caplog.at_level("WARNING", logger="agentkv.worker"):
        optional.take(bad)
    assert optional.matcher is None and not optional.done
    (dropped,) = [r for r in caplog.records if "no longer held" in r.getMessage()]
    assert dropped.agent == "kelvin" and dropped.why.startswith("output format")
    logprobs = mx.zeros((1, grammars.vocab))
    out, failed = masked(logprobs, [optional])
    assert not failed and mx.array_equal(out, logprobs).item()
    held = grammars.forms(Ask(required=True), tools).constraint(tools)
    assert not held.optional
    held.take(opening)
    with pytest.raises(InvalidArgument):
        held.take(bad)
    # In a batch's step, where a matcher fails its mask (here: a token it did not allow):
    optional = grammars.forms(Ask(), tools).constraint(tools)
    held = grammars.forms(Ask(required=True), tools).constraint(tools)
    for constraint in (optional, held):
        constraint.matcher.consume_token(opening)
        constraint.matcher.consume_token(bad)
    out, failed = masked(mx.zeros((2, grammars.vocab)), [optional, held])
    assert list(failed) == [1] and optional.matcher is None  # the optional one: free
    assert mx.array_equal(out[0], mx.zeros(grammars.vocab)).item()


def test_a_spelled_call_of_a_tool_not_allowed_goes_out_as_text(qwen_grammars):
    """A reply whose strict constraint was dropped mid-reply is free: a call of a tool not
    allowed, opened by its special token (which the batcher marks OPENED), is text."""
    from inference_worker.chat import ChatFormat
    from inference_worker.tools import OPENED, canonical_tools

    _, tokenizer = qwen_grammars
    tools = canonical_tools(json.dumps(TOOLS))
    lyon = _call({"name": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius"}})
    on = _call({"name": "set_mode", "arguments": {"mode": "on", "fast": True}})
    for allowed, made in ((("set_mode",), ["set_mode"]), ((), ["get_weather", "set_mode"])):
        calls = ChatFormat(tokenizer).reply_calls(tools, 0, allowed)
        text, first = calls.feed(f"{lyon}\n{on}".replace("<tool_call>", OPENED))
        rest, last = calls.flush()
        assert [call.name for call in first + last] == made
        assert (lyon in text + rest) is bool(allowed)  # refused: as the model spelled it
        spelled = ChatFormat(tokenizer).reply_calls(tools, 0, allowed)  # ordinary tokens
        assert spelled.feed(f"{lyon}\n{on}") == (f"{lyon}\n{on}", [])  # text, as quoted
