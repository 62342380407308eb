#!/usr/bin/env bash
# Sets everything up, then runs the linters and the whole test suite.
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck disable=SC1091
source scripts/setup.sh
ruff check .
ruff format --check .
# One pytest worker per core, a test file to a worker (module fixtures start once), the files
# in collection order: tests/conftest.py puts the longest first. `-n 0` runs them in one process.
# A container's CPU quota counts as its cores (xdist counts the host's CPUs).
export PYTEST_XDIST_AUTO_NUM_WORKERS="${PYTEST_XDIST_AUTO_NUM_WORKERS:-$(python scripts/cores.py)}"
python -m pytest -n auto --dist loadfile --no-loadscope-reorder "$@"
