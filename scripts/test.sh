#!/usr/bin/env bash
# The README's test command: set up, lint, type-check, run every test on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$(pwd)/.venv/bin:$PATH"
echo "== ruff"; ruff check .
# mypy runs beside pytest (a minute of one core on a clean clone; the tests leave a core idle part of the
# time): its report is printed after pytest's, and either failing fails the command.
mypy_log=$(mktemp)
mypy protocol engine kvtransfer workers gateway prefill_worker decode_worker pdserve loadtest bench \
    > "$mypy_log" 2>&1 &
mypy_pid=$!
# an interrupted run stops mypy too (a background job of a script ignores the terminal's Ctrl-C, and
# pytest exits 2 on it rather than dying of the signal: the INT trap ends the script once pytest has)
trap '[ -z "$mypy_pid" ] || kill "$mypy_pid" 2>/dev/null || true; rm -f "$mypy_log"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
echo "== pytest (mypy running beside it)"
# pytest exits 5 when it collected no test: that is a failure here, like any non-zero exit.
# -n 2: two pytest-xdist workers (the suites that share the live system run in one of them, see
# tests/README.md); --durations=20: the slowest tests, to keep an eye on the suite's time.
pytest_status=0
python -m pytest -q -p no:cacheprovider -n 2 --durations=20 "$@" || pytest_status=$?
mypy_status=0
wait "$mypy_pid" || mypy_status=$?
mypy_pid=""
echo "== mypy"; cat "$mypy_log"
if [ "$pytest_status" -ne 0 ] || [ "$mypy_status" -ne 0 ]; then
    echo "FAILED: pytest exit $pytest_status, mypy exit $mypy_status" >&2
    exit 1
fi
