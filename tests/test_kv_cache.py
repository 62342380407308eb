"""Our quantized KV caches: mlx-lm's protocol, Q4 accuracy, and bit-exact restore through the
real store process over both read paths, on llama, gemma3_text and deepseek_v2."""

from __future__ import annotations

import weakref

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from agentkv.client.blocks import StoredBlock
from agentkv.keys import chain_keys
from agentkv.layers import KVFormat
from inference_worker.blocks import block_spans, cache_blocks, caches_from_blocks
from inference_worker.kv_cache import QuantizedKV
from inference_worker.layer_spec import model_layers
from tests.conftest import ARCHS

NS = "default"
PROMPT = list(range(5, 305))  # 300 tokens: two full 128-token blocks and a partial one


def prefill(model, tokens, fmt=None, chunk=128):
    caches = [QuantizedKV(fmt or KVFormat()) for _ in model.layers]
    for i in range(0, len(tokens), chunk):
        logits = model(mx.array([tokens[i : i + chunk]]), cache=caches)
    return caches, logits[0, -1]


def greedy(model, caches, first, n=8):
    out, token = [], first
    for _ in range(n):
        logits = model(mx.array([[token]]), cache=caches)[0, -1]
        token = int(mx.argmax(logits).item())
        out.append((token, logits))
    return out


@pytest.mark.parametrize("path", ["stream", "locate"])
@pytest.mark.parametrize("arch", ARCHS)
def test_restore_through_the_store_is_bit_exact(tiny_models, store, arch, path):
    model, _ = tiny_models[arch]
    fp = f"test-{arch}:k4v4g64f16:b128"
    hot, _ = prefill(model, PROMPT)
    blocks, keys = cache_blocks(hot, PROMPT, fp, block_tokens=128)
    assert [len(b.token_ids) for b in blocks] == [128, 128, 44]
    assert keys == chain_keys(fp, [PROMPT[a:b] for a, b in block_spans(0, 300, 128)])
    store.put_blocks(NS, fp, blocks)
    read = store.get_blocks if path == "stream" else store.read_blocks_local
    warm = caches_from_blocks(list(read(NS, fp, keys)), len(model.layers), KVFormat())
    assert all(w.offset == 300 for w in warm)
    for (t_hot, l_hot), (t_warm, l_warm) in zip(
        greedy(model, hot, 7), greedy(model, warm, 7), strict=True
    ):
        assert t_hot == t_warm
        assert mx.array_equal(l_hot, l_warm).item()


@pytest.mark.parametrize(
    "fmt", [KVFormat(8, 4), KVFormat(4, 8), KVFormat(8, 8), KVFormat(3, 5, 32), KVFormat(6, 2)]
)
def test_other_kv_formats_restore_bit_exactly(tiny_models, fmt):
    """...and every tensor a format writes passes the restore's check against the layers."""
    model, _ = tiny_models["llama"]
    hot, _ = prefill(model, PROMPT, fmt)
    blocks, keys = cache_blocks(hot, PROMPT, "fp-formats", block_tokens=128)
    stored = [
        StoredBlock(k, b.parent_key, b.token_ids, b.tensors)
        for b, k in zip(blocks, keys, strict=True)
    ]
    warm = caches_from_blocks(stored, len(model.layers), fmt, specs=model_layers(model))
    a = model(mx.array([[3]]), cache=hot)
    b = model(mx.array([[3]]), cache=warm)
    assert mx.array_equal(a, b).item()


@pytest.mark.parametrize(
    "fmt, tolerance",
    [
        # Random weights give K/V with no structure for quantization to keep; group-64
        # 8-bit error is ~1/255 of a group's range, 4-bit ~1/15. Measured on this tiny
        # llama: 8-bit ~0.01, 4-bit ~0.14 max |logit difference|, logits spanning ~±4.
        (KVFormat(8, 8), 0.05),
        (KVFormat(4, 4), 0.4),
    ],
)
def test_quantized_logits_stay_close_to_fp(tiny_models, fmt, tolerance):
    model, _ = tiny_models["llama"]
    fp_cache = make_prompt_cache(model)
    reference = model(mx.array([PROMPT]), cache=fp_cache)[0, -1]
    _, quantized = prefill(model, PROMPT, fmt)
    assert mx.abs(quantized - reference).max().item() < tolerance
    assert int(mx.argmax(quantized).item()) == int(mx.argmax(reference).item())


def test_decode_uses_quantized_attention_and_prefill_does_not(tiny_models):
    model, _ = tiny_models["llama"]
    caches, _ = prefill(model, PROMPT)
    assert not hasattr(caches[0], "bits")  # a prefill chunk attended over dequantized K/V
    model(mx.array([[3]]), cache=caches)
    assert caches[0].bits == 4  # a decode step attends over Q4 directly
    mixed, _ = prefill(model, PROMPT, KVFormat(8, 4))
    model(mx.array([[3]]), cache=mixed)
    assert not hasattr(mixed[0], "bits")  # mlx-lm's quantized path has one bits for K and V


def held_bytes(cache: QuantizedKV) -> int:
    """K and V's bytes at the positions the cache holds, sliced out."""
    k, v = cache.quantized(cache.offset)
    return sum(a.nbytes for a in (*k, *v))


def test_nbytes_follows_the_positions_held_as_the_arrays_change(tiny_models):
    """nbytes is counted per position (slicing every array each time was slow on the MLX
    thread): it follows growth, a trim, a window's drop, and a batch's rows coming and
    going, as the arrays sliced would say."""
    from inference_worker.batch_cache import BatchQuantizedKV

    model, _ = tiny_models["llama"]
    caches = prefill(model, PROMPT)[0]  # (its logits' graph would hold the arrays)
    a = caches[0]
    assert a.nbytes == held_bytes(a) > 0
    old = weakref.ref(a.keys[0])
    model(mx.array([[3] * 300]), cache=caches)  # past its capacity: new arrays
    mx.eval([x for c in caches for x in c.state_arrays()])  # (lazy, they hold the old)
    assert old() is None  # nbytes keeps no array it counted alive
    assert a.nbytes == held_bytes(a)
    a.trim(150)
    assert a.nbytes == held_bytes(a)
    window = QuantizedKV(KVFormat(), 1, 64, 64)
    x = mx.zeros((1, 2, 300, 64), mx.float16)
    window.keep_from = 1 << 40
    window.update_and_fetch(x, x)
    window.release()
    assert window.start > 0 and window.nbytes == held_bytes(window)
    others = [prefill(model, PROMPT[:n])[0][0] for n in (40, 90)]
    batch = BatchQuantizedKV.merge([a, others[0]])
    assert batch.nbytes == held_bytes(batch.kv) == 2 * held_bytes(a)  # padded to the longest
    batch.extend([others[1]])
    assert batch.nbytes == held_bytes(batch.kv) == 3 * held_bytes(a)
    batch.filter([1, 2])
    assert batch.nbytes == held_bytes(batch.kv) == 2 * held_bytes(others[1])


def test_cache_protocol(tiny_models):
    model, _ = tiny_models["llama"]
    caches, _ = prefill(model, PROMPT)
    c = caches[0]
    assert c.offset == c.size() == 300 and not c.empty() and c.is_trimmable()
    per_token = 2 * 2 * (64 // 8 * 4 + 2 * 2)  # K and V, 2 heads, packed + fp16 scale/bias
    assert c.nbytes == 300 * per_token
    assert c.trim(10) == 10 and c.offset == 290
    assert c.make_mask(1) is None and c.make_mask(4) == "causal"
    assert c.make_mask(4, window_size=64).shape == (4, 294)


def test_block_spans_cut_at_block_boundaries():
    assert block_spans(0, 300, 128) == [(0, 128), (128, 256), (256, 300)]
    assert block_spans(256, 300, 128) == [(256, 300)]
    assert block_spans(128, 128, 128) == []


def test_kv_format_is_validated():
    with pytest.raises(ValueError, match="k_bits"):
        KVFormat(k_bits=7)
    with pytest.raises(ValueError, match="group_size"):
        KVFormat(group_size=48)
    assert KVFormat(8, 4).name == "k8v4g64f16"
