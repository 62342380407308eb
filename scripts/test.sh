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
python -m pytest "$@"
