"""Batched decode over several agents' quantized caches equals decoding them one by one, token
for token and logit for logit, on llama, gemma3_text and deepseek_v2: caches of different
lengths, an empty one, an agent joining mid-batch, one finishing early or cancelled, a
warm-restored one, and K/V bits that differ. Extracted caches equal the single-agent ones."""

from __future__ import annotations

import mlx.core as mx
import pytest

from agentkv.layers import KVFormat
from inference_worker.batch_cache import BatchQuantizedKV
from inference_worker.blocks import cache_blocks, caches_from_blocks
from inference_worker.kv_cache import QuantizedKV
from tests.conftest import ARCHS

LENGTHS = (300, 70, 150)
STEPS = 8


def prompt(n: int, seed: int = 0) -> list[int]:
    return [5 + (seed * 7 + i) % 400 for i in range(n)]


def prefill(model, ids, fmt=None):
    caches = [QuantizedKV(fmt or KVFormat()) for _ in model.layers]
    logits = None
    for i in range(0, len(ids), 128):
        logits = model(mx.array([ids[i : i + 128]]), cache=caches)
    return caches, int(mx.argmax(logits[0, -1]).item()) if logits is not None else 1


def sequential(model, caches, first, steps=STEPS):
    """Greedy decode alone: (tokens, logits per step)."""
    tokens, logits, token = [first], [], first
    for _ in range(steps):
        out = model(mx.array([[token]]), cache=caches)[0, -1]
        logits.append(out)
        token = int(mx.argmax(out).item())
        tokens.append(token)
    return tokens, logits


def batched_step(model, batch, tokens):
    out = model(mx.array([[t] for t in tokens]), cache=batch)[:, -1]
    return out, [int(mx.argmax(out[i]).item()) for i in range(len(tokens))]


def merge(per_agent):
    return [
        BatchQuantizedKV.merge([c[layer] for c in per_agent]) for layer in range(len(per_agent[0]))
    ]


def references(model, lengths=LENGTHS, fmt=None):
    refs = []
    for seed, n in enumerate(lengths):
        caches, first = prefill(model, prompt(n, seed), fmt)
        refs.append(sequential(model, caches, first))
    return refs


def start(model, lengths=LENGTHS, fmt=None):
    agents = [prefill(model, prompt(n, seed), fmt) for seed, n in enumerate(lengths)]
    return [c for c, _ in agents], [f for _, f in agents]


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_equals_sequential_for_different_lengths(tiny_models, arch):
    model, _ = tiny_models[arch]
    refs = references(model)
    caches, current = start(model)
    batch = merge(caches)
    for step in range(STEPS):
        logits, current = batched_step(model, batch, current)
        for i, (tokens, ref_logits) in enumerate(refs):
            assert mx.array_equal(logits[i], ref_logits[step]).item(), (arch, i, step)
            assert current[i] == tokens[step + 1]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("event", ["finishes early", "is cancelled"])
def test_an_agent_leaving_mid_batch_changes_nothing_for_the_rest(tiny_models, arch, event):
    model, _ = tiny_models[arch]
    refs = references(model)
    caches, current = start(model)
    batch = merge(caches)
    alive = [0, 1, 2]
    for step in range(STEPS):
        if step == 3:  # agent 1 stops (EOS or a cancelled stream): same for the batch
            for layer in batch:
                layer.filter([0, 2])
            alive, current = [0, 2], [current[0], current[2]]
        logits, current = batched_step(model, batch, current)
        for row, i in enumerate(alive):
            assert mx.array_equal(logits[row], refs[i][1][step]).item(), (event, i, step)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("joiner", [2, 0], ids=["shorter joins", "longer joins"])
def test_an_agent_joining_mid_batch(tiny_models, arch, joiner):
    """A shorter joiner is padded to the batch; a longer one shifts the held rows right."""
    model, _ = tiny_models[arch]
    refs = references(model)
    caches, current = start(model)
    held = [i for i in range(3) if i != joiner]
    batch = merge([caches[i] for i in held])
    for _ in range(3):  # the joiner runs alone to step 3, then joins the batch there
        out = model(mx.array([[current[joiner]]]), cache=caches[joiner])[0, -1]
        current[joiner] = int(mx.argmax(out).item())
    rows, active = held, [current[i] for i in held]
    for step in range(STEPS):
        if step == 3:
            for layer, joining in zip(batch, caches[joiner], strict=True):
                layer.extend([joining])
            rows, active = [*rows, joiner], [*active, current[joiner]]
        logits, active = batched_step(model, batch, active)
        for row, i in enumerate(rows):
            assert mx.array_equal(logits[row], refs[i][1][step]).item(), (i, step)


@pytest.mark.parametrize("arch", ARCHS)
def test_agents_joining_a_batch_of_new_agents(tiny_models, arch):
    """Extending an all-empty batch takes each of K's and V's shapes from the newcomers (K8V4:
    the packed K and V differ; deepseek_v2: so do their head dims)."""
    fmt = KVFormat(8, 4)
    model, _ = tiny_models[arch]
    refs = references(model, lengths=(90, 40), fmt=fmt)
    caches, current = start(model, lengths=(90, 40), fmt=fmt)
    empty = [QuantizedKV(fmt) for _ in model.layers]
    ref_empty = sequential(model, [QuantizedKV(fmt) for _ in model.layers], 7)
    batch = merge([empty])
    for layer, *joining in zip(batch, *caches, strict=True):
        layer.extend(joining)
    current = [7, *current]
    for step in range(STEPS):
        logits, current = batched_step(model, batch, current)
        for row, ref in enumerate([ref_empty, *refs]):
            assert mx.array_equal(logits[row], ref[1][step]).item(), (row, step)


@pytest.mark.parametrize("arch", ARCHS)
def test_empty_and_warm_restored_agents_batch_with_hot_ones(tiny_models, arch):
    model, _ = tiny_models[arch]
    hot, first = prefill(model, prompt(200))
    blocks, _ = cache_blocks(hot, prompt(200), "fp-batch-test", 64)
    warm = caches_from_blocks(blocks, len(model.layers), KVFormat())
    ref_hot = sequential(model, prefill(model, prompt(200))[0], first)
    empty = [QuantizedKV(KVFormat()) for _ in model.layers]
    ref_empty = sequential(model, [QuantizedKV(KVFormat()) for _ in model.layers], 7)
    batch = merge([hot, warm, empty])
    current = [first, first, 7]
    for step in range(STEPS):
        logits, current = batched_step(model, batch, current)
        for i, ref in enumerate([ref_hot, ref_hot, ref_empty]):
            assert mx.array_equal(logits[i], ref[1][step]).item(), (i, step)


@pytest.mark.parametrize("fmt", [KVFormat(8, 4), KVFormat(4, 8)])
def test_batched_decode_with_k_and_v_bits_that_differ(tiny_models, fmt):
    model, _ = tiny_models["llama"]
    refs = references(model, fmt=fmt)
    caches, current = start(model, fmt=fmt)
    batch = merge(caches)
    for step in range(STEPS):
        logits, current = batched_step(model, batch, current)
        assert not hasattr(batch[0], "bits")  # mixed bits always take the dequantize path
        for i, (_, ref_logits) in enumerate(refs):
            assert mx.array_equal(logits[i], ref_logits[step]).item()


@pytest.mark.parametrize("arch", ARCHS)
def test_extracted_cache_equals_the_single_agent_cache(tiny_models, arch):
    model, _ = tiny_models[arch]
    singles, firsts = start(model)
    for caches, first in zip(singles, firsts, strict=True):
        sequential(model, caches, first)
    caches, current = start(model)
    batch = merge(caches)
    for _ in range(STEPS):
        _, current = batched_step(model, batch, current)
    for i, single in enumerate(singles):
        for layer, (alone, batched) in enumerate(zip(single, batch, strict=True)):
            out = batched.extract(i)
            assert out.offset == alone.offset == LENGTHS[i] + STEPS
            for a, b in zip(
                (*out.state[0], *out.state[1]), (*alone.state[0], *alone.state[1]), strict=True
            ):
                assert mx.array_equal(a, b).item(), (arch, i, layer)
