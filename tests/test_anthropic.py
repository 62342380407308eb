"""Anthropic's Messages API on the gateway, driven by the official `anthropic` package, in
front of a real store and worker (each a separate process): on the default model (SmolLM2)
for text, on tests/model_kit.py's scripted Qwen 2.5-style model for tool use.

The two APIs are one path: the same conversation sent through either goes to the same agent
and gets the same greedy reply; a resent conversation reads its past from the cache
(cache_read_input_tokens) and prefills only what is new (input_tokens); a streamed reply
adds up to the whole one. The sans-IO checks come first, without a server."""

from __future__ import annotations

import copy
import http.client
import json
from pathlib import Path

import anthropic
import pytest

from agentkv import defaults
from agentkv.client.worker import WorkerClient
from agentkv.gateway.anthropic import parse_messages
from agentkv.gateway.anthropic_reply import MessageReply, error_body
from agentkv.gateway.errors import HTTPError
from agentkv.gateway.protocol import parse_chat
from agentkv.launch import gateway_process, store_process, worker_process
from agentkv.worker.v1 import worker_pb2 as pb
from inference_worker.models import resolve_model
from tests.helpers import free_address
from tests.model_kit import TOOL_CALL, WEATHER_TOOL
from tests.test_tools import ToolStack

MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a concise geography tutor. Answer in one short sentence."
ASK = ["What is the capital of France?", "And of Italy?"]
WEATHER = WEATHER_TOOL["function"]
TOOL = {"name": WEATHER["name"], "description": WEATHER["description"],
        "input_schema": WEATHER["parameters"]}  # fmt: skip
RESULT = '{"temperature": 21, "unit": "celsius"}'
GREEDY = {"temperature": 0}


# The wire format, sans I/O


def anthropic_body(**extra) -> dict:
    """A tool loop as Anthropic's clients send it: blocks, cache_control, a tool_result."""
    use = {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
           "input": {"city": "Paris"}}  # fmt: skip
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in ",
                                      "cache_control": {"type": "ephemeral"}},
                                     {"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, use]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01",
             "content": [{"type": "text", "text": RESULT}]},
            {"type": "text", "text": "Thanks!"}]},
    ]  # fmt: skip
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    body = {"model": "m", "max_tokens": 8, "system": system, "messages": messages}
    return copy.deepcopy(body | {"tools": [TOOL], "metadata": {"user_id": "u1"}} | extra)


def openai_body() -> dict:
    """The same conversation as OpenAI's clients send it."""
    call = {"id": "toolu_01", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_01", "content": RESULT},
        {"role": "user", "content": "Thanks!"},
    ]
    return {"model": "m", "messages": messages, "tools": [WEATHER_TOOL], "user": "u1"}


def test_a_conversation_is_the_same_call_through_either_api():
    ours, theirs = parse_messages(anthropic_body()), parse_chat(openai_body(), 8)
    assert ours.messages == theirs.messages
    assert ours.tools == theirs.tools and ours.scope == theirs.scope
    assert ours.anonymous_id() == theirs.anonymous_id()  # so it reaches the same agent
    strict = parse_messages(anthropic_body(tools=[TOOL | {"strict": True}]))  # held the same
    openai_strict = parse_chat(openai_body() | {"tools": [{**WEATHER_TOOL, "function": WEATHER | {
        "strict": True}}]}, 8)  # fmt: skip
    assert strict.tools == openai_strict.tools and '"strict":true' in strict.tools
    # max_tokens is a ceiling, as Anthropic's current models read it: lowered to the room
    # the context has left
    assert ours.sampling == {"temperature": 1.0, "max_tokens": 8, "fit_max_tokens": True}
    assert not ours.stream and ours.max_tool_calls == 0
    single = {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}
    assert parse_messages(anthropic_body(**single)).max_tool_calls == 1
    forced = parse_messages(anthropic_body(tool_choice={"type": "any"}))
    named = parse_messages(anthropic_body(tool_choice={"type": "tool", "name": "get_weather"}))
    assert forced.tool_call_required and not forced.tool_call_name
    assert (named.tool_call_required, named.tool_call_name) == (False, "get_weather")
    assert parse_messages(anthropic_body(tool_choice={"type": "none"})).tool_call_forbidden
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    form = {"output_config": {"format": {"type": "json_schema", "schema": schema}}}
    assert parse_messages(anthropic_body(**form)).output_format == {
        "json_schema": json.dumps(schema)
    }
    partial = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    with pytest.raises(HTTPError, match="does not continue a partial reply"):
        parse_messages(anthropic_body(messages=partial))  # Anthropic's prefill
    options = {"temperature": 0, "top_p": 0.5, "top_k": 40, "stop_sequences": ["\n\n"]}
    neutral = {"thinking": {"type": "disabled"}, "speed": "standard", "container": None}
    neutral |= {"cache_control": {"type": "ephemeral"}, "service_tier": "auto"}
    sampling = parse_messages(anthropic_body(**options, **neutral)).sampling
    assert sampling == {"temperature": 0.0, "top_p": 0.5, "top_k": 40, "max_tokens": 8,
                        "stop": ["\n\n"], "fit_max_tokens": True}  # fmt: skip


def edited(path: str, value) -> dict:
    """anthropic_body() with the value at `path` (keys and indexes, dot-separated) replaced,
    or removed when value is ...; a top-level key is added."""
    body = anthropic_body()
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = body
    for key in parents:
        node = node[key]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return body


@pytest.mark.parametrize(
    "path, value, param",
    [
        ("max_tokens", ..., None),  # required, as Anthropic's
        ("max_tokens", -1, None),
        ("temperature", 1.5, "temperature"),  # Anthropic's range is [0, 1]
        ("top_k", -1, "top_k"),
        ("stop_sequences", [""], "stop_sequences"),
        ("thinking", {"type": "sometimes"}, "thinking.type"),
        ("mcp_servers", [], "mcp_servers"),
        ("output_config", {"format": {"type": "json_schema"}}, "output_config.format.schema"),
        ("output_config", {"format": {"type": "regex"}}, "output_config.format.type"),
        (
            "output_config",
            {"format": {"type": "json_schema", "schema": {"title": "\ud800"}}},
            "output_config.format.schema",  # a lone surrogate escape: no UTF-8 can hold it
        ),
        (
            "output_config",
            {"format": {"type": "json_schema", "schema": {}, "strict": True}},
            "output_config.format.strict",
        ),
        (
            "context_management",
            {"edits": [{"type": "clear_tool_uses_20250919"}]},
            "context_management.edits.0",
        ),
        ("tool_choice", {}, "tool_choice"),
        ("speed", "fast", "speed"),
        ("system", 7, "system"),
        ("metadata", {"user_id": 7}, "metadata.user_id"),
        ("metadata", {"user_id": "u1", "foo": 5}, "metadata.foo"),  # the red team's
        ("thinking", {"type": "enabled", "budget_tokens": -1}, "thinking.budget_tokens"),
        ("thinking", {"type": "enabled", "budget_tokens": "big"}, "thinking.budget_tokens"),
        ("messages", [], "messages"),
        ("messages.0.role", "system", "messages.0"),
        ("messages.0.content.0", {"type": "image", "source": {}}, "messages.0.content.0.type"),
        ("messages.0.content", [], "messages.0"),
        ("messages.2.content.0.tool_use_id", ["toolu_01"], "messages.2.content.0.tool_use_id"),
        (
            "messages.2.content",
            [{"type": "text", "text": "first"}, {"type": "tool_result", "tool_use_id": "toolu_01"}],
            "messages.2.content.1",
        ),
        ("messages.1.content.1.caller", {"type": "code_execution"}, "messages.1.content.1.caller"),
        ("messages.0.content.0.citations", [{"type": "x"}], "messages.0.content.0"),
        ("messages.1.content.1.input", "Paris", "messages.1.content.1.input"),
        ("messages.2.content.0.tool_use_id", "toolu_02", "messages.2.content.0.tool_use_id"),
        ("messages.2.content.0", {"type": "text", "text": "no result"}, "messages.2"),
        ("messages.2", {"role": "assistant", "content": "two in a row"}, "messages.2"),
        (
            "messages.1",
            {"role": "assistant", "content": "unasked"},
            "messages.2.content.0.tool_use_id",
        ),
        ("tools.0.input_schema", ..., "tools.0"),
        ("tools.0.name", "get weather", "tools.0.name"),
        ("tools.0", {"type": "web_search_20250305", "name": "web_search"}, "tools.0.type"),
        ("tool_choice", {"type": "tool", "name": "get weather"}, "tool_choice.name"),
        ("tool_choice", {"type": "some"}, "tool_choice"),
        (
            "tool_choice",
            {"type": "none", "disable_parallel_tool_use": True},  # none has no other field
            "tool_choice.disable_parallel_tool_use",
        ),
    ],
)
def test_what_agentkv_would_not_do_as_anthropic_specifies_is_a_400(path, value, param):
    with pytest.raises(HTTPError) as caught:
        parse_messages(edited(path, value))
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message


def stream_of(reply: MessageReply, items: list, usage: pb.Usage) -> list[tuple[str, dict]]:
    pieces = reply.opening()
    for item in items:
        pieces += reply.text(item) if isinstance(item, str) else reply.call(item)
    pieces += reply.closing(usage, {}, False)
    events = []
    for piece in pieces:
        name, data = piece.split("\n")[:2]
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def test_a_streamed_reply_adds_up_to_the_whole_one():
    call = pb.ToolCall(id="abc123XYZ", name="get_weather", arguments='{"city": "Paris"}')
    usage = pb.Usage(prompt_tokens=30, prefilled_tokens=10, generated_tokens=12,
                     finish_reason="tool_calls")  # fmt: skip
    items = ["Let ", "me look.", "\n", call, "\n"]  # as the worker sends them
    whole = MessageReply("m", 16).whole(items, usage, {})
    assert whole["stop_reason"] == "tool_use" and whole["stop_sequence"] is None
    assert whole["usage"] == {"input_tokens": 10, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 20, "output_tokens": 12}  # fmt: skip
    events = stream_of(MessageReply("m", 16), items, usage)
    names = [name for name, _ in events]
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta",
                     "content_block_delta", "content_block_stop", "content_block_start",
                     "content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]  # fmt: skip
    blocks = []  # the stream's blocks, put together as a client does
    for name, data in events:
        if name == "content_block_start":
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            delta, block = data["delta"], blocks[data["index"]]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            else:
                block["input"] = json.loads(delta["partial_json"])
    assert blocks == whole["content"]  # white space around the call makes no block
    assert [b["type"] for b in blocks] == ["text", "tool_use"]
    assert blocks[0]["text"] == "Let me look." and blocks[1]["input"] == {"city": "Paris"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    # A reply ended by a stop sequence names it; white space alone is a reply too.
    stopped = pb.Usage(finish_reason="stop", stop_sequence="\n\n")
    message = MessageReply("m", 16).whole([" "], stopped, {})
    assert message["stop_reason"] == "stop_sequence" and message["stop_sequence"] == "\n\n"
    assert message["content"] == [{"type": "text", "text": " "}]
    streamed = stream_of(MessageReply("m", 16), [" "], stopped)
    texts = [data["delta"]["text"] for name, data in streamed if name == "content_block_delta"]
    assert texts == [" "]
    # Cut short by the context's end, by --timeout, or asked for no reply (max_tokens 0)
    ends = {
        ("length", 16): "max_tokens",
        ("length", 9): "model_context_window_exceeded",
        ("deadline", 3): "max_tokens",
        ("none", 0): "max_tokens",
        ("stop", 5): "end_turn",
    }
    for (finish, made), reason in ends.items():
        usage = pb.Usage(finish_reason=finish, generated_tokens=made)
        assert MessageReply("m", 16).whole([], usage, {})["stop_reason"] == reason


def test_what_clients_send_besides_the_conversation_is_taken_as_they_mean_it():
    """Claude Code's per-request billing stamp is no part of the system prompt; a system
    message later in the conversation, hints the model may ignore (thinking, effort,
    clearing thinking), a failed tool's result, user turns in a row and top_p 0."""
    stamp = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=fa690;"}
    body = anthropic_body()
    body["system"].insert(0, stamp)
    assert parse_messages(body).messages == parse_messages(anthropic_body()).messages
    assert parse_messages(body).anonymous_id() == parse_messages(anthropic_body()).anonymous_id()
    body = anthropic_body(thinking={"type": "adaptive"}, output_config={"effort": "high"},
                          context_management={"edits": [{"type": "clear_thinking_20251015"}]},
                          top_p=0)  # fmt: skip
    body["messages"][2]["content"][0]["is_error"] = True
    body["messages"] += [{"role": "user", "content": "And Rome?"},
                         {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                         {"role": "user", "content": "Please."}]  # fmt: skip
    call = parse_messages(body)
    # user turns in a row stay apart (so a conversation filled with max_tokens 0 goes on warm)
    assert [m["role"] for m in call.messages] == ["system", "user", "assistant", "tool", "user",
                                                  "user", "system", "user"]  # fmt: skip
    assert call.messages[3]["content"] == "Error: " + RESULT
    assert [m["content"] for m in call.messages[4:6]] == ["Thanks!", "And Rome?"]
    assert call.sampling["temperature"] == 0.0 and call.sampling["top_p"] == 1.0  # greedy
    use = body["messages"][1]["content"][1] | {"caller": {"type": "direct"}}
    body["messages"][1]["content"][1] = use
    body["tools"][0]["eager_input_streaming"] = True
    assert parse_messages(body).messages == call.messages
    # assistant turns in a row are one (a client may send the text and the call apart)
    split = anthropic_body()
    text, use = split["messages"][1]["content"]
    split["messages"][1:2] = [{"role": "assistant", "content": [use]},
                              {"role": "assistant", "content": [text]}]  # fmt: skip
    [merged] = [m for m in parse_messages(split).messages if m["role"] == "assistant"]
    [whole] = [m for m in parse_messages(anthropic_body()).messages if m["role"] == "assistant"]
    assert merged["tool_calls"] == whole["tool_calls"] and merged["content"] == "Let me look."


def test_an_error_quoting_a_lone_surrogate_is_still_json():
    with pytest.raises(HTTPError) as caught:
        parse_messages(anthropic_body(**{"\ud800": 1}))
    body = error_body(caught.value)
    assert json.loads(json.dumps(body, ensure_ascii=False).encode())["error"]["message"]


# Against real processes: text on the default model


class Stack:
    """A store, a worker on SmolLM2 and a gateway (with a token table when `tokens`)."""

    def __init__(self, root: Path, tokens: Path | None = None) -> None:
        self.model = model = resolve_model(defaults.MODEL, "auto", "cpu", root / "model-cache")
        self.store = store_process(root / "data", root / "store.log").start()
        self.worker = worker_process(
            str(model), self.store.address, root / "worker.log", extra_args=["--block-tokens", "64"]
        ).start()
        flags = ["--model-name", MODEL]
        self.gateway = gateway_process(
            [self.worker.address], root / "gateway.log", self.store.address, "127.0.0.1:0", flags
        ).start()

    def rendered(self, messages: list[dict], reply: bool = False) -> int:
        """Tokens of a conversation as the model's own chat template renders it, as it
        stands or (`reply`) ready for the reply."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(self.model))
        ids = tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=reply, return_dict=False
        )
        return len(ids)

    def client(self) -> anthropic.Anthropic:
        return client_of(self.gateway.address)

    def stop(self) -> None:
        for proc in (self.gateway, self.worker, self.store):
            proc.stop()


def client_of(address: str, api_key: str = "unused") -> anthropic.Anthropic:
    """The official client of the gateway at `address`, without its retries."""
    return anthropic.Anthropic(base_url=f"http://{address}", api_key=api_key, max_retries=0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("anthropic"))
    yield stack
    stack.stop()


def ask(client: anthropic.Anthropic, messages: list[dict], agent: str, extra=None, **options):
    """A greedy call (the SDK has no temperature parameter since 2.x: sent as extra_body)."""
    extra = extra or {}
    options.setdefault("max_tokens", 16)
    return client.messages.create(
        model=MODEL, system=SYSTEM, messages=messages, extra_body=GREEDY | extra,
        extra_headers={"X-Agent-Id": agent}, **options,
    )  # fmt: skip


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_a_resent_conversation_reads_its_past_from_the_cache(stack):
    client, messages = stack.client(), [{"role": "user", "content": ASK[0]}]
    first = ask(client, messages, "claude-like")
    assert first.type == "message" and first.role == "assistant" and first.model == MODEL
    assert first.id.startswith("msg_") and text_of(first)
    assert first.stop_reason in ("end_turn", "max_tokens")
    assert first.usage.cache_creation_input_tokens == 0
    messages += [{"role": "assistant", "content": first.content},  # the blocks given back
                 {"role": "user", "content": ASK[1]}]  # fmt: skip
    second = ask(client, messages, "claude-like")
    usage = second.usage
    # All of the first exchange but the reply's last token came from the cache (in RAM).
    held = first.usage.input_tokens + first.usage.cache_read_input_tokens
    held += first.usage.output_tokens - 1
    assert usage.cache_read_input_tokens == held and usage.input_tokens > 0
    assert second.agentkv["cache_state"] == "hot"
    assert second.agentkv["prefilled_tokens"] == usage.input_tokens


def test_the_same_conversation_gets_the_same_reply_through_openais_api(stack):
    import openai

    messages = [{"role": "user", "content": ASK[0]}]
    ours = ask(stack.client(), messages, "via-anthropic", max_tokens=24)
    theirs = openai.OpenAI(
        base_url=f"http://{stack.gateway.address}/v1", api_key="unused", max_retries=0
    ).chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *messages],
        temperature=0, max_tokens=24, extra_headers={"X-Agent-Id": "via-openai"},
    )  # fmt: skip
    assert text_of(ours) == theirs.choices[0].message.content
    total = ours.usage.input_tokens + ours.usage.cache_read_input_tokens
    assert total == theirs.usage.prompt_tokens
    assert ours.usage.output_tokens == theirs.usage.completion_tokens


def test_a_streamed_reply_is_the_whole_one(stack):
    messages = [{"role": "user", "content": ASK[0]}]
    whole = ask(stack.client(), messages, "whole-one", max_tokens=20)
    with stack.client().messages.stream(
        model=MODEL, system=SYSTEM, messages=messages, extra_body=GREEDY, max_tokens=20,
        extra_headers={"X-Agent-Id": "streamed-one"},
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_message()
    texts = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert "".join(texts) == text_of(final) == text_of(whole) and len(texts) > 1
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens  # from message_delta
    # message_start already tells what the prompt cost (Claude Code sizes its context by it)
    start = events[0].message.usage
    assert events[0].type == "message_start" and start.input_tokens == final.usage.input_tokens
    assert start.cache_read_input_tokens == final.usage.cache_read_input_tokens
    assert start.input_tokens + start.cache_read_input_tokens > 0


def test_stop_sequences_and_max_tokens_end_a_reply_as_anthropics_do(stack):
    messages = [{"role": "user", "content": ASK[0]}]
    free = ask(stack.client(), messages, "free", max_tokens=24)
    text = text_of(free)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = ask(stack.client(), messages, "cut", max_tokens=24, stop_sequences=["@@@", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text.startswith(text_of(cut)) and stop not in text_of(cut)
    short = ask(stack.client(), messages, "short", max_tokens=2)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_count_tokens_is_the_prompt_a_fresh_agent_gets(stack):
    client, messages = stack.client(), [{"role": "user", "content": ASK[0]}]
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages)
    first = ask(client, messages, "counted")
    assert counted.input_tokens == first.usage.input_tokens + first.usage.cache_read_input_tokens
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": ASK[1]}]  # fmt: skip
    with WorkerClient(stack.worker.address) as worker:
        hot = worker.info().num_hot_agents
        counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages)
        assert worker.info().num_hot_agents == hot  # counting makes no agent
    fresh = ask(client, messages, "counted-fresh")  # told the whole conversation at once
    assert counted.input_tokens == fresh.usage.input_tokens + fresh.usage.cache_read_input_tokens
    # a history that ends with the assistant's message counts as it stands (LangChain's
    # trim_messages counts such), as the model's own template renders it
    said = [messages[0], {"role": "assistant", "content": "Paris."}]
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=said)
    assert counted.input_tokens == stack.rendered([{"role": "system", "content": SYSTEM}, *said])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-opus", messages=messages)
    with pytest.raises(anthropic.BadRequestError, match="count_tokens takes none"):
        client.messages.count_tokens(model=MODEL, messages=messages, extra_body={"max_tokens": 8})
    with pytest.raises(anthropic.BadRequestError, match="no tool-call format"):
        client.messages.count_tokens(model=MODEL, messages=messages, tools=[TOOL])


def test_bad_requests_get_anthropics_error_format(stack):
    client = stack.client()
    with pytest.raises(anthropic.BadRequestError) as caught:
        ask(client, [{"role": "user", "content": "Hi"}], "bad", {"temperature": 1.5})
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-opus", max_tokens=4,
                               messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
    assert caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="only custom tools"):
        ask(client, [{"role": "user", "content": "Hi"}], "bad",
            tools=[{"type": "bash_20250124", "name": "bash"}])  # fmt: skip
    # Tools for a model whose template has no tool-call format: the worker's refusal.
    with pytest.raises(anthropic.BadRequestError, match="no tool-call format"):
        ask(client, [{"role": "user", "content": "Hi"}], "no-tools", tools=[TOOL])
    # A prompt past the model's context, in Anthropic's words (clients look for them)
    with pytest.raises(anthropic.BadRequestError, match=r"prompt is too long: .* 8192"):
        ask(client, [{"role": "user", "content": "apple " * 9000}], "too-long")
    # A field named with a lone surrogate escape: quoted back escaped, still JSON
    status, answer = post(stack.gateway.address, "/v1/messages",
                          {"model": MODEL, "max_tokens": 2, "\ud800": 1})  # fmt: skip
    assert status == 400 and "\\ud800" in answer["error"]["message"]


def test_max_tokens_past_the_context_is_a_ceiling_and_0_only_fills_the_cache(stack):
    client, messages = stack.client(), [{"role": "user", "content": ASK[0]}]
    warmed = ask(client, messages, "prefetched", max_tokens=0)
    assert warmed.content == [] and warmed.stop_reason == "max_tokens"
    assert warmed.usage.output_tokens == 0 and warmed.usage.input_tokens > 0
    # 20,000 tokens, past SmolLM2's 8,192 (Claude Code asks for 32,000, streamed; the SDK
    # refuses more than ~21,000 without a stream)
    reply = ask(client, messages, "prefetched", max_tokens=20000)
    held = warmed.usage.input_tokens + warmed.usage.cache_read_input_tokens
    assert reply.usage.cache_read_input_tokens == held  # all but the generation prompt
    assert reply.agentkv["cache_state"] == "hot" and text_of(reply)
    assert reply.stop_reason == "end_turn"
    models = client.models.list()  # Anthropic's shape, for a client that says its version
    assert [m.id for m in models.data] == [MODEL] and models.data[0].type == "model"


def test_an_api_key_is_a_bearer_token(stack, tmp_path):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [
        {"name": "a", "token": "token-a-0123456789", "namespaces": ["team-a"]}]}))  # fmt: skip
    tokens.chmod(0o600)
    flags = ["--model-name", MODEL, "--auth-tokens", str(tokens)]
    gateway = gateway_process(
        [stack.worker.address], tmp_path / "gateway.log", stack.store.address, "127.0.0.1:0", flags
    ).start()
    try:
        client = client_of(gateway.address, "token-a-0123456789")
        reply = ask(client, [{"role": "user", "content": ASK[0]}], "keyed", max_tokens=2)
        assert reply.agentkv["namespace"] == "team-a"
        wrong = client_of(gateway.address, "token-b-0123456789")
        with pytest.raises(anthropic.AuthenticationError) as caught:
            ask(wrong, [{"role": "user", "content": ASK[0]}], "keyed", max_tokens=2)
        assert caught.value.body["error"]["type"] == "authentication_error"
        # Older clients and curl send the key as X-Api-Key.
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
        for key, status in (("token-a-0123456789", 200), ("token-b-0123456789", 401)):
            answer = post(gateway.address, "/v1/messages", body, **{"x-api-key": key})
            assert answer[0] == status
        both = {"x-api-key": "token-a-0123456789", "authorization": "Bearer stale"}
        assert post(gateway.address, "/v1/messages", body, **both)[0] == 200  # either will do
        assert answer[1] == {"type": "error", "error": {"type": "authentication_error",
            "message": "a valid bearer token is required (Authorization: Bearer ..., "
                       "or X-Api-Key)"}}  # fmt: skip
    finally:
        gateway.stop()


def test_a_worker_that_cannot_answer_is_passed_by(stack, tmp_path):
    """count_tokens asks the first worker that answers: a dead one is passed by."""
    flags = ["--model-name", MODEL]
    workers = [free_address(), stack.worker.address]
    gateway = gateway_process(
        workers, tmp_path / "gateway.log", stack.store.address, "127.0.0.1:0", flags
    ).start()
    try:
        client = client_of(gateway.address)
        messages = [{"role": "user", "content": ASK[0]}]
        counted = client.messages.count_tokens(model=MODEL, messages=messages)
        assert counted.input_tokens == stack.rendered(messages, reply=True)
    finally:
        gateway.stop()


def _no_ids(blocks: list) -> list[dict]:
    return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in blocks]


def post(address: str, path: str, body: dict, **headers: str) -> tuple[int, dict]:
    """One request as curl sends it: (status, its JSON)."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), headers)
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        conn.close()


# Against real processes: tool use on the scripted model


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    stack = ToolStack(tmp_path_factory.mktemp("anthropic-tools"))
    yield stack
    stack.stop()


def test_a_tool_loop_comes_back_as_tool_use_blocks_and_resumes_warm(tools):
    client = client_of(tools.gateway.address)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]

    def turn():
        return client.messages.create(
            model="qwen-tools", system="You are a weather assistant.", messages=messages,
            tools=[TOOL], extra_body=GREEDY, max_tokens=32, extra_headers={"X-Agent-Id": "looper"},
        )  # fmt: skip

    first = turn()
    assert first.stop_reason == "tool_use"
    [use] = [block for block in first.content if block.type == "tool_use"]
    assert (use.name, use.input) == (TOOL_CALL["name"], TOOL_CALL["arguments"])
    messages += [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": RESULT}]},
    ]  # fmt: skip
    second = turn()
    held = first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.cache_read_input_tokens == held
    assert second.agentkv["cache_state"] == "hot"
    conversation = [
        {"role": "system", "content": "You are a weather assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": use.id, "type": "function", "function": {
                "name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": RESULT},
    ]  # fmt: skip
    assert second.usage.input_tokens + held == tools.prompt_tokens(conversation)
    assert second.stop_reason == "tool_use"  # the scripted model calls again
    # streamed: the call arrives as a tool_use block whose input is the whole JSON
    with client.messages.stream(
        model="qwen-tools", messages=messages[:1], tools=[TOOL], extra_body=GREEDY, max_tokens=32,
        extra_headers={"X-Agent-Id": "streamer"},
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    [streamed] = [block for block in final.content if block.type == "tool_use"]
    assert (streamed.name, streamed.input) == (TOOL_CALL["name"], TOOL_CALL["arguments"])
    assert final.stop_reason == "tool_use"
    # the same message as the whole reply (the worker's text before the call included)
    assert _no_ids(final.content) == _no_ids(first.content)
    # count_tokens with the tools: the loop's prompt, as the tokenizer's template renders it
    counted = client.messages.count_tokens(
        model="qwen-tools", system="You are a weather assistant.", messages=messages, tools=[TOOL]
    )
    assert counted.input_tokens == tools.prompt_tokens(conversation)
