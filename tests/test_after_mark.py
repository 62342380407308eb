"""Turns that continue an agent's conversation from an earlier point (TurnRequest.after_mark,
Usage.mark, mark_name), on the default model in real store and worker processes: from its
last point a turn is an ordinary append; from an earlier one it drops the turns after it
and answers token for token as a fresh agent told that branch turn by turn does, reusing
the cache up to the point; a point the agent no longer keeps is NOT_FOUND and changes
nothing, and after_mark_last refuses to drop anything."""

from __future__ import annotations

import time

import pytest

from agentkv import defaults
from agentkv.client.worker import WorkerClient
from agentkv.errors import InvalidArgument, MarkNotFound, TurnsFollow
from inference_worker.models import resolve_model
from tests.test_whole_conversation import ASK, NS, SYSTEM
from tests.test_whole_conversation import EDITED as BRANCH
from tests.test_whole_conversation import step_by_step as told  # a fresh agent, turn by turn


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return resolve_model(defaults.MODEL, "auto", "cpu", tmp_path_factory.mktemp("model-cache"))


def test_a_turn_continues_from_an_earlier_point_as_a_fresh_agent_would(smollm2, start_worker):
    w = WorkerClient(start_worker(smollm2).address)
    replies = told(w, "main", ASK)
    marks = [r.usage.mark for r in replies]
    assert all(len(m) == 24 for m in marks) and len(set(marks)) == 3
    tokens = w.describe(NS, "main").num_tokens

    # From the last point: an ordinary append, the same as a fresh agent's third turn would
    # be followed by.
    last = w.turn(NS, "main", [("user", "Thanks!")], max_tokens=16, after_mark=marks[-1])
    plain = told(w, "plain", [*ASK, "Thanks!"])[-1]
    assert last.token_ids == plain.token_ids
    assert last.usage.prefilled_tokens == plain.usage.prefilled_tokens

    # From the first reply: the turns after it are dropped, the reply is the branch's, and
    # only the new question (and the first reply's last token) is prefilled.
    branch = w.turn(NS, "main", [("user", BRANCH)], max_tokens=16, after_mark=marks[0])
    want = told(w, "fresh-branch", [ASK[0], BRANCH])[-1]
    assert branch.token_ids == want.token_ids
    assert branch.usage.prompt_tokens == want.usage.prompt_tokens
    assert branch.usage.prefilled_tokens == want.usage.prefilled_tokens
    assert branch.usage.prompt_tokens < tokens
    assert branch.usage.mark != marks[1]

    # The dropped points are gone; the agent is unchanged by the refusal.
    before = w.describe(NS, "main")
    with pytest.raises(MarkNotFound, match="has no point"):
        w.turn(NS, "main", [("user", "Go on.")], max_tokens=4, after_mark=marks[1])
    assert w.describe(NS, "main").num_tokens == before.num_tokens


def committed(w: WorkerClient, agent: str):
    """The agent's state once its last turn is in the store (it is written after the reply,
    which changes its generation): all its cache, which holds all but the reply's last
    token."""
    deadline = time.monotonic() + 60
    while (state := w.describe(NS, agent)).persisted_tokens < state.num_tokens - 1:
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    return state


def test_after_mark_last_refuses_to_drop_turns(smollm2, start_worker):
    w = WorkerClient(start_worker(smollm2).address)
    first, second = told(w, "kept", ASK[:2])
    before = committed(w, "kept")
    with pytest.raises(TurnsFollow, match="1 turn"):
        w.turn(
            NS, "kept", [("user", BRANCH)], max_tokens=8,
            after_mark=first.usage.mark, after_mark_last=True,
        )  # fmt: skip
    after = w.describe(NS, "kept")
    assert (after.num_tokens, after.generation) == (before.num_tokens, before.generation)
    # The last point is taken, and equals an append.
    go_on = w.turn(
        NS, "kept", [("user", ASK[2])], max_tokens=16,
        after_mark=second.usage.mark, after_mark_last=True,
    )  # fmt: skip
    assert go_on.token_ids == told(w, "kept-fresh", ASK)[-1].token_ids


def test_a_named_point_is_found_after_a_restore(smollm2, start_worker):
    """A name given with the turn (mark_name) finds its point as its digest does, in the
    store too: the worker that continues from it restored the agent."""
    w = WorkerClient(start_worker(smollm2).address)
    w.create_agent(NS, "named", SYSTEM)
    first = w.turn(NS, "named", [("user", ASK[0])], max_tokens=16, mark_name="first-0")
    w.turn(NS, "named", [("user", ASK[1])], max_tokens=16, mark_name="second-1")
    w.evict(NS, "named")
    got = w.turn(NS, "named", [("user", BRANCH)], max_tokens=16, after_mark="first-0")
    assert got.usage.cache_state == "warm"
    # all the first turn left in the cache: all but its reply's last token
    held = first.usage.prompt_tokens + first.usage.generated_tokens - 1
    assert got.usage.reused_store_tokens == held
    assert got.token_ids == told(w, "named-fresh", [ASK[0], BRANCH])[-1].token_ids
    with pytest.raises(MarkNotFound):
        w.turn(NS, "named", [("user", "Go on.")], max_tokens=4, after_mark="second-1")


def test_keep_named_marks_refuses_a_resent_conversation_that_would_drop_a_named_point(
    smollm2, start_worker
):
    """Two callers' conversations that open alike share an agent (the gateway's anonymous
    ones): one's resent conversation left the agent before the other's named point (its
    Responses id), which was dropped, and the id then refused. With keep_named_marks it is
    TurnsFollow and nothing changes; resent from the point's end, it is taken."""
    w = WorkerClient(start_worker(smollm2).address)
    w.create_agent(NS, "shared", SYSTEM)
    opening = [("system", SYSTEM), ("user", ASK[0])]
    whole = {"whole_conversation": True, "max_tokens": 16}
    first = w.turn(NS, "shared", opening, mark_name="resp-a", **whole)
    other = [("system", SYSTEM), ("user", BRANCH)]  # another caller's: edited before it
    before = committed(w, "shared")
    with pytest.raises(TurnsFollow, match=r"1 named point\(s\) .* the last 'resp-a'"):
        w.turn(NS, "shared", other, keep_named_marks=True, **whole)
    after = w.describe(NS, "shared")
    assert (after.num_tokens, after.generation) == (before.num_tokens, before.generation)
    going_on = [*opening, ("assistant", first.text), ("user", ASK[1])]
    w.turn(NS, "shared", going_on, keep_named_marks=True, mark_name="resp-b", **whole)
    got = w.turn(NS, "shared", [("user", BRANCH)], max_tokens=16, after_mark="resp-a")
    assert got.token_ids == told(w, "fresh", [ASK[0], BRANCH])[-1].token_ids
    w.turn(NS, "shared", other, **whole)  # without it, as before: dropped, and gone
    with pytest.raises(MarkNotFound):
        w.turn(NS, "shared", [("user", ASK[1])], max_tokens=4, after_mark="resp-a")


@pytest.mark.parametrize(
    "options, match",
    [
        ({"after_mark": "x" * 65}, "at most 64 characters"),
        ({"keep_named_marks": True}, "for a resent whole_conversation"),
        ({"after_mark": "m", "whole_conversation": True}, "whole_conversation resends"),
        ({"mark_name": "a,b"}, "letters, digits"),
        ({"mark_name": "n" * 17}, "1 to 16"),
    ],
)  # fmt: skip
def test_bad_marks_are_refused(smollm2, start_worker, options, match):
    w = WorkerClient(start_worker(smollm2).address)
    w.create_agent(NS, "bad", SYSTEM)
    with pytest.raises(InvalidArgument, match=match):
        w.turn(NS, "bad", [("user", ASK[0])], max_tokens=4, **options)
    assert w.turn(NS, "bad", [("user", ASK[0])], max_tokens=4).usage.mark


def test_named_marks_keep_the_format_older_workers_read():
    """Names and replies' calls go in a metadata value of their own: the marks' value stays
    the five fields a worker from before them splits, and a manifest without them reads as
    before."""
    from inference_worker.conversation import ChatState, Mark
    from inference_worker.metadata import MARK_EXTRAS, MARKS, chat_metadata, chat_state

    marks = (
        Mark("a" * 24, 10, 9, "assistant", True, "first-0", ("c1", "c2")),
        Mark("b" * 24, 20, 19, "user", False),
    )
    written = chat_metadata(ChatState(marks=marks))
    assert all(len(item.split(",")) == 5 for item in written[MARKS].split(";"))
    assert written[MARK_EXTRAS] == f"{'a' * 24},first-0,c1 c2"
    assert chat_state(written).marks == marks
    before = {k: v for k, v in written.items() if k != MARK_EXTRAS}
    assert [(m.name, m.calls) for m in chat_state(before).marks] == [("", ())] * 2
    assert MARK_EXTRAS not in chat_metadata(ChatState(marks=marks[1:]))
    # 64 named marks after replies of 5 calls each: every name is kept, and the latest
    # replies' calls while they fit in one value
    many = tuple(
        Mark(
            f"{i:024x}", i, i, "assistant", True, f"n{i:011x}", tuple(f"c{i}x{j}" for j in "12345")
        )
        for i in range(64)
    )
    extras = chat_metadata(ChatState(marks=many))[MARK_EXTRAS]
    read = chat_state(chat_metadata(ChatState(marks=many))).marks
    assert len(extras) <= 4096 and [m.name for m in read] == [m.name for m in many]
    assert read[-1].calls == many[-1].calls and read[0].calls == ()


def test_tool_results_after_a_point_answer_its_calls_in_their_order():
    """Templates pair results with calls by place: results that follow a reply's point are
    put in its calls' order; results of other calls, or a call left unanswered, are
    refused. A point that kept no calls (a reply without any, a worker from before) takes
    them as given."""
    from inference_worker.conversation import ChatMessage, ChatState, Mark, continued

    def result(call_id: str) -> ChatMessage:
        return ChatMessage("tool", f"result of {call_id}", tool_call_id=call_id)

    state = ChatState(marks=(Mark("d" * 24, 5, 4, "assistant", True, "", ("c1", "c2")),))
    then = ChatMessage("user", "And tomorrow?")
    got = continued(list(range(5)), state, "d" * 24, [result("c2"), result("c1"), then])
    assert [m.tool_call_id for m in got.messages] == ["c1", "c2", ""]
    for wrong in ([result("c1")], [result("c1"), result("c3")], [result("c1")] * 2, [then]):
        with pytest.raises(InvalidArgument, match=r"made the tool calls \['c1', 'c2'\]"):
            continued(list(range(5)), state, "d" * 24, wrong)
    plain = ChatState(marks=(Mark("d" * 24, 5, 4, "assistant", True),))
    got = continued(list(range(5)), plain, "d" * 24, [result("c2"), result("c1")])
    assert [m.tool_call_id for m in got.messages] == ["c2", "c1"]
