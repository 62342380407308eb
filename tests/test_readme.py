"""Every Python block in README.md runs as written, twice (so it is idempotent), against a
real store and two real workers: only the README's addresses are swapped for the test's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agentkv.launch import gateway_process

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```$", README, re.DOTALL | re.MULTILINE)
STORE, WORKERS = "127.0.0.1:50051", ("127.0.0.1:50061", "127.0.0.1:50062")
GATEWAY = "127.0.0.1:8000"


def first_line(block: str) -> str:
    return next(line for line in block.splitlines() if line and not line.startswith("from "))


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("block", BLOCKS, ids=[first_line(b)[:40] for b in BLOCKS])
def test_a_readme_python_block_runs_as_written_twice(
    block, tiny_model_dirs, store_process, start_worker, launched, tmp_path
):
    workers = [start_worker(tiny_model_dirs["llama"], name=f"worker{i}").address for i in range(2)]
    text = block.replace(STORE, store_process.address)
    if GATEWAY in text:  # the gateway's block: it serves the tiny model under the README's id
        model = re.search(r'model="([^"]+)"', text).group(1)
        args = ["--model-name", model]
        gateway = gateway_process(workers, tmp_path / "gateway.log", extra_args=args)
        text = text.replace(GATEWAY, launched(gateway).address)
    for readme_address, address in zip(WORKERS, workers, strict=True):
        text = text.replace(readme_address, address)
    assert not re.search(r"127\.0\.0\.1:500\d\d", text), "an address the test does not serve"
    script = tmp_path / "snippet.py"
    script.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for run in (1, 2):
        proc = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=240,
            cwd=tmp_path,
            env=env,
        )
        assert proc.returncode == 0, f"run {run} of:\n{block}\n{proc.stderr[-3000:]}"
