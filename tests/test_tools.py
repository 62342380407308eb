"""Tool calling end to end: OpenAI function tools through the SDK and the gateway to a real
store and worker, each a separate process, on tests/model_kit.py's scripted Qwen 2.5-style
model, whose greedy reply to any conversation is one call, TOOL_CALL.

A reply's call comes back parsed (the openai client's message.tool_calls, the SDK's
reply.tool_calls), with finish_reason "tool_calls"; the agent loop (the call resent, then its
result) resumes the agent's cache and prefills only the tool's message, and the prompt is
the one the tokenizer's own chat template renders with the tools. The sans-IO parts (the
SDK's messages, the gateway's checks and JSON) are tested first, without a server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest

from agentkv.client.aio import AsyncAgentMemory
from agentkv.client.memory import AgentMemory
from agentkv.client.messages import as_messages, tools_json, turn_request
from agentkv.client.worker import WorkerClient
from agentkv.client.worker_core import TurnResult
from agentkv.errors import InvalidArgument, SystemPromptDiffers
from agentkv.launch import gateway_process, store_process, worker_process
from agentkv.worker.v1 import worker_pb2 as pb
from tests.model_kit import TOOL_CALL, WEATHER_TOOL, build_tool_model

MODEL = "qwen-tools"
SYSTEM = "You are a weather assistant."
ASK = "What is the weather in Paris?"
TOOLS = [WEATHER_TOOL]
RESULT = '{"temperature": 21, "unit": "celsius"}'


# The SDK's messages and replies, sans I/O


def test_the_sdk_takes_pairs_openai_dicts_and_pb_messages():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = as_messages([
        ("system", SYSTEM),
        {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                     {"type": "text", "text": "!"}]},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [call]},
        {"role": "tool", "content": "21 C", "tool_call_id": "call_1"},
        pb.Message(role="user", content="Thanks"),
    ])  # fmt: skip
    assert [m.role for m in messages] == ["system", "user", "assistant", "tool", "user"]
    assert [m.content for m in messages] == [SYSTEM, "Hi !", "", "21 C", "Thanks"]
    assert messages[2].tool_calls == [
        pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    ]
    assert messages[3].tool_call_id == "call_1" and not messages[2].tool_call_id
    assert as_messages("Hello", role="tool") == [pb.Message(role="tool", content="Hello")]
    # arguments as an object (Hugging Face's convention) are written as its JSON text
    hf = {"function": {"name": "f", "arguments": {"city": "Paris"}}}
    [message] = as_messages([{"role": "assistant", "tool_calls": [hf]}])
    assert json.loads(message.tool_calls[0].arguments) == {"city": "Paris"}
    for bad in ({"content": "no role"}, ("user",), {"role": "user", "content": 7},
                {"role": "assistant", "tool_calls": [{"function": {}}]}):  # fmt: skip
        with pytest.raises(InvalidArgument):
            as_messages([bad])


def test_tools_are_sent_as_json_text():
    assert tools_json(None) == tools_json([]) == tools_json("") == ""
    assert json.loads(tools_json(TOOLS)) == TOOLS
    assert tools_json('[{"type": "function"}]') == '[{"type": "function"}]'  # as it is
    request = turn_request("ns", "a", [("user", ASK)], tools=TOOLS, whole_conversation=True)
    assert json.loads(request.tools) == TOOLS and not turn_request("ns", "a", []).tools


@pytest.mark.parametrize("field", ["max_tokens", "top_k", "deadline_ms", "max_tool_calls"])
def test_a_negative_count_is_refused_naming_its_field(field):
    """protobuf's own refusal named no field: "Value out of range: -1"."""
    with pytest.raises(InvalidArgument, match=f"^{field} must be >= 0, got -1$"):
        turn_request("ns", "a", [("user", ASK)], **{field: -1})


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ("\ud800", r"message 0's content is not valid text: surrogates not allowed at character 0"),
        ([("user", "ok"), ("user", "a\udfffb")], r"message 1's content is not valid text: .* 1"),
        (None, "messages must be a text or a list of messages, got NoneType"),
        ({"role": "user", "content": "hi"}, "messages must be a text or a list of messages"),
        ([(None, "hi")], "message 0's role is not a text: None"),
        ([("user", None)], None),  # no content: none, as a dict's None content
        ([("us\udc00er", "hi")], "message 0's role is not valid text"),
        ([{"role": "tool", "content": "1", "tool_call_id": 5}], "message 0's call id is not a"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f\ud800"}}]}],
            "a tool call's name is not valid text",
        ),
    ],
    ids=["lone-surrogate", "surrogate-in-a-pair", "none", "one-dict", "role-none", "content-none",
         "role-surrogate", "call-id-number", "call-name-surrogate"],
)  # fmt: skip
def test_messages_the_wire_cannot_carry_are_refused_naming_the_message(messages, says):
    """Python's own errors came out of say(): UnicodeEncodeError for a lone surrogate (from
    gRPC's serializer), TypeError for None, protobuf's "bad argument type" for a role."""
    if says is None:
        assert as_messages(messages)[0].content == ""
        return
    with pytest.raises(InvalidArgument, match=f"^{says}"):
        as_messages(messages)


def test_an_option_a_turn_lacks_is_named_as_python_names_a_keyword():
    """protobuf's refusal read 'Protocol message SamplingParams has no "bogus" field'."""
    with pytest.raises(TypeError, match=r"^unexpected option 'bogus' \(sampling: temperature, "):
        turn_request("ns", "a", [("user", ASK)], bogus=1)


def test_one_stop_string_is_one_stop_string():
    """say(..., stop="END") stopped at any of E, N and D: protobuf takes a text given for
    a list of texts as the list of its characters. A stop string the wire cannot carry is
    refused naming it."""
    assert turn_request("ns", "a", [("user", ASK)], stop="END").sampling.stop == ["END"]
    assert turn_request("ns", "a", [("user", ASK)], stop=["a", "b"]).sampling.stop == ["a", "b"]
    with pytest.raises(InvalidArgument, match=r"^a stop string is not valid text"):
        turn_request("ns", "a", [("user", ASK)], stop=["ok", "\ud800"])


def test_a_turns_tool_calls_are_collected_apart_from_its_text():
    result, call = TurnResult(), pb.ToolCall(id="call_1", name="f", arguments="{}")
    for response in (
        pb.TurnResponse(tokens=pb.TokenChunk(text="Let me look.", token_ids=[1, 2])),
        pb.TurnResponse(tool_call=call),
        pb.TurnResponse(usage=pb.Usage(finish_reason="tool_calls")),
    ):
        result.add(response)
    assert result.text == "Let me look." and result.tool_calls == [call]
    assert result.events == ["Let me look.", call] and result.token_ids == [1, 2]
    assert result.usage.finish_reason == "tool_calls"


# Against real processes


class ToolStack:
    """A store, a worker on the scripted tool-calling model (or `model`), and a gateway in
    front of it, serving it as `name`."""

    def __init__(self, root: Path, model: Path | None = None, name: str = MODEL) -> None:
        self.model = model or build_tool_model(root / "model")
        self.store = store_process(root / "data", root / "store.log").start()
        args = ["--block-tokens", "64"]
        self.worker = worker_process(
            str(self.model), self.store.address, root / "worker.log", extra_args=args
        ).start()
        flags = ["--model-name", name]
        self.gateway = gateway_process(
            [self.worker.address], root / "gateway.log", self.store.address, "127.0.0.1:0", flags
        ).start()

    def client(self) -> openai.OpenAI:
        url = f"http://{self.gateway.address}/v1"
        return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)

    def prompt_tokens(self, messages: list[dict]) -> int:
        """The length of the conversation as the tokenizer's own chat template renders it
        with TOOLS, ready for the reply (calls' arguments as objects, as HF's convention)."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(self.model))
        rendered = [_hf(m) for m in messages]
        ids = tokenizer.apply_chat_template(
            rendered, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return len(ids)

    def stop(self) -> None:
        for proc in (self.gateway, self.worker, self.store):
            proc.stop()


def _hf(message: dict) -> dict:
    out = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                **c,
                "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])},
            }
            for c in message["tool_calls"]
        ]
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = ToolStack(tmp_path_factory.mktemp("tools"))
    yield stack
    stack.stop()


def ask(client: openai.OpenAI, messages: list[dict], agent: str | None = None, **options):
    headers = {"X-Agent-Id": agent} if agent else {}
    return client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=32,
        extra_headers=headers, **options,
    )  # fmt: skip


def the_call(name: str, arguments: str) -> None:
    assert (name, json.loads(arguments)) == (TOOL_CALL["name"], TOOL_CALL["arguments"])


def test_the_worker_names_its_tool_parser(stack):
    with WorkerClient(stack.worker.address) as worker:
        assert worker.info().tool_parser == "json_tools"


def test_a_reply_that_calls_a_tool_comes_back_as_openais_tool_calls(stack):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    reply = ask(stack.client(), messages)  # no identity: an anonymous agent made with TOOLS
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.isalnum()
    the_call(call.function.name, call.function.arguments)
    assert reply.agentkv["agent_id"].startswith("anon-")
    assert reply.usage.prompt_tokens == stack.prompt_tokens(messages)


def test_a_streamed_tool_call_comes_in_openais_delta_chunks(stack):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    chunks = list(
        ask(stack.client(), messages, "streamed", stream=True,
            stream_options={"include_usage": True})
    )  # fmt: skip
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == ""  # no text but the call's
    calls = [tc for d in deltas for tc in d.delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.isalnum()
    the_call(calls[0].function.name, calls[0].function.arguments)
    finishes = [d.finish_reason for d in deltas]
    assert finishes[-1] == "tool_calls" and not any(finishes[:-1])
    assert not deltas[-1].delta.tool_calls  # the call came before the closing chunk
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_the_agent_loop_resumes_warm_and_prefills_only_the_tools_result(stack):
    client = stack.client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    first = ask(client, messages, "looper")
    called = first.choices[0].message
    messages += [
        called.model_dump(),  # as the openai client gives it back: content None, nulls
        {"role": "tool", "tool_call_id": called.tool_calls[0].id, "content": RESULT},
    ]
    second = ask(client, messages, "looper")
    # The whole previous conversation came from the cache but for the last token of its
    # reply (its end of turn), which had not yet been through the model.
    held = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert second.usage.prompt_tokens_details.cached_tokens == held
    assert second.agentkv["cache_state"] == "hot"
    assert second.agentkv["prefilled_tokens"] == second.usage.prompt_tokens - held
    assert second.usage.prompt_tokens == stack.prompt_tokens(messages)
    [call] = second.choices[0].message.tool_calls  # the scripted model calls again
    the_call(call.function.name, call.function.arguments)
    assert call.id != called.tool_calls[0].id
    # The call's id is the worker's; a client that spells it otherwise resumes as well.
    renamed = json.loads(json.dumps(messages).replace(called.tool_calls[0].id, "call_mine"))
    again = ask(client, renamed, "looper")
    assert again.usage.prompt_tokens_details.cached_tokens == held


def test_the_sdk_says_with_tools_and_appends_the_result_warm(stack):
    with AgentMemory(stack.worker.address, store=stack.store.address) as mem:
        agent = mem.agent("sdk-tools", system=SYSTEM, tools=TOOLS)
        reply = agent.say(ASK, tools=TOOLS).wait()
        [call] = reply.tool_calls
        the_call(call.name, call.arguments)
        assert reply.usage.finish_reason == "tool_calls" and reply.text == ""
        assert list(reply.events()) == [call] and list(reply) == []
        first = reply.usage
        answered = agent.say([{"role": "tool", "content": RESULT, "tool_call_id": call.id}])
        usage = answered.usage
        held = first.prompt_tokens + first.generated_tokens - 1
        assert usage.cache_state == "hot" and usage.reused_hot_tokens == held
        assert usage.prefilled_tokens == usage.prompt_tokens - held  # the tool's message
        conversation = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "content": RESULT, "tool_call_id": call.id},
        ]  # fmt: skip
        assert usage.prompt_tokens == stack.prompt_tokens(conversation)
        assert answered.usage.finish_reason == "tool_calls" and len(answered.tool_calls) == 1
        # Made with tools: the same agent with them, another one without.
        assert not mem.agent("sdk-tools", system=SYSTEM, tools=json.dumps(TOOLS)).created
        with pytest.raises(SystemPromptDiffers, match="other tools"):
            mem.agent("sdk-tools", system=SYSTEM)


def test_the_asyncio_sdk_collects_tool_calls_too(stack):
    async def main() -> tuple[list[pb.ToolCall], list, str]:
        async with AsyncAgentMemory(stack.worker.address) as mem:
            agent = await mem.agent("async-tools", system=SYSTEM, tools=TOOLS)
            reply = await (await agent.say(ASK)).wait()  # the agent's own tools
            events = [event async for event in reply.events()]
            return reply.tool_calls, events, reply.usage.finish_reason

    calls, events, finish = asyncio.run(main())
    assert len(calls) == 1 and events == calls and finish == "tool_calls"
    the_call(calls[0].name, calls[0].arguments)


def check_weather_agent(
    base_url: str, model_class: str, streamed: bool = False, by_id: bool = False
) -> None:
    """OpenAI's Agents SDK, unchanged, over the gateway at `base_url`: an agent with one
    function tool on `model_class` (OpenAIChatCompletionsModel, OpenAIResponsesModel), run
    (`streamed` or not) once on ASK, then again on that run's history and a new question
    (`by_id`: on only what followed its last response, the tool's result, and the question,
    with previous_response_id). Its tool is called with the model's arguments, and the
    second run resumes the agent's cache: its call and result too."""
    import agents

    ran = []

    @agents.function_tool
    def get_weather(city: str, unit: str = "celsius") -> str:
        """The current weather in a city."""
        ran.append((city, unit))
        return f"21 degrees {unit} in {city}"

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    agent = agents.Agent(
        name=f"weather-{model_class}-{streamed}",
        instructions=SYSTEM,
        tools=[get_weather],
        model=getattr(agents, model_class)(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=32),
        tool_use_behavior="stop_on_first_tool",  # the scripted model would call for ever
    )

    async def run(items, **options):
        if not streamed:
            return await agents.Runner.run(agent, items, **options)
        result = agents.Runner.run_streamed(agent, items, **options)
        async for _ in result.stream_events():
            pass
        return result

    async def twice():  # one event loop: the client's connections belong to it
        first = await run(f"{ASK} ({model_class}, {streamed}, {by_id})")
        if by_id:
            result = first.to_input_list()[-1]
            assert result["type"] == "function_call_output"
            new = [result, {"role": "user", "content": "And tomorrow?"}]
            second = await run(new, previous_response_id=first.last_response_id)
            return first, second
        history = [*first.to_input_list(), {"role": "user", "content": "And tomorrow?"}]
        return first, await run(history)

    first, second = asyncio.run(twice())
    assert first.final_output == "21 degrees celsius in Paris"
    assert ran[0] == (TOOL_CALL["arguments"]["city"], TOOL_CALL["arguments"]["unit"])
    usage = first.raw_responses[0].usage
    cached = second.raw_responses[0].usage.input_tokens_details.cached_tokens
    assert cached >= usage.input_tokens + usage.output_tokens - 1  # its call and result too
    assert second.final_output == first.final_output and ran[1] == ran[0]


def test_an_openai_agents_sdk_agent_calls_its_tool_and_resumes_warm(stack):
    """OpenAI's Agents SDK, unchanged, over the gateway (its chat-completions model)."""
    check_weather_agent(str(stack.client().base_url), "OpenAIChatCompletionsModel")


def test_the_sdk_takes_the_openai_clients_message_objects_and_the_developer_role():
    from openai.types.chat import ChatCompletionMessage

    call = {"id": "abc123XYZ", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    said = ChatCompletionMessage.model_validate(
        {"role": "assistant", "content": None, "tool_calls": [call]}
    )
    messages = as_messages([{"role": "developer", "content": SYSTEM}, said])
    assert [m.role for m in messages] == ["system", "assistant"]
    assert messages[1].tool_calls == [
        pb.ToolCall(id="abc123XYZ", name="get_weather", arguments='{"city": "Paris"}')
    ]
    as_dicts = as_messages([{"role": "assistant", "content": None, "tool_calls": said.tool_calls}])
    assert as_dicts[0].tool_calls == messages[1].tool_calls  # the call objects alone too
    with pytest.raises(InvalidArgument):
        as_messages([{"role": "assistant", "tool_calls": [object()]}])
