"""Metric math on hand-built records: exact values."""

from __future__ import annotations

import pytest

from loadtest.config import SLOConfig
from loadtest.metrics import latency_stats, meets_slo, summarize, tpot_s
from loadtest.records import RequestRecord


def rec(i: int, *, ttft: float | None = 0.1, e2e: float | None = 1.1, out: int = 11, ok: bool = True,
        itl: list[float] | None = None, prompt: int | None = 5, kind: str | None = None) -> RequestRecord:
    return RequestRecord(index=i, session_id=i, turn=0, start_s=0.0, success=ok, ttft_s=ttft, e2e_s=e2e,
                         output_tokens=out, prompt_tokens=prompt, itl_s=itl or [], error_kind=kind)


def test_tpot_excludes_first_token() -> None:
    # (1.1 - 0.1) / (11 - 1) = 0.1 s
    assert tpot_s(rec(0)) == pytest.approx(0.1, abs=1e-12)
    assert tpot_s(rec(0, out=1)) is None  # a single token has no TPOT
    assert tpot_s(rec(0, ok=False, kind="timeout")) is None


def test_latency_stats_exact() -> None:
    stats = latency_stats([0.001 * v for v in range(1, 101)])  # 1..100 ms
    assert stats is not None
    assert stats.count == 100
    assert stats.mean == pytest.approx(50.5)
    assert stats.median == pytest.approx(50.5)
    assert stats.p90 == pytest.approx(90.1)  # numpy linear: 1 + 0.9 * 99
    assert stats.p99 == pytest.approx(99.01)
    assert stats.max == pytest.approx(100.0)
    assert latency_stats([]) is None


def test_meets_slo_both_limits() -> None:
    slo = SLOConfig(ttft_ms=200, tpot_ms=50)
    assert meets_slo(rec(0, ttft=0.2, e2e=0.2 + 10 * 0.05), slo)  # exactly on both limits
    assert not meets_slo(rec(0, ttft=0.201, e2e=0.701), slo)  # TTFT over
    assert not meets_slo(rec(0, ttft=0.1, e2e=0.1 + 10 * 0.051), slo)  # TPOT over
    assert meets_slo(rec(0, ttft=0.1, e2e=5.0, out=1), slo)  # one token: TTFT alone
    assert not meets_slo(rec(0, ok=False, kind="http_status"), slo)


def test_summarize_throughput_goodput_errors() -> None:
    records = [
        rec(0, ttft=0.1, e2e=0.6, out=11, itl=[0.05] * 10),  # TPOT 50 ms: meets
        rec(1, ttft=0.3, e2e=0.8, out=11, itl=[0.05] * 10),  # TTFT 300 ms: misses
        rec(2, ttft=0.1, e2e=2.1, out=11, itl=[0.2] * 10),  # TPOT 200 ms: misses
        rec(3, ttft=None, e2e=None, out=0, ok=False, kind="http_status"),
        rec(4, ttft=0.1, e2e=None, out=3, ok=False, kind="stream_error"),
        rec(5, ttft=None, e2e=None, out=0, ok=False, kind="timeout"),
    ]
    s = summarize(records, duration_s=2.0, slo=SLOConfig(ttft_ms=200, tpot_ms=100))
    assert (s.num_requests, s.completed, s.failed) == (6, 3, 3)
    assert s.errors_by_kind == {"http_status": 1, "stream_error": 1, "timeout": 1}
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_token_throughput == pytest.approx(33 / 2)
    assert s.total_token_throughput == pytest.approx((33 + 15) / 2)
    assert s.goodput == pytest.approx(0.5)
    assert s.ttft_ms is not None and s.ttft_ms.mean == pytest.approx(500 / 3)
    assert s.tpot_ms is not None and s.tpot_ms.max == pytest.approx(200.0)
    assert s.itl_ms is not None and s.itl_ms.count == 30
    assert s.e2e_ms is not None and s.e2e_ms.median == pytest.approx(800.0)


def test_summarize_rejects_zero_duration() -> None:
    with pytest.raises(ValueError, match="duration_s"):
        summarize([], 0.0, SLOConfig())
