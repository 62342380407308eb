"""Offline model directories: every architecture loads with mlx_lm.load and chats; the
fingerprint moves with everything that makes KV bytes valid; the scripted tool model answers
every conversation with its one tool call, as mlx-lm's json_tools parser reads it."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from agentkv.layers import KVFormat
from inference_worker.fingerprint import model_fingerprint
from tests.conftest import ARCHS
from tests.model_kit import (
    BOS,
    QWEN25_CHAT_TEMPLATE,
    TOOL_CALL,
    TOOL_CALL_JSON,
    TOOL_REPLY,
    WEATHER_TOOL,
    build_tool_model,
)

CONVERSATION = [
    {"role": "system", "content": "You are the warden."},
    {"role": "user", "content": "Where were you on the night of the 14th?"},
    {"role": "assistant", "content": "In the yard, def f(x): return x  # honest"},
    {"role": "user", "content": "Prove it."},
]

ASK = {"role": "user", "content": "What is the weather in Paris?"}
CALLED = {  # the model's own reply, as the next request sends it back
    "role": "assistant",
    "content": "",
    "tool_calls": [{"id": "call_1", "type": "function", "function": TOOL_CALL}],
}
TOOL_CONVERSATIONS = {
    "system": [{"role": "system", "content": "You are a weather bot."}, ASK],
    "no_system": [ASK],
    "tool_result": [ASK, CALLED, {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}],
}


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_load_offline_and_run(tiny_models, arch):
    model, tokenizer = tiny_models[arch]
    ids = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), tokenizer.vocab_size)
    assert logits.dtype == mx.float32
    assert bool(mx.isfinite(logits).all().item())


def test_chat_template_adds_one_bos_and_appends_cleanly(tiny_models):
    _, tokenizer = tiny_models["llama"]
    bos = tokenizer.convert_tokens_to_ids(BOS)
    whole = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert whole.count(bos) == 1 and whole[0] == bos
    # Rendering the first two messages, then only what the rest adds as text, tokenizes to
    # exactly the whole conversation: the boundary is a special token.
    head = tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False)
    full = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert full.startswith(head)
    suffix = tokenizer.encode(full[len(head) :], add_special_tokens=False)
    assert tokenizer.encode(head, add_special_tokens=False) + suffix == whole


def test_fingerprint_covers_weights_config_tokenizer_and_format(tiny_model_dirs, tmp_path):
    src = tiny_model_dirs["llama"]
    base = model_fingerprint(src, KVFormat(), 256)
    assert base.startswith("llama-") and base.endswith(":k4v4g64f16:b256") and len(base) <= 128
    assert model_fingerprint(src, KVFormat(), 256) == base
    assert model_fingerprint(src, KVFormat(8, 4), 256) != base
    assert model_fingerprint(src, KVFormat(), 128) != base
    assert model_fingerprint(src, KVFormat(), 256, "float32") != base
    for name, change in [
        ("model.safetensors", lambda b: b[:-1] + bytes([b[-1] ^ 1])),
        ("config.json", lambda b: json.dumps({**json.loads(b), "rope_theta": 1.0}).encode()),
        ("tokenizer.json", lambda b: b.replace(b'"<|eos|>"', b'"<|EOS|>"')),
    ]:
        copy = tmp_path / name
        shutil.copytree(src, copy)
        (copy / name).write_bytes(change((copy / name).read_bytes()))
        assert model_fingerprint(copy, KVFormat(), 256) != base, name


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    import mlx_lm

    return mlx_lm.load(str(build_tool_model(tmp_path_factory.mktemp("models") / "tool")))


def render(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False
    )


def test_tool_model_has_qwen25_tool_calling(tool_model):
    _, tokenizer = tool_model
    assert tokenizer.chat_template == QWEN25_CHAT_TEMPLATE
    assert tokenizer.has_tool_calling and tokenizer.tool_parser.__module__.endswith("json_tools")
    assert (tokenizer.tool_call_start, tokenizer.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert tokenizer.eos_token_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    assert tokenizer.bos_token is None
    # Qwen 2.5's template: a default system prompt before the tools, tool results as a user turn
    text = render(tokenizer, TOOL_CONVERSATIONS["tool_result"])
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert '\n<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("name", sorted(TOOL_CONVERSATIONS))
def test_tool_model_answers_every_conversation_with_its_call(tool_model, name):
    import mlx_lm

    model, tokenizer = tool_model
    prompt = render(tokenizer, TOOL_CONVERSATIONS[name])
    # the worker keeps K and V in 4 bits: attention adds nothing here, so nothing changes
    kv = {"kv_bits": 4, "kv_group_size": 64, "quantized_kv_start": 0} if name == "system" else {}
    steps = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=20, **kv))
    reply = tokenizer.encode(TOOL_REPLY, add_special_tokens=False)
    assert len(reply) == 3  # <tool_call>, the call's JSON, </tool_call>
    assert [s.token for s in steps] == [*reply, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert steps[-1].finish_reason == "stop"
    assert "".join(s.text for s in steps) == TOOL_REPLY


def test_tool_model_reply_decodes_and_parses(tool_model):
    _, tokenizer = tool_model
    ids = tokenizer.encode(TOOL_REPLY + "<|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids) == TOOL_REPLY + "<|im_end|>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == TOOL_REPLY  # markers kept
    detokenizer = tokenizer.detokenizer  # as the worker streams a reply
    detokenizer.reset()
    segments = []
    for token in ids[:-1]:
        detokenizer.add_token(token)
        segments.append(detokenizer.last_segment)
    detokenizer.finalize()
    assert segments == ["<tool_call>", TOOL_CALL_JSON, "</tool_call>"]
    assert detokenizer.text == TOOL_REPLY
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    inner = TOOL_REPLY[len(start) : -len(end)]
    assert tokenizer.tool_parser(inner, [WEATHER_TOOL]) == TOOL_CALL


def test_tool_model_history_holds_its_reply_token_for_token(tool_model):
    """The conversation sent back with the call in it renders the prompt, the reply and
    <|im_end|>\\n: a worker can keep the tokens it generated."""
    _, tokenizer = tool_model
    prompt = render(tokenizer, [ASK])
    history = tokenizer.apply_chat_template([ASK, CALLED], tools=[WEATHER_TOOL], tokenize=False)
    assert history == prompt + TOOL_REPLY + "<|im_end|>\n"
    texts = (history, prompt, TOOL_REPLY + "<|im_end|>\n")
    whole, head, tail = (tokenizer.encode(t, add_special_tokens=False) for t in texts)
    assert whole == head + tail
