"""The gateway's OpenAI wire format without a server: what a request body becomes, what is
refused (never ignored), every gRPC status as an HTTP status, and how an agent is named."""

from __future__ import annotations

import json

import grpc
import pytest

from agentkv import errors
from agentkv.gateway.protocol import HTTPError, agent_id, parse_chat, usage_json, with_creation
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
    assert call.messages == [("system", "Be brief."), ("user", "ab")] and call.system == "Be brief."
    assert parsed(stream=True, stream_options={"include_usage": True}).include_usage
    assert not parsed(stream=True, stream_options=None).include_usage  # null: not given
    assert not parsed(stream_options=None).include_usage
    assert parsed(response_format={"type": "text"}, n=1, logprobs=False).model == "m"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"n": 3}, "n"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
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
        ({"stream": True, "stream_options": {"include_usage": "false"}}, "include_usage"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # OpenAI: stream only
        ({"stream": False, "stream_options": {}}, "stream_options"),
        ({"safety_identifier": 7}, "safety_identifier"),
        ({"messages": [{"role": [], "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
         "messages[0].content"),
        ({"messages": [{"role": "user", "content": "a\udfff"}]}, "messages[0].content"),
        ({"best_of": 2}, "best_of"),
        ({"model": ""}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
         "messages[1]"),
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
    pair = json.loads('"\\ud83d\\ude00"')  # JSON's escaped surrogate pair: one character
    assert parsed(messages=[{"role": "user", "content": pair}]).messages[0][1] == "😀"


def test_cached_tokens_are_never_negative():
    usage = pb.Usage(prompt_tokens=10, prefilled_tokens=12)  # a template that added tokens
    assert usage_json(usage)["prompt_tokens_details"]["cached_tokens"] == 0


def test_every_grpc_status_has_its_http_status():
    expected = {
        errors.InvalidArgument: 400, errors.OutOfRange: 400, errors.Unauthenticated: 401,
        errors.PermissionDenied: 403, errors.AgentNotFound: 404, errors.AgentExists: 409,
        errors.FailedPrecondition: 409,
        errors.ResourceExhausted: 429, errors.Unavailable: 503, errors.DeadlineExceeded: 504,
        errors.CorruptBlock: 500, errors.AgentKVError: 500,
    }  # fmt: skip
    for kind, status in expected.items():
        error = HTTPError.of(kind("why"))
        assert error.status == status, kind
        assert error.body()["error"]["message"] == "why"
    assert HTTPError.of(errors.GenerationConflict("raced", current_generation=3)).status == 409
    assert HTTPError.of(errors.OutOfRange("long")).code == "context_length_exceeded"
    assert (
        HTTPError.of(errors.ResourceExhausted("full")).code
        == grpc.StatusCode.RESOURCE_EXHAUSTED.name.lower()
    )


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
