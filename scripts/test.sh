#!/usr/bin/env bash
# The README's test command: set up, lint, type-check, run every test on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$(pwd)/.venv/bin:$PATH"
echo "== ruff"; ruff check .
echo "== mypy"; mypy protocol engine kvtransfer workers gateway prefill_worker decode_worker pdserve loadtest bench
echo "== pytest"
# pytest exits 5 when it collected no test: that is a failure here, like any non-zero exit.
# -n 2: two pytest-xdist workers (the suites that share the live system run in one of them, see
# tests/README.md); --durations=20: the slowest tests, to keep an eye on the suite's time.
python -m pytest -q -p no:cacheprovider -n 2 --durations=20 "$@"
