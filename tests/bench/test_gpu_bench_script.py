"""scripts/gpu_bench.sh on CPU with a fake interpreter: it refuses without CUDA, and on a "GPU" it runs the
benchmarks with flags their parsers accept, writes their logs under OUTDIR and reports a failed step."""

from __future__ import annotations

import shlex
import stat
import subprocess
from pathlib import Path

import pytest

from bench.engine import moe_decode, prefill, throughput
from bench.kernels import fused_moe

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/usr/bin/env bash
# -c: the CUDA / import probes (exit $CUDA) and machine.json; -m MODULE ARGS: recorded, one line each
if [[ "$1" == "-c" ]]; then [[ "$2" == *cuda.is_available* ]] && exit "$CUDA"; echo '{}'; exit 0; fi
printf '%q ' "$@" >> "$CALLS"; echo >> "$CALLS"
[[ "$2" == "$FAIL" ]] && { echo "boom"; exit 1; }
echo "fake $2 ran"
"""


Calls = list[list[str]]


def _run(tmp_path: Path, cuda: int, fail: str = "none") -> tuple[subprocess.CompletedProcess[str], Calls]:
    py = tmp_path / "python"
    py.write_text(FAKE_PYTHON)
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    calls = tmp_path / "calls"
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(py), "CUDA": str(cuda), "CALLS": str(calls), "FAIL": fail}
    res = subprocess.run(["bash", "scripts/gpu_bench.sh", str(tmp_path / "out")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    lines = calls.read_text().splitlines() if calls.exists() else []
    return res, [shlex.split(line) for line in lines]


def test_refuses_without_cuda(tmp_path: Path) -> None:
    res, calls = _run(tmp_path, cuda=1)
    assert res.returncode == 2 and "no CUDA device" in res.stderr
    assert calls == []


def test_runs_engine_and_prefill_with_flags_their_parsers_accept(tmp_path: Path) -> None:
    res, calls = _run(tmp_path, cuda=0)
    assert res.returncode == 0, res.stdout + res.stderr
    assert [c[:2] for c in calls] == [["-m", "bench.engine.throughput"], ["-m", "bench.engine.prefill"],
                                      ["-m", "bench.engine.moe_decode"], ["-m", "bench.kernels.fused_moe"]]
    engine = throughput.build_parser().parse_args(calls[0][2:])
    assert (engine.device, engine.model, engine.batches, engine.hf_batches) == ("cuda", "llama3-8b", [1, 32],
                                                                                [1, 32])
    assert engine.warmup >= 1 and engine.repeats >= 3 and str(engine.json).endswith("out/engine.json")
    pre = prefill.build_parser().parse_args(calls[1][2:])
    assert pre.device == "cuda" and pre.gemm_repeats >= 20 and pre.json.endswith("out/prefill.json")
    moe = moe_decode.build_parser().parse_args(calls[2][2:])
    assert (moe.device, moe.model, moe.batches) == ("cuda", "qwen3-30b-a3b", [1, 32])
    kernel = fused_moe.build_parser().parse_args(calls[3][2:])
    assert kernel.device == "cuda" and kernel.shape == "qwen3-30b-a3b" and max(kernel.tokens) >= 2048
    for name in ("engine.log", "prefill.log", "moe.log", "moe-kernel.log", "machine.json"):
        assert (tmp_path / "out" / name).exists(), name


@pytest.mark.parametrize("failing",
                         ["bench.engine.throughput", "bench.engine.prefill", "bench.engine.moe_decode"])
def test_a_failed_step_fails_the_script_after_running_all(tmp_path: Path, failing: str) -> None:
    res, calls = _run(tmp_path, cuda=0, fail=failing)
    assert res.returncode == 1
    assert len(calls) == 4
    name = {"bench.engine.throughput": "engine", "bench.engine.prefill": "prefill",
            "bench.engine.moe_decode": "moe"}[failing]
    assert f"== {name}: exit 1" in res.stdout
