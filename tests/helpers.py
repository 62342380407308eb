"""Building blocks for store tests: Q4-shaped random blocks and a store process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from agentkv.keys import ROOT_KEY, block_key
from client.blocks import Block, Tensor
from client.store import StoreClient

FP = "tiny-llama:q4g64:test0001"
NS = "default"


def q4_tensors(
    num_tokens: int, num_layers: int = 4, kv_heads: int = 2, head_dim: int = 64, seed: int = 0
) -> list[Tensor]:
    """K and V of every layer as MLX stores Q4 group-64: packed uint32, fp16 scales and biases."""
    rng = np.random.default_rng(seed)
    groups, packed = head_dim // 64, head_dim // 8
    tensors = []
    for layer in range(num_layers):
        for kv in ("keys", "values"):
            shape = (1, kv_heads, num_tokens)
            tensors += [
                Tensor(
                    f"layers.{layer}.{kv}.packed",
                    "U32",
                    (*shape, packed),
                    rng.integers(0, 2**32, (*shape, packed), dtype=np.uint32),
                ),
                Tensor(
                    f"layers.{layer}.{kv}.scales",
                    "F16",
                    (*shape, groups),
                    rng.standard_normal((*shape, groups)).astype(np.float16),
                ),
                Tensor(
                    f"layers.{layer}.{kv}.biases",
                    "F16",
                    (*shape, groups),
                    rng.standard_normal((*shape, groups)).astype(np.float16),
                ),
            ]
    return tensors


def make_chain(
    token_ids: list[int], block_tokens: int = 64, fingerprint: str = FP, seed: int = 0, **shape
) -> tuple[list[Block], list[bytes]]:
    """Blocks (and their keys) covering token_ids in spans of block_tokens, last one shorter."""
    blocks, keys, parent = [], [], ROOT_KEY
    for i, start in enumerate(range(0, len(token_ids), block_tokens)):
        span = token_ids[start : start + block_tokens]
        blocks.append(Block(parent, span, q4_tensors(len(span), seed=seed + i, **shape)))
        parent = block_key(fingerprint, parent, span)
        keys.append(parent)
    return blocks, keys


def same_bytes(a: Block, b) -> bool:
    return [(t.name, t.dtype, t.shape, bytes(t.data)) for t in a.tensors] == [
        (t.name, t.dtype, t.shape, bytes(t.data)) for t in b.tensors
    ]


@dataclass
class StoreProcess:
    """`agentkv-store` started the way a user starts it, as a separate process."""

    data_dir: Path
    log_path: Path
    extra_args: list[str] = field(default_factory=list)
    listen: str = "127.0.0.1:0"
    proc: subprocess.Popen | None = None
    address: str = ""

    def start(self, timeout: float = 30.0) -> StoreProcess:
        self.log_path.touch()
        offset = self.log_path.stat().st_size
        cmd = [
            sys.executable,
            "-m",
            "cache_store",
            "--data-dir",
            str(self.data_dir),
            "--listen",
            self.listen,
            *self.extra_args,
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for entry in self._log_entries(offset):
                if entry.get("event") == "serving":
                    self.address = entry["address"]
                    return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"store exited {self.proc.returncode}:\n{self.log_text()}")
            time.sleep(0.05)
        raise TimeoutError(f"store did not start:\n{self.log_text()}")

    def _log_entries(self, offset: int) -> list[dict]:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
        entries = []
        for line in lines:
            try:
                entries.append(json.loads(line))
            except ValueError:
                continue
        return entries

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)

    def client(self, **kwargs) -> StoreClient:
        return StoreClient(self.address, **kwargs)
