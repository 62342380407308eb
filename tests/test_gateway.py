"""The OpenAI-compatible gateway, driven by the official `openai` package, in front of a real
store and worker on the default model (SmolLM2), each a separate process.

Clients resend the whole history every call: the gateway's agent must answer as the Python
SDK's does for the same conversation (greedy, token for token: the stored contexts are
compared), report the previous conversation as cached, survive a worker restart warm, and
answer an edited history as a fresh agent does."""

from __future__ import annotations

import http.client
import json
import queue
import re
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import httpx2
import openai
import pytest

from agentkv import defaults
from agentkv.client.worker import WorkerClient
from agentkv.launch import gateway_process, store_process, worker_process
from agentkv.rpc import ALLOW_KEEPALIVE
from agentkv.worker.v1 import worker_pb2 as pb
from inference_worker.models import resolve_model
from tests.helpers import free_address, homed_at, until

MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a concise geography tutor. Answer in one short sentence."
ASK = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]
# A system prompt over one 64-token block, shared by agents that have no identity.
LONG_SYSTEM = SYSTEM + " Reference: " + " ".join(
    f"{city} is the capital of {country}."
    for city, country in [("Paris", "France"), ("Rome", "Italy"), ("Madrid", "Spain"),
                          ("Berlin", "Germany"), ("Lisbon", "Portugal"), ("Vienna", "Austria"),
                          ("Prague", "Czechia"), ("Warsaw", "Poland"), ("Athens", "Greece"),
                          ("Dublin", "Ireland"), ("Oslo", "Norway"), ("Bern", "Switzerland")]
)  # fmt: skip


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    text: str

    def json(self):
        return json.loads(self.text)


def raw(address: str, method: str, path: str, body: bytes | None = None, **headers) -> Answer:
    """One HTTP request as any client sends it, the answer read whole."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request(method, path, body, {k.replace("_", "-"): v for k, v in headers.items()})
        answer = conn.getresponse()
        text = answer.read().decode()
        return Answer(answer.status, {k.lower(): v for k, v in answer.getheaders()}, text)
    finally:
        conn.close()


class Stack:
    """A store, a worker on a fixed address (so that it can restart there) and a gateway."""

    def __init__(self, root: Path, model: Path) -> None:
        self.root, self.model, self.worker_address = root, model, free_address()
        self.store = store_process(root / "data", root / "store.log").start()
        self.worker = self._worker().start()
        self.gateway = self.start_gateway([self.worker_address])
        self.sdk = WorkerClient(self.worker_address)

    def _worker(self):
        args = ["--block-tokens", "64"]
        return worker_process(
            str(self.model), self.store.address, self.root / "worker.log",
            self.worker_address, args,
        )  # fmt: skip

    def start_gateway(
        self, workers: list[str], *args: str, name: str = "gateway", listen: str = "127.0.0.1:0"
    ):
        flags = ["--model-name", MODEL, *args]
        log = self.root / f"{name}.log"
        return gateway_process(workers, log, self.store.address, listen, flags).start()

    def restart_worker(self) -> None:
        self.worker.stop()
        self.worker = self._worker().start()

    def client(self, gateway=None, **options) -> openai.OpenAI:
        address = (gateway or self.gateway).address
        options = {"api_key": "unused", "max_retries": 0, **options}
        return openai.OpenAI(base_url=f"http://{address}/v1", **options)

    def stored_tokens(self, agent: str, namespace: str = "default") -> list[int]:
        self.sdk.wait_durable(namespace, agent)
        from agentkv.client.store import StoreClient

        with StoreClient(self.store.address) as store:
            return list(store.get_agent(namespace, agent).token_ids)

    def stop(self) -> None:
        for proc in (self.gateway, self.worker, self.store):
            proc.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway")
    model = resolve_model(defaults.MODEL, "auto", "cpu", root / "model-cache")
    stack = Stack(root, model)
    yield stack
    stack.stop()


def ask(client: openai.OpenAI, messages: list[dict], agent: str | None = None, **options):
    headers = {"X-Agent-Id": agent} if agent else {}
    options.setdefault("max_tokens", 16)
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, extra_headers=headers, **options
    )


def sdk_turns(stack: Stack, agent: str, questions: list[str], system: str = SYSTEM) -> list:
    """A fresh SDK agent told the conversation one question a turn."""
    stack.sdk.create_agent("default", agent, system)
    return [stack.sdk.turn("default", agent, [("user", q)], max_tokens=16) for q in questions]


def test_models_and_health(stack):
    client = stack.client()
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4o")
    health = raw(stack.gateway.address, "GET", "/health")
    assert health.status == 200 and health.json()["workers"][stack.worker_address] == "serving"


def test_a_gateway_says_which_workers_do_not_answer_from_its_start_until_they_do(stack):
    silent = free_address()
    gateway = stack.start_gateway([silent, stack.worker_address], name="one-silent")
    try:

        def said(event: str) -> list[dict]:
            log = gateway.log_tail(200_000).splitlines()
            lines = [json.loads(line) for line in log if line.startswith("{")]  # not gRPC's
            return [line for line in lines if line["event"] == event]

        eventually(lambda: said("worker does not answer"), "the warning")
        (warning,) = said("worker does not answer")  # once the check of both has ended
        assert warning["level"] == "warning" and warning["worker"] == silent
        assert "failed to connect" in warning["reason"].lower(), warning
        health = raw(gateway.address, "GET", "/health").json()
        assert health["workers"] == {silent: "unavailable", stack.worker_address: "serving"}
        with WorkerProxy(stack.worker_address, listen=silent):  # it comes up
            eventually(lambda: said("worker answers"), "word that it answers")
            assert [line["worker"] for line in said("worker answers")] == [silent]
            assert len(said("worker does not answer")) == 1
    finally:
        gateway.stop()


def test_a_resent_history_answers_as_the_sdk_and_prefills_only_the_new_message(stack):
    client, fresh = stack.client(), sdk_turns(stack, "sdk-twin", ASK)
    messages = [{"role": "system", "content": SYSTEM}]
    previous = None
    for i, question in enumerate(ASK):
        messages.append({"role": "user", "content": question})
        reply = ask(client, messages, "resent")
        text, usage = reply.choices[0].message.content, reply.usage
        assert text == fresh[i].text and usage.completion_tokens == len(fresh[i].token_ids)
        assert usage.prompt_tokens == fresh[i].usage.prompt_tokens
        if previous is None:  # the call made the agent: it prefilled everything
            assert reply.agentkv["prefilled_tokens"] == usage.prompt_tokens
            assert usage.prompt_tokens_details.cached_tokens == 0
        else:
            assert reply.agentkv["prefilled_tokens"] == fresh[i].usage.prefilled_tokens
            # The whole previous conversation came from the cache but for the last token of
            # its reply, which had not yet been through the model.
            held = previous.prompt_tokens + previous.completion_tokens - 1
            assert usage.prompt_tokens_details.cached_tokens == held
            assert reply.agentkv["cache_state"] == "hot"
        previous = usage
        messages.append({"role": "assistant", "content": text})
    assert stack.stored_tokens("resent") == stack.stored_tokens("sdk-twin")
    listed = raw(stack.gateway.address, "GET", "/v1/agents").json()["data"]
    resent = next(a for a in listed if a["agent_id"] == "resent")
    assert resent["tier"] == "hot" and resent["num_tokens"] == len(stack.stored_tokens("resent"))


def test_streaming_sends_the_same_reply_in_openais_chunks(stack):
    client = stack.client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK[0]}]
    whole = ask(client, messages, "whole")
    stream = ask(client, messages, "streamed", stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and not any(finishes[:-1])
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )
    # Without include_usage no usage chunk comes, and the stream still ends with [DONE].
    body = {"model": MODEL, "messages": messages, "stream": True, "temperature": 0, "max_tokens": 4}
    answer = raw(
        stack.gateway.address, "POST", "/v1/chat/completions", json.dumps(body).encode(),
        X_Agent_Id="raw-stream",
    )  # fmt: skip
    events = [line for line in answer.text.splitlines() if line.startswith("data: ")]
    assert answer.headers["content-type"].startswith("text/event-stream")
    # Nothing between the client and the gateway may cache the stream or hold it back.
    assert answer.headers["cache-control"] == "no-cache"
    assert answer.headers["x-accel-buffering"] == "no"
    assert events[-1] == "data: [DONE]" and all("usage" not in e for e in events[:-1])


def test_the_agent_comes_from_the_first_identity_given(stack):
    client = stack.client()
    messages = [{"role": "user", "content": "Name one ocean."}]

    def agent(headers: dict, **body) -> str:
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, extra_headers=headers, extra_body=body
        )
        return reply.agentkv["agent_id"]

    assert agent({"X-Agent-Id": "a", "X-Session-ID": "s"}, prompt_cache_key="k") == "a"
    assert agent({"X-Session-ID": "s"}, prompt_cache_key="k", user="u") == "s"
    assert agent({"X-Session-ID": "a session / with spaces"}).startswith("s-")
    anonymous = agent({})
    assert anonymous.startswith("anon-") and agent({}) == anonymous
    # An end user (user, safety_identifier) and a cache key name no agent: they keep the
    # conversations of different users and keys apart.
    scopes = [{"user": "u"}, {"safety_identifier": "u"}, {"prompt_cache_key": "u"},
              {"prompt_cache_key": "k", "user": "u"}]  # fmt: skip
    scoped = [agent({}, **scope) for scope in scopes]
    assert all(a.startswith("anon-") for a in scoped) and len({anonymous, *scoped}) == 5
    assert agent({}, user="u") == scoped[0]
    with pytest.raises(openai.BadRequestError, match="X-Agent-Id"):
        agent({"X-Agent-Id": "no spaces allowed"})


def said_then_restarted(stack: Stack, client: openai.OpenAI, agent: str) -> tuple[Any, list]:
    """The agent's first call (ASK[0]), durable; then its worker restarted. That call's
    reply and the conversation with the next question."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK[0]}]
    first = ask(client, messages, agent)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": ASK[1]},
    ]
    stack.sdk.wait_durable("default", agent)
    stack.restart_worker()
    return first, messages


def test_after_a_worker_restart_the_next_call_is_warm(stack):
    client = stack.client()
    fresh = sdk_turns(stack, "restart-twin", ASK[:2])
    first, messages = said_then_restarted(stack, client, "restarted")
    reply = ask(client, messages, "restarted")
    assert reply.agentkv["cache_state"] == "warm" and not reply.agentkv["restore_failure"]
    held = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert reply.usage.prompt_tokens_details.cached_tokens == held
    assert reply.choices[0].message.content == fresh[1].text


def test_an_agent_prefetched_after_a_worker_restart_answers_hot(stack):
    client = stack.client()
    first, messages = said_then_restarted(stack, client, "prefetched")
    fetched = raw(stack.gateway.address, "POST", "/v1/agents/prefetched/prefetch")
    assert fetched.status == 200, fetched.text
    body = fetched.json()
    assert (body["agent_id"], body["namespace"], body["cache_state"]) == (
        "prefetched", "default", "warm")  # fmt: skip
    assert body["restored_bytes"] > 0 and not body["restore_failure"]
    reply = ask(client, messages, "prefetched")
    assert reply.agentkv["cache_state"] == "hot"  # restored before the call came
    held = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert reply.usage.prompt_tokens_details.cached_tokens == held  # as without a restart
    pinned = raw(stack.gateway.address, "POST", "/v1/agents/prefetched/pin").json()
    assert pinned["pinned"] and pinned["tier"] == "hot" and pinned["agent_id"] == "prefetched"
    assert not raw(stack.gateway.address, "POST", "/v1/agents/prefetched/unpin").json()["pinned"]
    missing = raw(stack.gateway.address, "POST", "/v1/agents/nobody/prefetch")
    assert missing.status == 404 and missing.json()["error"]["code"] == "not_found"
    bad = raw(stack.gateway.address, "POST", "/v1/agents/bad%20id/prefetch")
    assert bad.status == 400


def test_an_edited_history_answers_as_a_fresh_agent(stack):
    client = stack.client()
    messages = [{"role": "system", "content": SYSTEM}]
    for question in ASK:
        messages.append({"role": "user", "content": question})
        messages.append(
            {
                "role": "assistant",
                "content": ask(client, messages, "editor").choices[0].message.content,
            }
        )
    # A middle message changed: the reply is a fresh agent's told the edited history.
    changed = [*messages[:3], {"role": "user", "content": "And of Spain?"}]
    reply = ask(client, changed, "editor")
    want = sdk_turns(stack, "fresh-changed", [ASK[0], "And of Spain?"])[-1]
    assert reply.choices[0].message.content == want.text
    assert reply.usage.prompt_tokens_details.cached_tokens > 0  # up to the edit
    # The last exchange dropped: the second question asked again.
    reply = ask(client, messages[:4], "editor")
    want = sdk_turns(stack, "fresh-dropped", ASK[:2])[-1]
    assert reply.choices[0].message.content == want.text
    assert stack.stored_tokens("editor") == stack.stored_tokens("fresh-dropped")


def test_requests_without_identity_share_a_stored_system_prompt(stack):
    client = stack.client()
    replies = []
    for question in ("Which city is the capital of Spain?", "Which city is the capital of Norway?"):
        messages = [
            {"role": "system", "content": LONG_SYSTEM},
            {"role": "user", "content": question},
        ]
        replies.append(ask(client, messages))
    first, second = replies
    assert first.agentkv["agent_id"] != second.agentkv["agent_id"]  # two conversations
    assert first.agentkv["reused_store_tokens"] == 0
    shared = second.agentkv["reused_store_tokens"]
    assert shared > 64  # the system prompt's blocks (107 tokens), stored by the first
    assert second.usage.prompt_tokens_details.cached_tokens == shared
    assert second.agentkv["prefilled_tokens"] == first.agentkv["prefilled_tokens"] - shared


def error_of(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    body = caught.value.body
    assert isinstance(body, dict) and {"message", "type", "code"} <= set(body), body
    return caught.value


def test_bad_requests_get_openais_error_format(stack):
    client = stack.client()
    messages = [{"role": "user", "content": "Hello."}]
    cases = [
        (dict(model="gpt-4o"), 404, "model_not_found"),
        (  # a custom tool: agentkv calls only functions
            dict(tool_choice={"type": "custom", "custom": {"name": "f"}}),
            400,
            "unsupported_value",
        ),
        (dict(tools=[{"type": "custom", "custom": {"name": "f"}}]), 400, "unsupported_value"),
        (dict(n=2), 400, "unsupported_value"),
        (dict(tool_choice="required"), 400, "unsupported_value"),  # this model has no calls
        (dict(frequency_penalty=0.5), 400, "unsupported_value"),
        (dict(temperature=3), 400, None),
        (dict(messages=[]), 400, None),
        (  # a tool's result answering no call
            dict(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]),
            400,
            None,
        ),
        (
            dict(messages=[*messages, {"role": "assistant", "content": "Hi"}]),
            400,
            "unsupported_value",
        ),
        (dict(max_tokens=100_000), 400, "context_length_exceeded"),
        (dict(extra_body={"beam_width": 4}), 400, "unsupported_parameter"),
        (dict(stream_options={"include_usage": True}), 400, None),  # without stream: true
    ]
    for options, status, code in cases:
        request = {"model": MODEL, "messages": messages, "max_tokens": 4, **options}
        error = error_of(lambda r=request: client.chat.completions.create(**r))
        assert error.status_code == status, (options, error)
        if code:
            assert error.body["code"] == code, (options, error.body)
    address, path = stack.gateway.address, "/v1/chat/completions"
    bad_json = raw(address, "POST", path, b"{not json")
    assert bad_json.status == 400 and "not JSON" in bad_json.json()["error"]["message"]
    huge = raw(address, "POST", path, b"x" * (9 << 20))
    assert huge.status == 413 and huge.json()["error"]["code"] == "request_too_large"
    deep = raw(address, "POST", path, b"[" * 50_000 + b"]" * 50_000)
    assert deep.status == 400 and "nested too deeply" in deep.json()["error"]["message"]
    long = raw(address, "POST", path, b'{"max_tokens": ' + b"1" * 5000 + b"}")
    said = long.json()["error"]["message"]  # the red team's: Python's advice, to a caller
    assert long.status == 400 and "4300 digits" in said and "sys." not in said, said
    surrogate = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]})
    lone = raw(address, "POST", path, surrogate.encode())
    assert lone.status == 400 and lone.json()["error"]["param"] == "messages[0].content"
    form = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"title": "\ud800"}}}
    body = json.dumps({"model": MODEL, "messages": messages, "response_format": form})
    in_schema = raw(address, "POST", path, body.encode())  # was a 500, from the worker's stub
    assert in_schema.status == 400, in_schema
    assert in_schema.json()["error"]["param"] == "response_format.json_schema.schema"
    encoded = surrogate.replace("\\ud800", "\ud800").encode(errors="surrogatepass")
    assert b"\xed\xa0\x80" in encoded  # the surrogate's bytes, which no UTF-8 text holds
    not_utf8 = raw(address, "POST", path, encoded)
    assert not_utf8.status == 400, not_utf8
    assert "not UTF-8" in not_utf8.json()["error"]["message"]
    for number in ("1e999", "NaN", "-Infinity"):  # Python's JSON takes them; a reply of them
        schema = {"type": "object", "properties": {"n": {"type": "number", "maximum": 0}}}
        form = {"type": "json_schema", "name": "n", "schema": schema}  # is echoed back
        body = json.dumps({"model": MODEL, "input": "x", "text": {"format": form}})
        body = body.replace('"maximum": 0', f'"maximum": {number}')
        refused = raw(address, "POST", "/v1/responses", body.encode())
        assert refused.status == 400, (number, refused)
        assert number in refused.json()["error"]["message"], refused.json()
    nowhere = raw(address, "GET", "/v1/completions")
    assert nowhere.status == 404 and "error" in nowhere.json()
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4}).encode()
    accented = raw(address, "POST", path, body, X_Agent_Id="agént".encode())  # UTF-8 bytes
    assert accented.status == 400, accented
    assert "invalid X-Agent-Id 'agént'" in accented.json()["error"]["message"]


def test_a_refused_first_call_leaves_no_agent_behind(stack):
    """A call refused before its turn ran (its context and max_tokens past the model's
    window) leaves no agent it made, named or anonymous, so failing requests do not grow
    the store. (The anonymous agent's id is learnt from a call that ran, then deleted.)"""
    from agentkv.errors import AgentNotFound

    client = stack.client()
    messages = [{"role": "user", "content": "A question asked once, and refused."}]
    ran = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=1, temperature=0
    )
    anonymous = ran.headers["x-agentkv-agent-id"]
    with WorkerClient(stack.worker_address) as worker:
        assert worker.delete("default", anonymous)
        for agent in ("refused-first", None):
            error = error_of(lambda a=agent: ask(client, messages, a, max_tokens=100_000))
            assert error.status_code == 400 and error.body["code"] == "context_length_exceeded"

        def gone(agent_id: str) -> bool:
            try:
                worker.describe("default", agent_id)
            except AgentNotFound:
                return True
            return False

        until(lambda: gone("refused-first") and gone(anonymous), "the refused calls' agents")


def test_tools_for_a_model_without_a_tool_call_format_are_a_400(stack):
    """SmolLM2's chat template has no tool-call format mlx-lm knows: its worker refuses tools
    (the model's calls would come back as text), for a new agent and for one that exists."""
    client = stack.client()
    with WorkerClient(stack.worker_address) as worker:
        assert worker.info().tool_parser == ""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    ask(client, messages, "no-tools")  # made without tools
    for agent, stream in ((None, False), (None, True), ("no-tools", False)):
        error = error_of(lambda a=agent, s=stream: ask(client, messages, a, tools=tools, stream=s))
        assert error.status_code == 400 and error.body["code"] == "invalid_argument"
        assert "tool-call format" in error.body["message"], error.body


# "anon-named" is a name given, not an anonymous agent's: no agent of its own when busy
@pytest.mark.parametrize("agent", ["busy", "anon-named"])
def test_a_second_call_while_the_agent_is_busy_is_a_409(stack, agent):
    client = stack.client()
    messages = [{"role": "user", "content": "Count from one to fifty in words."}]
    stream = ask(client, messages, agent, stream=True, max_tokens=120)
    next(iter(stream))  # the turn is in flight
    error = error_of(lambda: ask(client, messages, agent))
    assert error.status_code == 409 and "in progress" in error.body["message"]
    # the agent's turn under way ends: worth sending again, after a second
    assert (error.response.headers["x-should-retry"], error.response.headers["retry-after"]) == (
        "true",
        "1",
    )
    stream.close()


def eventually(check: Callable[[], bool], what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def agent_of(stream: openai.Stream) -> str:
    return stream.response.headers["x-agentkv-agent-id"]


@pytest.mark.parametrize("scope", [{"user": "end-user-7"}, {"prompt_cache_key": "support-v1"}])
def test_calls_sharing_a_user_or_cache_key_are_conversations_apart(stack, scope):
    """OpenAI's `user` names an end user and `prompt_cache_key` a group of requests, never
    one conversation: two conversations of one user at once are no 409, and each keeps its
    own agent, whose cache the other does not overwrite."""
    client = stack.client()
    key = next(iter(scope.values()))
    story = [{"role": "user", "content": f"Write a long story about a lighthouse. ({key})"}]
    stream = ask(client, story, stream=True, max_tokens=400, extra_body=scope)
    next(iter(stream))  # the first conversation's turn is in flight
    asked = [{"role": "user", "content": f"{ASK[0]} ({key})"}]
    reply = ask(client, asked, extra_body=scope)
    busy = agent_of(stream)
    stream.close()
    assert reply.agentkv["agent_id"] != busy and busy.startswith("anon-")
    # One after the other: the story, then the question resent with another.
    ask(client, story, max_tokens=8, extra_body=scope)
    asked += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": ASK[1]},
    ]
    again = ask(client, asked, extra_body=scope)
    assert again.agentkv["agent_id"] == reply.agentkv["agent_id"]
    held = reply.usage.prompt_tokens + reply.usage.completion_tokens - 1
    assert again.usage.prompt_tokens_details.cached_tokens == held


class WorkerProxy:
    """A gRPC proxy in front of a worker that forwards every call; `_hold` holds one back
    before it is forwarded. `linger`: a Turn its caller cancels runs on at the worker until
    its agent's deletion has been refused that many times, as a turn whose step is long
    (a big prefill on a busy worker) ends late."""

    def __init__(self, worker: str, linger: int = 0, listen: str = "127.0.0.1:0") -> None:
        self.channel, self.linger = grpc.insecure_channel(worker), linger
        self.turns: dict[str, grpc.Future] = {}  # agent -> its last Turn, when lingering
        self.refused: Counter[str] = Counter()  # agent -> deletions refused (mid-turn)
        self.forwarded: Counter[str] = Counter()  # agent -> reply tokens passed on
        handler = grpc.method_handlers_generic_handler("agentkv.worker.v1.InferenceWorker", {
            name: grpc.unary_unary_rpc_method_handler(partial(self._unary, name))
            for name in ("CreateAgent", "DescribeAgent", "DeleteAgent", "GetWorkerInfo")
        } | {"Turn": grpc.unary_stream_rpc_method_handler(self._turn)})  # fmt: skip
        self.pool = ThreadPoolExecutor(16)
        self.server = grpc.server(self.pool, handlers=[handler], options=ALLOW_KEEPALIVE)
        self.address = f"127.0.0.1:{self.server.add_insecure_port(listen)}"
        self.server.start()

    def _hold(self, name: str, request: bytes, context: Any) -> Callable[[], None]:
        """Waits as the call's test needs; returns what to do at each Turn response."""
        return lambda: None

    def _unary(self, name: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._hold(name, request, context)
        method = self.channel.unary_unary(f"/agentkv.worker.v1.InferenceWorker/{name}")
        try:
            return method(request, timeout=context.time_remaining())
        except grpc.RpcError as exc:
            if name == "DeleteAgent" and exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                agent = pb.DeleteAgentRequest.FromString(request).agent_id
                self.refused[agent] += 1
                if self.refused[agent] >= self.linger and agent in self.turns:
                    self.turns[agent].cancel()
            _forward_error(exc, context)

    def _turn(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        responded = self._hold("Turn", request, context)
        agent = pb.TurnRequest.FromString(request).agent_id
        method = self.channel.unary_stream("/agentkv.worker.v1.InferenceWorker/Turn")
        responses = method(request, timeout=context.time_remaining())
        if self.linger:
            self.turns[agent] = responses
        else:
            context.add_callback(responses.cancel)
        try:
            for response in responses:
                responded()
                self.forwarded[agent] += len(pb.TurnResponse.FromString(response).tokens.token_ids)
                yield response
        except grpc.RpcError as exc:
            _forward_error(exc, context)

    def __enter__(self) -> WorkerProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(None)
        self.channel.close()
        self.pool.shutdown(wait=False)


class HeldWorker(WorkerProxy):
    """Makes two identical new calls race where the gateway meets them: each CreateAgent
    waits until `creates` have come (every call found no agent before any made it), then
    each Turn waits until the first Turn after them has sent its first response (every
    other call finds that turn in progress)."""

    def __init__(self, worker: str, creates: int = 2) -> None:
        self.creates, self.released, self.streaming = creates, threading.Event(), threading.Event()
        self.lock, self.leader = threading.Lock(), False
        super().__init__(worker)

    def _hold(self, name: str, request: bytes, context: Any) -> Callable[[], None]:
        if name == "CreateAgent":
            with self.lock:
                self.creates -= 1
                if self.creates <= 0:
                    self.released.set()
            self.released.wait(60)
        if name != "Turn":
            return lambda: None
        with self.lock:
            lead = self.released.is_set() and not self.leader
            self.leader = self.leader or lead
        if self.released.is_set() and not lead:
            self.streaming.wait(60)
        return self.streaming.set if lead else lambda: None


class StalledWorker(WorkerProxy):
    """Holds each Turn of the `agents` chosen after `sent` responses (0: a turn still queued
    or prefilling, 1: a reply still running, however fast the worker is: its prompt's usage
    came, and its first token is held back) until `released`.
    `stalled`: each agent as its Turn stalls; `ended`: as that Turn ends (cancelled)."""

    def __init__(self, worker: str, sent: int = 1, agents: Callable[[str], bool] = bool) -> None:
        self.sent, self.agents, self.released = sent, agents, threading.Event()
        self.stalled: queue.Queue[str] = queue.Queue()
        self.ended: queue.Queue[str] = queue.Queue()
        super().__init__(worker)

    def _hold(self, name: str, request: bytes, context: Any) -> Callable[[], None]:
        agent = pb.TurnRequest.FromString(request).agent_id if name == "Turn" else ""
        if not self.agents(agent):
            return lambda: None
        sent = []

        def responded() -> None:
            if len(sent) == self.sent:
                self.stalled.put(agent)
                context.add_callback(lambda: self.ended.put(agent))
                self.released.wait(60)
            sent.append(agent)

        return responded

    def __exit__(self, *exc: object) -> None:
        self.released.set()
        super().__exit__(*exc)


class HeldCreation(StalledWorker):
    """Holds each CreateAgent of the `agents` chosen, before it reaches the worker, until
    `released` (its Turns pass). `stalled`: each agent as its CreateAgent is held; `ended`:
    as the worker has answered it, whether or not its caller still waits."""

    def _hold(self, name: str, request: bytes, context: Any) -> Callable[[], None]:
        return lambda: None

    def _unary(self, name: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        agent = pb.CreateAgentRequest.FromString(request).agent_id if name == "CreateAgent" else ""
        held = self.agents(agent)
        if held:
            self.stalled.put(agent)
            self.released.wait(60)
        try:
            return super()._unary(name, request, context)
        finally:
            if held:
                self.ended.put(agent)


def _forward_error(exc: grpc.RpcError, context: grpc.ServicerContext) -> None:
    context.set_trailing_metadata(exc.trailing_metadata() or ())
    context.abort(exc.code(), exc.details())


def test_two_identical_new_anonymous_calls_at_once_get_an_agent_each(stack):
    with HeldWorker(stack.worker_address) as proxy:
        gateway = stack.start_gateway([proxy.address], name="raced")
        try:
            client = stack.client(gateway)
            messages = [{"role": "user", "content": "Count from one to fifty in words. (raced)"}]
            with ThreadPoolExecutor(2) as pool:
                calls = [pool.submit(ask, client, messages, max_tokens=120) for _ in range(2)]
                replies = [call.result() for call in calls]
            first, second = sorted(replies, key=lambda r: r.agentkv["agent_id"])
            own, spare = first.agentkv["agent_id"], second.agentkv["agent_id"]
            assert own.startswith("anon-") and spare.startswith(f"{own}-")
            assert first.choices[0].message.content == second.choices[0].message.content
            # Nothing reaches the spare again (the conversation's next call goes to its own
            # agent): it is deleted once its reply has ended.
            eventually(lambda: not agent_exists(stack, spare), f"{spare} was left behind")
            assert agent_exists(stack, own)
        finally:
            gateway.stop()


def test_an_anonymous_call_whose_agent_is_busy_gets_a_spare_deleted_after_it(stack):
    """The same conversation sent while its turn runs, as a "regenerate" right after "stop"
    does before the stopped turn has ended: an agent of its own, which nothing reaches
    again, deleted once its reply ends, whole or abandoned."""
    client = stack.client()
    messages = [{"role": "user", "content": "Write a long story about a lighthouse. (spare)"}]
    stream = ask(client, messages, stream=True, max_tokens=400)
    next(iter(stream))  # the conversation's turn is in flight
    own = agent_of(stream)
    whole = ask(client, messages, max_tokens=4).agentkv["agent_id"]
    abandoned = ask(client, messages, stream=True, max_tokens=400)
    next(iter(abandoned))
    abandoned.close()
    stream.close()
    spares = [whole, agent_of(abandoned)]
    assert all(spare.startswith(f"{own}-") for spare in spares) and len(set(spares)) == 2
    for spare in spares:
        eventually(lambda s=spare: not agent_exists(stack, s), f"{spare} was left behind")
    assert agent_exists(stack, own)


def test_a_stopped_gateway_deletes_its_spare_agents_before_it_exits(stack):
    """SIGTERM drains: a spare whose turn is still ending (its client gone) is deleted once
    that turn ends, before the gateway exits. The turn ends at its third refused deletion,
    after the gateway's stop has begun (the deletion's tries are 0.25 s, then 0.5 s apart)."""
    with WorkerProxy(stack.worker_address, linger=3) as proxy:
        gateway = stack.start_gateway([proxy.address], name="stopped")
        try:
            client = stack.client(gateway)
            messages = [{"role": "user", "content": "Write a long story about a mill. (stop)"}]
            streams = [ask(client, messages, stream=True, max_tokens=150) for _ in range(2)]
            for stream in streams:
                next(iter(stream))  # the second's is a spare: the first's turn is in flight
            own, spare = map(agent_of, streams)
            assert spare.startswith(f"{own}-")
            for stream in streams:
                stream.close()
            assert gateway.stop() == 0, gateway.log_tail()
            assert not agent_exists(stack, spare), f"{spare} outlived the gateway"
            assert agent_exists(stack, own)
        finally:
            gateway.stop()


def stop_creating_a_spare(stack, gateway, proxy, pool, tag: str) -> tuple[str, Any]:
    """Has `gateway` make a spare agent (its conversation's own is busy) whose CreateAgent
    `proxy` holds, then SIGTERMs it: the spare's id, and its call (a Future)."""
    client = stack.client(gateway)
    messages = [{"role": "user", "content": f"Write a long story about a mill. ({tag})"}]
    busy = ask(client, messages, stream=True, max_tokens=400)
    next(iter(busy))  # the conversation's own agent is busy: the next call's is a spare
    call = pool.submit(ask, client, messages, max_tokens=8)
    spare = proxy.stalled.get(timeout=60)
    busy.close()
    gateway.proc.send_signal(signal.SIGTERM)
    return spare, call


def test_a_stopped_gateway_deletes_a_spare_whose_creation_outlived_the_drain(stack):
    """A spare's CreateAgent still running when the drain ends (its request cancelled) makes
    the agent all the same: the gateway deletes it once made, not before, then exits."""
    with (
        HeldCreation(stack.worker_address, agents=is_spare) as proxy,
        ThreadPoolExecutor(1) as pool,
    ):
        gateway = stack.start_gateway([proxy.address], name="stopped-creating")
        try:
            spare, call = stop_creating_a_spare(stack, gateway, proxy, pool, "made")
            drained = "timeout graceful shutdown exceeded"  # uvicorn cancels the request
            eventually(lambda: drained in gateway.log_path.read_text(), "the drain did not end")
            proxy.released.set()
            assert proxy.ended.get(timeout=60) == spare  # the worker has made it
            assert gateway.proc.wait(60) == 0, gateway.log_tail()
            assert not agent_exists(stack, spare), f"{spare} outlived the gateway"
            error = error_of(call.result)
            assert error.status_code == 503 and error.body["code"] == "unavailable"
        finally:
            gateway.stop()


def test_a_stop_leaves_a_spare_its_hung_worker_holds_and_names_it(stack):
    """A spare whose CreateAgent the worker holds (hung: it answers pings, not calls) kept
    the stop waiting for that call's deadline, --timeout (5 minutes), then for its delete's.
    The stop now waits --cleanup-seconds, names the spare left in its log, and exits."""
    with (
        HeldCreation(stack.worker_address, agents=is_spare) as proxy,
        ThreadPoolExecutor(1) as pool,
    ):
        gateway = stack.start_gateway([proxy.address], "--cleanup-seconds", "1", name="left")
        try:
            spare, call = stop_creating_a_spare(stack, gateway, proxy, pool, "left")
            assert gateway.proc.wait(30) == 0, gateway.log_tail()  # the proxy holds it 60 s
            lines = gateway.log_tail(200_000).splitlines()
            logged = [json.loads(line) for line in lines if line.startswith("{")]
            (said,) = [entry for entry in logged if entry["event"].startswith("spare agents")]
            assert said["agents"] == [spare] and said["level"] == "warning", said
            assert error_of(call.result).status_code == 503
        finally:
            proxy.released.set()
            gateway.stop()


class HungInfo(WorkerProxy):
    """A worker that answers all but GetWorkerInfo, which it holds (hung) until it closes."""

    def __init__(self, worker: str) -> None:
        self.closing = threading.Event()
        super().__init__(worker)

    def _hold(self, name: str, request: bytes, context: Any) -> Callable[[], None]:
        if name == "GetWorkerInfo":
            self.closing.wait(120)
        return lambda: None

    def __exit__(self, *exc: object) -> None:
        self.closing.set()
        super().__exit__(*exc)


def test_a_response_continued_while_its_worker_hangs_goes_on_at_the_next(stack):
    """previous_response_id asks the agent's worker whether it knows after_mark first; one
    that does not answer within 5 s is passed by as a dead one is (before: a 503 for every
    such call until the SDK's routing had marked it down by other calls, ~25 s)."""
    with HungInfo(stack.worker_address) as hung:
        workers = [hung.address, stack.worker_address]
        gateway = stack.start_gateway(workers, name="hung-info")
        try:
            client = stack.client(gateway)
            # An agent whose worker is the hung one (rendezvous order, as the SDK routes).
            agent = homed_at(hung.address, workers, "default", "hung-")
            named = {"X-Agent-Id": agent}
            first = client.responses.create(
                model=MODEL, input=ASK[0], max_output_tokens=4, extra_headers=named
            )
            then = client.responses.create(
                model=MODEL, input=ASK[1], max_output_tokens=4, extra_headers=named,
                previous_response_id=first.id,
            )  # fmt: skip
            assert then.error is None and then.output_text, then  # (incomplete: 4 tokens)
            assert then.usage.input_tokens_details.cached_tokens > 0  # went on from first
        finally:
            gateway.stop()


MILL = [{"role": "user", "content": "Write a long story about a mill."}]


def opened_stream(client: openai.OpenAI, agent: str) -> Iterator:
    """A long streamed reply of `agent`'s, its first chunk read."""
    chunks = iter(ask(client, MILL, agent, stream=True, max_tokens=200))
    next(chunks)
    return chunks


def test_replies_still_running_when_a_stop_has_drained_end_with_a_503(stack):
    """SIGTERM gives replies in flight the drain's 10 s; one still running then ends as the
    worker's do, with 503 `unavailable` (send it again): OpenAI's error JSON, an error event
    once streaming, and no traceback in the log."""
    with StalledWorker(stack.worker_address) as proxy, ThreadPoolExecutor(1) as pool:
        gateway = stack.start_gateway([proxy.address], name="drained")
        try:
            client, messages = stack.client(gateway), MILL
            chunks = opened_stream(client, "drained-stream")
            events = iter(client.responses.create(
                model=MODEL, input=messages, stream=True, max_output_tokens=200,
                extra_headers={"X-Agent-Id": "drained-responses"},
            ))  # fmt: skip
            opened = [next(events) for _ in range(2)]  # created, in progress
            whole = pool.submit(ask, client, messages, "drained-whole", max_tokens=200)
            started = {proxy.stalled.get(timeout=60) for _ in range(3)}
            assert started == {"drained-stream", "drained-whole", "drained-responses"}
            gateway.proc.send_signal(signal.SIGTERM)
            error = error_of(whole.result)
            assert error.status_code == 503 and error.body["code"] == "unavailable"
            with pytest.raises(openai.APIError, match="stopping") as cut:
                list(chunks)
            assert cut.value.body["code"] == "unavailable"
            # the Responses stream: its error event, next in sequence, then response.failed
            sent = opened + list(events)
            assert [e.type for e in sent[-2:]] == ["error", "response.failed"]
            assert [e.sequence_number for e in sent] == list(range(len(sent)))
            assert sent[-2].code == "unavailable" and "stopping" in sent[-2].message
            assert sent[-1].response.error.code == "server_error"  # OpenAI's types' word
            assert gateway.proc.wait(60) == 0
            log = gateway.log_tail(200_000)
            assert "Traceback" not in log
            assert "timeout graceful shutdown exceeded" in log  # uvicorn's, as a warning
            assert '"level": "error"' not in log, log
        finally:
            gateway.stop()


def test_a_worker_gone_mid_reply_is_a_503_that_says_send_it_again(stack):
    """A worker that goes away mid-reply (its link cut) ends the reply with 503 `unavailable`
    in an HTTP client's terms (send it again), not the SDK's (describe() the agent)."""
    with StalledWorker(stack.worker_address, sent=2) as proxy, ThreadPoolExecutor(1) as pool:
        gateway = stack.start_gateway([proxy.address], name="cut-link")
        try:
            client, messages = stack.client(gateway), MILL
            chunks = opened_stream(client, "cut-stream")
            whole = pool.submit(ask, client, messages, "cut-whole", max_tokens=200)
            assert {proxy.stalled.get(timeout=60) for _ in range(2)} == {"cut-stream", "cut-whole"}
            proxy.server.stop(0)  # each reply has its first chunk of tokens (a busy worker's
            # stream sends those queued while it was sending as one chunk)

            def said(agent: str) -> str:
                n = proxy.forwarded[agent]
                count = "1 token" if n == 1 else f"{n} tokens"
                return f"the worker went away after {count} of the reply; send the request again"

            error = error_of(whole.result)
            assert error.status_code == 503 and error.body["code"] == "unavailable"
            assert proxy.forwarded["cut-whole"] >= 1 and error.body["message"] == said("cut-whole")
            with pytest.raises(openai.APIError) as cut:
                list(chunks)
            assert cut.value.body["code"] == "unavailable"
            assert proxy.forwarded["cut-stream"] >= 1 and cut.value.message == said("cut-stream")
        finally:
            gateway.stop()


def test_a_turn_past_the_gateways_timeout_is_a_504_naming_the_flag(stack):
    with StalledWorker(stack.worker_address) as proxy:
        gateway = stack.start_gateway([proxy.address], "--timeout", "3", name="timed")
        try:
            messages = [{"role": "user", "content": "Write a long story about a mill."}]
            sent = []  # each request the openai client sends, its retries among them
            hooks = {"request": [sent.append]}
            client = stack.client(
                gateway, max_retries=2, http_client=httpx2.Client(event_hooks=hooks)
            )
            error = error_of(lambda: ask(client, messages, "timed", max_tokens=50))
            assert error.status_code == 504 and error.body["code"] == "deadline_exceeded"
            assert "within the gateway's --timeout" in error.body["message"]
            # A retry would run out of time as well: the client is told not to send one
            # (before, it sent the call three times, 9 s of the worker's time for one 504).
            assert error.response.headers["x-should-retry"] == "false" and len(sent) == 1
        finally:
            gateway.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_gone_before_its_first_token_cancels_its_turn_and_spare_then(stack, stream):
    """A client that leaves while its turn waits for its first token (queued, or in a long
    prefill; held back here) cancels that turn at once, which deletes its spare agent: not
    once the first token comes."""
    with StalledWorker(stack.worker_address, sent=0, agents=is_spare) as proxy:
        gateway = stack.start_gateway([proxy.address], name=f"left-{stream}")
        try:
            messages = [{"role": "user", "content": f"Write a long story about a mill. ({stream})"}]
            busy = ask(stack.client(gateway), messages, stream=True, max_tokens=400)
            next(iter(busy))  # the conversation's own agent is busy: the next call's is a spare
            body = {"model": MODEL, "messages": messages, "stream": stream, "max_tokens": 8}
            host, port = gateway.address.rsplit(":", 1)
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            conn.request("POST", "/v1/chat/completions", json.dumps(body))
            spare = proxy.stalled.get(timeout=60)
            conn.close()
            assert proxy.ended.get(timeout=30) == spare, "the turn went on without its client"
            busy.close()
            eventually(lambda: not agent_exists(stack, spare), f"{spare} was left behind")
        finally:
            gateway.stop()


def is_spare(agent: str) -> bool:
    return agent.startswith("anon-") and agent.count("-") == 2  # anon-DIGEST-SPARE


def test_a_client_that_goes_away_cancels_its_turn(stack):
    client = stack.client()
    messages = [{"role": "user", "content": "Write a long story about a lighthouse."}]
    stream = ask(client, messages, "leaver", stream=True, max_tokens=400)
    chunks = iter(stream)
    next(chunks), next(chunks)
    stream.close()
    # The turn ends long before its 400 tokens: the agent takes a new turn once it has.
    deadline = time.monotonic() + 60
    while True:
        try:
            reply = ask(client, messages, "leaver", max_tokens=2)
            break
        except openai.ConflictError:
            assert time.monotonic() < deadline, "the abandoned turn kept running"
    assert reply.choices[0].finish_reason == "length"
    state = stack.sdk.describe("default", "leaver")
    assert state.num_tokens < 200  # the abandoned reply stopped short of its 400 tokens


def test_a_client_that_leaves_a_whole_reply_cancels_it_without_a_traceback(stack):
    messages = [{"role": "user", "content": "Write a long story about a harbour."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 400, "temperature": 0}
    host, port = stack.gateway.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"X-Agent-Id": "whole-leaver"})
    deadline = time.monotonic() + 60
    while not agent_exists(stack, "whole-leaver"):  # made by the call, which then takes its turn
        assert time.monotonic() < deadline, stack.gateway.log_tail()
        time.sleep(0.05)
    conn.close()
    while True:  # the abandoned turn ends long before its 400 tokens
        try:
            reply = ask(stack.client(), messages, "whole-leaver", max_tokens=2)
            break
        except openai.ConflictError:
            assert time.monotonic() < deadline, "the abandoned turn kept running"
    assert reply.choices[0].finish_reason == "length"
    assert stack.sdk.describe("default", "whole-leaver").num_tokens < 200
    assert "Traceback" not in stack.gateway.log_tail(200_000)


def agent_exists(stack: Stack, agent: str) -> bool:
    from agentkv.errors import AgentNotFound

    try:
        stack.sdk.describe("default", agent)
        return True
    except AgentNotFound:
        return False


def test_tokens_name_the_namespace_and_keep_tenants_apart(stack, tmp_path):
    table = tmp_path / "tokens.json"
    table.write_text(json.dumps({"tokens": [
        {"name": "a", "token": "token-a-0123456789", "namespaces": ["team-a"]},
        {"name": "b", "token": "token-b-0123456789", "namespaces": ["team-b"]},
    ]}))  # fmt: skip
    table.chmod(0o600)
    gateway = stack.start_gateway([stack.worker_address], "--auth-tokens", str(table), name="auth")
    try:
        messages = [{"role": "user", "content": "Say hello."}]
        anonymous = stack.client(gateway, api_key="wrong")
        assert error_of(lambda: ask(anonymous, messages, "x")).status_code == 401
        health = raw(gateway.address, "GET", "/health")  # a probe needs no token
        assert health.status == 200 and health.json() == {"status": "ok"}  # nor sees workers
        assert raw(gateway.address, "GET", "/health", authorization="Bearer wrong").status == 401
        health = raw(gateway.address, "GET", "/health", authorization="Bearer token-b-0123456789")
        assert health.json()["workers"] == {stack.worker_address: "serving"}
        team_a = stack.client(gateway, api_key="token-a-0123456789")
        reply = ask(team_a, messages, "alice")
        assert reply.agentkv["namespace"] == "team-a"
        before = stack.stored_tokens("alice", "team-a")
        other = stack.client(
            gateway, api_key="token-a-0123456789", default_headers={"X-Namespace": "team-b"}
        )
        error = error_of(lambda: ask(other, messages, "alice"))
        assert error.status_code == 403 and error.body["code"] == "permission_denied"
        team_b = stack.client(gateway, api_key="token-b-0123456789")
        assert ask(team_b, messages, "alice").agentkv["namespace"] == "team-b"  # its own alice
        assert stack.stored_tokens("alice", "team-a") == before  # A's agent untouched
    finally:
        gateway.stop()


def test_an_ipv6_address_is_logged_and_written_in_brackets(stack):
    """[::1]:PORT, as a URL and every HOST:PORT parser takes it (::1:PORT is neither)."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    address_file = stack.root / "ipv6.json"
    flags = ("--address-file", str(address_file))
    gateway = stack.start_gateway([stack.worker_address], *flags, name="ipv6", listen="[::1]:0")
    try:
        assert re.fullmatch(r"\[::1\]:\d+", gateway.address), gateway.address
        eventually(address_file.exists, "no --address-file was written")
        assert json.loads(address_file.read_text()) == {"address": gateway.address}
        assert [m.id for m in stack.client(gateway).models.list()] == [MODEL]
    finally:
        gateway.stop()


def test_no_worker_is_a_503(stack):
    gateway = stack.start_gateway([free_address()], name="no-worker")
    try:
        client = stack.client(gateway)
        error = error_of(lambda: ask(client, [{"role": "user", "content": "Hi."}], "x"))
        assert error.status_code == 503
        # sent again once the client's own backoff has passed the retry-after second
        sent = []
        hooks = {"request": [sent.append]}
        client = stack.client(gateway, max_retries=1, http_client=httpx2.Client(event_hooks=hooks))
        again = error_of(lambda: ask(client, [{"role": "user", "content": "Hi."}], "x"))
        assert again.response.headers["x-should-retry"] == "true" and len(sent) == 2
        assert raw(gateway.address, "GET", "/health").status == 503
    finally:
        gateway.stop()


def test_an_anonymous_conversation_sent_to_gateways_of_two_models_gets_an_agent_each(stack):
    """Two gateways on one store and namespace serving other models (here the same weights
    stored in other blocks: another fingerprint): an anonymous conversation sent to both
    finds its own agent on each, not a 409 for the other model's."""
    other = worker_process(
        str(stack.model), stack.store.address, stack.root / "other.log",
        extra_args=["--block-tokens", "128"],
    ).start()  # fmt: skip
    gateway = stack.start_gateway([other.address], name="other-model")
    try:
        messages = [{"role": "user", "content": "Name three rivers. (two models)"}]
        first = ask(stack.client(), messages)
        own = first.agentkv["agent_id"]
        stack.sdk.wait_durable("default", own)  # in the store, where the other model meets it
        second = ask(stack.client(gateway), messages)
        theirs = second.agentkv["agent_id"]
        assert own.startswith("anon-") and theirs.startswith(f"{own}-") and theirs != own
        assert ask(stack.client(gateway), messages).agentkv["agent_id"] == theirs
        assert ask(stack.client(), messages).agentkv["agent_id"] == own
    finally:
        gateway.stop()
        other.stop()
