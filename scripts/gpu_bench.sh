#!/usr/bin/env bash
# Measure, on ONE H200, the engine rows of docs/benchmarks/README.md (decode, engine vs transformers, prefill):
#   1. decode tokens/s against the HBM roofline (batch 1 and 32, 1k and 4k context, graphs and async) and
#      engine vs transformers `generate` at batch 1 and 32 (both warmed up, 3 interleaved repeats);
#   2. prefill of an 8000-token prompt against the best of 20+20 bf16 8192^3 GEMMs (before and after the
#      prefills), and the attention kernel against SDPA flash;
#   3. decode of the Qwen3-30B-A3B mixture of experts (batch 1 and 32) against the roofline of the bytes a
#      step reads (dense weights, the routed experts, KV), and the fused MoE kernels against a per-expert
#      loop and a batched-GEMM ceiling at prefill sizes.
# Llama-3-8B shapes with dummy bf16 weights; no network needed (the device's python3 has torch, triton and
# transformers; msgspec, which the engine imports, must be importable: carry its wheel, docs/gpu.md).
# Usage: scripts/gpu_bench.sh [OUTDIR]   (default: $OUT, else /tmp/pdserve-gpu-bench; PYTHON=... picks the
# interpreter: default the project venv if present, else python3). Writes OUTDIR/{engine,prefill}.json,
# moe.json, moe-kernel.json, their logs and machine.json; about 10 minutes; exits non-zero if either step failed or timed out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${1:-${OUT:-/tmp/pdserve-gpu-bench}}"
mkdir -p "$OUTDIR"
PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_bench.sh: no CUDA device visible to $PYTHON" >&2
    exit 2
fi
if ! "$PYTHON" -c 'import msgspec, transformers, triton' 2>/dev/null; then
    echo "gpu_bench.sh: $PYTHON lacks msgspec, transformers or triton (carry msgspec as a wheel)" >&2
    exit 2
fi
unset TRITON_INTERPRET  # compiled kernels, never the interpreter
export PYTHONUNBUFFERED=1
"$PYTHON" -c 'import json, torch, triton, transformers
from bench.machine import machine_info
print(json.dumps({**machine_info(), "torch": torch.__version__, "triton": triton.__version__,
                  "transformers": transformers.__version__, "device": torch.cuda.get_device_name()}, indent=1))' \
    > "$OUTDIR/machine.json"

failed=0
step() {  # name limit_s args...: one benchmark under timeout, its output teed to OUTDIR/name.log
    local name=$1 limit=$2 started=$SECONDS
    shift 2
    echo "== $name: $PYTHON $*"
    timeout "$limit" "$PYTHON" "$@" 2>&1 | tee "$OUTDIR/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc$( ((rc == 124)) && echo " (timed out after $limit s)") in $((SECONDS - started)) s"
    ((rc == 0)) || failed=1
}

step engine 330 -m bench.engine.throughput --device cuda --model llama3-8b --load-format dummy \
    --dtype bfloat16 --attention-backend triton --num-blocks 34000 --max-num-seqs 128 --new-tokens 96 \
    --batches 1 32 --contexts 1024 4096 --modes graphs async --hf-batches 1 32 --hf-context 1024 \
    --warmup 1 --repeats 3 --json "$OUTDIR/engine.json"
step prefill 150 -m bench.engine.prefill --device cuda --repeats 3 --json "$OUTDIR/prefill.json"
step moe 420 -m bench.engine.moe_decode --device cuda --model qwen3-30b-a3b --dtype bfloat16 \
    --attention-backend triton --batches 1 32 --context 1024 --new-tokens 64 --num-blocks 4096 \
    --max-model-len 4096 --repeats 3 --json "$OUTDIR/moe.json"
step moe-kernel 180 -m bench.kernels.fused_moe --device cuda --shape qwen3-30b-a3b --tokens 512 2048 8192 \
    --repeats 10 --json "$OUTDIR/moe-kernel.json"

echo "== summary"
grep -hE "^(copy bandwidth|async |graphs )|engine / transformers|^prefill|^ceiling|^attention alone|^batch|roofline|fused / ceiling" \
    "$OUTDIR/engine.log" "$OUTDIR/prefill.log" "$OUTDIR/moe.log" "$OUTDIR/moe-kernel.log" 2>/dev/null
exit "$failed"
