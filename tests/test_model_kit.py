"""Offline model directories: every architecture loads with mlx_lm.load and chats; the
fingerprint moves with everything that makes KV bytes valid."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from agentkv.layers import KVFormat
from inference_worker.fingerprint import model_fingerprint
from tests.conftest import ARCHS
from tests.model_kit import BOS

CONVERSATION = [
    {"role": "system", "content": "You are the warden."},
    {"role": "user", "content": "Where were you on the night of the 14th?"},
    {"role": "assistant", "content": "In the yard, def f(x): return x  # honest"},
    {"role": "user", "content": "Prove it."},
]


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
