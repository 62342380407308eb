"""The model fingerprint: one name for everything that makes stored KV bytes valid.

It covers the weights (every byte of every weight file), the dtype they compute in, the
config, the tokenizer files, the KV format (bits for K and V, group size, scales' dtype) and
the block size. Any change to any of them changes the fingerprint, and the store never
serves blocks across it.
"""

from __future__ import annotations

import json
from pathlib import Path

import xxhash

from agentkv.layers import KVFormat

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)
READ_CHUNK = 16 << 20


def _hash_file(digest: xxhash.xxh3_128, path: Path) -> None:
    digest.update(path.name.encode() + b"\0")
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            digest.update(chunk)


def model_fingerprint(
    model_dir: Path, fmt: KVFormat, block_tokens: int, dtype: str = "", template: str = ""
) -> str:
    """e.g. "llama-5f0c...:k4v4g64f16:b256" (at most 128 characters, store-safe). `dtype`, the
    dtype the weights are cast to ("" if none), is hashed too: it changes the KV computed;
    so is a chat template used instead of the model's (`template`): it renders the tokens."""
    digest = xxhash.xxh3_128()
    if dtype:
        digest.update(f"dtype:{dtype}\0".encode())
    if template:
        digest.update(f"chat_template:{template}\0".encode())
    config = json.loads((model_dir / "config.json").read_text())
    digest.update(json.dumps(config, sort_keys=True).encode())
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            _hash_file(digest, model_dir / name)
    for weights in sorted(model_dir.glob("*.safetensors")):
        _hash_file(digest, weights)
    arch = "".join(c for c in str(config.get("model_type", "model")) if c.isalnum() or c == "_")
    return f"{arch[:32]}-{digest.hexdigest()[:32]}:{fmt.name}:b{block_tokens}"
