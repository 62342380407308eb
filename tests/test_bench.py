"""The one benchmark command, run --quick end to end so that no section can rot: every
section runs its own store and worker processes, and the report gathers their tables,
targets and plots. No timing is asserted: only that everything ran and was reported. On the
real default model (SmolLM2-135M, CPU) the quick report takes minutes, hence the timeouts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = [sys.executable, "-m", "agentkv.cli", "bench"]
# A smoke run of every section: the earlier round's 4.2M model keeps it to minutes in CI;
# the README's tables are SmolLM2's (`agentkv bench`, whose default model it is).
TOY_MODEL = ROOT / "models" / "agentkv-default"


@pytest.mark.timeout(1800)  # over pytest's 300 s default: every section runs the model
def test_bench_quick_writes_the_whole_report(tmp_path):
    out = tmp_path / "report"
    run = subprocess.run(
        [*BENCH, "--quick", "--quiet", "--model", str(TOY_MODEL), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    from benchmarks.report import SECTIONS

    assert [s["section"] for s in report["sections"]] == [s.name for s in SECTIONS]
    for section in report["sections"]:
        assert section["returncode"] == 0 and not section["error"], section["section"]
        assert "|" in section["tables"], section["section"]  # it printed a table
        for png in section["files"]:
            assert (out / png).stat().st_size > 0
    text = (out / "REPORT.md").read_text()
    for key in ("date", "cpu", "cores", "blas", "mlx", "model"):
        assert f"| {key} |" in text
    verdicts = [v for s in report["sections"] for v, _ in s["targets"]]
    assert len(verdicts) >= 8 and set(verdicts) <= {"MET", "MISS"}
    for s in SECTIONS:
        assert f"## {s.title} ({s.paper})" in text
    assert "Quick mode is a smoke run" in text and "smoke run" in run.stdout  # said up front
    assert "| plots |" in text  # written, or why not


def test_bench_help_names_the_command_a_user_typed():
    run = subprocess.run([*BENCH, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("usage: agentkv bench ")


@pytest.mark.parametrize("command", [BENCH, [sys.executable, "benchmarks/ttft.py"]])
def test_a_model_the_bench_cannot_use_is_a_usage_error_in_one_line(command, tmp_path):
    """As the CLI's: "error: ..." and exit 2. It was Python's SystemExit: the line without
    "error:", and exit 1, the code of a run that failed."""
    missing = tmp_path / "nonexist.gguf"
    run = subprocess.run(
        [*command, "--model", str(missing), "--out", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines()[-1] == (  # after a section's progress lines, if any
        f"error: --model {missing}: no model at {missing}: no such file or directory "
        "(shipped: smollm2-135m-instruct)"
    )
    assert "Traceback" not in run.stderr


def test_paths_given_to_the_bench_are_the_user_s_directory_s(tmp_path):
    """The reviewer's: `agentkv bench` ran in the source tree, so a relative --out wrote
    there (and said it wrote "relrep/REPORT.md"), and a relative --model was not found."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "toy").symlink_to(TOY_MODEL)
    args = ["--quick", "--quiet", "--only", "capacity", "--model", "models/toy", "--out", "rel"]
    run = subprocess.run([*BENCH, *args], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (tmp_path / "rel" / "REPORT.md").exists() and not (ROOT / "rel").exists()
    assert f"wrote {tmp_path / 'rel' / 'REPORT.md'}" in run.stdout
    (tmp_path / "rel" / "report.json").write_text('{"mode": "quick", "sect')  # cut short
    run = subprocess.run([*BENCH, *args], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert "report.json cannot be read" in run.stdout  # its sections not kept, said so
    assert json.loads((tmp_path / "rel" / "report.json").read_text())["sections"]


@pytest.mark.parametrize("where", ["file/sub", "/proc/none/report"], ids=["under-a-file", "proc"])
def test_an_out_the_bench_cannot_write_is_one_line(tmp_path, where):
    (tmp_path / "file").write_text("a file")
    out = tmp_path / where if not where.startswith("/") else Path(where)
    run = subprocess.run(
        [*BENCH, "--quick", "--only", "capacity", "--model", str(TOY_MODEL), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.splitlines()[-1].startswith(f"agentkv bench: error: --out {out}: ")
