#!/usr/bin/env bash
# Sets everything up, then runs the main job: the store walkthrough
# (a real agentkv-store process storing, restoring, forking and healing Q4 KV blocks).
# Usage: bash scripts/run.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck disable=SC1091
source scripts/setup.sh
agentkv walkthrough "$@"
