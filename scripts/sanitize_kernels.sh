#!/usr/bin/env bash
# Run NVIDIA compute-sanitizer (memcheck, then racecheck) over pdserve's compiled Triton kernels
# (store_kv, paged_prefill_attention, paged_decode_attention at several num_splits) on the small shape grid
# of bench/kernels/sanitize_driver.py (block-boundary lengths, GQA 1/4, head_dim 64/128, bf16/fp16).
#
# 1. a plain run of the driver compiles every kernel into a private Triton cache and checks each output
#    against the plain-torch references (so the sanitized runs only load kernels: no JIT under the tool);
# 2. `compute-sanitizer --tool memcheck` and `--tool racecheck` each run the driver once more, with
#    PYTORCH_NO_CUDA_MEMORY_CACHING=1 so every tensor is its own allocation (memcheck then sees an
#    out-of-bounds access past any tensor, not only past PyTorch's pooled segments).
# One summary line per tool: "memcheck: OK, 0 errors (41 s)" / "racecheck: FAILED, 3 errors ...".
# Exit codes: 0 clean, 1 a tool reported an error, a driver mismatch or a timeout, 2 no CUDA or no
# compute-sanitizer. Time bound: SANITIZE_TIMEOUT seconds per step (default 110; 3 steps).
# Usage: scripts/sanitize_kernels.sh [LOGDIR]   (PYTHON=... interpreter; default .venv/bin/python, else python3;
#        COMPUTE_SANITIZER=... the binary; logs in LOGDIR, default a temporary directory;
#        SANITIZE_KERNEL_FILTER=... passed as --kernel-name to check only matching kernels, e.g. kns=_kernel)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
SAN="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || true)}"
if [[ -z "$SAN" ]]; then
    for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer; do
        [[ -x "$c" ]] && SAN="$c" && break
    done
fi
[[ -n "$SAN" && -x "$SAN" ]] || { echo "sanitize_kernels.sh: compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2
                                  exit 2; }
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "sanitize_kernels.sh: no CUDA device visible to $PY" >&2
    exit 2
fi
LIMIT="${SANITIZE_TIMEOUT:-110}"
LOGDIR="${1:-$(mktemp -d /tmp/sanitize.XXXXXX)}"
mkdir -p "$LOGDIR"
unset TRITON_INTERPRET  # compiled kernels, never the interpreter
export TRITON_CACHE_DIR="$LOGDIR/triton-cache"
echo "sanitize_kernels: $("$SAN" --version | tail -n 1); logs in $LOGDIR"

started=$SECONDS
timeout "$LIMIT" "$PY" -m bench.kernels.sanitize_driver --json "$LOGDIR/driver.json" > "$LOGDIR/driver.log" 2>&1
rc=$?
if ((rc != 0)); then
    tail -n 20 "$LOGDIR/driver.log" >&2
    echo "driver: FAILED (exit $rc$( ((rc == 124)) && echo ", timed out after ${LIMIT} s"))"
    exit 1
fi
echo "driver: OK, $(tail -n 1 "$LOGDIR/driver.log" | sed 's/^sanitize_driver: //') ($((SECONDS - started)) s)"

failed=0
for tool in memcheck racecheck; do
    started=$SECONDS
    log="$LOGDIR/$tool.log"
    filter=()
    [[ -n "${SANITIZE_KERNEL_FILTER:-}" ]] && filter=(--kernel-name "$SANITIZE_KERNEL_FILTER")
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$LIMIT" "$SAN" --tool "$tool" --error-exitcode 99 \
        "${filter[@]}" --print-limit 50 --log-file "$log" "$PY" -m bench.kernels.sanitize_driver > "$LOGDIR/$tool.out" 2>&1
    rc=$?
    # memcheck ends with "ERROR SUMMARY: N errors"; racecheck with "RACECHECK SUMMARY: H hazards
    # displayed (N errors, W warnings)" and no ERROR SUMMARY line.
    errors=$(grep -oE 'ERROR SUMMARY: [0-9]+' "$log" 2>/dev/null | tail -n 1 | grep -oE '[0-9]+$')
    extra=$(grep -oE 'RACECHECK SUMMARY: .*' "$log" 2>/dev/null | tail -n 1)
    if [[ -z "$errors" && -n "$extra" ]]; then
        errors=$(grep -oE '\(([0-9]+) errors' <<<"$extra" | grep -oE '[0-9]+')
    fi
    if ((rc == 0)) && [[ "$errors" == "0" ]]; then
        echo "$tool: OK, 0 errors${extra:+; $extra} ($((SECONDS - started)) s)"
        continue
    fi
    failed=1
    why="exit $rc"
    ((rc == 124)) && why="timed out after ${LIMIT} s"
    ((rc == 99)) && why="errors reported"
    ((rc == 1)) && why="driver mismatch (see $LOGDIR/$tool.out)"
    echo "$tool: FAILED, ${errors:-?} errors, $why${extra:+; $extra} ($((SECONDS - started)) s); log $log"
    grep -m 10 -E '^========= (Invalid|Error|.*[Hh]azard)' "$log" >&2 || tail -n 20 "$log" >&2
done
exit "$failed"
