"""Trains agentkv's default model on this CPU and writes it to models/agentkv-default.

A 4.2M-parameter llama (4 layers, hidden 256, 4 heads of 64, 2 KV heads, vocab 4096) learns
from the Python standard library's source, plus chat-formatted questions about its functions
answered with their docstrings (so the chat template means something to it). float32, with
an optimized BLAS when one is installed. The result is committed; run this only to remake it.

    python scripts/train_default_model.py [--minutes 12] [--out models/agentkv-default]
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/model_kit.py

from inference_worker.blas import load_optimized_blas

BLAS = load_optimized_blas()  # before mlx is imported

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402

from tests import model_kit  # noqa: E402

CONFIG = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "intermediate_size": 768,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}
SYSTEM_PROMPTS = ["You are a helpful Python expert.", "Answer briefly.", ""]


def qa_pairs(source: str, module: str) -> list[tuple[str, str]]:
    """(question, docstring paragraph) for every documented function and class."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    pairs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 20:
                answer = doc.strip().split("\n\n")[0][:400]
                pairs.append((f"What does {node.name} in {module} do?", answer))
    return pairs


def chat_documents(files: list[Path], rng: random.Random) -> list[str]:
    docs = []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for question, answer in qa_pairs(source, path.stem):
            system = rng.choice(SYSTEM_PROMPTS)
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
            docs.append(render(messages))
    return docs


def render(messages: list[dict]) -> str:
    body = "".join(f"<|{m['role']}|>\n{m['content']}{model_kit.END}\n" for m in messages)
    return model_kit.BOS + body


def corpus(rng: random.Random) -> tuple[list[str], list[str]]:
    files = model_kit.stdlib_files()
    rng.shuffle(files)
    held_out = files[: len(files) // 20]
    train = files[len(held_out) :]
    code = [model_kit.BOS + t + model_kit.EOS for t in model_kit.read_texts(train)]
    chats = chat_documents(train, rng)
    docs = code + chats
    rng.shuffle(docs)
    eval_docs = [model_kit.BOS + t + model_kit.EOS for t in model_kit.read_texts(held_out)]
    print(f"{len(code)} source files, {len(chats)} chat documents; {len(eval_docs)} held out")
    return docs, eval_docs


def encode(tokenizer, docs: list[str]) -> np.ndarray:
    ids = [e.ids for e in tokenizer.encode_batch(docs)]
    return np.fromiter((i for doc in ids for i in doc), dtype=np.int32)


def batches(tokens: np.ndarray, batch: int, seq: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(tokens) - seq - 1, batch)
        window = np.stack([tokens[s : s + seq + 1] for s in starts])
        yield mx.array(window[:, :-1]), mx.array(window[:, 1:])


def loss_fn(model, x, y):
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


def evaluate(model, tokens: np.ndarray, seq: int, max_windows: int = 64) -> float:
    losses = []
    for start in range(0, min(len(tokens) - seq - 1, max_windows * seq), seq):
        window = tokens[start : start + seq + 1]
        x, y = mx.array(window[None, :-1]), mx.array(window[None, 1:])
        losses.append(loss_fn(model, x, y).item())
    return math.exp(sum(losses) / len(losses))


def train(model, tokens: np.ndarray, minutes: float, batch: int, seq: int) -> dict:
    steps_guess = int(minutes * 60 * 4000 / (batch * seq))  # ~4K tokens/s measured here
    schedule = optim.join_schedules(
        [optim.linear_schedule(1e-5, 2e-3, 100), optim.cosine_decay(2e-3, steps_guess, 1e-4)],
        [100],
    )
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.01)
    step_fn = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x, y):
        loss, grads = step_fn(model, x, y)
        optimizer.update(model, grads)
        return loss

    start, steps, data = time.time(), 0, batches(tokens, batch, seq, np.random.default_rng(0))
    while time.time() - start < minutes * 60:
        loss = step(*next(data))
        mx.eval(state, loss)
        steps += 1
        if steps % 50 == 0:
            print(f"step {steps}  loss {loss.item():.3f}  {time.time() - start:.0f}s", flush=True)
    return {"steps": steps, "tokens_seen": steps * batch * seq, "seconds": time.time() - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=12.0)
    p.add_argument("--out", type=Path, default=Path("models/agentkv-default"))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    args = p.parse_args()
    print(f"BLAS: {BLAS or 'the reference BLAS bundled with mlx (slow)'}")
    rng = random.Random(0)
    docs, eval_docs = corpus(rng)
    tokenizer = model_kit.train_tokenizer(docs, vocab_size=4096)
    tokens, eval_tokens = encode(tokenizer, docs), encode(tokenizer, eval_docs)
    print(f"{len(tokens):,} training tokens, {len(eval_tokens):,} held-out tokens")
    config = {**CONFIG, "vocab_size": tokenizer.get_vocab_size()}
    model = model_kit.random_model(config, seed=0)
    stats = train(model, tokens, args.minutes, args.batch, args.seq)
    stats["held_out_perplexity"] = round(evaluate(model, eval_tokens, args.seq), 2)
    stats["blas"] = BLAS or "reference"
    print(json.dumps(stats))
    model_kit.save_model(args.out, model, config, tokenizer)
    (args.out / "training.json").write_text(json.dumps({**stats, "config": config}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
