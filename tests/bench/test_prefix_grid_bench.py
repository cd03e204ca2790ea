"""bench/engine/prefix_grid.py end to end on the CPU (tiny dummy Llama, fp32, torch attention): every
grid's greedy-twice answers are counted, the hits are whole grid chunks, the timing rows carry ratios
against the grid-less engine of the same run, and the script exits 0 (every grid pair identical)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.engine import prefix_grid


def test_prefix_grid_bench_reports_answers_and_costs(tmp_path: Path) -> None:
    out = tmp_path / "grid.json"
    rc = prefix_grid.main(["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--attention-backend",
                           "torch", "--num-prompts", "2", "--prompt-len", "100", "--max-tokens", "4",
                           "--timing-len", "128", "--suffix-len", "32", "--grids", "0,64", "--repeats", "2",
                           "--num-blocks", "128", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    off, grid = report["answers"]
    assert (off["grid"], grid["grid"]) == (0, 64)
    assert off["hits"] == [96, 96] and grid["hits"] == [64, 64]  # 100 tokens: 6 full blocks, 1 grid chunk
    assert grid["identical"] == grid["prompts"] == 2
    rows = report["timing"]
    assert [r["grid"] for r in rows] == [0, 64] and rows[0]["fresh_vs_first"] == 1.0
    assert all(len(r["fresh_s"]) == 2 and r["prefill_tok_per_s"] > 0 for r in rows)
