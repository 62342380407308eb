#!/usr/bin/env bash
# Sets everything up, then runs the main job: the demo (a store and a worker as separate
# processes; a five-phase multi-agent workflow whose agents keep their Q4 KV caches).
# Usage: bash scripts/run.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck disable=SC1091
source scripts/setup.sh
agentkv demo "$@"
