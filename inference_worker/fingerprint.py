"""The model fingerprint: one name for everything that makes stored KV bytes valid.

It covers the weights (every byte of every weight file), the dtype they compute in, the
config, the tokenizer files, the KV format (bits for K and V, group size, scales' dtype) and
the block size. Any change to any of them changes the fingerprint, and the store never
serves blocks across it.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import xxhash

from agentkv.layers import KVFormat
from inference_worker.model_cache import remembered

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)
READ_CHUNK = 16 << 20
FORMULA = "fingerprint v1"  # change it with what _fingerprint hashes: it keys remembered ones


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
    so is a chat template used instead of the model's (`template`): it renders the tokens.
    Remembered in the model cache for the files as they are (model_cache.remembered)."""
    config = model_dir / "config.json"
    files = [model_dir / name for name in TOKENIZER_FILES if (model_dir / name).exists()]
    files += sorted(model_dir.glob("*.safetensors"))
    what = json.dumps([FORMULA, fmt.name, block_tokens, dtype, template])
    tail = f":{fmt.name}:b{block_tokens}"
    return remembered(
        what, [config, *files], partial(_fingerprint, config, files, tail, dtype, template)
    )


def _fingerprint(config_file: Path, files: list[Path], tail: str, dtype: str, template: str) -> str:
    digest = xxhash.xxh3_128()
    if dtype:
        digest.update(f"dtype:{dtype}\0".encode())
    if template:
        digest.update(f"chat_template:{template}\0".encode())
    config = json.loads(config_file.read_text())
    digest.update(json.dumps(config, sort_keys=True).encode())
    for path in files:
        _hash_file(digest, path)
    arch = "".join(c for c in str(config.get("model_type", "model")) if c.isalnum() or c == "_")
    return f"{arch[:32]}-{digest.hexdigest()[:32]}{tail}"
