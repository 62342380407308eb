"""scripts/cores.py: the cores scripts/test.sh counts (a pytest worker each, and one more), a
container's CPU quota counted as its cores."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from scripts.cores import quota_cores


@pytest.mark.parametrize(
    ("files", "cores"),
    [
        ({"cpu.max": "200000 100000\n"}, 2),
        ({"cpu.max": "150000 100000\n"}, 1),  # whole cores only
        ({"cpu.max": "50000 100000\n"}, 1),  # never 0
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({"cpu.max": "garbled\n"}, None),
        ({}, None),
    ],
    ids=["v2-2", "v2-1.5", "v2-half", "v2-none", "v1-4", "v1-none", "unreadable", "absent"],
)
def test_quota_cores(tmp_path, files, cores):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert quota_cores(tmp_path) == cores


def test_prints_a_positive_count_no_more_than_the_cpus():
    out = subprocess.run(
        [sys.executable, "scripts/cores.py"], capture_output=True, text=True, check=True
    )
    assert 1 <= int(out.stdout) <= os.cpu_count()
