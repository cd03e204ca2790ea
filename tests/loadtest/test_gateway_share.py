"""The gateway's share of the time per output token (loadtest/gateway_share.py): the client's interval
after each request's second token, the workers' step-interval histogram read from their pages, the share
and its line in the report. Whole runs against the fake server are in test_runner.py."""

from __future__ import annotations

import pytest

from loadtest.config import SLOConfig
from loadtest.gateway_share import IntervalReading, client_interval, gateway_share, page_interval
from loadtest.metrics import summarize
from loadtest.records import BenchResult, KVScrape, RequestRecord, RunResult
from loadtest.report import markdown_summary


def rec(itl_s: list[float], tokens: int, success: bool = True) -> RequestRecord:
    return RequestRecord(index=0, session_id=0, turn=0, start_s=0.0, success=success, ttft_s=0.1,
                         e2e_s=0.1 + sum(itl_s), itl_s=itl_s, output_tokens=tokens)


def test_client_interval_leaves_out_the_hand_off_and_counts_coalesced_tokens() -> None:
    records = [
        rec([0.5, 0.01, 0.01, 0.02], 5),  # 0.5 s hand-off left out: 0.04 s over 3 tokens
        rec([0.2, 0.06], 5),  # the last chunk carried 3 tokens: 0.06 s over 3 tokens
        rec([0.2], 2),  # two tokens: no interval after the second
        rec([0.1, 9.0, 9.0], 4, success=False),  # failed: not counted
    ]
    mean, tokens = client_interval(records)
    assert tokens == 6 and mean == pytest.approx(0.10 / 6)
    assert client_interval([rec([0.2], 2)]) == (None, 0)


def test_page_interval_sums_series_and_refuses_a_page_without_the_histogram() -> None:
    name = "vllm:inter_token_latency_seconds"
    page = (f"# TYPE {name} histogram\n"
            f'{name}_bucket{{le="+Inf",model_name="a"}} 10\n{name}_count{{model_name="a"}} 10\n'
            f'{name}_sum{{model_name="a"}} 0.25\n'
            f'{name}_bucket{{le="+Inf",model_name="b"}} 30\n{name}_count{{model_name="b"}} 30\n'
            f'{name}_sum{{model_name="b"}} 0.5\n')
    assert page_interval(page) == IntervalReading(0.75, 40.0)
    with pytest.raises(ValueError, match="no vllm:inter_token_latency_seconds histogram"):
        page_interval("# TYPE pdserve_kv_blocks_used gauge\npdserve_kv_blocks_used 3\n")


def test_share_is_one_minus_worker_over_client_and_shows_in_the_report() -> None:
    records = [rec([0.3] + [0.025] * 8, 10)]  # client: 25 ms per token over 8 tokens
    share = gateway_share(IntervalReading(1.0, 100), IntervalReading(1.18, 109), records)  # 20 ms x 9
    assert share.worker_tokens == 9 and share.worker_itl_ms == pytest.approx(20.0)
    assert share.client_tokens == 8 and share.client_itl_ms == pytest.approx(25.0)
    assert share.share == pytest.approx(0.2)
    idle = gateway_share(IntervalReading(1.0, 100), IntervalReading(1.0, 100), records)
    assert idle.worker_itl_ms is None and idle.share is None  # the workers counted no token
    run = RunResult(label="concurrency=1", rate=None, concurrency=1, records=records,
                    summary=summarize(records, 1.0, SLOConfig()), gateway_share=share,
                    kv=KVScrape(error="metrics scrape off"))
    text = markdown_summary(BenchResult(config={}, runs=[run]))
    assert ("Time per output token outside the engine loop (concurrency=1): client 25.00 ms over 8 tokens, "
            "decode-side workers' step interval 20.00 ms over 9 tokens: share 20.0 %") in text
