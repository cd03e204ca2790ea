"""The GPU benchmark's plan and report logic, checked on CPU without starting anything: which processes
``bench.serving.disagg_vs_colocated --device cuda`` starts with which flags and GPUs, the time estimate,
and the goodput/crossover arithmetic of ``bench.serving.disagg_report`` on hand-built results."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.serving import disagg_report as rep
from bench.serving.disagg_vs_colocated import _sweep_seconds, bench_argv, parse_args, parse_mix, spec
from loadtest.records import BenchResult, LatencyStats, RunResult, Summary
from pdserve.live_system import children


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_cuda_plan_places_workers_and_shares_engine_flags(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    args = parse_args(["--device", "cuda"])
    assert (args.model, args.rates, args.duration, args.slo_ttft_ms, args.slo_tpot_ms) == (
        "llama3-8b", "2,4,6,8", "20s", 1000.0, 25.0)
    dis = children(spec(args, "disagg", tmp_path), 8000, "tcp://127.0.0.1:1")
    colo = children(spec(args, "colocated", tmp_path), 8001, "tcp://127.0.0.1:2")
    assert [n for n, _ in dis] == ["gateway", "prefill", "decode"]
    assert [n for n, _ in colo] == ["gateway", "colocated-0", "colocated-1"]
    # placed as `pdserve up` places workers: --device cuda:N, every GPU visible (CUDA IPC)
    # (children inherit the launcher's environment unchanged: no argv narrows the visible GPUs)
    assert all("CUDA_VISIBLE_DEVICES" not in " ".join(argv) for _, argv in dis + colo)
    workers = [argv for n, argv in dis + colo if n != "gateway"]
    assert [_flag(a, "--device") for a in workers] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    for argv in workers:
        assert _flag(argv, "--model") == "llama3-8b"
        assert _flag(argv, "--max-num-batched-tokens") == "2048" and _flag(argv, "--num-blocks") == "12000"
        assert _flag(argv, "--dtype") == "auto"
    assert [_flag(a, "--transfer-backend") for a in workers[:2]] == ["nixl", "nixl"]
    assert "--transfer-backend" not in workers[2] and "--transfer-backend" not in workers[3]
    assert len({_flag(a, "--worker-id") for a in workers}) == 4


def test_cuda_defaults_fit_the_time_budget() -> None:
    args = parse_args(["--device", "cuda"])
    assert _sweep_seconds(args) == 2 * 4 * (20 + 15)  # both systems, 4 rates, 20 s + 15 s warm-up/drain
    assert _sweep_seconds(args) + 150 <= 7.5 * 60     # + start-up (both systems at once) within 7.5 min
    assert args.time_budget <= 7.5 * 60
    argv = bench_argv(args, "http://x", Path("o"), 3000, 150)
    assert (_flag(argv, "--input-len"), _flag(argv, "--output-len"), _flag(argv, "--duration")) == (
        "fixed:3000", "fixed:150", "20s")
    assert "--ignore-eos" in argv and _flag(argv, "--arrival") == "poisson"
    assert _flag(argv, "--request-timeout") == "30s"  # bounds the drain of an overloaded rate


def test_parse_mix_names_and_refuses_bad_mixes() -> None:
    assert parse_mix("long") == ("long", 3000, 150)
    assert parse_mix("256:32") == ("in256-out32", 256, 32)
    for bad in ("x", "1:2:3", "0:10", "10:1", "a:b"):
        with pytest.raises(ValueError, match="bad mix"):
            parse_mix(bad)


def _run(rate: float, sent: int, done: int, good: float, ttft90: float, tpot90: float) -> RunResult:
    def stats(p90: float) -> LatencyStats:
        return LatencyStats(count=done, mean=p90 / 2, median=p90 / 2, p90=p90, p99=p90 * 2, max=p90 * 3)

    summary = Summary(num_requests=sent, completed=done, failed=sent - done, errors_by_kind={},
                      duration_s=10.0, request_throughput=done / 10, output_token_throughput=0.0,
                      total_token_throughput=0.0, goodput=good, slo_ttft_ms=1000.0, slo_tpot_ms=25.0,
                      ttft_ms=stats(ttft90), tpot_ms=stats(tpot90), itl_ms=stats(tpot90), e2e_ms=None)
    return RunResult(label=f"r{rate}", rate=rate, concurrency=None, summary=summary, records=[])


def test_goodput_rows_system_goodput_and_crossover() -> None:
    colo = rep.rate_rows(BenchResult(config={}, runs=[
        _run(2, 20, 20, 2.0, 400, 20), _run(4, 40, 40, 2.0, 600, 30), _run(8, 80, 70, 0.5, 3000, 60)]),
        1000, 25)
    dis = rep.rate_rows(BenchResult(config={}, runs=[
        _run(2, 20, 20, 2.0, 450, 12), _run(4, 40, 40, 4.0, 700, 14), _run(8, 80, 80, 6.0, 900, 24)]),
        1000, 25)
    assert [r.slo_met_p90 for r in colo] == [True, False, False]  # TPOT p90 30 > 25; 8: not all done
    assert [r.attainment for r in colo] == [1.0, 0.5, 0.0625]     # goodput x duration / sent
    assert (rep.system_goodput(colo), rep.system_goodput(dis)) == (2, 8)
    assert colo[2].itl_p99 == 120 and not colo[2].slo_met_p90
    assert rep.ratio(8, 2) == 4 and rep.ratio(1, 0) == math.inf and math.isnan(rep.ratio(0, 0))
    text = rep.crossover(colo, dis)
    assert text.startswith("Disaggregation pays") and "4, 8 req/s" in text and "2 req/s" in text
    assert "Crossover between 2 and 4 req/s" in text
    assert rep.crossover([], []) == "No rate was measured on both systems."
