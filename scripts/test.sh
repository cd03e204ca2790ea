#!/usr/bin/env bash
# The README's test command: set up, lint, type-check, run every test on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$(pwd)/.venv/bin:$PATH"
echo "== ruff"; ruff check .
echo "== mypy"; mypy protocol engine kvtransfer workers gateway prefill_worker decode_worker pdserve loadtest
echo "== pytest"
# pytest exits 5 when it collected no test: that is a failure here, like any non-zero exit.
python -m pytest -q -p no:cacheprovider "$@"
