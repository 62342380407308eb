"""The load test's short versions: 16 agents, 4 client threads, two workers, evictions and
restores, and every turn checked against a greedy replay; and a few seconds of its time-bound
mode, where agents retire and fresh ones take their place. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The load test checks correctness under load, not the model: the earlier round's 4.2M
# model keeps it to seconds (SmolLM2 runs it as `python benchmarks/load.py`).
TOY_MODEL = ROOT / "models" / "agentkv-default"


def load_test(out: Path, *args: str) -> dict:
    """Runs benchmarks/load.py; returns its JSON once it passed."""
    run = subprocess.run(
        [sys.executable, "benchmarks/load.py", *args, "--model", str(TOY_MODEL), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "MET  no turn lost or wrong" in run.stdout
    (result,) = [json.loads(p.read_text()) for p in out.glob("load-*.json")]
    assert not (result["lost"] or result["wrong"] or result["errors"])
    return result


def test_short_load_test_loses_nothing(tmp_path):
    result = load_test(tmp_path, "--quick")
    assert result["turns"] == 16 * 3 and result["agents"] == 16
    assert result["restores"] == result["cache_states"]["warm"] > 0
    assert result["evictions"]["client"] > 0  # the clients evicted agents
    assert result["evictions"]["workers"] > 0  # and so did the workers' hot budgets


def test_time_bound_load_retires_agents_and_replays_them_all(tmp_path):
    result = load_test(tmp_path, "--minutes", "0.05", "--agents", "3", "--turns", "2")
    turns: dict[str, list[int]] = {}
    for r in result["records"]:
        turns.setdefault(r["agent"], []).append(r["turn"])
    assert result["agents"] >= len(turns) > 3  # fresh agents took the retired ones' place
    assert sorted(turns["agent-0"]) == [0, 1] and "agent-0.g2" in turns
    assert max(len(t) for t in turns.values()) == 2  # contexts stay bounded
