"""The worker's runtime: the one thread that owns MLX, the model loaded on it, and the facts
derived once from the config, the device and the model (`Runtime`, frozen).

Import this only after inference_worker.blas.load_optimized_blas() (it imports mlx).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import load

from agentkv.addresses import is_loopback
from agentkv.errors import Unavailable, in_one_line
from agentkv.layers import LayerSpec
from inference_worker.config import WorkerConfig
from inference_worker.fingerprint import model_fingerprint
from inference_worker.layer_spec import model_layers
from inference_worker.models import ModelError, resolve_model
from inference_worker.sampling import vocab_size

log = logging.getLogger("agentkv.worker")
TICK_SECONDS = 2.0  # the longest the MLX thread waits for a job before its tick runs
# Jobs that came during a step run together before the next one, for as long as that step
# took (at least this long): a burst of turns joins the batch in one step, not one step
# each, and a flood of calls at most halves the pace of the turns in flight.
JOBS_SLICE_SECONDS = 0.005
_IDLE = object()  # no job arrived within TICK_SECONDS
STOPPING = "the worker is stopping: this call's work was not run; send it again"


class MLXThread:
    """Runs submitted work in order on one thread, and `on_tick` after the jobs waiting (or
    every TICK_SECONDS without one). MLX ties arrays to the thread that made them, so the
    model is loaded here too (DeepSeek-V2 failed otherwise)."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        # The engine's step; it returns True while work is in flight: then no job is awaited.
        self.on_tick: Callable[[], bool] = lambda: False
        # The engine's word that the next job waits for a tick: its queue is full, and a step
        # may move turns into the batch, making room.
        self.tick_first: Callable[[], bool] = lambda: False
        # Held only around a put: no job lands behind close()'s None, where nothing runs it.
        self._closing = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="agentkv-mlx", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queues `fn(*args)`; once closed, the future fails at once (Unavailable): an RPC
        thread still running after the server's stop would otherwise wait on it forever, and
        the process's exit waits on that thread."""
        future: Future = Future()
        with self._closing:
            if not self._closed:
                self._jobs.put((fn, args, future))
                return future
        future.set_exception(Unavailable(STOPPING))
        return future

    def close(self) -> None:
        with self._closing:
            self._closed = True
            self._jobs.put(None)
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        try:
            self._serve()
        finally:
            self._fail_queued()
            # MLX keeps this thread's streams in thread-local state that C++ frees after
            # join() returns, racing the process's exit, which then could abort ("terminate
            # called without an active exception", ml-explore/mlx#3126). Freed here instead.
            mx.clear_streams()

    def _fail_queued(self) -> None:
        """Fails the jobs left behind (none, unless the loop itself failed)."""
        with self._closing:
            self._closed = True
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[2].set_running_or_notify_cancel():
                item[2].set_exception(Unavailable(STOPPING))

    def _serve(self) -> None:
        busy, tick = False, 0.0
        while True:
            try:
                item = self._jobs.get(block=not busy, timeout=TICK_SECONDS)
            except queue.Empty:
                item = _IDLE
            if item is not _IDLE and not self._run_waiting(item, max(tick, JOBS_SLICE_SECONDS)):
                return
            started = time.monotonic()
            try:
                busy = self.on_tick()
            except Exception:  # the thread must outlive it: every RPC waits on this thread
                log.exception("engine tick failed")
                busy = False
            tick = time.monotonic() - started

    def _run_waiting(self, item: tuple | None, seconds: float) -> bool:
        """Runs `item`, then the jobs queued behind it, for up to `seconds` or until
        `tick_first`. False once close()'s None is reached."""
        ends = time.monotonic() + seconds
        while item is not None:
            _run(*item)
            if time.monotonic() >= ends or self.tick_first():
                return True
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return True
        return False


def _run(fn: Callable[..., Any], args: tuple, future: Future) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args))
    except BaseException as exc:
        future.set_exception(exc)


@dataclass(frozen=True, slots=True)
class Runtime:
    """What the worker derives once at start-up; nothing changes it afterwards."""

    mlx: MLXThread  # owns the model: everything MLX runs there
    model: Any
    tokenizer: Any
    device: str  # mlx's default device: "cpu" or "gpu"
    dtype: str  # what the weights compute in; "" keeps their own
    model_dir: Path
    fingerprint: str
    max_context: int  # the most tokens an agent may hold
    quantized_query_max: int  # longer queries dequantize before attention (DESIGN.md, CPU)
    restore_path: str  # "locate" or "stream"
    layers: tuple[LayerSpec, ...]  # what each layer caches, probed from the model
    windows: tuple[int | None, ...]  # per layer, the window its cache keeps; None: all
    vocab_size: int  # the ids a turn may generate: the logits' width, within the tokenizer's
    token_bytes: int  # one token of context in every layer's quantized cache
    token_chars: int  # the most characters one token spells: n tokens hold at most n * this

    def info(self, config: WorkerConfig, blas: str | None) -> dict:
        """The static facts GetWorkerInfo reports."""
        return {
            "model": config.model,
            "fingerprint": self.fingerprint,
            "kv_format": config.kv.name,
            "block_tokens": config.block_tokens,
            "max_context": self.max_context,
            "device": self.device,
            "dtype": self.dtype or "as stored",
            "blas": blas or "reference",
        }


def resolve_runtime(config: WorkerConfig) -> Runtime:
    """Starts the MLX thread, loads the model there and derives the rest; raises
    RuntimeError when the model does not run on this device in this dtype."""
    device = mx.default_device().type.name
    path = resolve_model(config.model, config.gguf_weights, device)
    # "auto" is float32 on CPU (the fastest there with BLAS, and what MoE's gather matmul
    # needs on CPU) and the weights' own ("") on a GPU.
    dtype = config.dtype if config.dtype != "auto" else "float32" if device == "cpu" else ""
    restore_path = config.restore_path  # auto: locate when the store is on this host
    if restore_path == "auto":
        restore_path = "locate" if is_loopback(config.store) else "stream"
    template = read_template(config.chat_template)
    mlx = MLXThread()
    try:
        loading = mlx.submit(load_model, path, dtype, template)
        model, tokenizer, layers, num_logits = loading.result()
        config.kv.check_fits(layers)
    except ValueError as exc:  # as a model that does not run here: one line, not a trace
        mlx.close()
        raise RuntimeError(str(exc)) from None
    except BaseException:
        mlx.close()
        raise
    model_config = json.loads((path / "config.json").read_text())
    return Runtime(
        mlx,
        model,
        tokenizer,
        device,
        dtype,
        path,
        model_fingerprint(path, config.kv, config.block_tokens, dtype, template),
        int(model_config.get("max_position_embeddings") or 1 << 17),
        config.quantized_query_max or (1 if device == "cpu" else 32),
        restore_path,
        layers,
        # Sliding-window layers keep only their window (and restore only blocks reaching it).
        tuple(layer.window if config.window_caches else None for layer in layers),
        num_logits,
        config.kv.token_bytes(layers),
        # A vocabulary entry's byte-level or piece form is never shorter than its text.
        max(map(len, tokenizer.get_vocab()), default=1),
    )


def read_template(path: str) -> str:
    """The chat template in a file (Jinja), or in a tokenizer_config.json's chat_template;
    "" for none. RuntimeError, one line, for a file that holds none."""
    if not path:
        return ""
    try:
        text = Path(path).read_text(encoding="utf-8")
        if path.endswith(".json"):
            text = json.loads(text)["chat_template"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise RuntimeError(f"--chat-template {path}: no chat template read: {exc!r}") from None
    if not isinstance(text, str) or not text.strip():
        raise RuntimeError(f"--chat-template {path}: the chat template is empty or not a text")
    return text


def load_model(
    path: Path, dtype: str, template: str = ""
) -> tuple[Any, Any, tuple[LayerSpec, ...], int]:
    """The model and its tokenizer (with `template` as its chat template, when given),
    loaded on this thread (the MLX thread) and cast to `dtype` ("": as stored), with each
    layer's spec and the vocabulary size."""
    try:
        model, tokenizer = load(str(path), {"chat_template": template} if template else None)
    except (OSError, RuntimeError):  # said in a line by start(), as they are
        raise
    except Exception as exc:  # a config or tokenizer file of the wrong shape, as mlx-lm meets it
        raise ModelError(f"the model at {path} does not load: {in_one_line(exc)}") from exc
    if dtype:
        model.set_dtype(getattr(mx, dtype))  # floating parameters only; packed weights stay
    try:  # one probe token through the model: also proves it runs here
        layers = tuple(model_layers(model))
    except RuntimeError as exc:
        raise RuntimeError(
            f"the model does not run on this device in this dtype: {exc} "
            "(on CPU, --dtype float32 runs everything)"
        ) from exc
    # A model's logits may be wider than its tokenizer (rows padded for speed): no such id
    # may be generated, as no text decodes from it.
    return model, tokenizer, layers, min(vocab_size(model), len(tokenizer))
