"""bench/timing.py and bench/ceilings.py: the spread arithmetic, warm-up calls left out of every timing,
both sides of a comparison warmed and repeated alike, and a ceiling that is the best of at least 20 calls
(a ceiling from one call, or a mean, understated an H200's GEMM by 9–13 %)."""

from __future__ import annotations

import pytest
import torch

from bench.ceilings import copy_bandwidth, gemm_tflops
from bench.timing import MIN_CEILING_REPEATS, Spread, ceiling_seconds, interleaved, paired_ratio, time_calls

CPU = torch.device("cpu")


class ScriptedClock:
    """A clock that a fake call advances by the next scripted duration."""

    def __init__(self, durations: list[float]) -> None:
        self.now, self.durations, self.calls = 0.0, list(durations), 0

    def __call__(self) -> float:
        return self.now

    def work(self) -> None:
        self.now += self.durations[self.calls]
        self.calls += 1


def test_spread_of_values_and_its_conversions() -> None:
    s = Spread.of([3.0, 1.0, 2.0, 10.0])
    assert (s.min, s.median, s.max, s.n) == (1.0, 2.5, 10.0, 4)
    assert s.scaled(1e3) == Spread(1e3, 2.5e3, 1e4, 4)
    rates = s.per(100.0)  # seconds -> a rate: the fastest call is the highest rate
    assert (rates.min, rates.median, rates.max) == (10.0, 40.0, 100.0)
    assert s.fmt(".1f", " s") == "2.5 s (1.0–10.0, n=4)"
    assert s.as_dict() == {"min": 1.0, "median": 2.5, "max": 10.0, "n": 4}
    with pytest.raises(ValueError, match="at least one value"):
        Spread.of([])


def test_paired_ratio_is_per_repeat() -> None:
    r = paired_ratio([10.0, 20.0, 30.0], [5.0, 5.0, 10.0])
    assert (r.min, r.median, r.max, r.n) == (2.0, 3.0, 4.0, 3)
    with pytest.raises(ValueError, match="numerators"):
        paired_ratio([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="zero"):
        paired_ratio([1.0], [0.0])


def test_time_calls_leaves_the_warm_up_calls_out() -> None:
    clock = ScriptedClock([9.0, 8.0, 1.0, 2.0, 3.0])  # two slow cold calls, then three warm ones
    assert time_calls(clock.work, CPU, warmup=2, repeats=3, clock=clock) == [1.0, 2.0, 3.0]
    assert clock.calls == 5
    with pytest.raises(ValueError, match="repeats"):
        time_calls(clock.work, CPU, warmup=0, repeats=0, clock=clock)


def test_interleaved_warms_and_repeats_both_sides_alike() -> None:
    calls: list[str] = []

    def side(name: str, cold: float, warm: float):  # type: ignore[no-untyped-def]
        def call() -> float:
            calls.append(name)
            return cold if calls.count(name) == 1 else warm
        return call

    ours, peer = interleaved(side("engine", 1.0, 100.0), side("peer", 17.0, 41.0), warmup=1, repeats=3)
    assert calls == ["engine", "peer"] * 4
    assert ours == [100.0] * 3 and peer == [41.0] * 3  # the peer's slow first call is not a repeat
    with pytest.raises(ValueError, match="warmup"):
        interleaved(side("a", 0, 0), side("b", 0, 0), warmup=-1, repeats=1)


def test_a_ceiling_is_the_best_of_at_least_twenty_calls() -> None:
    durations = [5.0] * 3 + [2.0] * 19 + [1.0]  # 3 warm-up calls; the fastest is the 20th timed call
    clock = ScriptedClock(durations)
    got = ceiling_seconds(clock.work, CPU, clock=clock)
    assert got.n == MIN_CEILING_REPEATS and got.min == 1.0 and got.median == 2.0
    assert clock.calls == 3 + MIN_CEILING_REPEATS
    with pytest.raises(ValueError, match="at least 20"):
        ceiling_seconds(clock.work, CPU, repeats=MIN_CEILING_REPEATS - 1, clock=clock)


def test_gemm_and_copy_ceilings_report_their_spread() -> None:
    gemm = gemm_tflops(64, torch.float32, CPU)
    assert gemm.n == MIN_CEILING_REPEATS and 0 < gemm.min <= gemm.median <= gemm.max
    copies = copy_bandwidth(CPU, nbytes=1 << 16)
    assert copies.n == MIN_CEILING_REPEATS and 0 < copies.min <= copies.max
    with pytest.raises(ValueError, match="at least 20"):
        gemm_tflops(64, torch.float32, CPU, repeats=5)
