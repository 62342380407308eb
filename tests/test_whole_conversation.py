"""Whole conversations resent, as OpenAI-style clients send them (TurnRequest's
whole_conversation), on the default model in real store and worker processes: the worker
resumes from its own last reply (matched by the text it sent, keeping the token ids it
generated), prefills only what is new, and answers an edited history exactly as a fresh
agent given that history turn by turn does, greedy, token for token."""

from __future__ import annotations

import time

import pytest

from agentkv import defaults
from agentkv.client.worker import WorkerClient
from agentkv.errors import AgentNotFound, FailedPrecondition, InvalidArgument
from agentkv.worker.v1 import worker_pb2 as pb
from inference_worker.models import resolve_model

NS = "chat"
SYSTEM = "You are a concise geography tutor. Answer in one short sentence."
ASK = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]
EDITED = "And of Spain?"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return resolve_model(defaults.MODEL, "auto", "cpu", tmp_path_factory.mktemp("model-cache"))


def whole(w: WorkerClient, agent: str, conversation: list[tuple[str, str]]):
    return w.turn(NS, agent, conversation, max_tokens=16, whole_conversation=True)


def held(usage) -> int:
    """The tokens a turn left in the cache: all but its reply's last, not yet run."""
    return usage.prompt_tokens + usage.generated_tokens - 1


def step_by_step(w: WorkerClient, agent: str, questions: list[str]) -> list:
    """A fresh agent told the conversation one question a turn, as the SDK does."""
    w.create_agent(NS, agent, SYSTEM)
    return [w.turn(NS, agent, [("user", q)], max_tokens=16) for q in questions]


def test_a_resent_conversation_prefills_only_what_is_new(smollm2, start_worker):
    w = WorkerClient(start_worker(smollm2).address)
    fresh = step_by_step(w, "sdk", ASK)
    w.create_agent(NS, "resent", SYSTEM)
    history = [("system", SYSTEM)]
    for i, question in enumerate(ASK):
        history.append(("user", question))
        reply = whole(w, "resent", history)
        assert reply.token_ids == fresh[i].token_ids  # what the SDK's agent said
        assert reply.usage.prefilled_tokens == fresh[i].usage.prefilled_tokens
        assert reply.usage.prompt_tokens == fresh[i].usage.prompt_tokens
        if i:  # every token before the new message came from the cache
            assert reply.usage.reused_hot_tokens == held(fresh[i - 1].usage)
        history.append(("assistant", reply.text))


def test_a_conversation_with_an_empty_system_message_resumes_too(smollm2, start_worker):
    """The reviewer's: an empty system message was dropped from the marks' chain but not
    from a resend's, so no mark ever matched and every turn prefilled the whole history."""
    w = WorkerClient(start_worker(smollm2).address)
    w.create_agent(NS, "empty-system", "")
    history = [("system", ""), ("user", ASK[0])]
    first = whole(w, "empty-system", history)
    history += [("assistant", first.text), ("user", ASK[1])]
    second = whole(w, "empty-system", history)
    assert second.usage.reused_hot_tokens == held(first.usage)
    assert second.usage.prefilled_tokens == second.usage.prompt_tokens - held(first.usage)


def test_an_edited_history_answers_as_a_fresh_agent_would(smollm2, start_worker):
    w = WorkerClient(start_worker(smollm2).address)
    w.create_agent(NS, "edited", SYSTEM)
    history = [("system", SYSTEM)]
    replies = []
    for question in ASK:
        history.append(("user", question))
        replies.append(whole(w, "edited", history))
        history.append(("assistant", replies[-1].text))

    # A middle message changed: it resumes after the first reply, reusing its tokens.
    changed = [*history[:3], ("user", EDITED)]
    got = whole(w, "edited", changed)
    want = step_by_step(w, "fresh-changed", [ASK[0], EDITED])[-1]
    assert got.token_ids == want.token_ids
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.prefilled_tokens < got.usage.prompt_tokens // 2

    # The last exchange dropped and asked again: the same reply as the first time.
    got = whole(w, "edited", history[:4])
    want = step_by_step(w, "fresh-dropped", ASK[:2])[-1]
    assert got.token_ids == want.token_ids == replies[1].token_ids

    # A reply the client rewrote is not this agent's: its text is tokenized, as the first
    # turn of a fresh agent given that history renders it.
    rewritten = [*history[:2], ("assistant", "Paris, of course."), ("user", ASK[1])]
    got = whole(w, "edited", rewritten)
    w.create_agent(NS, "fresh-rewritten", SYSTEM)
    want = w.turn(NS, "fresh-rewritten", rewritten[1:], max_tokens=16)
    assert got.token_ids == want.token_ids
    assert got.usage.prompt_tokens == want.usage.prompt_tokens


def test_a_restored_agent_resumes_its_resent_conversation(smollm2, start_worker):
    """The marks a resent conversation resumes from are in the store with the agent."""
    w = WorkerClient(start_worker(smollm2).address)
    w.create_agent(NS, "warm", SYSTEM)
    history = [("system", SYSTEM), ("user", ASK[0])]
    first = whole(w, "warm", history)
    history += [("assistant", first.text), ("user", ASK[1])]
    w.evict(NS, "warm")
    warm = whole(w, "warm", history)
    assert warm.usage.cache_state == "warm"
    assert warm.usage.reused_store_tokens == held(first.usage)
    assert warm.usage.prefilled_tokens < 20


def test_a_reply_cut_by_a_stop_string_is_resumed_as_the_caller_saw_it(smollm2, start_worker):
    """The stop string's tokens stay in the agent's context, but its caller never saw them:
    the cut reply resent, with a question after it, answers as a fresh agent told that
    conversation does (before, the agent kept the newline and answered otherwise)."""
    w = WorkerClient(start_worker(smollm2).address)
    system = "You are a helpful assistant."
    history = [("system", system), ("user", "List three fruits, one per line.")]
    w.create_agent(NS, "cut", system)
    first = w.turn(NS, "cut", history, max_tokens=24, whole_conversation=True, stop=["\n"])
    w.create_agent(NS, "uncut", system)
    full = w.turn(NS, "uncut", history, max_tokens=24, whole_conversation=True)
    assert full.text.startswith(first.text + "\n"), (first.text, full.text)
    history += [("assistant", first.text), ("user", "Repeat your answer exactly.")]
    got = whole(w, "cut", history)
    w.create_agent(NS, "fresh-cut", system)
    want = whole(w, "fresh-cut", history)
    assert got.token_ids == want.token_ids
    assert got.usage.prompt_tokens == want.usage.prompt_tokens


def test_an_empty_reply_comes_back_in_the_history(smollm2, start_worker):
    """A stop string that cuts a reply at once leaves it empty. The history holding it, as an
    OpenAI client resends it, is taken (it was refused: "message 2 (assistant) is empty") and
    answers as a fresh agent told it does. Turns that add messages still refuse empty ones."""
    w = WorkerClient(start_worker(smollm2).address)
    history = [("system", SYSTEM), ("user", ASK[0])]
    w.create_agent(NS, "probe", SYSTEM)
    first_char = whole(w, "probe", history).text[0]
    w.create_agent(NS, "mute", SYSTEM)
    empty = w.turn(NS, "mute", history, max_tokens=16, whole_conversation=True, stop=[first_char])
    assert empty.text == "" and empty.usage.generated_tokens == 1
    history += [("assistant", ""), ("user", ASK[1])]
    got = whole(w, "mute", history)
    w.create_agent(NS, "fresh-mute", SYSTEM)
    want = whole(w, "fresh-mute", history)
    assert got.token_ids == want.token_ids and got.text
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    with pytest.raises(InvalidArgument, match=r"message 0 \(user\) is empty"):
        w.turn(NS, "mute", [("user", " ")], max_tokens=4)


def test_a_changed_system_prompt_starts_over_from_nothing(smollm2, start_worker):
    """Nothing of the cache is kept: a new agent's system prompt is quantized before its first
    turn, so no cached prefix of another system prompt's rendering would be bit for bit it."""
    w = WorkerClient(start_worker(smollm2).address)
    w.create_agent(NS, "renamed", SYSTEM)
    whole(w, "renamed", [("system", SYSTEM), ("user", ASK[0])])
    other = "You are a terse pirate. Answer in one short sentence."
    got = whole(w, "renamed", [("system", other), ("user", ASK[0])])
    assert got.usage.prefilled_tokens == got.usage.prompt_tokens
    w.create_agent(NS, "pirate", other)
    want = w.turn(NS, "pirate", [("user", ASK[0])], max_tokens=16)
    assert got.usage.prompt_tokens == want.usage.prompt_tokens  # the same conversation


def test_a_switched_system_prompt_answers_as_a_fresh_agent(smollm2, start_worker):
    """A conversation that starts over with another system prompt, and then with the agent's
    own again, answers each time token for token as a fresh agent made with that prompt. Its
    stable prefix is kept whole from the cache or prefilled as a turn of its own, as a new
    agent's is; before, it was prefilled in the same turn as the rest (and on the way back,
    6 of its tokens came from the cache), so the replies differed."""
    w = WorkerClient(start_worker(smollm2).address)
    tutor, pirate = "You are a concise geography tutor.", "You are a pirate."
    w.create_agent(NS, "switch", tutor)
    whole(w, "switch", [("system", tutor), ("user", "Hello.")])
    for n, (system, question) in enumerate(
        [
            (pirate, "Say hi."),
            (tutor, "Say hi."),
            (pirate, "Name a color."),
            (tutor, "Where is Peru?"),
        ]
    ):
        conversation = [("system", system), ("user", question)]
        got = whole(w, "switch", conversation)
        w.create_agent(NS, f"fresh-switch-{n}", system)
        want = whole(w, f"fresh-switch-{n}", conversation)
        assert got.token_ids == want.token_ids, (n, got.text, want.text)
        assert got.usage.prompt_tokens == want.usage.prompt_tokens


def in_progress(w: WorkerClient, agent: str) -> bool:
    """Whether the agent has a turn in flight: an empty turn, which changes nothing, is
    refused while one is."""
    try:
        w.turn(NS, agent, [], max_tokens=0)
    except FailedPrecondition as exc:
        assert "in progress" in exc.message, exc.message
        return True
    return False


def wait_in_progress(w: WorkerClient, agent: str) -> None:
    deadline = time.monotonic() + 60
    while not in_progress(w, agent):  # the turn's request is on its way
        assert time.monotonic() < deadline, f"{agent}'s turn never started"


def test_an_empty_turn_changes_nothing_even_before_the_first_turn(smollm2, start_worker):
    """An agent holds its system prompt as the first turn will render it (20 tokens here);
    an empty append-only turn had rendered it alone (18), so the first turn kept less."""
    w = WorkerClient(start_worker(smollm2).address)
    w.create_agent(NS, "idle", SYSTEM)
    before = w.describe(NS, "idle").num_tokens
    w.turn(NS, "idle", [], max_tokens=0)
    assert w.describe(NS, "idle").num_tokens == before
    first = w.turn(NS, "idle", [("user", ASK[0])], max_tokens=4)
    assert first.usage.reused_hot_tokens == before


def test_a_turn_cancelled_before_its_first_token_leaves_no_trace(smollm2, start_worker):
    w = WorkerClient(start_worker(smollm2).address)
    w.create_agent(NS, "cancelled", SYSTEM)
    before = w.describe(NS, "cancelled").num_tokens
    long = "Read this log before you answer. " + "The ship passed the lighthouse at dawn. " * 300
    request = pb.TurnRequest(
        namespace=NS, agent_id="cancelled", messages=[pb.Message(role="user", content=long)],
        sampling=pb.SamplingParams(max_tokens=8),
    )  # fmt: skip
    call = w.stub.Turn(request, timeout=120)  # a prefill of about 2,700 tokens
    wait_in_progress(w, "cancelled")
    call.cancel()
    deadline = time.monotonic() + 60
    while True:  # the cancelled turn leaves at its next step
        try:
            retried = w.turn(NS, "cancelled", [("user", ASK[0])], max_tokens=16)
            break
        except FailedPrecondition:
            assert time.monotonic() < deadline, "the cancelled turn kept running"
    assert retried.usage.prompt_tokens - retried.usage.prefilled_tokens == before
    assert retried.token_ids == step_by_step(w, "fresh", ASK[:1])[0].token_ids


def test_a_delete_during_a_turn_is_refused_and_the_agent_stays_whole(smollm2, start_worker):
    w = WorkerClient(start_worker(smollm2).address)
    w.create_agent(NS, "busy", SYSTEM)
    stream = w.stream_turn(NS, "busy", [("user", "Count to one hundred in words.")], max_tokens=300)
    next(stream)  # the turn is in flight
    with pytest.raises(FailedPrecondition, match="turn in progress"):
        w.delete(NS, "busy")
    stream.close()  # cancels the turn
    deadline = time.monotonic() + 60
    while True:
        try:
            assert w.delete(NS, "busy")
            break
        except FailedPrecondition:
            assert time.monotonic() < deadline, "the cancelled turn kept running"
    with pytest.raises(AgentNotFound):
        w.describe(NS, "busy")  # gone, not put back by its turn
