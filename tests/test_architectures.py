"""Architecture specifics through the worker process: DeepSeek-V2's MoE computes in float32 on
CPU whatever dtype its weights are stored in (mlx's gather matmul needs it there), and a
dtype that cannot run fails at start with a clear message."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from agentkv.client.worker import WorkerClient


def bfloat16_copy(src, dst):
    shutil.copytree(src, dst)
    weights = mx.load(str(dst / "model.safetensors"))
    mx.save_safetensors(
        str(dst / "model.safetensors"),
        {
            k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in weights.items()
        },
        metadata={"format": "mlx"},
    )
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return dst


def test_a_bfloat16_moe_model_runs_in_float32_on_cpu(tiny_model_dirs, start_worker, tmp_path):
    model = bfloat16_copy(tiny_model_dirs["deepseek_v2"], tmp_path / "ds-bf16")
    w = WorkerClient(start_worker(model).address)
    w.create_agent("ns", "a", "You are an expert. " * 20)
    reply = w.turn("ns", "a", [("user", "Route me through the experts.")], max_tokens=6)
    assert len(reply.token_ids) == 6
    w.evict("ns", "a")
    again = w.turn("ns", "a", [("user", "Again.")], max_tokens=4)
    assert again.usage.cache_state == "warm" and not again.usage.restore_failure


def test_a_dtype_that_cannot_run_fails_at_start(tiny_model_dirs, start_worker):
    with pytest.raises(RuntimeError) as failed:
        start_worker(tiny_model_dirs["deepseek_v2"], "--dtype", "bfloat16")
    assert "GatherMM" in str(failed.value) and "--dtype float32" in str(failed.value)
