"""The load test's short version: 16 agents, 4 client threads, two workers, evictions and
restores, and every turn checked against a greedy replay. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_short_load_test_loses_nothing(tmp_path):
    run = subprocess.run(
        [sys.executable, "benchmarks/load.py", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "MET  no turn lost or wrong" in run.stdout
    (result,) = [json.loads(p.read_text()) for p in tmp_path.glob("load-*.json")]
    assert result["turns"] == 16 * 3 and not result["lost"] and not result["wrong"]
    assert result["cache_states"]["warm"] > 0  # agents were restored along the way
