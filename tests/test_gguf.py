"""GGUF import: files written as llama.cpp's converter writes them (tests/gguf_kit.py) load
with the same logits as the weights they came from, for every supported architecture."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten
from mlx_lm import load

from inference_worker import model_import
from inference_worker.gguf_import import (
    IMPORTED_FILES,
    LOCK,
    GGUFError,
    cached_import,
    damage,
    format_version,
    import_gguf,
)
from inference_worker.gguf_model import read_gguf
from inference_worker.gguf_tokenizer import build_tokenizer
from inference_worker.models import ModelError, resolve_model
from tests.gguf_kit import ggml_data, write_gguf
from tests.model_kit import TINY_CONFIGS, random_model, save_model

ARCHS = ("llama", "qwen2", "qwen3", "gemma3_text")
TEXTS = [
    "def f(x):\n    return x * 2  # twice",
    "Numbers 1234567 and 3.14159, unicode café ünïcode 😀",
    "  leading spaces,\ttabs\n\n\nand don't we'll they've",
]
Q = GGMLQuantizationType


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny_model_dirs):
    """Per architecture: its model directory, the loaded model and its float32 weights."""
    from tests.model_kit import tiny_tokenizer

    root = tmp_path_factory.mktemp("gguf-src")
    tokenizer = tiny_tokenizer()
    out = {}
    for arch in ARCHS:
        config = {**TINY_CONFIGS[arch], "vocab_size": tokenizer.get_vocab_size()}
        path = save_model(root / arch, random_model(config, seed=3), config, tokenizer)
        model, tok = load(str(path))
        weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
        out[arch] = (path, config, model, tok, weights)
    return out


def logits(model, tokenizer) -> mx.array:
    return model(mx.array([tokenizer.encode(TEXTS[0])]))


@pytest.mark.parametrize("weights", ["float32", "native"])
@pytest.mark.parametrize("arch", ARCHS)
def test_float_gguf_imports_bit_exact(sources, tmp_path, arch, weights):
    path, config, model, tok, w = sources[arch]
    gguf = write_gguf(tmp_path / "m.gguf", w, config, path)
    imported, _ = load(str(import_gguf(gguf, tmp_path / "out", weights)))
    assert mx.array_equal(logits(imported, tok), logits(model, tok))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_gguf_matches_its_dequantized_weights(sources, tmp_path, arch, qtype):
    """The reference is the source model with each 2-D weight passed through gguf's own
    numpy quantize + dequantize. Dequantized (float32) and native (MLX quantized layers)
    imports both match it up to float rounding, a thousandth of what quantization moved."""
    path, config, model, tok, w = sources[arch]
    gguf = write_gguf(tmp_path / "m.gguf", w, config, path, qtype)
    ref_weights = {
        k: dequantize(quantize(v, qtype), qtype) if v.ndim == 2 else v for k, v in w.items()
    }
    reference = random_model(config)
    reference.load_weights([(k, mx.array(v)) for k, v in ref_weights.items()])
    expected = logits(reference, tok)
    moved = float(mx.abs(expected - logits(model, tok)).max())  # what quantization did
    assert moved > 0
    for weights in ("float32", "native"):
        imported, _ = load(str(import_gguf(gguf, tmp_path / weights, weights)))
        imported.set_dtype(mx.float32)
        diff = float(mx.abs(logits(imported, tok) - expected).max())
        assert diff <= 1e-3 * moved, (weights, diff, moved)


def test_byte_level_tokenizer_and_template_survive_import(sources, tmp_path):
    path, config, _, tok, w = sources["llama"]
    out = import_gguf(write_gguf(tmp_path / "m.gguf", w, config, path), tmp_path / "out")
    _, imported = load(str(out))
    for text in TEXTS:
        assert imported.encode(text) == tok.encode(text)
        assert imported.decode(imported.encode(text)) == text
    chat = [{"role": "user", "content": "hi <|end|> there"}]
    assert imported.apply_chat_template(chat, add_generation_prompt=True) == (
        tok.apply_chat_template(chat, add_generation_prompt=True)
    )
    assert imported.eos_token_id == tok.eos_token_id


def test_sentencepiece_vocabulary_rebuilds_the_same_ids():
    """A sentencepiece BPE vocabulary with its merges dropped (as GGUF stores it) tokenizes
    like the tokenizer it came from, leading whitespace aside (llama.cpp prefixes one '▁'
    to the text, which `tokenizers`' Metaspace does not when the text starts with a space)."""
    from tokenizers import SentencePieceBPETokenizer

    from tests.model_kit import read_texts, stdlib_files

    specials = ["<unk>", "<s>", "</s>"]
    spm = SentencePieceBPETokenizer()
    texts = list(read_texts(stdlib_files(limit=30)))
    spm.train_from_iterator(texts, vocab_size=600, special_tokens=specials, show_progress=False)
    tokens = [t for t, _ in sorted(spm.get_vocab().items(), key=lambda kv: kv[1])]
    meta = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [-float(i) for i in range(len(tokens))],
        "tokenizer.ggml.token_type": [3 if t in specials else 1 for t in tokens],
        "tokenizer.ggml.add_space_prefix": True,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    rebuilt = build_tokenizer(meta)
    lines = [ln.strip() for t in texts[:10] for ln in t.splitlines() if ln.strip()][:1500]
    assert len(lines) > 500
    assert [rebuilt.encode(ln).ids for ln in lines] == [spm.encode(ln).ids for ln in lines]
    assert rebuilt.decode(rebuilt.encode("  two  spaces").ids) == "  two  spaces"


def _bare_gguf(path, arch: str, data=None, qtype: GGMLQuantizationType | None = None):
    writer = GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", 1)
    data = np.zeros((4, 8), dtype=np.float32) if data is None else data
    writer.add_tensor("token_embd.weight", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# The GGML types agentkv decodes, bit for bit as gguf's numpy dequantize does.
READABLE = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1}
READABLE |= {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
# under native: MLX layers of 4, 5 or 8 bits; the K-quants' scales rounded to fp16
KEPT_QUANTIZED = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K}
ROUNDED_SCALES = {Q.Q4_K: 15, Q.Q5_K: 31}  # and their largest quant
QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding)


@pytest.mark.parametrize("qtype", list(Q), ids=lambda q: q.name)
def test_every_tensor_type_reads_as_gguf_decodes_it_or_is_refused_by_name(tmp_path, qtype):
    """A tensor either reads as gguf's own dequantize gives it (bit for bit in float32;
    under native, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 as MLX quantization that dequantizes to it,
    Q4_K and Q5_K as MLX quantization within its fp16-rounded scales and biases, the others
    rounded to float16)
    or is refused naming it and its type."""
    data = ggml_data((8, 512), qtype, seed=int(qtype))
    gguf = _bare_gguf(tmp_path / "t.gguf", "llama", data, qtype)
    if qtype not in READABLE:
        says = rf"'token_embd.weight' is ({qtype.name}|type {int(qtype)}), which agentkv"
        with pytest.raises(GGUFError, match=says):
            read_gguf(gguf)
        return
    want = dequantize(data, qtype)
    tensors, _ = read_gguf(gguf, "float32")
    np.testing.assert_array_equal(np.array(tensors["token_embd.weight"]), want)
    native, _ = read_gguf(gguf, "native")
    got = native["token_embd.weight"]
    assert ("token_embd.scales" in native) == (qtype in KEPT_QUANTIZED)
    if qtype in KEPT_QUANTIZED:  # MLX affine quantization, group 32
        scales, biases = (native[f"token_embd.{k}"] for k in ("scales", "biases"))
        f32 = (scales.astype(mx.float32), biases.astype(mx.float32))
        got = mx.dequantize(got, *f32, 32, got.shape[-1] * 32 // 512)
    elif qtype not in (Q.F32, Q.F16):
        want = want.astype(np.float16)
    if qtype in ROUNDED_SCALES:  # scale and bias each within 2^-11 of theirs: w = s*q + b
        top = ROUNDED_SCALES[qtype]
        bound = 2**-11 * (top * np.abs(np.array(f32[0])) + np.abs(np.array(f32[1])))
        err = np.abs(np.array(got) - want).reshape(*bound.shape, 32)
        assert (err <= bound[..., None]).all() and err.max() > 0
        return
    np.testing.assert_array_equal(np.array(got), want)


# A Q4_K_M-like mix (llama.cpp's choice per tensor) with the other types agentkv decodes.
MIX = {
    "model.embed_tokens.weight": Q.Q4_K,
    "model.layers.0.self_attn.q_proj.weight": Q.Q4_K,
    "model.layers.0.self_attn.k_proj.weight": Q.Q4_K,
    "model.layers.0.self_attn.v_proj.weight": Q.Q6_K,
    "model.layers.0.self_attn.o_proj.weight": Q.Q5_K,
    "model.layers.0.mlp.gate_proj.weight": Q.Q4_K,
    "model.layers.0.mlp.up_proj.weight": Q.Q5_K,
    "model.layers.0.mlp.down_proj.weight": Q.Q3_K,
    "model.layers.1.self_attn.q_proj.weight": Q.Q5_0,
    "model.layers.1.self_attn.v_proj.weight": Q.Q5_1,
    "model.layers.1.mlp.down_proj.weight": Q.Q2_K,
}


def test_a_k_quant_gguf_runs_as_its_gguf_dequantized_weights(tmp_path):
    """A model whose weights are K-quants (random valid blocks) and Q5_0/Q5_1 imports and
    gives, bit for bit in float32, the logits of the same model loaded from gguf's own
    dequantization. Under native its Q4_K, Q5_K, Q5_0 and Q5_1 layers stay 4- and 5-bit MLX
    layers (the K-quants' scales rounded to fp16, the other decoded weights float16): its
    logits are within 3x of what rounding every decoded weight to float16 moves them."""
    from tests.model_kit import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config = {**TINY_CONFIGS["qwen3"], "hidden_size": 256, "intermediate_size": 512}
    config["vocab_size"] = tokenizer.get_vocab_size()  # rows of 256: whole K-quant blocks
    source = save_model(tmp_path / "src", random_model(config, seed=4), config, tokenizer)
    model, tok = load(str(source))
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    gguf = write_gguf(tmp_path / "m.gguf", weights, config, source, raw=MIX)
    decoded = {k: dequantize(ggml_data(weights[k].shape, q), q) for k, q in MIX.items()}
    rounded = {k: v.astype(np.float16).astype(np.float32) for k, v in decoded.items()}
    expected, in_fp16 = (
        logits(with_weights(config, {**weights, **d}), tok) for d in (decoded, rounded)
    )
    moved = float(mx.abs(in_fp16 - expected).max())
    for kind in ("float32", "native"):
        imported, _ = load(str(cached_import(gguf, kind, tmp_path / "cache")))
        imported.set_dtype(mx.float32)
        got = logits(imported, tok)
        if kind == "float32":
            assert bool(mx.isfinite(expected).all()) and mx.array_equal(got, expected), kind
            continue
        kept = {k for k, m in imported.named_modules() if isinstance(m, QUANTIZED)}
        assert kept == {k.rpartition(".")[0] for k, q in MIX.items() if q in KEPT_QUANTIZED}
        assert 0 < float(mx.abs(got - expected).max()) <= 3 * moved


def with_weights(config: dict, weights: dict):
    model = random_model(config)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    return model


def test_an_unsupported_architecture_is_one_line(tmp_path):
    gguf = _bare_gguf(tmp_path / "mamba.gguf", "mamba")
    with pytest.raises(ModelError) as err:
        resolve_model(str(gguf), "float32", cache_dir=tmp_path / "cache")
    message = str(err.value)
    assert "'mamba' is not supported" in message and "llama" in message and "\n" not in message
    assert {p.name for p in (tmp_path / "cache").glob("*")} <= {LOCK}  # nothing half-imported


def worker_error(model, tmp_path, *args: str) -> str:
    """The last line a worker started on `model` prints as it exits with 2, no traceback."""
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "inference_worker", "--model", str(model)),
            *("--store", "127.0.0.1:1", *args),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={"AGENTKV_MODEL_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def test_worker_refuses_an_unsupported_gguf_in_one_line(tmp_path):
    gguf = _bare_gguf(tmp_path / "rwkv.gguf", "rwkv6")
    last = worker_error(gguf, tmp_path)
    assert last.startswith("agentkv-worker: error: GGUF architecture 'rwkv6' is not supported")


@pytest.mark.parametrize(
    "metadata, missing, says",
    [
        ({"tokenizer.ggml.tokens": None}, "", "metadata lacks tokenizer.ggml.tokens"),
        ({"llama.attention.head_count": None}, "", "metadata lacks llama.attention.head_count"),
        ({"tokenizer.ggml.eos_token_id": 99999}, "", "eos_token_id 99999 is past the vocabulary"),
        ({}, "model.embed_tokens.weight", "has no token_embd.weight"),
        # The red team's: each was a traceback (ZeroDivisionError; garbage weights read from
        # a shifted offset for a negative one; a RecursionError 2,993 lines long).
        ({"llama.attention.head_count": 0}, "", "cannot use: ZeroDivisionError"),
        ({"general.alignment": 0}, "", "general.alignment 0: not a multiple of 8"),
        ({"general.alignment": 12}, "", "general.alignment 12: not a multiple of 8"),
        ({"general.nested": functools.reduce(lambda a, _: [a], range(20), [1])}, "", "past 8"),
    ],
    ids=[
        "no-tokens",
        "no-head-count",
        "eos-past-vocabulary",
        "no-token-embd",
        "zero-heads",
        "zero-alignment",
        "odd-alignment",
        "nested-arrays",
    ],
)
def test_a_gguf_lacking_what_a_model_needs_is_one_line(
    sources, tmp_path, capsys, metadata, missing, says
):
    """From `agentkv model import` (its own process's main) and the worker's resolve_model."""
    path, config, _, _, w = sources["llama"]
    w = {k: v for k, v in w.items() if k != missing}
    gguf = write_gguf(tmp_path / "bad.gguf", w, config, path, metadata=metadata)
    with pytest.raises(SystemExit) as exit_:
        model_import.main([str(gguf), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: GGUF") and err.count("\n") == 1
    assert says in err
    with pytest.raises(ModelError, match=says):
        resolve_model(str(gguf), "float32", cache_dir=tmp_path / "cache")


def _renamed(gguf: Path, old: str, new: str) -> Path:
    """`gguf` with its first `old` (a key or tensor name) renamed `new`, of the same length."""
    data = gguf.read_bytes()
    gguf.write_bytes(data.replace(old.encode(), new.encode(), 1))
    return gguf


def _short_embedding(w: dict) -> dict:
    return {**w, "model.embed_tokens.weight": w["model.embed_tokens.weight"][:-40]}


def _past_float16(w: dict) -> dict:
    norm = np.array(w["model.norm.weight"], dtype=np.float32)
    norm[0] = 1e5
    return {**w, "model.norm.weight": norm}


WRONG_FILES = {  # the reviewer's, each imported "successfully"
    # its last 40 tokens read past the embeddings, and its end token could never be sampled
    "short-embedding": (_short_embedding, None, "float32", "but token_embd.weight has"),
    # the last of the two was used, silently
    "tensor-twice": (
        None,
        ("blk.0.attn_q.weight", "blk.0.attn_k.weight"),
        "float32",
        "holds tensor 'blk.0.attn_k.weight' twice",
    ),
    "key-twice": (
        None,
        ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"),
        "float32",
        "holds metadata key 'tokenizer.ggml.eos_token_id' twice",
    ),
    # checked finite in float32, then cast to float16: an infinite weight
    "past-float16": (_past_float16, None, "float16", "'output_norm.weight' holds weights up to"),
}


@pytest.mark.parametrize("case", WRONG_FILES)
def test_a_gguf_llama_cpp_would_refuse_is_one_line(sources, tmp_path, capsys, case):
    """From `agentkv model import` (its own process's main) and the worker's resolve_model."""
    path, config, _, _, w = sources["llama"]
    harm_weights, rename, weights, says = WRONG_FILES[case]
    gguf = write_gguf(tmp_path / "bad.gguf", (harm_weights or dict)(w), config, path)
    if rename:
        _renamed(gguf, *rename)
    with pytest.raises(SystemExit) as exit_:
        model_import.main([str(gguf), "--out", str(tmp_path / "out"), "--weights", weights])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: GGUF") and err.count("\n") == 1
    assert says in err, err
    with pytest.raises(ModelError, match=re.escape(says)):
        resolve_model(str(gguf), weights, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "out").exists()


def test_a_vocabulary_one_token_past_the_embeddings_is_refused_though_a_token_repeats(
    sources, tmp_path
):
    """The reviewer's: the rows were checked against the tokenizer's vocabulary size, which
    counts a repeated token once, while its id is its last place: one past the rows."""
    path, config, _, _, w = sources["llama"]
    _, meta = read_gguf(write_gguf(tmp_path / "whole.gguf", w, config, path))
    tokens = list(meta["tokenizer.ggml.tokens"])
    rows = w["model.embed_tokens.weight"].shape[0]
    assert len(tokens) <= rows
    repeated = {"tokenizer.ggml.tokens": tokens + [tokens[0]] * (rows + 1 - len(tokens))}
    gguf = write_gguf(tmp_path / "bad.gguf", w, config, path, metadata=repeated)
    with pytest.raises(GGUFError, match=f"has {rows + 1} tokens .* has {rows} rows"):
        import_gguf(gguf, tmp_path / "out")


def test_a_token_longer_than_any_model_s_is_refused_naming_it(sources, tmp_path):
    """The reviewer's: a merge table rebuilt from a token takes time squared in its length
    (a 1 MB token: minutes of a worker's start)."""
    path, config, _, _, w = sources["llama"]
    tokens = {"tokenizer.ggml.tokens": ["a", "b" * 5000, "c"]}
    gguf = write_gguf(tmp_path / "long.gguf", w, config, path, metadata=tokens)
    with pytest.raises(GGUFError, match=r"tokens\[1\] is 5,000 characters long, past the 4,096"):
        import_gguf(gguf, tmp_path / "out")


def test_weights_past_float16_import_whole_in_float32(sources, tmp_path):
    path, config, _, _, w = sources["llama"]
    gguf = write_gguf(tmp_path / "m.gguf", _past_float16(w), config, path)
    model, _ = load(str(import_gguf(gguf, tmp_path / "out", "float32")))
    assert model.model.norm.weight[0].item() == 1e5


MAMBA = {
    "model_type": "mamba",
    "hidden_size": 32,
    "intermediate_size": 64,
    "state_size": 4,
    "num_hidden_layers": 1,
    "conv_kernel": 4,
    "use_bias": False,
    "use_conv_bias": True,
    "time_step_rank": 4,
}


@pytest.mark.parametrize("kind", ["unknown-model-type", "recurrent-layers"])
def test_a_model_directory_agentkv_cannot_run_is_one_line_from_the_worker(
    tiny_model_dirs, tmp_path, kind
):
    """mlx-lm lacking the model_type, or a model whose layers keep other caches than KV
    (Mamba's), is the worker's one line, not mlx-lm's ValueError."""
    from tests.model_kit import tiny_tokenizer

    if kind == "recurrent-layers":
        tokenizer = tiny_tokenizer()
        config = {**MAMBA, "vocab_size": tokenizer.get_vocab_size()}
        model = save_model(tmp_path / "mamba", random_model(config), config, tokenizer)
        says = "mamba layer 0 uses ArraysCache: agentkv caches full-attention and sliding"
    else:
        model = shutil.copytree(tiny_model_dirs["llama"], tmp_path / "mamba9")
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "model_type": "mamba9"}))
        says = f"model at {model}: mlx-lm "
    last = worker_error(model, tmp_path)
    assert last.startswith("agentkv-worker: error: ") and says in last, last
    if kind != "recurrent-layers":
        assert "mamba9 not supported" in last


@pytest.mark.parametrize(
    "spec, says",
    [
        ("models/agentkv-defualt", "no model at models/agentkv-defualt: no such file"),
        ("/nonexistent/model.gguf", "no such file or directory"),
        ("./relative-typo", "no such file or directory"),
    ],
)
def test_a_missing_local_model_is_never_sent_to_the_hub(spec, says):
    with pytest.raises(ModelError, match=says):
        resolve_model(spec)


def test_a_missing_model_that_could_be_a_hub_id_says_it_is_neither(tmp_path):
    """From another folder, "models/agentkv-defualt" could be a Hugging Face id. The hub,
    out of reach, was all the error spoke of ("... check your internet connection"); it now
    says first that no such path is here, naming the folder it looked in."""
    code = "from inference_worker.models import resolve_model; resolve_model('models/typo')"
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"inference_worker.models.ModelError: no model at models/typo: no such file or "
        f"directory in {tmp_path}, nor did the Hugging Face hub give a model of that id ("
    ), last


def test_the_demo_with_a_bad_model_prints_the_workers_one_line(tmp_path):
    missing = tmp_path / "no-such-model"
    proc = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", "demo", "--model", str(missing), "--no-cold"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [  # the worker's line, not "error: " twice
        f"agentkv-worker: error: no model at {missing}: no such file or directory "
        "(shipped: smollm2-135m-instruct)"
    ]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "starting agentkv-worker" in proc.stdout and "failed" in proc.stdout


def test_an_incomplete_model_directory_names_what_it_lacks(tmp_path):
    with pytest.raises(ModelError, match=r"lacks config.json, \*.safetensors, a tokenizer"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelError, match=r"lacks \*.safetensors, a tokenizer"):
        resolve_model(str(tmp_path))


def test_a_model_that_is_no_file_nor_directory_or_a_directory_with_gguf_weights_is_refused(
    tiny_model_dirs,
):
    """The red team's: /dev/zero (or a FIFO) was "no such file or directory"; --gguf-weights
    float16 with a model directory was taken, and did nothing."""
    with pytest.raises(ModelError, match="/dev/zero: neither a GGUF file nor a model directory"):
        resolve_model("/dev/zero")
    model = str(tiny_model_dirs["llama"])
    with pytest.raises(ModelError, match=f"--gguf-weights float16 is for a GGUF file, and {model}"):
        resolve_model(model, "float16")
    assert resolve_model(model) == Path(model)  # auto: as it was


def test_the_import_cache_is_keyed_by_content(sources, tmp_path):
    path, config, _, _, w = sources["qwen3"]
    gguf = write_gguf(tmp_path / "m.gguf", w, config, path)
    cache = tmp_path / "cache"
    first = cached_import(gguf, "float32", cache)
    assert cached_import(gguf, "float32", cache) == first
    assert cached_import(gguf, "native", cache) != first
    w2 = {**w, "model.norm.weight": w["model.norm.weight"] * 2}
    changed = cached_import(write_gguf(tmp_path / "m.gguf", w2, config, path), "float32", cache)
    assert (
        changed != first
        and (changed / "config.json").read_text() != (first / "config.json").read_text()
    )
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no staging left


BAD_METADATA = {  # the red team's, each imported "successfully", then failing the worker
    "no-layers": ({"llama.block_count": 0}, "gives 0 layers (block_count), its tensors 2"),
    "more-layers": ({"llama.block_count": 1000}, "gives 1000 layers"),
    "most-layers": ({"llama.block_count": 2**32 - 1}, "gives 4294967295 layers"),  # MemoryError
    "kv-heads": ({"llama.attention.head_count_kv": 1}, "disagrees with its tensors"),
    "width": ({"llama.embedding_length": 1}, "GGUF"),  # was ZeroDivisionError
    "rope-nan": ({}, "rope_theta = nan: not a finite number"),  # answered only its end token
    "merges": (  # was the tokenizers library's "TypeError: failed to extract enum PyMerges"
        {"tokenizer.ggml.merges": ["nospace"]},
        "tokenizer.ggml.merges[0] 'nospace' is not two tokens of the vocabulary",
    ),
}


@pytest.mark.parametrize("case", BAD_METADATA)
def test_gguf_metadata_its_tensors_disagree_with_is_refused_at_import(sources, tmp_path, case):
    path, config, _, _, w = sources["llama"]
    metadata, said = BAD_METADATA[case]
    config = {**config, "rope_theta": float("nan")} if case == "rope-nan" else config
    gguf = write_gguf(tmp_path / "m.gguf", w, config, path, metadata=metadata)
    with pytest.raises(GGUFError) as refused:
        import_gguf(gguf, tmp_path / "out")
    assert said in refused.value.args[0], refused.value.args[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # nothing left


@pytest.mark.parametrize("harm", ["cut", "flipped", "removed"])
def test_a_damaged_cached_import_is_imported_again(sources, tmp_path, harm):
    """The red team's case: the cached import's weights cut short were used as they were
    (every worker start failed with MLX's "invalid data offsets", and `agentkv model
    import` said it was done); a byte flipped was served under a new fingerprint, every
    agent then another model's. Each file is checked against what its import recorded, and
    a damaged import is made again, the same as it first was."""
    path, config, _, _, w = sources["qwen3"]
    gguf = write_gguf(tmp_path / "m.gguf", w, config, path)
    cache = tmp_path / "cache"
    target = cached_import(gguf, "float32", cache)
    weights = target / "model.safetensors"
    whole = weights.read_bytes()
    assert damage(target) == ""
    if harm == "cut":
        weights.write_bytes(whole[: len(whole) // 2])
        said = f"model.safetensors is {len(whole) // 2} bytes, not the {len(whole)} imported"
    elif harm == "flipped":
        weights.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))
        said = "model.safetensors is not the file imported (its xxh3 differs)"
    else:
        (target / "tokenizer.json").unlink()
        said = "tokenizer.json is missing"
    assert damage(target) == said
    assert cached_import(gguf, "float32", cache) == target
    assert weights.read_bytes() == whole and damage(target) == ""
    load(str(target))
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # nothing left aside
    os.utime(weights)  # touched, the same bytes: hashed, and whole
    assert damage(target) == ""
    (target / "agentkv-import.json").write_text("[1, 2]")  # a record that is no record
    assert damage(target).startswith("agentkv-import.json cannot be read")


def test_a_model_cache_that_takes_no_files_says_so_and_what_to_do(sources, tmp_path, monkeypatch):
    """The red team's read-only (immutable) cache: `error: [Errno 1] Operation not permitted:
    '.../.SmolLM2-...'`, a staging name. Root ignores modes, so the refusal is simulated."""
    import errno

    from inference_worker import gguf_import

    path, config, _, _, w = sources["qwen3"]
    gguf = write_gguf(tmp_path / "m.gguf", w, config, path)
    cache = tmp_path / "cache"

    def refused(prefix: str, dir: Path) -> str:
        raise PermissionError(errno.EPERM, "Operation not permitted", str(Path(dir) / prefix))

    monkeypatch.setattr(gguf_import.tempfile, "mkdtemp", refused)
    said = rf"the model cache {cache} cannot hold imports: Operation not permitted \(set AGENTKV"
    with pytest.raises(OSError, match=said):
        cached_import(gguf, "float32", cache)


def test_an_import_into_a_directory_is_whole_or_not_there(sources, tmp_path):
    """`import_gguf` writes beside `out` and renames into place: an empty directory is
    filled, an earlier import replaced, and one holding other files refused untouched."""
    path, config, _, _, w = sources["llama"]
    gguf = write_gguf(tmp_path / "m.gguf", w, config, path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(GGUFError, match="holds files of its own"):
        import_gguf(gguf, out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    (out / "notes.txt").unlink()
    (tmp_path / "afile").write_text("x")  # under a file: was "[Errno 17] File exists"
    with pytest.raises(GGUFError, match=f"--out {tmp_path}/afile/x: {tmp_path}/afile is a file"):
        import_gguf(gguf, tmp_path / "afile" / "x")
    (tmp_path / "afile").unlink()
    # files of an import's names, but no import's (the red team's: a model of one's own)
    (out / "config.json").write_text('{"model_type": "llama"}')
    (out / "model.safetensors").write_text("mine")
    with pytest.raises(GGUFError, match="holds files of its own"):
        import_gguf(gguf, out)
    assert (out / "model.safetensors").read_text() == "mine"
    for name in ("config.json", "model.safetensors"):
        (out / name).unlink()
    # an in-place import cut short (config.json goes first, comes back last): redone
    (out / "model.safetensors").write_text("half")
    import_gguf(gguf, out)
    shutil.rmtree(out)
    out.mkdir()
    import_gguf(gguf, out)
    import_gguf(gguf, out, "native")
    assert json.loads((out / "config.json").read_text())["agentkv_gguf"]["weights"] == "native"
    load(str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "out"]  # no staging left


def staging_left(sources, tmp_path: Path, suffix: str) -> tuple[Path, Path, Path, Path]:
    """(gguf, cache, target, staging): a file whose import into `cache` is gone, and a
    staging directory of that import's key (`.KEY.suffix`) left beside where it would go."""
    path, config, _, _, w = sources["qwen3"]
    gguf = write_gguf(tmp_path / "m.gguf", w, config, path)
    cache = tmp_path / "cache"
    target = cached_import(gguf, "float32", cache)
    shutil.rmtree(target)
    staging = cache / f".{target.name}.{suffix}"
    staging.mkdir()
    return gguf, cache, target, staging


@pytest.mark.parametrize("held_via", ["cache", "link"])
def test_a_killed_imports_staging_directory_is_removed_by_the_next_import(
    sources, tmp_path, caplog, held_via
):
    """A staging directory of the same import that nobody holds (its process was killed) goes
    at the next import; one an import in progress holds (another process) stays meanwhile.
    The import that waits says so (it waited without a word: a worker's start, silent).
    Imports into the cache by another path (a link to it, or another mount of it) take
    turns with it too: the lock file is in the cache (it was beside the path each named,
    so each took the other's staging for a killed import's, and removed it)."""
    import fcntl
    import threading

    from tests.helpers import until

    gguf, cache, target, stale = staging_left(sources, tmp_path, "k1ll3d")
    (stale / "model.safetensors").write_bytes(b"half of it")
    other = cache / ".another-model-0123456789abcdef-float32-v4.x1"
    other.mkdir()
    (tmp_path / "link").symlink_to(cache)
    # as an import in progress holds the cache: its lock file in it
    held = os.open(tmp_path / held_via / "import.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)
    importing = threading.Thread(target=cached_import, args=(gguf, "float32", cache))
    waiting = "waiting for another import into the model cache to end"
    try:
        importing.start()
        until(lambda: waiting in caplog.messages, "the import to say it waits")
        assert stale.exists() and not target.exists()  # it waits for the other import
    finally:
        os.close(held)
    importing.join(120)
    assert (target / "config.json").exists() and not stale.exists()
    assert other.exists()  # another file's: not this import's to judge


def test_a_model_cache_that_is_no_directory_is_named_by_its_variable(
    sources, tmp_path, monkeypatch
):
    """AGENTKV_MODEL_CACHE naming a file stopped the worker with "[Errno 17] File exists:
    PATH", which named neither the variable nor the cache."""
    path, config, _, _, w = sources["qwen3"]
    gguf = write_gguf(tmp_path / "m.gguf", w, config, path)
    (tmp_path / "afile").write_text("mine")
    monkeypatch.setenv("AGENTKV_MODEL_CACHE", str(tmp_path / "afile"))
    with pytest.raises(
        OSError, match=r"the model cache \(env AGENTKV_MODEL_CACHE\) .*afile cannot hold"
    ):
        cached_import(gguf, "float32")
    assert (tmp_path / "afile").read_text() == "mine"


def test_an_import_into_a_mount_point_is_written_inside_it(sources, tmp_path, monkeypatch):
    """A volume's root cannot be renamed into place (EBUSY): the import is staged inside it
    and moved in file by file, config.json last; an earlier import there is replaced, and a
    killed one's staging removed (before, `--out /mnt/vol` failed 'Device or resource busy')."""
    path, config, model, tok, w = sources["qwen3"]
    gguf = write_gguf(tmp_path / "m.gguf", w, config, path)
    volume = tmp_path / "vol"
    (volume / ".import.k1ll3d").mkdir(parents=True)
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == volume)
    for _ in range(2):  # new, then over the earlier import
        assert import_gguf(gguf, volume) == volume
        assert sorted(p.name for p in volume.iterdir()) == sorted(IMPORTED_FILES)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "vol"]
    imported, _ = load(str(volume))
    assert mx.array_equal(logits(imported, tok), logits(model, tok))


def refuse_flock(monkeypatch) -> None:
    """From here on, flock is refused, as some NFS and SMB mounts refuse it (ENOLCK)."""
    import errno
    import fcntl

    def refused(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refused)


def test_an_import_goes_on_where_the_filesystem_refuses_flock(sources, tmp_path, monkeypatch):
    """Some NFS and SMB mounts refuse flock (ENOLCK, or EBADF where it becomes a byte-range
    lock): the import goes on, and leaves staging directories it cannot judge alone."""
    gguf, cache, _, maybe_live = staging_left(sources, tmp_path, "n0l0ck")
    refuse_flock(monkeypatch)
    assert (cached_import(gguf, "float32", cache) / "config.json").exists()
    assert maybe_live.exists()


def test_an_import_another_landed_first_is_taken_where_flock_is_refused(
    sources, tmp_path, monkeypatch
):
    """Without flock, two imports of one file run at once: the second to move its staging
    into place met the first's (ENOTEMPTY) and stopped its worker saying the cache "cannot
    hold imports". It takes the import that landed."""
    from inference_worker import gguf_import

    gguf, cache, target, _ = staging_left(sources, tmp_path, "n0l0ck")
    write_model = gguf_import.write_model

    def landed_meanwhile(path: Path, out: Path, weights: str) -> None:
        write_model(path, out, weights)
        shutil.copytree(out, target)  # another process's import, the same, landed first

    refuse_flock(monkeypatch)
    monkeypatch.setattr(gguf_import, "write_model", landed_meanwhile)
    assert cached_import(gguf, "float32", cache) == target
    assert damage(target) == ""


def test_llama3_rope_scaling_comes_back_from_rope_freqs(tmp_path):
    """Llama 3.x GGUFs carry RoPE scaling only as llama.cpp's precomputed rope_freqs
    tensor; the importer recognises Llama 3's settings from it, and the logits match."""
    from inference_worker.gguf_import import GGUFError
    from inference_worker.gguf_model import llama3_rope
    from tests.model_kit import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,  # Llama 3.2's
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = {
        **TINY_CONFIGS["llama"],
        "vocab_size": tokenizer.get_vocab_size(),
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "rope_scaling": scaling,
    }
    path = save_model(tmp_path / "src", random_model(config, seed=5), config, tokenizer)
    model, _ = load(str(path))
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    out = import_gguf(write_gguf(tmp_path / "m.gguf", weights, config, path), tmp_path / "out")
    imported, _ = load(str(out))
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == scaling
    ids = mx.array([list(range(1, 400))])  # positions where the scaling matters
    assert mx.array_equal(imported(ids), model(ids))
    with pytest.raises(GGUFError, match="match no Llama 3 RoPE scaling"):
        llama3_rope(np.ones(32) * 3.0, 64, 500000.0)


def test_a_worker_serves_a_gguf_file_directly(sources, tmp_path, start_worker, monkeypatch):
    """`agentkv-worker --model FILE.gguf`: imported into the model cache at start, served,
    and the fingerprint names the GGUF's content (another file, another fingerprint)."""
    from agentkv.client.worker import WorkerClient

    path, config, _, _, w = sources["qwen3"]
    monkeypatch.setenv("AGENTKV_MODEL_CACHE", str(tmp_path / "cache"))
    gguf = write_gguf(tmp_path / "tiny-qwen3.gguf", w, config, path, Q.Q8_0)
    worker = WorkerClient(start_worker(gguf, name="gguf").address)
    worker.create_agent("ns", "a", "You are terse.")
    reply = worker.turn("ns", "a", [("user", "Hello there.")], max_tokens=4)
    assert len(reply.token_ids) == 4
    (imported,) = [p for p in (tmp_path / "cache").iterdir() if p.name != LOCK]
    assert imported.name.startswith("tiny-qwen3-") and imported.name.endswith(
        f"-float32-v{format_version('float32')}"
    )
    other = write_gguf(tmp_path / "other.gguf", w, config, path, Q.Q4_0)
    again = WorkerClient(start_worker(other, name="other").address)
    assert again.info().fingerprint != worker.info().fingerprint


def test_a_gguf_whose_chat_template_leaves_out_what_users_say_is_refused(sources, tmp_path):
    """The red team's: a tokenizer.chat_template that renders no message imported and
    served, every conversation rendering as nothing the model could answer. (An empty one
    is no template: refused at start before.)"""
    path, config, _, _, w = sources["llama"]
    mute = {"tokenizer.chat_template": "{% for message in messages %}{% endfor %}"}
    gguf = write_gguf(tmp_path / "mute.gguf", w, config, path, metadata=mute)
    last = worker_error(gguf, tmp_path)
    assert last.startswith("agentkv-worker: error: the model's chat template leaves out"), last


@pytest.mark.parametrize("kind", ["config-value", "tokenizer-shape"])
def test_a_model_directory_with_a_file_of_the_wrong_shape_is_one_line_from_the_worker(
    tiny_model_dirs, tmp_path, kind
):
    """The red team's: a config.json value of the wrong type, or a tokenizer.json that is
    JSON but not a tokenizer's, was mlx-lm's traceback (TypeError, KeyError)."""
    model = shutil.copytree(tiny_model_dirs["llama"], tmp_path / kind)
    if kind == "config-value":
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "hidden_size": "big"}))
    else:
        (model / "tokenizer.json").write_text(json.dumps({"model": {}}))
    last = worker_error(model, tmp_path)
    assert last.startswith(f"agentkv-worker: error: the model at {model} does not load: "), last


def test_agentkv_model_import_writes_the_directory_or_says_why_in_one_line(sources, tmp_path):
    """The CLI runs the import as the worker package's own process (it imports none of the
    worker's modules): a GGUF becomes a directory that loads; a bad file is one line."""
    path, config, model, tok, w = sources["llama"]
    gguf = write_gguf(tmp_path / "m.gguf", w, config, path)
    cli = [sys.executable, "-m", "agentkv.cli", "model", "import"]
    run = subprocess.run([*cli, str(gguf), "--out", str(tmp_path / "out")], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0 and f"--model {tmp_path / 'out'}" in run.stdout, run.stderr
    imported, imported_tok = load(str(tmp_path / "out"))
    assert mx.array_equal(logits(imported, imported_tok), logits(model, tok)).item()
    env = {**os.environ, "AGENTKV_MODEL_CACHE": str(tmp_path / "cache")}
    bad = subprocess.run([*cli, str(_bare_gguf(tmp_path / "mamba.gguf", "mamba"))],
                         capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "'mamba'" in bad.stderr
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_an_import_onto_a_full_disk_is_one_line_and_leaves_nothing(sources, tmp_path, small_disk):
    """The red team's: MLX's failed write was a RuntimeError traceback from the CLI."""
    path, config, _, _, w = sources["llama"]
    gguf = write_gguf(tmp_path / "m.gguf", w, config, path)
    disk = small_disk("32k")
    cli = [sys.executable, "-m", "agentkv.cli", "model", "import", str(gguf)]
    run = subprocess.run([*cli, "--out", str(disk / "out")], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 2 and run.stderr.startswith("error: "), run.stderr
    assert run.stderr.count("\n") == 1 and "bytes free there" in run.stderr, run.stderr
    assert list(disk.iterdir()) == []  # no staging directory, no half a model


def test_agentkv_model_import_of_a_missing_file_says_there_is_none(tmp_path):
    """A typo in the file's name reads as one ("no such file"), not as a file of the
    wrong kind, as the worker's --model says."""
    missing = tmp_path / "nosuch.gguf"
    run = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", "model", "import", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr == f"error: {missing}: no such file or directory\n"


def _patch(gguf: Path, name: str, dims: tuple[int, ...] | None = None, shift: int = 0) -> int:
    """Rewrites tensor `name`'s dims (GGUF's order, int64) or moves its data offset by
    `shift` bytes in `gguf`'s header; the offset it now has (from the data section)."""
    data = bytearray(gguf.read_bytes())
    at = data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    if dims is not None:
        struct.pack_into(f"<{n_dims}q", data, at + 4, *dims)
    (offset,) = struct.unpack_from("<Q", data, at + 8 + 8 * n_dims)
    struct.pack_into("<Q", data, at + 8 + 8 * n_dims, offset + shift)
    gguf.write_bytes(data)
    return offset + shift


def _cli_refuses(gguf: Path, tmp_path: Path) -> str:
    """`agentkv model import gguf --out DIR`'s one line (exit 2), having left nothing."""
    out = tmp_path / "models" / "out"
    run = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", "model", "import", str(gguf), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2 and run.stderr.startswith("error: GGUF "), run.stderr
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
    assert not out.exists() and not list((tmp_path / "models").glob("*"))
    return run.stderr


@pytest.mark.parametrize(
    "case, says",
    [
        (
            "misaligned",
            "tensor 'token_embd.weight' starts at offset {offset}, not a multiple of the "
            "file's alignment 32",
        ),
        ("zero-dim", "tensor 'token_embd.weight' has shape [0, {hidden}], with a dimension of 0"),
        ("negative-dim", "tensor 'token_embd.weight' has shape [{vocab}, -5], with a dimension"),
        ("past-the-end", "is cut short: tensor 'token_embd.weight' lacks its data"),
        ("nan-weights", "tensor 'token_embd.weight' holds 3 weights that are NaN or infinite"),
    ],
    ids=["misaligned", "zero-dim", "negative-dim", "past-the-end", "nan-weights"],
)
def test_a_tensor_the_gguf_spec_does_not_allow_is_one_line(sources, tmp_path, case, says):
    """The red team's: a tensor's data 3 bytes off the alignment imported (exit 0) as NaNs,
    and the worker then answered '<|endoftext|>' to everything; a dimension of 0 imported
    as an empty tensor that MLX refused at load. Now the CLI and the worker say why."""
    path, config, _, _, w = sources["llama"]
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    if case == "nan-weights":
        embed = w["model.embed_tokens.weight"].copy()
        embed[1, :3] = [np.nan, np.inf, -np.inf]
        w = {**w, "model.embed_tokens.weight": embed}
    gguf = write_gguf(tmp_path / "bad.gguf", w, config, path)
    name, offset = "token_embd.weight", None
    if case == "misaligned":
        offset = _patch(gguf, name, shift=3)
    elif case in ("zero-dim", "negative-dim"):
        _patch(gguf, name, dims=(hidden, 0) if case == "zero-dim" else (-5, vocab))
    elif case == "past-the-end":
        _patch(gguf, name, shift=1 << 30)
    says = says.format(offset=offset, hidden=hidden, vocab=vocab)
    assert says in _cli_refuses(gguf, tmp_path)
    with pytest.raises(ModelError, match=re.escape(says)):
        resolve_model(str(gguf), "float32", cache_dir=tmp_path / "cache")


def test_the_shipped_gguf_with_its_embeddings_moved_off_the_alignment_is_refused(tmp_path):
    """The red team's own file: SmolLM2 with token_embd.weight at offset 3, not 0."""
    from inference_worker.models import shipped_file

    gguf = tmp_path / "smollm2.gguf"
    shutil.copyfile(shipped_file("smollm2-135m-instruct"), gguf)
    assert _patch(gguf, "token_embd.weight", shift=3) == 3  # it was the first, at 0
    assert _cli_refuses(gguf, tmp_path) == (
        f"error: GGUF {gguf}: tensor 'token_embd.weight' starts at offset 3, not a multiple "
        "of the file's alignment 32\n"
    )


@pytest.mark.parametrize("weights", ["float32", "float16", "bfloat16", "native"])
def test_a_quantized_block_with_a_nan_scale_is_refused_under_every_weights(tmp_path, weights):
    """A Q8_0 block whose fp16 scale is NaN: its 32 weights are NaN, as float32, float16 or
    bfloat16, and as the MLX layer's scale and bias under native."""
    data = quantize(np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32), Q.Q8_0)
    data[2, 34:36] = np.array([np.nan], dtype=np.float16).view(np.uint8)  # row 2's 2nd block
    gguf = _bare_gguf(tmp_path / "t.gguf", "llama", data, Q.Q8_0)
    with pytest.raises(GGUFError, match=r"'token_embd\.weight' holds 32 weights that are NaN"):
        read_gguf(gguf, weights)


def test_an_import_whose_tokenizer_meets_a_full_disk_is_one_line_and_leaves_nothing(
    sources, tmp_path, small_disk
):
    """The weights fit, tokenizer.json does not: the tokenizers library's bare Exception
    ("No space left on device") was a traceback from the CLI, and would stop a worker."""
    path, config, _, _, w = sources["llama"]
    gguf = write_gguf(tmp_path / "m.gguf", w, config, path)
    whole = import_gguf(gguf, tmp_path / "whole")
    weights = (whole / "model.safetensors").stat().st_size
    assert (whole / "tokenizer.json").stat().st_size > 8192  # more than the room left
    disk = small_disk(f"{(-(-weights // 4096) + 2) * 4}k")  # the weights' pages and 8 KiB
    cli = [sys.executable, "-m", "agentkv.cli", "model", "import", str(gguf)]
    run = subprocess.run([*cli, "--out", str(disk / "out")], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 2 and run.stderr.startswith("error: "), run.stderr
    assert run.stderr.count("\n") == 1 and "tokenizer.json" in run.stderr, run.stderr
    assert "bytes free there" in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert list(disk.iterdir()) == []


def test_an_import_is_as_readable_as_the_umask_makes_a_directory(sources, tmp_path):
    """The reviewer's: the import was staged in mkdtemp's 0700 directory and renamed into
    place, so a model imported as root (the image's build, `sudo agentkv model import`) was
    unreadable to the service's user: the worker exited "Permission denied: config.json"."""
    path, config, _, _, w = sources["llama"]
    gguf = write_gguf(tmp_path / "m.gguf", w, config, path)
    umask = os.umask(0o022)
    try:
        out = import_gguf(gguf, tmp_path / "out")
        again = import_gguf(gguf, out)  # an earlier import replaced
        cached = cached_import(gguf, cache_dir=tmp_path / "cache")  # a worker's --model FILE
    finally:
        os.umask(umask)
    for model in (again, cached):
        assert stat.S_IMODE(model.stat().st_mode) == 0o755, model
        assert all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in model.iterdir()), model
