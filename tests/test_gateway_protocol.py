"""The gateway's OpenAI wire format without a server: what a request body becomes, what is
refused (never ignored), every gRPC status as an HTTP status, and how an agent is named."""

from __future__ import annotations

import asyncio
import copy
import gc
import hashlib
import json
import pickle

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv import errors
from agentkv.client.worker_core import ReplyCutOff, cut_off
from agentkv.gateway.completion import Completion, finish_reason, usage_json, with_creation
from agentkv.gateway.errors import HTTPError
from agentkv.gateway.protocol import agent_id, parse_chat
from agentkv.gateway.turns import to_the_end
from agentkv.worker.v1 import worker_pb2 as pb

BODY = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def parsed(**fields):
    return parse_chat({**BODY, **fields}, default_max_tokens=64)


def test_a_request_maps_to_the_workers_sampling():
    call = parsed(temperature=0, top_p=0.5, max_completion_tokens=9, stop="END", seed=7)
    assert call.sampling == {"temperature": 0.0, "top_p": 0.5, "max_tokens": 9, "stop": ["END"],
                             "seed": 7}  # fmt: skip
    # OpenAI's defaults: with no max_tokens, the reply may fill what room the context has
    assert parsed().sampling == {"temperature": 1.0, "max_tokens": 64, "fit_max_tokens": True}
    assert parsed(max_tokens=5).sampling["max_tokens"] == 5
    assert "fit_max_tokens" not in parsed(max_completion_tokens=5).sampling  # named: a limit
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    call = parsed(messages=[{"role": "developer", "content": "Be brief."},
                            {"role": "user", "content": parts}])  # fmt: skip
    assert call.messages == [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "ab"}]  # fmt: skip
    assert call.system == "Be brief." and call.tools == ""
    assert parsed(stream=True, stream_options={"include_usage": True}).include_usage
    assert not parsed(stream=True, stream_options=None).include_usage  # null: not given
    assert not parsed(stream_options=None).include_usage
    assert parsed(response_format={"type": "text"}, n=1, logprobs=False).model == "m"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"n": 3}, "n"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}},
         "response_format.json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"type": "object"}}},
         "response_format.json_schema.type"),  # a schema where its wrapper belongs
        ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
        ({"presence_penalty": 1}, "presence_penalty"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"max_tokens": 2**32}, "max_tokens"),  # past the worker's uint32
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"stop": {}}, "stop"),
        ({"stop": False}, "stop"),
        ({"stop": 0}, "stop"),
        ({"stop": ["\ud800"]}, "stop"),  # a lone surrogate: JSON allows it, UTF-8 does not
        ({"user": "\ud800"}, "user"),
        ({"stream": True, "stream_options": {"include_usage": "false"}},
         "stream_options.include_usage"),
        ({"stream": True, "stream_options": {"include_usage": True, "usage": True}},
         "stream_options.usage"),  # not dropped unread
        ({"stream": True, "stream_options": {"include_obfuscation": 1}},
         "stream_options.include_obfuscation"),
        ({"max_completion_tokens": 16, "max_tokens": -5}, "max_tokens"),  # both are read
        ({"max_completion_tokens": 16, "max_tokens": "lots"}, "max_tokens"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "description": "\ud800"}}}},
         "response_format.json_schema.schema"),  # a lone surrogate anywhere in it
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # OpenAI: stream only
        ({"stream": False, "stream_options": {}}, "stream_options"),
        ({"safety_identifier": 7}, "safety_identifier"),
        ({"messages": [{"role": [], "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
         "messages[0].content"),
        ({"messages": [{"role": "user", "content": "a\udfff"}]}, "messages[0].content"),
        ({"best_of": 2}, "best_of"),
        ({"metadata": {"k": 7}}, "metadata.k"),  # OpenAI's: 16 pairs of strings at most
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"model": ""}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
         "messages[1]"),
        ({"messages": [{"role": "user", "content": "a", "foo": 1}]}, "messages[0].foo"),  # taken
        ({"messages": [{"role": "user", "content": "a", "name": 5}]}, "messages[0].name"),
        ({"messages": [{"role": "user", "content": "a", "name": "\ud800"}]}, "messages[0].name"),
        ({"messages": [{"role": "assistant", "content": "a", "refusal": "no"},
                       {"role": "user", "content": "b"}]}, "messages[0].refusal"),
    ],
)  # fmt: skip
def test_what_agentkv_does_not_do_is_refused_by_name(fields, param):
    with pytest.raises(HTTPError) as refused:
        parsed(**fields)
    assert refused.value.status == 400 and refused.value.param == param
    assert refused.value.body()["error"]["type"] == "invalid_request_error"


def test_what_openai_allows_is_read_as_openai_means_it():
    # null for a parameter with a neutral value is that value
    assert parsed(n=None, presence_penalty=None, frequency_penalty=None, logprobs=None).model
    assert parsed(seed=-1).sampling["seed"] == 2**64 - 1  # signed in OpenAI, unsigned here
    # top_p 0 keeps only the likeliest token; the worker's 0 would turn nucleus off
    assert parsed(temperature=0.7, top_p=0, max_tokens=3).sampling | {"max_tokens": 0} == {
        "temperature": 0.0, "top_p": 1.0, "max_tokens": 0}  # fmt: skip
    assert parsed(stop=[]).sampling == parsed().sampling
    assert parsed(max_completion_tokens=9, max_tokens=5).sampling["max_tokens"] == 9  # the newer
    streamed = parsed(
        stream=True, stream_options={"include_usage": True, "include_obfuscation": True}
    )
    assert streamed.include_usage  # obfuscation: no padding here, nothing to turn on or off
    said = {"role": "assistant", "content": "b", "refusal": None, "audio": None, "name": "x",
            "annotations": []}  # fmt: skip
    sent = [{"role": "user", "content": "a", "name": "bob"}, said, {"role": "user", "content": "c"}]
    assert [m["content"] for m in parsed(messages=sent).messages] == ["a", "b", "c"]
    pair = json.loads('"\\ud83d\\ude00"')  # JSON's escaped surrogate pair: one character
    assert parsed(messages=[{"role": "user", "content": pair}]).messages[0]["content"] == "😀"


def test_cached_tokens_are_never_negative():
    usage = pb.Usage(prompt_tokens=10, prefilled_tokens=12)  # a template that added tokens
    assert usage_json(usage)["prompt_tokens_details"]["cached_tokens"] == 0


def test_the_sdks_own_errors_read_in_http_terms():
    """The SDK's deadline is the gateway's --timeout (a store's call says so); a reply cut
    off by its worker is sent again; a worker's own answers pass as they are."""
    deadline = errors.DeadlineExceeded("Deadline Exceeded")
    assert HTTPError.of(deadline).message == (
        "the call to the worker did not end within the gateway's --timeout (Deadline Exceeded)"
    )
    deadline.peer = "store"
    assert "the call to the store did not end" in HTTPError.of(deadline).message
    for tokens, said in ((1, "1 token"), (0, "0 tokens"), (7, "7 tokens")):
        cut = HTTPError.of(ReplyCutOff("describe() the agent", "w:1", tokens))
        assert (cut.status, cut.code) == (503, "unavailable")
        assert (
            cut.message == f"the worker went away after {said} of the reply; send the request again"
        )


def test_a_call_that_ran_out_of_time_during_a_reply_says_its_worker_keeps_the_turn():
    """A worker keeps a turn cut after a token of it went out on its stream, and undoes one
    cut before (its caller saw none of it): the SDK's own deadline, once tokens came, says
    the turn is kept, so its caller does not say the message again; before any came, that
    it is undone unless one was on its way. A worker's own error, or another, pass as they
    are."""

    class Agent:
        def __repr__(self) -> str:
            return "Agent(ns/a)"

    deadline = errors.DeadlineExceeded("Deadline Exceeded")
    kept = cut_off(deadline, "w:1", 3, Agent())
    assert isinstance(kept, errors.DeadlineExceeded) and not kept.remote
    assert kept.message == (
        "Deadline Exceeded after 3 tokens of the reply of Agent(ns/a): its worker keeps the "
        "turn, with the reply so far"
    )
    assert HTTPError.of(kept).message.startswith(
        "the call to the worker did not end within the gateway's --timeout (Deadline Exceeded "
        "after 3 tokens of the reply"
    )
    early = cut_off(deadline, "w:1", 0, Agent())  # after the start, before any token came
    assert early.message == (
        "Deadline Exceeded after 0 tokens of the reply of Agent(ns/a): its worker undoes the "
        "turn unless a token of it was on its way: describe() the agent before saying it again"
    )
    own = errors.DeadlineExceeded("the turn of agent 'a' ran out of time before its first token")
    own.remote = True
    assert cut_off(own, "w:1", 3, Agent()) is own
    busy = errors.FailedPrecondition("in progress")
    assert cut_off(busy, "w:1", 3, Agent()) is busy


def test_errors_with_more_than_a_message_survive_pickling():
    cut = pickle.loads(pickle.dumps(ReplyCutOff("gone", "w:1", 3)))
    assert (type(cut), cut.message, cut.worker, cut.num_tokens) == (ReplyCutOff, "gone", "w:1", 3)
    lost = copy.copy(errors.GenerationConflict("raced", current_generation=4))
    assert (lost.message, lost.current_generation) == ("raced", 4)
    follow = pickle.loads(pickle.dumps(errors.TurnsFollow("left", resumed_at=3)))
    assert (follow.message, follow.resumed_at) == ("left", 3)


def test_every_grpc_status_has_its_http_status():
    expected = {
        errors.InvalidArgument: 400, errors.OutOfRange: 400, errors.PermissionDenied: 403,
        errors.AgentNotFound: 404, errors.AgentExists: 409,
        errors.FailedPrecondition: 409,
        errors.ResourceExhausted: 429, errors.Unavailable: 503, errors.DeadlineExceeded: 504,
        errors.CorruptBlock: 500, errors.AgentKVError: 500,
    }  # fmt: skip
    for kind, status in expected.items():
        answer = kind("why")
        answer.remote = True  # a worker's answer (the gateway's own deadline says --timeout)
        error = HTTPError.of(answer)
        assert error.status == status, kind
        assert error.body()["error"]["message"] == "why"
    assert HTTPError.of(errors.GenerationConflict("raced", current_generation=3)).status == 409
    # A worker or store refusing the gateway's (or the worker's) own token: the service's
    # configuration, not the caller's key (before, a 401 told the caller its key was wrong).
    refused = HTTPError.of(errors.Unauthenticated("unauthenticated: no bearer token"))
    assert (refused.status, refused.code) == (502, "upstream_unauthenticated")
    assert "behind the gateway refused its credentials" in refused.message
    # A --store or --worker address of another kind of server: the deployment's, not a 500.
    unserved = errors.AgentKVError("the server there does not serve this call")
    unserved.code = grpc.StatusCode.UNIMPLEMENTED
    unserved = HTTPError.of(unserved)
    assert (unserved.status, unserved.code) == (502, "upstream_unimplemented")
    assert HTTPError.of(errors.OutOfRange("long")).code == "context_length_exceeded"
    # past the worker's memory, not the context: compacting the prompt would not help
    over = HTTPError.of(errors.OverBudget("big"))
    assert (over.status, over.code) == (400, "out_of_range")
    # the store's disk full: no rate limit the caller could wait out by its own pace
    full = HTTPError.of(errors.DiskFull("no space left on the store's disk"))
    assert (full.status, full.kind, full.code) == (503, "service_unavailable", "disk_full")
    assert (
        HTTPError.of(errors.ResourceExhausted("full")).code
        == grpc.StatusCode.RESOURCE_EXHAUSTED.name.lower()
    )


def test_the_retry_headers_say_which_errors_pass():
    """OpenAI's and Anthropic's clients send every 408, 409, 429 and 5xx again, twice by
    default: the gateway says which would go otherwise. A busy worker, an agent mid-turn, a
    raced write or a service out of reach pass (retry after a second); a quota, a full disk,
    an agent made otherwise, a deadline or a bug stay (no retry)."""
    passing = [
        errors.ServerBusy("worker busy"), errors.AgentBusy("in progress"),
        errors.GenerationConflict("raced", current_generation=2),
        errors.Unavailable("down"), errors.BucketUnreachable("away"),
        ReplyCutOff("gone", "w:1", 3),
    ]  # fmt: skip
    for exc in passing:
        headers = HTTPError.of(exc).headers()
        assert headers == {"x-should-retry": "true", "retry-after": "1"}, exc
    staying = [
        errors.QuotaExceeded("full"), errors.NamespaceQuotaExceeded("full"),
        errors.ReplyTooLarge("big"), errors.ResourceExhausted("pinned"),
        errors.DiskFull("disk"), errors.SystemPromptDiffers("other"),
        errors.FingerprintMismatch("model"), errors.DeadlineExceeded("slow"),
        errors.CorruptBlock("bad"), errors.AgentKVError("bug"),
    ]  # fmt: skip
    for exc in staying:
        assert HTTPError.of(exc).headers() == {"x-should-retry": "false"}, exc
    assert HTTPError(500, "internal error: KeyError", "server_error").headers() == {
        "x-should-retry": "false"
    }
    assert HTTPError.of(errors.InvalidArgument("bad")).headers() == {}  # never sent again
    assert HTTPError(413, "too large").headers() == {}


def test_the_agent_is_the_first_identity_given():
    call = parsed(user="u", prompt_cache_key="k")
    assert agent_id("a", "s", call) == "a"
    assert agent_id("", "s", call) == "s"
    assert agent_id("", "a b/c", call).startswith("s-")  # not an agent id: digested
    anonymous = agent_id("", "", parsed())
    assert anonymous.startswith("anon-") and anonymous == agent_id("", "", parsed())
    more = [*BODY["messages"], {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "More"}]  # fmt: skip
    assert agent_id("", "", parsed(messages=more)) == anonymous  # the same conversation, resent
    with pytest.raises(errors.InvalidArgument, match="X-Agent-Id"):
        agent_id("bad id", "", call)


def test_an_end_user_or_a_cache_key_keeps_conversations_apart_and_names_no_agent():
    scopes = [{"user": "u"}, {"safety_identifier": "u"}, {"prompt_cache_key": "u"},
              {"prompt_cache_key": "k", "user": "u"}, {"user": "v"}]  # fmt: skip
    agents = [agent_id("", "", parsed(**scope)) for scope in scopes]
    assert all(a.startswith("anon-") for a in agents)
    assert len({*agents, agent_id("", "", parsed())}) == len(scopes) + 1
    other = [{"role": "user", "content": "Bye"}]
    assert agent_id("", "", parsed(user="u", messages=other)) != agents[0]  # another one
    more = [*BODY["messages"], {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "More"}]  # fmt: skip
    assert agent_id("", "", parsed(user="u", messages=more)) == agents[0]  # resent


def test_a_first_call_counts_what_making_its_agent_took():
    turn = pb.Usage(prompt_tokens=100, prefilled_tokens=60, reused_hot_tokens=40, cache_state="hot")
    made = pb.Usage(prompt_tokens=40, prefilled_tokens=8, reused_store_tokens=32,
                    cache_state="warm")  # fmt: skip
    whole = with_creation(turn, made)
    assert (whole.prefilled_tokens, whole.reused_store_tokens, whole.reused_hot_tokens) == (
        68,
        32,
        0,
    )
    assert whole.cache_state == "warm" and turn.prefilled_tokens == 60  # a copy
    assert with_creation(turn, None) is turn
    # A system prompt alone: the turn ran its last token again (for its logits). Each
    # prompt token counts once, as prefilled or read, never above the prompt.
    turn = pb.Usage(prompt_tokens=45, prefilled_tokens=6, reused_hot_tokens=39)
    made = pb.Usage(prompt_tokens=40, prefilled_tokens=40)
    whole = with_creation(turn, made)
    assert (whole.prefilled_tokens, whole.reused_store_tokens) == (45, 0)
    made = pb.Usage(prompt_tokens=40, prefilled_tokens=8, reused_store_tokens=32)
    whole = with_creation(turn, made)
    assert (whole.prefilled_tokens, whole.reused_store_tokens) == (13, 32)
    assert whole.prefilled_tokens + whole.reused_store_tokens == whole.prompt_tokens


# Tool calling: OpenAI function tools pass to the worker; what only constrained decoding
# could promise is refused.

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
LOOP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": "22 C", "tool_call_id": "call_1"},
]


def test_function_tools_are_sent_as_compact_json_with_sorted_keys():
    call = parsed(tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False)
    assert call.max_tool_calls == 1  # the worker ends the reply after one call
    assert parsed(tools=[WEATHER], parallel_tool_calls=True).max_tool_calls == 0
    assert parsed(tools=[WEATHER]).max_tool_calls == 0
    user = parsed(messages=[{"role": "user", "content": "hi", "tool_calls": []}]).messages
    assert user == [{"role": "user", "content": "hi"}]  # [] is no calls, as null
    assert call.tools == json.dumps([WEATHER], sort_keys=True, separators=(",", ":"))
    assert json.loads(call.tools) == [WEATHER]
    reordered = {"function": dict(reversed(WEATHER["function"].items())), "type": "function"}
    assert parsed(tools=[reordered]).tools == call.tools  # the same tools, however spelled
    for strict in (False, True):  # passed on: the Agents SDK sets it on every tool
        tool = {**WEATHER, "function": {**WEATHER["function"], "strict": strict}}
        assert json.loads(parsed(tools=[tool], parallel_tool_calls=True).tools) == [tool]
    minimal = {"type": "function", "function": {"name": "now"}}  # no description, parameters
    assert json.loads(parsed(tools=[minimal]).tools) == [minimal]
    for none in ({}, {"tools": None}, {"tools": []}, {"tool_choice": None},
                 {"tool_choice": "auto"}, {"parallel_tool_calls": None}):  # fmt: skip
        assert parsed(**none).tools == ""


def test_a_tool_loop_passes_to_the_worker_as_the_sdk_takes_it():
    parts = [{"type": "text", "text": "22 "}, {"type": "text", "text": "C"}]
    loop = [*LOOP[:2], {**LOOP[2], "content": parts}]
    call = parsed(messages=loop, tools=[WEATHER])
    assert call.messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},  # null content: none
        {"role": "tool", "content": "22 C", "tool_call_id": "call_1"},
    ]
    # As the openai package gives a reply back (message.model_dump()): extra nulls, no content
    dumped = {"role": "assistant", "content": None, "refusal": None, "audio": None,
              "function_call": None, "annotations": None, "tool_calls": [CALL]}  # fmt: skip
    absent = {"role": "assistant", "tool_calls": [CALL]}
    for assistant in (dumped, absent, {**absent, "content": ""}):
        assert parsed(messages=[LOOP[0], assistant, LOOP[2]]).messages == call.messages
    worded = {**absent, "content": "Let me look."}
    assert parsed(messages=[LOOP[0], worded, LOOP[2]]).messages[1]["content"] == "Let me look."
    # Two calls, answered in any order, then the conversation goes on.
    other = {**CALL, "id": "call_2"}
    two = [LOOP[0], {"role": "assistant", "tool_calls": [CALL, other]},
           {**LOOP[2], "tool_call_id": "call_2"}, LOOP[2],
           {"role": "assistant", "content": "22 C."},
           {"role": "user", "content": "Thanks"}]  # fmt: skip
    assert [m["role"] for m in parsed(messages=two).messages] == [
        "user", "assistant", "tool", "tool", "assistant", "user"]  # fmt: skip


BAD_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {}}}


@pytest.mark.parametrize(
    "fields, param, code",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "get weather"}}},
         "tool_choice.function.name", None),
        ({"tool_choice": {"type": "function", "name": "get_weather"}},
         "tool_choice.name", "unsupported_parameter"),  # the Responses form, on chat
        ({"tool_choice": {"type": "custom", "custom": {"name": "x"}}}, "tool_choice",
         "unsupported_value"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "now"}}},
         "tool_choice.function.name", None),  # a tool the request does not have
        ({"tool_choice": "sometimes"}, "tool_choice", None),
        ({"tool_choice": 1}, "tool_choice", None),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", None),
        ({"tools": WEATHER}, "tools", None),
        ({"tools": ["get_weather"]}, "tools[0]", None),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type",
         "unsupported_value"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_value"),
        ({"tools": [{**WEATHER, "extra": 1}]}, "tools[0].extra", "unsupported_parameter"),
        ({"tools": [{"type": "function", "function": {"name": "f", "returns": {}}}]},
         "tools[0].function.returns", "unsupported_parameter"),
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]},
         "tools[0].function.name", None),
        ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]},
         "tools[0].function.name", None),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
         "tools[0].function.name", None),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
         "tools[0].function.parameters", None),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
         "tools[0].function.description", None),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]},
         "tools[0].function.description", None),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"\ud800": 1}}}]},
         "tools", None),  # a lone surrogate anywhere in them
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_value"),
        ({"function_call": "auto"}, "function_call", "unsupported_value"),
        ({"messages": [LOOP[0], {"role": "assistant", "content": None,
                                 "function_call": {"name": "f", "arguments": "{}"}}, LOOP[2]]},
         "messages[1].function_call", "unsupported_value"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "call_1"}]},
         "messages[0].tool_call_id", None),  # answers no call
        ({"messages": [*LOOP[:2], {**LOOP[2], "tool_call_id": "call_9"}]},
         "messages[2].tool_call_id", None),
        ({"messages": [*LOOP, LOOP[2]]}, "messages[3].tool_call_id", None),  # answered twice
        ({"messages": [*LOOP[:2], {"role": "user", "content": "And?"}]}, "messages[2]", None),
        ({"messages": [LOOP[0], {"role": "assistant", "tool_calls": [CALL, {**CALL, "id": "c2"}]},
                       LOOP[2]]}, "messages[2]", None),  # c2 never answered
        ({"messages": LOOP[:2]}, "messages[1]", "unsupported_value"),  # the assistant's last
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]},
         "messages[0].tool_calls", None),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "call_1"}]},
         "messages[0].tool_call_id", None),
        ({"messages": [{"role": "tool", "content": None, "tool_call_id": "call_1"}]},
         "messages[0].content", None),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 7}]},
         "messages[0].tool_call_id", None),
        ({"messages": [LOOP[0], {"role": "assistant", "content": None}, LOOP[0]]},
         "messages[1].content", None),  # no calls: a text is needed
        ({"messages": [LOOP[0], {"role": "assistant", "tool_calls": {"id": "call_1"}}, LOOP[2]]},
         "messages[1].tool_calls", None),
        ({"messages": [LOOP[0], {"role": "assistant", "tool_calls": [BAD_CALL]}, LOOP[2]]},
         "messages[1].tool_calls[0].arguments", None),  # an object, not its JSON text
        ({"messages": [LOOP[0], {"role": "assistant", "tool_calls": [{**CALL, "id": ""}]},
                       LOOP[2]]}, "messages[1].tool_calls[0].id", None),
        ({"messages": [LOOP[0], {"role": "assistant", "tool_calls": [{**CALL, "type": None}]},
                       LOOP[2]]}, "messages[1].tool_calls[0]", None),
    ],
)  # fmt: skip
def test_what_tools_cannot_do_here_is_refused_by_name(fields, param, code):
    with pytest.raises(HTTPError) as refused:
        parsed(**fields)
    error = refused.value.body()["error"]
    assert refused.value.status == 400 and (error["param"], error["code"]) == (param, code)
    assert error["type"] == "invalid_request_error"
    if code == "unsupported_value" and "tool_choice" in param:
        assert "the model decides" in error["message"]  # no constrained decoding


GET_TIME = {"type": "function", "function": {"name": "get_time"}}


def allowed(mode: str, *names: str, **more) -> dict:
    tools = [{"type": "function", "function": {"name": name}} for name in names]
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools, **more}}


def test_allowed_tools_pass_to_the_worker_with_the_tools_whole():
    """allowed_tools restricts the calls, not the conversation: its tools, and so its agent
    and cached prefix, are those of the same request without it. Allowing none is "none"."""
    call = parsed(tools=[WEATHER, GET_TIME], tool_choice=allowed("auto", "get_time"))
    assert call.tool_call_allowed == ("get_time",)
    assert not (call.tool_call_required or call.tool_call_forbidden or call.tool_call_name)
    free = parsed(tools=[WEATHER, GET_TIME])
    assert call.tools == free.tools and agent_id("", "", call) == agent_id("", "", free)
    twice = parsed(tools=[WEATHER, GET_TIME], tool_choice=allowed("required", *["get_time"] * 2))
    assert twice.tool_call_required and twice.tool_call_allowed == ("get_time",)
    none = parsed(tools=[WEATHER], tool_choice=allowed("auto"))
    assert none.tool_call_forbidden and not none.tool_call_allowed
    every = parsed(
        tools=[WEATHER, GET_TIME], tool_choice=allowed("required", "get_time", "get_weather")
    )
    assert every.tool_call_required and not every.tool_call_allowed  # nothing to restrict


@pytest.mark.parametrize(
    "choice, param, code",
    [
        (allowed("sometimes", "get_weather"), "tool_choice.allowed_tools.mode", None),
        ({"type": "allowed_tools", "allowed_tools": {"mode": "auto"}},
         "tool_choice.allowed_tools.tools", None),
        (allowed("required"), "tool_choice.allowed_tools.tools", None),  # none to call
        (allowed("auto", "get_time"), "tool_choice.allowed_tools.tools", None),  # not a tool
        (allowed("auto", "get weather"), "tool_choice.allowed_tools.tools[0].function.name",
         None),
        (allowed("auto", "get_weather", extra=1), "tool_choice.allowed_tools.extra",
         "unsupported_parameter"),
        ({"type": "allowed_tools", "mode": "auto", "tools": []}, "tool_choice.mode",
         "unsupported_parameter"),  # the Responses form, on chat
        ({"type": "allowed_tools", "allowed_tools": {
            "mode": "auto", "tools": [{"type": "custom", "custom": {"name": "f"}}]}},
         "tool_choice.allowed_tools.tools[0]", "unsupported_value"),
        ({"type": "allowed_tools", "allowed_tools": {
            "mode": "auto", "tools": [{"type": "function", "name": "get_weather"}]}},
         "tool_choice.allowed_tools.tools[0].name", "unsupported_parameter"),
    ],
)  # fmt: skip
def test_bad_allowed_tools_are_refused_by_name(choice, param, code):
    with pytest.raises(HTTPError) as refused:
        parsed(tools=[WEATHER], tool_choice=choice)
    error = refused.value.body()["error"]
    assert refused.value.status == 400 and (error["param"], error["code"]) == (param, code)


def test_tools_are_part_of_an_anonymous_conversation():
    plain = agent_id("", "", parsed())
    # a conversation without tools keeps its agent: the digest of what it was before tools
    key = repr(("", ("user", "Hi"))).encode()
    assert plain == "anon-" + hashlib.blake2b(key, digest_size=12).hexdigest()
    weather = agent_id("", "", parsed(tools=[WEATHER]))
    other = {"type": "function", "function": {"name": "get_time"}}
    assert len({plain, weather, agent_id("", "", parsed(tools=[other]))}) == 3
    spelled = {"function": WEATHER["function"], "type": "function"}
    assert agent_id("", "", parsed(tools=[spelled])) == weather
    resent = parsed(tools=[WEATHER], messages=[{"role": "user", "content": "Hi"}, *LOOP[1:]])
    assert agent_id("", "", resent) == weather  # the same conversation, resent


def test_a_reply_that_calls_tools_is_written_as_openais():
    usage = pb.Usage(prompt_tokens=9, generated_tokens=5, finish_reason="tool_calls")
    calls = [pb.ToolCall(id="call_a", name="get_weather", arguments='{"city": "Paris"}'),
             pb.ToolCall(id="call_b", name="get_time", arguments="{}")]  # fmt: skip
    completion = Completion("m")
    whole = completion.whole(["\n", *calls], usage, {})  # the reply's events, in order
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": None,  # white space alone is no text
        "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "type": "function",
             "function": {"name": "get_time", "arguments": "{}"}},
        ],
    }  # fmt: skip
    said = completion.whole(["Checking.", calls[0]], usage, {})["choices"][0]["message"]
    assert said["content"] == "Checking." and len(said["tool_calls"]) == 1
    plain = completion.whole(["Hi"], pb.Usage(finish_reason="stop"), {})["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "Hi"}  # no tool_calls key
    chunk = completion.tool_call_chunk(calls[1], 1)
    assert chunk["object"] == "chat.completion.chunk" and chunk["id"] == whole["id"]
    assert chunk["choices"] == [{"index": 0, "finish_reason": None, "logprobs": None, "delta": {
        "tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                        "function": {"name": "get_time", "arguments": "{}"}}]}}]  # fmt: skip
    reasons = {r: finish_reason(pb.Usage(finish_reason=r)) for r in
               ("stop", "length", "tool_calls", "cancelled", "deadline", "none")}  # fmt: skip
    assert reasons == {"stop": "stop", "length": "length", "tool_calls": "tool_calls",
                       "cancelled": "stop", "deadline": "stop", "none": "stop"}  # fmt: skip


# Any JSON body, near OpenAI's shapes: a ChatCall or a 400, never another exception (which
# the gateway would answer as a 500). Each body is a valid tool loop with up to 3 of its values
# replaced by random JSON, or dropped.

JSON_LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.sampled_from(["", "user", "assistant", "tool", "function", "get_weather", "auto", "\ud800"]),
    st.text(max_size=12),
)  # fmt: skip
JSON = st.recursive(
    JSON_LEAF,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
FUZZED_LOOP = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "abc123XYZ", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "abc123XYZ", "content": "21"},
    ],
    "tools": [WEATHER],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 9,
    "stop": ["END"],
}  # fmt: skip


def _places(value, path=()):
    """Every path to a value inside `value`."""
    yield path
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, inner in items:
        yield from _places(inner, (*path, key))


@st.composite
def bodies(draw):
    body = json.loads(json.dumps(FUZZED_LOOP))
    for _ in range(draw(st.integers(0, 3))):
        path = draw(st.sampled_from(list(_places(body))[1:]))
        *above, last = path
        parent = body
        for key in above:
            parent = parent[key]
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[last]
        else:
            parent[last] = draw(JSON)
    return body


@settings(max_examples=500, deadline=None, derandomize=True)
@given(bodies())
def test_any_body_is_a_chat_call_or_a_400(body):
    try:
        call = parse_chat(body, default_max_tokens=64)
    except HTTPError as exc:
        assert exc.status == 400
        return
    call.anonymous_id()  # what a call without identity is named by
    assert isinstance(call.tools, str) and call.messages


def test_a_tool_call_id_given_twice_is_refused_on_every_route():
    """Two calls of one id (a result would answer either), or two results of one call: a
    400 on the OpenAI route and the Anthropic one, as on the Responses one."""
    from agentkv.gateway.anthropic import parse_messages

    function = {"name": "get_weather", "arguments": "{}"}
    calls = [{"id": "c1", "type": "function", "function": function}] * 2
    messages = [
        {"role": "user", "content": "Weather in two cities?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
    ]
    with pytest.raises(HTTPError, match=r"two tool calls have one id, 'c1'") as caught:
        parsed(messages=messages)
    assert caught.value.param == "messages[1].tool_calls[1].id"
    use = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "r"}
    for uses, results, said in (
        ([use, use], [result], "two tool_use blocks have one id, 't1'"),
        ([use], [result, result], "a second tool_result for 't1'"),
    ):
        body = {"model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": uses},
            {"role": "user", "content": results},
        ]}  # fmt: skip
        with pytest.raises(HTTPError, match=said):
            parse_messages(body)


def test_tool_results_are_put_in_their_calls_order():
    """Chat templates pair a tool result with a call by its place (Qwen 2.5's and Llama 3's
    name no call id): results sent in another order are put in the calls' order, on both
    the OpenAI and the Anthropic route."""
    from agentkv.gateway.anthropic import parse_messages

    function = {"name": "get_weather", "arguments": "{}"}
    calls = [{"id": f"c{i}", "type": "function", "function": function} for i in (1, 2, 3)]
    messages = [
        {"role": "user", "content": "Weather in three cities?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        *({"role": "tool", "tool_call_id": f"c{i}", "content": f"r{i}"} for i in (3, 1, 2)),
        {"role": "user", "content": "Thanks"},
    ]
    chat = parsed(messages=messages).messages
    assert [m.get("tool_call_id") for m in chat] == [None, None, "c1", "c2", "c3", None]
    assert [m["content"] for m in chat[2:5]] == ["r1", "r2", "r3"]
    uses = [
        {"type": "tool_use", "id": f"c{i}", "name": "get_weather", "input": {}} for i in (1, 2, 3)
    ]
    results = [
        {"type": "tool_result", "tool_use_id": f"c{i}", "content": f"r{i}"} for i in (2, 3, 1)
    ]
    body = {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Weather in three cities?"},
        {"role": "assistant", "content": uses},
        {"role": "user", "content": [*results, {"type": "text", "text": "Thanks"}]},
    ]}  # fmt: skip
    assert parse_messages(body).messages == chat


WEATHER_NAME = {"name": "get_weather"}


def test_a_response_format_and_a_required_call_pass_to_the_worker():
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    form = {"name": "v", "schema": schema, "strict": True, "description": "a verdict"}
    call = parsed(
        response_format={"type": "json_schema", "json_schema": form},
        tools=[WEATHER],
        tool_choice="required",
    )
    assert call.output_format == {"json_schema": json.dumps(schema)} and call.tool_call_required
    assert parsed(response_format={"type": "json_object"}).output_format == {"json_object": True}
    assert parsed(response_format={"type": "text"}).output_format is None
    assert not parsed(tool_choice="auto").tool_call_required
    assert parsed(tools=[WEATHER], tool_choice="none").tool_call_forbidden
    assert not parsed(tools=[WEATHER], tool_choice="auto").tool_call_forbidden
    named = parsed(tools=[WEATHER], tool_choice={"type": "function", "function": WEATHER_NAME})
    assert (named.tool_call_required, named.tool_call_name) == (True, "get_weather")
    unnamed = {"type": "json_schema", "json_schema": {"name": "v"}}  # no schema: any JSON
    assert parsed(response_format=unnamed).output_format == {"json_schema": "{}"}


def test_a_step_whose_caller_left_has_its_error_retrieved():
    """to_the_end runs a step (a CreateAgent) to its end after its caller (a client gone) is
    cancelled; the step's error then is no one's, and asyncio does not log it as "never
    retrieved" (a red team's burst of identical calls wrote one such error line per call)."""

    async def caller_leaves() -> list[str]:
        logged: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, c: logged.append(c["message"]))
        release, started = asyncio.Event(), asyncio.Event()

        async def create() -> None:
            started.set()
            await release.wait()
            raise errors.AgentExists("made meanwhile")

        caller = asyncio.ensure_future(to_the_end(create()))
        await started.wait()
        caller.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await caller
        del caller
        gc.collect()  # a task's unretrieved error is logged when the task is freed
        return logged

    assert asyncio.run(caller_leaves()) == []


def test_an_anthropic_max_tokens_out_of_range_says_the_range():
    from agentkv.gateway.anthropic import parse_messages

    for value in (10**12, -1):
        body = {"model": "m", "max_tokens": value, "messages": [{"role": "user", "content": "Hi"}]}
        with pytest.raises(HTTPError, match=rf"in \[0, 2\^32\) is required, got {value}$"):
            parse_messages(body)
    for body in ({}, {"max_tokens": None}):  # absent or null: required, not "got None"
        body |= {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
        with pytest.raises(HTTPError, match=r"in \[0, 2\^32\) is required$"):
            parse_messages(body)


def test_two_tools_of_one_name_or_parameters_not_of_an_object_are_refused():
    def tool(name: str, parameters: dict) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": parameters}}

    weather = tool("get_weather", {"type": "object"})
    for tools, said in (
        ([weather, weather], r"tools\[1\]: a second tool named 'get_weather'"),
        (
            [tool("f", {"type": "string"})],
            r"tools\[0\]: its parameters' schema is not of an object",
        ),
    ):
        with pytest.raises(HTTPError, match=said):
            parsed(tools=tools)
    assert parsed(tools=[weather, tool("f", {})]).tools  # no type given: an object's


def test_a_branch_forked_for_a_caller_that_left_is_deleted():
    """A resent conversation's branch is forked to the end even once its caller left (the
    worker makes it either way); it then took no turn and was left in the store, where the
    conversation's next call found it, its points still the agent's, and branched deeper
    each time. It is deleted now; a fork that failed, or that another call made meanwhile,
    is left as it is."""
    from agentkv.gateway.turns import Turns

    class Agent:
        def __init__(self, id: str, fails: Exception | None = None) -> None:
            self.id, self.fails, self.deleted = id, fails, 0
            self.release, self.started = asyncio.Event(), asyncio.Event()

        async def fork(self, branch_id: str) -> None:
            self.started.set()
            await self.release.wait()
            if self.fails:
                raise self.fails

        async def delete(self) -> bool:
            self.deleted += 1
            return True

    async def caller_leaves(fails: Exception | None) -> int:
        turns, agent, branch = Turns(lambda: None, 60.0), Agent("a", fails), Agent("a-b")
        caller = asyncio.ensure_future(turns._fork_branch(agent, branch))
        await agent.started.wait()
        caller.cancel()
        agent.release.set()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.gather(*turns.deletions)
        return branch.deleted

    assert asyncio.run(caller_leaves(None)) == 1
    assert asyncio.run(caller_leaves(errors.AgentExists("made meanwhile"))) == 0
    assert asyncio.run(caller_leaves(errors.Unavailable("worker gone"))) == 0


def test_a_spare_whose_call_is_refused_before_it_is_made_is_let_go(monkeypatch):
    """A spare agent (its conversation busy) whose call its worker's features refuse (a
    501 during a rolling upgrade), or whose caller left during that check, stayed among
    the gateway's spares until the gateway stopped, which then asked to delete an agent
    never made. It is let go at once now."""
    from agentkv.client.aio import AsyncAgent
    from agentkv.gateway import turns as gateway_turns

    async def refused(*args) -> None:
        raise HTTPError(501, "its worker predates tool_choice allowed_tools: upgrade it")

    monkeypatch.setattr(gateway_turns, "check_features", refused)

    async def say_on_a_spare() -> set:
        turns = gateway_turns.Turns(lambda: None, 60.0)
        spare = AsyncAgent(None, "anon-1234-abcd0123")
        turns.spares.add(spare)
        with pytest.raises(HTTPError):
            await turns._say(spare, parsed())
        return turns.spares

    assert asyncio.run(say_on_a_spare()) == set()


def test_a_worker_that_did_not_answer_is_asked_last_for_a_while(monkeypatch):
    """count_tokens and the model's info go to the first worker that answers, asked in
    their configured order: a hung first worker cost every such call its INFO_TIMEOUT (5 s)
    before the next was asked. One passed by is asked after the others for PASSED_FOR s."""
    from agentkv.gateway import workers as gateway_workers

    monkeypatch.setattr(gateway_workers, "INFO_TIMEOUT", 0.05)
    asked: list[str] = []

    class Worker:
        def __init__(self, address: str, hung: bool) -> None:
            self.address, self.hung = address, hung

        async def info(self) -> str:
            asked.append(self.address)
            if self.hung:
                await asyncio.Event().wait()  # never answers
            return self.address

    served = gateway_workers.Served({"a": Worker("a", True), "b": Worker("b", False)}, "")

    async def twice() -> list[str]:
        return [await served.first_worker(lambda w: w.info()) for _ in range(2)]

    assert asyncio.run(twice()) == ["b", "b"]
    assert asked == ["a", "b", "b"]  # the hung one once, not on every call
    monkeypatch.setattr(served.passed, "down_for", 0.0)  # its while over: asked first again
    asked.clear()
    assert asyncio.run(twice()) == ["b", "b"] and asked == ["a", "b", "a", "b"]
