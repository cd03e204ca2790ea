"""``bench.gateway.overhead``: config validation, delay subtraction on hand-built records, and a small
end-to-end smoke run (real gateways + fake workers + the bare SSE baseline, a handful of requests) whose
JSON must have sane fields and whose gateway targets must end with nothing in flight and all KV blocks
free."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from bench.gateway.cpu_pinning import CorePlan, assign_cores, format_cpus, physical_cores
from bench.gateway.curve_cost import CurveCost, CurveRound
from bench.gateway.overhead import main
from bench.gateway.overhead_report import render_curve_cost, render_scale
from bench.gateway.overhead_targets import OverheadConfig, summarize_level
from bench.gateway.process_scaling import (
    ClientShare,
    ScaleLevel,
    client_timeline,
    run_scale_level,
    steady_window,
)
from loadtest.records import RequestRecord


@pytest.mark.parametrize(("field", "value"), [("requests", 0), ("concurrency", ()), ("concurrency", (1, 0)),
                                              ("max_tokens", 1), ("token_delay_s", -0.1),
                                              ("prefill_delay_s", -1.0), ("warmup", -1), ("timeout_s", 0.0)])
def test_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        OverheadConfig(**{field: value})  # type: ignore[arg-type]


def rec(ttft: float, itl: list[float], tokens: int, success: bool = True) -> RequestRecord:
    return RequestRecord(index=0, session_id=0, turn=0, start_s=0.0, success=success, ttft_s=ttft,
                         itl_s=itl, e2e_s=ttft + sum(itl) + 0.001, output_tokens=tokens)


def test_summarize_subtracts_configured_delays() -> None:
    cfg = OverheadConfig(max_tokens=3, prefill_delay_s=0.010, token_delay_s=0.002)
    records = [rec(0.015, [0.003, 0.004], 3), rec(0.017, [0.005, 0.002], 3),
               rec(0.020, [0.003], 2)]  # short: counted as failed
    lv = summarize_level("disagg", 4, records, 2.0, cfg)
    assert (lv.completed, lv.failed, lv.requests) == (2, 1, 3)
    assert lv.first_error == "2 tokens, want 3"
    assert lv.req_s == pytest.approx(1.0)
    assert lv.ttft_ms is not None and lv.added_ttft_ms is not None
    assert lv.ttft_ms.median == pytest.approx(16.0)
    assert lv.added_ttft_ms.median == pytest.approx(6.0)  # 16 ms observed - 10 ms prefill delay
    assert lv.added_itl_ms is not None and lv.added_itl_ms.count == 4
    assert lv.added_itl_ms.median == pytest.approx(1.5)  # gaps 3,4,5,2 ms, median 3.5 - 2
    # e2e: 0.023 and 0.025 s; minus 10 ms prefill and 2 × 2 ms tokens
    assert lv.added_e2e_ms is not None and lv.added_e2e_ms.median == pytest.approx(10.0)
    # TPOT per request: (e2e - ttft) / (3 - 1) - 2 ms = (7 + 1) / 2 - 2 = 2 ms for both
    assert lv.added_tpot_ms is not None and lv.added_tpot_ms.median == pytest.approx(2.0)
    base = summarize_level("baseline", 4, records[:2], 2.0, cfg)
    assert base.added_ttft_ms is not None and base.added_ttft_ms.median == pytest.approx(16.0)


@pytest.mark.parametrize("argv", [["--requests", "0"], ["--targets", "disagg,nope"],
                                  ["--tokenizer", "/nonexistent/tokenizer-dir"], ["--concurrency", "x"],
                                  ["--curve-rounds", "3"], ["--curve-cost", "--curve-rounds", "0"],
                                  ["--curve-cost", "--curve-concurrency", "0"],
                                  ["--gateway-processes", "1,0"], ["--gateway-processes", "x"],
                                  ["--gateway-processes", "1", "--client-processes", "0"],
                                  ["--gateway-processes", "1", "--fake-decode-workers", "0"],
                                  ["--gateway-processes", "1", "--client-processes", "4",
                                   "--scale-concurrency", "2"],
                                  ["--gateway-processes", "1", "--scale-concurrency", "8",
                                   "--scale-concurrency-per-process", "4"],
                                  ["--gateway-processes", "1", "--scale-concurrency-per-process", "0"],
                                  ["--gateway-processes", "1,2", "--client-processes", "4",
                                   "--scale-concurrency-per-process", "2"],
                                  ["--scale-concurrency-per-process", "4"], ["--pin-cpus"],
                                  ["--gateway-processes", "1,4096", "--pin-cpus"]])
def test_bad_arguments_exit_2_and_start_nothing(argv: list[str], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert main([*argv, "--json", str(out)]) == 2
    assert "gateway_overhead:" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow  # starts two gateways, three fake workers and the baseline server
def test_smoke_run_writes_sane_json(tokenizer_dir: Path, tmp_path: Path) -> None:
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    rc = main(["--requests", "4", "--warmup", "1", "--concurrency", "1,2", "--max-tokens", "4",
               "--tokenizer", str(tokenizer_dir), "--json", str(out), "--out", str(md)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["machine"]["nproc"] == os.cpu_count()
    assert res["leaks"] == {"disagg": "ok", "colocated": "ok"}  # nothing in flight, all KV blocks free
    assert [(lv["target"], lv["concurrency"]) for lv in res["levels"]] == [
        (t, c) for t in ("disagg", "colocated", "baseline") for c in (1, 2)]
    for lv in res["levels"]:
        assert (lv["requests"], lv["completed"], lv["failed"]) == (4, 4, 0), lv["first_error"]
        assert lv["req_s"] > 0
        assert lv["itl_ms"]["count"] == 4 * 3  # every token its own chunk
        assert 0 < lv["ttft_ms"]["median"] <= lv["e2e_ms"]["median"] < 10_000
        assert lv["added_e2e_ms"]["median"] == pytest.approx(lv["e2e_ms"]["median"])  # no delays set
    text = md.read_text()
    assert "| disagg | 1 | 4/4 |" in text and "| baseline | 2 | 4/4 |" in text


def _round(arm: str, r: int, gateway_cpu_s: float, tokens: int = 1000) -> CurveRound:
    io_s = 0.012 if arm == "disagg" else 0.010
    return CurveRound(arm=arm, round=r, requests=10, completed=10, tokens=tokens, wall_s=1.0,
                      gateway_cpu_s=gateway_cpu_s, workers_cpu_s=0.05,
                      gateway_us_per_token=gateway_cpu_s / tokens * 1e6, workers_us_per_token=50.0,
                      added_tpot_p50_ms=0.2, gateway_zmq_io_cpu_s=io_s,
                      gateway_zmq_io_us_per_token=io_s / tokens * 1e6)


def test_curve_cost_report_gives_medians_spread_and_ratio() -> None:
    rounds = [_round("disagg", 0, 0.105), _round("disagg-insecure", 0, 0.100),
              _round("disagg-insecure", 1, 0.110), _round("disagg", 1, 0.121),
              _round("disagg", 2, 0.300), _round("disagg-insecure", 2, 0.090)]  # an outlier round
    cost = CurveCost(concurrency=32, rounds=rounds, leaks={}, loadavg_start=(1, 2, 3), loadavg_end=(3, 2, 1))
    text = "\n".join(render_curve_cost(cost, 16))
    row = ("| disagg | 30/30 | 121.0 [105.0–300.0] | 12.0 [12.0–12.0] | 50.0 [50.0–50.0] "
           "| 0.200 [0.200–0.200] |")
    assert row in text
    assert "| disagg-insecure | 30/30 | 100.0 [90.0–110.0] |" in text
    assert "121.0 / 100.0 µs = **1.210** (CURVE adds +21.0 µs, +21.0 %" in text
    assert "per round (same round, both arms): 1.050, 1.100, 3.333" in text
    assert "pooled (all rounds' CPU over all rounds' tokens): 175.3 / 100.0 µs = 1.753" in text
    assert "1.00, 2.00, 3.00 / 3.00, 2.00, 1.00" in text
    assert "12.0 / 10.0 µs per output token (CURVE adds +2.0 µs, +2.0 % of the gateway's per-token CPU)" \
        in text


@pytest.mark.slow  # starts two gateways and four fake workers side by side
def test_curve_cost_smoke_run(tokenizer_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    rc = main(["--targets", "", "--curve-cost", "--curve-rounds", "2", "--curve-concurrency", "2",
               "--requests", "6", "--warmup", "1", "--max-tokens", "4", "--tokenizer", str(tokenizer_dir),
               "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["levels"] == [] and res["leaks"] == {}
    cost = res["curve_cost"]
    assert cost["concurrency"] == 2 and cost["leaks"] == {"disagg": "ok", "disagg-insecure": "ok"}
    assert [(r["arm"], r["round"]) for r in cost["rounds"]] == [
        ("disagg", 0), ("disagg-insecure", 0), ("disagg-insecure", 1), ("disagg", 1)]  # alternated
    for r in cost["rounds"]:
        assert (r["requests"], r["completed"], r["tokens"]) == (6, 6, 24)
        assert r["gateway_cpu_s"] >= 0 and r["workers_cpu_s"] >= 0
        assert r["gateway_us_per_token"] == pytest.approx(r["gateway_cpu_s"] / 24 * 1e6)
        assert 0 <= r["gateway_zmq_io_cpu_s"] <= r["gateway_cpu_s"] + 0.02  # a part of it (10 ms ticks)
    assert sum(r["gateway_cpu_s"] for r in cost["rounds"]) > 0  # the gateways did work (10 ms ticks)


def _scale(processes: int, tokens_s: float, req_s: float, steady_tokens_s: float = 0.0) -> ScaleLevel:
    return ScaleLevel(processes=processes, clients=4, concurrency=64, sent=100, completed=100, tokens=1600,
                      first_error="", wall_s=1.0, tokens_s=tokens_s, req_s=req_s,
                      gateway_cores=0.9 * processes, busiest_client_core=0.5, busiest_worker_core=0.3,
                      processes_used=processes, leaks="ok", steady_s=0.5 if steady_tokens_s else 0.0,
                      steady_tokens_s=steady_tokens_s)


def test_scale_report_gives_steady_ratios_to_the_first() -> None:
    text = "\n".join(render_scale([_scale(1, 6000, 50, 6500), _scale(2, 11400, 90, 13000),
                                   _scale(4, 20400, 170, 23400)], 128))
    assert ("| 1 | 4 | 64 | 100/100 | 6500 (0.50) | **1.00** | 6000 | 50.0 | 1.00 | 0.90 | 0.50 | 1 | 0.30 "
            "| 1/1 | ok |" in text)
    assert "| 2 | 4 | 64 | 100/100 | 13000 (0.50) | **2.00** | 11400 | 90.0 | 1.80 | 1.80 |" in text
    assert "| 4 | 4 | 64 | 100/100 | 23400 (0.50) | **3.60** | 20400 | 170.0 | 3.40 | 3.60 |" in text
    empty = "\n".join(render_scale([_scale(1, 6000, 50, 6500), _scale(2, 11400, 90)], 128))
    assert "| 2 | 4 | 64 | 100/100 | – | – | 11400 | 90.0 | 1.80 |" in empty  # no window: no ratio


def _record(index: int, start: float, ttft: float, itl: list[float], tokens: int,
            success: bool = True) -> RequestRecord:
    return RequestRecord(index=index, session_id=index, turn=0, start_s=start, success=success, ttft_s=ttft,
                         itl_s=itl, output_tokens=tokens)


def test_client_timeline_places_every_token_on_the_shared_clock() -> None:
    records = [_record(0, 0.0, 0.5, [0.25, 0.25], 3), _record(1, 0.1, 1.0, [0.5], 4),
               _record(2, 2.0, 0.1, [], 2), _record(3, 2.5, 0.2, [0.1], 2, success=False)]
    streaming, last_send, arrivals, weights = client_timeline(records, 100.0, 2)
    assert streaming == pytest.approx(101.1)  # the first wave (sent at 0.0 and 0.1): latest first token
    assert last_send == pytest.approx(102.5)
    assert arrivals == pytest.approx([100.5, 100.75, 101.0, 101.1, 101.6, 102.1])  # failed one left out
    assert weights == pytest.approx([1, 1, 1, 2, 2, 2])  # 4 tokens in 2 chunks, 2 tokens in 1
    with pytest.raises(ValueError, match="no request records"):
        client_timeline([], 0.0, 1)


def _share(streaming: float, last_send: float, arrivals: list[float]) -> ClientShare:
    return ClientShare(sent=1, completed=1, tokens=len(arrivals), first_error="", start=0.0, end=10.0,
                       cpu_s=0.0, all_streaming=streaming, last_send=last_send, arrivals=arrivals,
                       weights=[1.0] * len(arrivals))


def test_steady_window_is_where_every_client_streams() -> None:
    a = _share(1.0, 5.0, [0.5, 1.0, 2.0, 3.0, 4.9, 5.0, 6.0])
    b = _share(2.0, 6.0, [1.5, 2.0, 2.5, 5.5])
    seconds, tokens = steady_window([a, b])
    assert seconds == pytest.approx(3.0)  # from b's first wave streaming (2.0) to a's last send (5.0)
    assert tokens == 5  # a: 2.0, 3.0, 4.9; b: 2.0, 2.5 (5.0 is the end, left out)
    assert steady_window([a, _share(5.5, 9.0, [6.0])]) == (0.0, 0.0)  # a ran dry before it streamed


@pytest.mark.slow  # starts a 1-process and a 2-process gateway (one after the other) with fake workers
def test_gateway_processes_smoke_run(tokenizer_dir: Path, tmp_path: Path) -> None:
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    # 32 requests x 128 tokens per client: its share (every token's arrival time) is larger than a
    # pipe's 64 KiB buffer, so the bench must read it before it joins the client process
    rc = main(["--targets", "", "--gateway-processes", "1,2", "--client-processes", "2",
               "--scale-concurrency", "4", "--requests", "64", "--warmup", "1", "--max-tokens", "128",
               "--fake-decode-workers", "2",
               "--tokenizer", str(tokenizer_dir), "--json", str(out), "--out", str(md)])
    assert rc == 0
    scale = json.loads(out.read_text())["scale"]
    assert [(s["processes"], s["clients"], s["concurrency"], s["decode_workers"]) for s in scale] == [
        (1, 2, 4, 2), (2, 2, 4, 2)]  # the leak check below covers both fake decode workers
    for s in scale:
        assert (s["sent"], s["completed"], s["tokens"], s["leaks"]) == (64, 64, 8192, "ok"), s["first_error"]
        assert s["tokens_s"] == pytest.approx(8192 / s["wall_s"]) and s["req_s"] > 0
        assert 0 <= s["steady_tokens_s"] * s["steady_s"] <= 8192  # the window holds a part of the tokens
        assert 1 <= s["processes_used"] <= s["processes"]
        assert len(s["process_requests"]) == s["processes"]
        assert sum(s["process_requests"]) == 64 + 2  # the measured ones and each client's warm-up
        assert s["processes_used"] == sum(1 for n in s["process_requests"] if n)
        assert len(s["process_cores"]) == len(s["gateway_cpus"]) == s["processes"]
        assert sum(s["process_cores"]) <= s["gateway_cores"] + 0.05  # the pool's parent adds to the total
    assert "| 1 | 2 | 4 | 64/64 |" in md.read_text() and "**1.00**" in md.read_text()


@pytest.mark.parametrize(("argv", "why"), [
    (["--gateway-processes", "1,4096", "--pin-cpus"], "--pin-cpus: .* too few for 4096 gateway processes"),
    (["--gateway-processes", "1", "--scale-concurrency", "8", "--scale-concurrency-per-process", "4"],
     "--scale-concurrency and --scale-concurrency-per-process exclude each other"),
    (["--pin-cpus"], "--pin-cpus need --gateway-processes"),
    (["--gateway-processes", "1", "--clock-probe"], "--clock-probe needs --pin-cpus"),
    (["--gateway-processes", "1", "--gateway-cores", "1"], "--gateway-cores needs --pin-cpus"),
    (["--gateway-processes", "1,2", "--client-processes", "4", "--scale-concurrency-per-process", "2"],
     "--scale-concurrency-per-process 2 x 1 gateway processes gives fewer streams than the 4 client")])
def test_scale_flags_are_refused_with_their_names(argv: list[str], why: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert re.search(why, capsys.readouterr().err)


def test_scale_report_gives_the_core_plan_and_each_process() -> None:
    one, two = _scale(1, 6000, 50), _scale(2, 11400, 90)
    one.process_cores, one.gateway_cpus = [1.17], ["8-9"]
    two.process_cores, two.gateway_cpus = [0.93, 0.95], ["8-9", "10-11"]
    one.process_requests, two.process_requests = [105], [61, 44]
    text = "\n".join(render_scale([one, two], 128, assign_cores(list(range(16)), 4), 64))
    assert ("- CPU pinning (`--pin-cpus`): gateway process 0: cores 8-9; gateway process 1: cores 10-11; "
            "gateway process 2: cores 12-13; gateway process 3: cores 14-15; clients, fake workers and the "
            "bench: cores 0-7 (the pool's parent on 8-15 when N > 1)") in text
    assert "- offered load: 64 streams per gateway process (`--scale-concurrency-per-process`)" in text
    assert "| 1/1 | ok | 1.17 | 8-9 | 105 |" in text
    assert "| 2/2 | ok | 0.93 / 0.95 | 8-9 / 10-11 | 61 / 44 |" in text
    assert text.count("| 0.00 | – |") == 2  # no load side measured, no probe: nothing to compare
    plain = "\n".join(render_scale([one], 128))
    assert "- CPU pinning: none" in plain and "- offered load: the same streams at every N" in plain


@pytest.mark.slow  # starts a 1-process gateway with fake workers, pinned
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="--pin-cpus needs Linux and 2 CPUs")
def test_pinned_level_runs_on_its_cores(tokenizer_dir: Path, tmp_path: Path) -> None:
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    before = os.sched_getaffinity(0)
    rc = main(["--targets", "", "--gateway-processes", "1", "--pin-cpus", "--client-processes", "2",
               "--scale-concurrency-per-process", "2", "--requests", "16", "--warmup", "1",
               "--max-tokens", "4", "--tokenizer", str(tokenizer_dir), "--json", str(out), "--out", str(md)])
    assert rc == 0
    assert os.sched_getaffinity(0) == before  # the bench's own set is given back
    res = json.loads(out.read_text())
    plan = assign_cores(sorted(before), 1, physical_cores(before))
    assert sorted(res["core_plan"]["gateway"][0]) == sorted(plan.gateway[0])
    assert sorted(res["core_plan"]["load"]) == sorted(plan.load)
    assert res["scale_per_process"] == 2
    [level] = res["scale"]
    assert (level["sent"], level["completed"], level["leaks"], level["concurrency"]) == (16, 16, "ok", 2)
    assert level["gateway_cpus"] == [format_cpus(plan.gateway[0])]  # read back from the process
    assert len(level["process_cores"]) == 1 and 0 < level["process_cores"][0] <= len(plan.gateway[0]) + 0.05
    assert "CPU pinning (`--pin-cpus`)" in md.read_text()


@pytest.mark.slow  # starts a 2-process gateway with fake workers
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="pinning needs Linux and 2 CPUs")
def test_two_process_level_pins_each_process_to_its_own_set(tokenizer_dir: Path, tmp_path: Path) -> None:
    a, b = sorted(os.sched_getaffinity(0))[:2]
    # a hand-made plan (assign_cores would refuse 2 processes on 2 CPUs): process 0 on b, process 1 on a
    plan = CorePlan(gateway=(frozenset({b}), frozenset({a})), load=frozenset({a, b}), probe=frozenset({a}))
    cfg = OverheadConfig(requests=8, warmup=1, max_tokens=4, concurrency=(2,), tokenizer=str(tokenizer_dir))
    level = run_scale_level(cfg, tokenizer_dir, tmp_path, 2, 4, 2, 1, plan)
    assert level.gateway_cpus == [str(b), str(a)]  # read back from each process, in index order
    assert (level.completed, level.leaks) == (8, "ok"), level.first_error
    assert len(level.process_cores) == 2
    assert level.probe_units_s > 0 and level.load_cores > 0  # the clock probe ran through the level


def test_scale_report_gives_load_side_cores_and_the_probe_against_the_first() -> None:
    one, four = _scale(1, 6000, 50), _scale(4, 20400, 170)
    one.load_cores, one.probe_units_s = 2.5, 400.0
    four.load_cores, four.probe_units_s = 6.25, 340.0
    text = "\n".join(render_scale([one, four], 128))
    assert "| 2.50 | 1.000 |" in text and "| 6.25 | 0.850 |" in text
