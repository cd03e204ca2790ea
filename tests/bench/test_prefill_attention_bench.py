"""``bench.kernels.prefill_attention`` on CPU (Triton's interpreter, tiny shapes): its FLOP count is the
bottom-right causal mask's, its SDPA ceiling does the same attention as the engine's reference, its check
catches a wrong output, and a ``--candidates`` run checks and ranks every variant. Timing needs a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.kernels.prefill_attention import (
    CHECK_TOL,
    CPU_CANDIDATES,
    CPU_SHAPE,
    Case,
    kernel_call,
    main,
    make_inputs,
    rel_error,
    sdpa_call,
)
from engine.ops.paged_prefill import paged_prefill_attention_reference

CPU = torch.device("cpu")


@pytest.mark.parametrize("text", ["1x5x0", "2x7x20", "3x1x16"])
def test_pairs_are_the_visible_entries_of_the_bottom_right_mask(text: str) -> None:
    case = Case.parse(text)
    rows = torch.arange(case.new)[:, None]
    cols = torch.arange(case.context + case.new)[None, :]
    visible = int((cols <= case.context + rows).sum())
    assert case.pairs() == case.seqs * visible
    assert case.flops(CPU_SHAPE) == 4 * CPU_SHAPE.head_dim * CPU_SHAPE.heads * case.seqs * visible


@pytest.mark.parametrize("text", ["1x5", "0x5x0", "1x0x3", "ax5x0"])
def test_bad_case_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=text):
        Case.parse(text)


def test_ceiling_and_kernel_match_the_engine_reference_and_a_wrong_output_fails() -> None:
    case = Case(2, 9, 37)
    inp = make_inputs(case, CPU_SHAPE, CPU)
    scale = CPU_SHAPE.head_dim ** -0.5
    ref = paged_prefill_attention_reference(inp.q, inp.k_cache, inp.v_cache, inp.block_tables, inp.seq_lens,
                                            inp.query_start_loc, case.new, case.context + case.new, scale)
    sdpa_out = sdpa_call(inp, scale)()
    assert rel_error(ref, sdpa_out) < 1e-5  # the ceiling attends with the same bottom-right mask
    for cand in CPU_CANDIDATES:
        assert rel_error(kernel_call(inp, scale, cand)(), sdpa_out) < 1e-5, cand.label
    wrong = ref.clone()
    wrong[case.new + 3] *= 1.1  # one row of the second sequence 10 % off
    assert rel_error(wrong, sdpa_out) > CHECK_TOL


def test_candidates_smoke_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.json"
    res = main(["--device", "cpu", "--cases", "1x6x0", "2x5x19", "--candidates", "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(res))
    assert [c["case"] for c in res["cases"]] == ["1x6x0", "2x5x19"]
    for case in res["cases"]:
        assert [r["candidate"] for r in case["rows"]] == [c.label for c in CPU_CANDIDATES]
        assert all(r["ok"] and r["rel_err"] < 1e-5 and r["seconds"]["n"] == 1 for r in case["rows"])
        assert case["sdpa_seconds"]["n"] == 20
    assert res["best_overall"]["candidate"] in {c.label for c in CPU_CANDIDATES}
    assert "| 2x5x19 | default tile |" in capsys.readouterr().out
