"""What the benchmarks share: a raw read of located block bytes (this machine's limit), and
the model they run (--model SPEC, resolved as agentkv-worker resolves it)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import xxhash

# the benchmarks build their model shapes with tests/model_kit.py, so the repo root goes on the path
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agentkv import defaults  # noqa: E402
from agentkv.v1 import store_pb2 as pb  # noqa: E402


class RawReader:
    """preadv of located segments into one preallocated buffer: what no client can beat."""

    def __init__(self, locations: Sequence[pb.BlockLocation]) -> None:
        self.plan = [(loc.path, list(loc.segments)) for loc in locations]
        self.num_bytes = sum(s.num_bytes for _, segs in self.plan for s in segs)
        self.buffer = memoryview(bytearray(self.num_bytes))  # zero-filled, so already faulted in

    def read(self, verify: bool = False) -> int:
        pos = 0
        for path, segments in self.plan:
            fd = os.open(path, os.O_RDONLY)
            try:
                for offset, size in merged_runs(segments):
                    if os.preadv(fd, [self.buffer[pos : pos + size]], offset) != size:
                        raise RuntimeError(f"{path} is short at {offset}")
                    pos += size
            finally:
                os.close(fd)
            if verify:
                self.check(segments, pos - sum(s.num_bytes for s in segments))
        return pos

    def verify(self) -> None:
        """Checks every segment's xxh3 over what the last read() left in the buffer."""
        pos = 0
        for _, segments in self.plan:
            self.check(segments, pos)
            pos += sum(s.num_bytes for s in segments)

    def check(self, segments: Sequence[pb.Segment], pos: int) -> None:
        for s in segments:
            if xxhash.xxh3_64_intdigest(self.buffer[pos : pos + s.num_bytes]) != s.checksum:
                raise RuntimeError(f"checksum mismatch in layer {s.layer}")
            pos += s.num_bytes


@contextmanager
def located(store: Any, ns: str, fp: str, keys: list[bytes], lease_s: int = 600) -> Iterator:
    """A RawReader of the blocks' locations, under a lease released when the block ends."""
    request = pb.LocateBlocksRequest(namespace=ns, fingerprint=fp, keys=keys, lease_seconds=lease_s)
    reply = store.call("LocateBlocks", request)
    try:
        yield RawReader(reply.blocks)
    finally:
        store.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=reply.lease_id))


def merged_runs(segments: Sequence[pb.Segment]) -> list[tuple[int, int]]:
    """(offset, size) of each run of adjacent segments: one preadv each."""
    runs: list[tuple[int, int]] = []
    for s in segments:
        if runs and sum(runs[-1]) == s.offset:
            runs[-1] = (runs[-1][0], runs[-1][1] + s.num_bytes)
        else:
            runs.append((s.offset, s.num_bytes))
    return runs


# the model every benchmark runs: --model SPEC, resolved as agentkv-worker resolves it

MODEL_HELP = (
    "a shipped model name, a .gguf file or an mlx-lm model directory, as agentkv-worker "
    "--model takes (default: %(default)s)"
)


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """--model SPEC, defaulting to the worker's own default model (SmolLM2-135M-Instruct)."""
    parser.add_argument("--model", metavar="SPEC", default=defaults.MODEL, help=MODEL_HELP)


def model_device() -> str:
    """The device a worker here computes on, without importing MLX (load_optimized_blas()
    must come first): Metal on macOS, else the CPU (unless MLX is already imported)."""
    if "mlx.core" in sys.modules:
        return sys.modules["mlx.core"].default_device().type.name
    return "gpu" if sys.platform == "darwin" else "cpu"


def model_dir(spec: str | os.PathLike[str] | None = None) -> Path:
    """The local mlx-lm model directory for `--model SPEC` (None: the default model), as
    the worker resolves it: a shipped name or a .gguf file is imported once into the model
    cache (weights "auto": float32 on a CPU). Exits with one line if SPEC names nothing.
    Pass the returned path, not SPEC, to worker processes: they then load these exact files."""
    from inference_worker.models import ModelError, resolve_model

    spec = str(spec) if spec is not None else defaults.MODEL
    try:
        return resolve_model(spec, "auto", model_device()).resolve()
    except ModelError as exc:
        raise SystemExit(f"--model {spec}: {exc}") from None


def load_tokenizer(path: Path):
    """The model directory's own tokenizer (a `tokenizers.Tokenizer`: .encode(text).ids,
    .decode(ids)), from its tokenizer.json; the same vocabulary mlx_lm.tokenizer_utils.load
    gives the worker."""
    from tokenizers import Tokenizer

    if not (path / "tokenizer.json").exists():
        raise SystemExit(f"{path} has no tokenizer.json (the benchmarks need one)")
    return Tokenizer.from_file(str(path / "tokenizer.json"))


def parameter_count(path: Path) -> int:
    """Parameters in the directory's *.safetensors files, from their headers."""
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, tensor in header.items():
            if name != "__metadata__":
                count = 1
                for dim in tensor["shape"]:
                    count *= dim
                total += count
    return total


def describe_model(path: Path, spec: str | None = None) -> str:
    """One line for a report: which model ran, its shape and weights, and from where."""
    config = json.loads((path / "config.json").read_text())
    gguf = config.get("agentkv_gguf") or {}
    name = Path(gguf["file"]).stem if gguf.get("file") else path.name
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // max(1, heads or 1)
    weights = gguf.get("weights") or config.get("torch_dtype") or "?"
    source = f"GGUF imported as {weights}" if gguf else f"{weights} weights"
    given = f"--model {spec}: " if spec and spec != str(path) else ""
    return (
        f"{given}{name} ({parameter_count(path) / 1e6:.1f}M-parameter "
        f"{config.get('model_type', '?')}, {config.get('num_hidden_layers')} layers, hidden "
        f"{config.get('hidden_size')}, {heads} heads, {kv} KV heads of {head_dim}, max context "
        f"{config.get('max_position_embeddings')}; {source}) at {path}"
    )


def max_context(path: Path) -> int:
    """The model's context window, tokens (its config's max_position_embeddings)."""
    config = json.loads((path / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 1 << 17)
