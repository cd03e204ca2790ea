"""``pdserve bench --workload agent`` through real processes: two disaggregated systems of the embedded
model (gateway, prefill and decode worker each, every worker with its own /metrics), one with the
workers' prefix cache on (the default) and one with ``--enable-prefix-caching false``, measured in one
bench run (2 sessions x 3 turns, short texts, greedy).

Each turn's prompt carries the session so far, so it grows; with reuse on, the prefill worker finds the
earlier turns' full blocks (hit rate > 0), with reuse off it finds none (== 0) while it still looks them
up. The KV the decode worker received in a turn is read per turn: with reuse off it is every prompt's
whole blocks (block size 16) x the model's KV bytes per block. No KV block is leaked.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.models.registry import resolve_model
from loadtest.cli import main
from loadtest.kv_size import kv_bytes_per_token, load_model_config
from pdserve.live_system import SystemSpec, live_systems

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
MODEL = "smollm2-135m"
BLOCK_SIZE = 16  # the workers' default --block-size


def _system(label: str, system: object) -> str:
    urls = system.metrics_urls  # type: ignore[attr-defined]
    url = system.url  # type: ignore[attr-defined]
    return f"label={label},url={url},prefill={urls['prefill']},decode={urls['decode']}"


def test_agent_bench_reuse_on_and_off(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    specs = [SystemSpec("disagg", tmp_path / "on", MODEL, num_blocks=256),
             SystemSpec("disagg", tmp_path / "off", MODEL, num_blocks=256,
                        worker_flags=("--enable-prefix-caching", "false"))]
    config = resolve_model(MODEL)
    with live_systems(specs) as (on, off):
        code = main(["--workload", "agent", "--endpoint", "chat", "--model", MODEL,
                     "--system", _system("reuse-on", on), "--system", _system("reuse-off", off),
                     "--sessions", "2", "--turns", "3", "--user-tokens", "12", "--tool-tokens", "24",
                     "--output-len", "fixed:4", "--ignore-eos", "--think-time", "0s",
                     "--request-timeout", "120s",
                     "--model-config", str(config), "--kv-dtype", "float32", "--leak-settle", "10s",
                     "--no-progress", "--output-dir", str(tmp_path / "out")])
        printed = capsys.readouterr()
        assert code == 0, printed.err + printed.out
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    per_token = kv_bytes_per_token(load_model_config(config), "float32")
    assert result["config"]["kv_bytes_per_token"] == per_token
    systems = {s["label"]: s for s in result["systems"]}
    assert list(systems) == ["reuse-on", "reuse-off"]
    for label, system in systems.items():
        assert [(t["turn"], t["sent"], t["completed"]) for t in system["turns"]] == [(0, 2, 2), (1, 2, 2),
                                                                                  (2, 2, 2)], label
        prompts = {(r["session_id"], r["turn"]): r["prompt_tokens"] for r in system["records"]}
        for session in range(2):  # turn k carries turns 0..k-1 and their answers: the prompt grows
            sizes = [prompts[(session, k)] for k in range(3)]
            assert sizes[0] > 36 and sizes[0] < sizes[1] < sizes[2], (label, sizes)
        assert system["kv"]["leaked"] == 0 and system["counters_error"] == "", label
        for turn in system["turns"]:
            blocks = sum(-(-prompts[(s, turn["turn"])] // BLOCK_SIZE) for s in range(2))
            whole = blocks * BLOCK_SIZE * per_token
            moved = turn["kv_bytes"]
            # reuse off: every prompt's whole blocks cross; reuse on: at most that (decode-side reuse: less)
            assert (moved == whole) if label == "reuse-off" else (0 < moved <= whole), (label, turn)
            assert turn["suffix_kv_bytes"] == turn["suffix_tokens"] * per_token
    run_on = systems["reuse-on"]["run_counters"]["prefill"]
    run_off = systems["reuse-off"]["run_counters"]["prefill"]
    assert run_on["hits"]["gpu"] > 0 and run_on["queries"]["gpu"] > 0
    assert run_off["hits"]["gpu"] == 0 and run_off["queries"]["gpu"] > 0
    on_turns, off_turns = systems["reuse-on"]["turns"], systems["reuse-off"]["turns"]
    assert all(t["prefill_hit_rate"] > 0 for t in on_turns[1:])  # later turns find the earlier ones' blocks
    assert all(t["prefill_hit_rate"] == 0 for t in off_turns)
    assert "## Side by side" in printed.out
