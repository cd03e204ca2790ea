#!/usr/bin/env bash
# Run the KV cache, kernel and attention-backend tests on a CUDA machine (an H200): compiled Triton
# kernels (no interpreter) in fp32, fp16 and bf16 over the full shape grids (the CPU suite runs a subset
# through the interpreter: tests/engine/grid.py), plus the `gpu`-marked tests that CPU runs skip.
# Usage: scripts/gpu_tests.sh [extra pytest args]   (PYTHON=... to pick the interpreter; default: the
# project venv if present, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_tests.sh: no CUDA device visible to $PYTHON" >&2
    exit 2
fi
unset TRITON_INTERPRET  # compiled kernels, never the interpreter
export PDSERVE_FULL_GRID=1  # every shape of every kernel grid
"$PYTHON" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
"device", torch.cuda.get_device_name())'
exec "$PYTHON" -m pytest -q -p no:cacheprovider -rs \
    tests/engine/test_kv_cache.py tests/engine/test_kernels.py tests/engine/test_attention_backends.py \
    tests/engine/test_gpu_parity.py tests/engine/test_cuda_graphs.py tests/engine/test_fused_ops.py \
    tests/engine/test_fused_model.py tests/engine/test_async_scheduling.py tests/engine/test_rotary_store.py \
    tests/engine/test_pdl.py tests/engine/test_decode_rope.py tests/engine/test_fused_moe.py \
    tests/engine/test_moe_align.py tests/engine/test_argmax.py \
    tests/engine/test_fp8_gemm.py tests/engine/test_fp8_gemv.py tests/engine/test_fp8_model.py \
    tests/engine/test_kv_host_tier.py tests/engine/test_host_copy.py \
    tests/engine/test_fp8_kv.py tests/engine/test_topk_softmax.py tests/engine/test_prefill_variants.py \
    tests/engine/test_cudnn_attention.py tests/engine/test_cudnn_paged_prefill.py "$@"
