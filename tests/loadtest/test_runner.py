"""Whole runs against the fake server (TTFT 50 ms, ITL 10 ms): closed and open loop, sweep, errors,
multi-turn, warm-up, duration bound, faults and the KV-leak scrape.

Timing tolerances: lower bounds are exact consequences of the fake's sleeps; upper bounds add slack for
the shared 2-core machine but stay far from the values the tests tell apart (e.g. TTFT 300 ms vs SLO
200 ms vs 50 ms).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import time
from pathlib import Path

import pytest

from loadtest.arrivals import arrival_times
from loadtest.config import BenchConfig, SLOConfig, WorkloadConfig
from loadtest.faults import FaultSpec
from loadtest.lengths import LengthDist
from loadtest.runner import run_bench, run_once
from loadtest.workload import make_sessions
from tests.loadtest.fake_server import FakeState

WL = WorkloadConfig(input_len=LengthDist("fixed", 20), output_len=LengthDist("fixed", 10))


def cfg(url: str, **kw: object) -> BenchConfig:
    base: dict[str, object] = dict(model="fake-model", workload=WL, arrival="closed", concurrency=2,
                                   num_requests=6, ignore_eos=True, progress=False, leak_settle_s=0.3)
    base.update(kw)
    return BenchConfig(url, **base)  # type: ignore[arg-type]


async def loop_lag(stop: asyncio.Event, period_s: float = 0.005) -> float:
    """Until ``stop`` is set, sleep ``period_s`` over and over on the running event loop; return the
    longest oversleep seen (seconds): how long the loop (or the whole process) was stalled at worst."""
    worst = 0.0
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(period_s)
        worst = max(worst, time.perf_counter() - t - period_s)
    return worst


async def test_closed_loop_metrics(fake: tuple[str, FakeState]) -> None:
    url, state = fake
    run = await run_once(cfg(url, slo=SLOConfig(ttft_ms=1000, tpot_ms=100)), rate=None)
    s = run.summary
    assert [r.index for r in run.records] == list(range(6)) and s.completed == 6 and s.failed == 0
    for r in run.records:
        assert r.output_tokens == 10 and r.prompt_tokens == 20 and len(r.itl_s) == 9
        assert r.e2e_s is not None and r.e2e_s >= 0.05 + 9 * 0.01 - 1e-3  # last token's earliest time
    assert s.ttft_ms is not None and 49 <= s.ttft_ms.median <= 200
    assert s.tpot_ms is not None and s.tpot_ms.mean <= 30
    # 6 requests, 2 at a time, each >= 140 ms: three rounds
    assert 0.42 - 3e-3 <= s.duration_s <= 0.42 + 1.5
    assert s.request_throughput == pytest.approx(6 / s.duration_s)
    assert s.output_token_throughput == pytest.approx(60 / s.duration_s)
    assert s.total_token_throughput == pytest.approx(180 / s.duration_s)
    assert s.goodput == pytest.approx(s.request_throughput)  # loose SLOs: every request meets them
    assert (run.kv.before, run.kv.after, run.kv.leaked, run.kv.error) == (0, 0, 0, "")
    assert state.counter == 6


async def test_goodput_counts_only_requests_within_slo(fake: tuple[str, FakeState]) -> None:
    url, state = fake
    state.plan = ["ok", "slow"]  # slow: TTFT 300 ms > SLO 200 ms
    run = await run_once(cfg(url, slo=SLOConfig(ttft_ms=200, tpot_ms=100)), rate=None)
    assert run.summary.completed == 6
    assert run.summary.goodput == pytest.approx(3 / run.summary.duration_s)
    tight = await run_once(cfg(url, slo=SLOConfig(ttft_ms=10, tpot_ms=100)), rate=None)
    assert tight.summary.goodput == 0.0  # no TTFT can beat the fake's 50 ms


async def test_errors_by_kind_in_a_run(fake: tuple[str, FakeState]) -> None:
    url, state = fake
    state.plan = ["ok", "500", "midstream", "hang"]
    run = await run_once(cfg(url, concurrency=4, num_requests=8, request_timeout_s=0.5), rate=None)
    s = run.summary
    assert (s.completed, s.failed) == (2, 6)
    assert s.errors_by_kind == {"http_status": 2, "stream_error": 2, "timeout": 2}
    assert s.duration_s >= 0.5  # the hung requests were waited for up to their timeout
    assert run.phases[0].timed_out == 2 and run.phases[0].failed == 6


async def test_open_loop_sweep_follows_arrivals(fake: tuple[str, FakeState]) -> None:
    url, _ = fake
    c = cfg(url, arrival="poisson", rates=(20.0, 40.0), num_requests=8, seed=3)
    stop = asyncio.Event()
    lag = asyncio.create_task(loop_lag(stop))
    try:
        result = await run_bench(c)
    finally:
        stop.set()
    worst_lag = await lag
    assert [r.label for r in result.runs] == ["rate=20/s", "rate=40/s"]
    # regression: torch (imported by conftest) made full GCs stall the loop ~400 ms mid-run; the runner
    # now freezes the objects alive at the start
    assert gc.get_freeze_count() > 0
    assert result.config["api_key"] is None and result.config["rates"] == [20.0, 40.0]
    for run in result.runs:
        assert run.summary.completed == 8 and run.rate is not None
        expected = list(itertools.islice(arrival_times("poisson", run.rate, 3), 8))
        for rec, at in zip(run.records, expected, strict=True):
            # sent on schedule: never early; late by at most 100 ms of noise plus two stalls of the event
            # loop as long as the longest one measured during the run (one delays the timer that ends
            # the wait for the send time, one the start of the request's task)
            assert at - 1e-3 <= rec.start_s <= at + 0.1 + 2 * worst_lag, (rec.index, worst_lag)


async def test_multi_turn_chat_grows_prefix(fake: tuple[str, FakeState]) -> None:
    url, state = fake
    wl = WorkloadConfig(kind="multi-turn", prompt_format="text", input_len=LengthDist("fixed", 4),
                        output_len=LengthDist("fixed", 3), num_turns=3)
    run = await run_once(cfg(url, workload=wl, endpoint="chat", num_requests=6), rate=None)
    assert sorted((r.session_id, r.turn) for r in run.records) == [(s, t) for s in (0, 1) for t in range(3)]
    by_len = sorted(state.bodies, key=lambda b: len(b["messages"]))
    assert [len(b["messages"]) for b in by_len] == [1, 1, 3, 3, 5, 5]
    last = by_len[-1]["messages"]
    assert [m["role"] for m in last] == ["user", "assistant", "user", "assistant", "user"]
    assert last[1]["content"] == " t0 t1 t2"  # the server's own reply is carried forward
    prompts = sorted(r.prompt_tokens or 0 for r in run.records)
    assert prompts == [4, 4, 11, 11, 18, 18]  # 4 new words + 3 reply words per turn


async def test_warmup_not_counted_and_api_key_sent(fake: tuple[str, FakeState]) -> None:
    url, state = fake
    run = await run_once(cfg(url, warmup=3, num_requests=4, api_key="sk-test"), rate=None)
    assert state.counter == 7 and run.summary.num_requests == 4
    assert set(state.auth) == {"Bearer sk-test"}


async def test_duration_bounds_the_run(fake: tuple[str, FakeState]) -> None:
    url, _ = fake
    c = cfg(url, arrival="constant", rates=(20.0,), num_requests=None, duration_s=0.5)
    run = await run_once(c, rate=20.0)
    # sends at 0, 50, ..., 450 ms; the last may miss the 0.5 s bound if the loop wakes > 50 ms late
    assert 9 <= run.summary.num_requests <= 10
    assert run.summary.duration_s <= 0.5 + 1.5


async def test_faults_split_phases(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    url, state = fake
    flag = tmp_path / "down"
    state.fault_file = flag
    faults = (FaultSpec(0.3, f"touch {flag}"), FaultSpec(0.1, "sleep 5", timeout_s=0.2),
              FaultSpec(60.0, "echo never"))
    c = cfg(url, arrival="constant", num_requests=12, faults=faults)
    run = await run_once(c, rate=20.0)
    ran, slow, never = run.faults
    assert ran.status == "ran" and ran.returncode == 0 and ran.started_s is not None
    assert 0.3 - 1e-3 <= ran.started_s <= 0.5
    assert slow.status == "timeout" and never.status == "skipped" and never.started_s is None
    assert slow.finished_s is not None and 0.3 - 1e-3 <= slow.finished_s <= 1.0  # killed at 0.2 s
    assert flag.exists() and ran.finished_s is not None
    before, mid, after = run.phases  # cut when the sleep (0.1 s) and the touch (0.3 s) started
    # a request fails only where the fake answered it 503 because the flag existed when it got there: one
    # sent just before the touch (at 0.3 s, as the touch) may reach a loaded fake after it, nothing else
    # fails before the fault
    index_of = {s.turns[0].prompt: s.session_id for s in itertools.islice(make_sessions(WL, c.seed), 12)}
    assert len(index_of) == 12  # (open loop: session i is request i)
    faulted = {index_of[tuple(body["prompt"])] for body in state.faulted}  # token-id prompts
    assert {r.index for r in run.records if not r.success} == faulted
    early = [r for r in run.records if r.start_s < ran.started_s]
    assert before.failed + mid.failed == len([r for r in early if r.index in faulted])
    # the touch takes effect once it has finished: every request sent after that fails with 503
    late = [r for r in run.records if r.start_s >= ran.finished_s]
    assert len(late) >= 3 and all(r.http_status == 503 for r in late)
    assert sum(p.completed + p.failed for p in run.phases) == 12
    assert after.failed >= len(late)
    assert run.summary.errors_by_kind == {"http_status": len(faulted)}


async def test_kv_leak_is_reported(fake: tuple[str, FakeState]) -> None:
    url, state = fake
    state.plan = ["ok", "leak"]
    run = await run_once(cfg(url, num_requests=4), rate=None)
    # each leaking request keeps ceil(20 / 16) + 1 = 3 blocks
    assert (run.kv.before, run.kv.after, run.kv.leaked) == (0, 6, 6)


async def test_kv_leak_reported_while_the_gauge_still_shows_earlier_work(fake: tuple[str, FakeState]) -> None:
    """The gauge lags a heartbeat: it still shows 9 blocks of finished earlier work for 0.4 s when the run
    starts. Taking that as the baseline hid the 6 leaked blocks (after 6 < before 9); the settled baseline
    is 0, so the leak is reported."""
    url, state = fake
    state.plan = ["ok", "leak"]
    state.stale_blocks, state.stale_until = 9, time.monotonic() + 0.4
    run = await run_once(cfg(url, num_requests=4, leak_settle_s=2.0), rate=None)
    assert (run.kv.before, run.kv.after, run.kv.leaked) == (0, 6, 6)


async def test_metrics_scrape_problems_do_not_stop_the_run(fake: tuple[str, FakeState]) -> None:
    url, _ = fake
    run = await run_once(cfg(url, num_requests=2, metrics_path="/nope"), rate=None)
    assert run.summary.completed == 2 and "HTTP 404" in run.kv.error and run.kv.leaked is None


async def test_gateway_share_against_the_decode_workers_step_interval(fake: tuple[str, FakeState]) -> None:
    """The fake decode worker reports 8 ms per token of the 10 ms (or more) the client waits: the run's
    worker interval is exactly 8 ms over every token after each request's first, the client's at least
    10 ms over the tokens after each request's second, and the share outside the engine 1 - 8 / client."""
    url, state = fake
    state.engine_itl_sum_s, state.engine_itl_count = 5.0, 100  # earlier work: left out by the readings
    run = await run_once(cfg(url, warmup=2, decode_metrics=(f"{url}/decode-worker",)), rate=None)
    share = run.gateway_share
    assert share is not None and share.error == ""
    assert share.worker_tokens == 6 * 9 and share.worker_itl_ms == pytest.approx(8.0)
    assert share.client_tokens == 6 * 8
    assert share.client_itl_ms is not None and 10.0 - 1e-3 <= share.client_itl_ms <= 40.0
    assert share.share == pytest.approx(1 - 8.0 / share.client_itl_ms)


async def test_gateway_share_unreadable_page_is_reported_run_goes_on(fake: tuple[str, FakeState]) -> None:
    url, _ = fake
    run = await run_once(cfg(url, num_requests=2, decode_metrics=(url,)), rate=None)  # the gateway's page
    share = run.gateway_share
    assert run.summary.completed == 2 and share is not None
    assert "no vllm:inter_token_latency_seconds histogram" in share.error and share.share is None
    assert (await run_once(cfg(url, num_requests=2), rate=None)).gateway_share is None  # not asked for
