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
# One pytest worker per core and one more, a test file to a worker (module fixtures start once),
# the files in collection order: tests/conftest.py puts the longest first. `-n 0` runs them in
# one process. A container's CPU quota counts as its cores (xdist counts the host's CPUs). The
# one more: with a worker per core, a quarter of 2 cores' time went idle, tests waiting on a
# hung peer's keepalive, a deadline, a restart; on 2 cores, 3 workers took 1 to 3 min less.
export PYTEST_XDIST_AUTO_NUM_WORKERS="${PYTEST_XDIST_AUTO_NUM_WORKERS:-$(($(python scripts/cores.py) + 1))}"
python -m pytest -n auto --dist loadfile --no-loadscope-reorder "$@"
