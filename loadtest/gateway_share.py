"""The gateway's share of the time per output token: the interval between tokens as the client sees it
against the decode step interval the decode-side workers report over the same run.

A decode-side worker (decode or colocated) observes ``vllm:inter_token_latency_seconds`` once per engine
step, weighted by the tokens of the step that were not their request's first (``workers/metrics.py``):
its ``_sum`` / ``_count`` over a run is the mean interval a token spent in the engine, step after step.
The client's interval is the same quantity measured at the other end of the gateway:
``Σ (last token chunk - second token chunk) / Σ (output tokens - 2)`` over the completed requests with
at least three tokens. The gap between the first and the second token is left out on the client side:
in a disaggregated system it is the prefill → decode hand-off (KV transfer and the decode worker's
join), which the worker's histogram does not hold either. Chunks that carry several tokens (the gateway
may coalesce) count by the tokens they carry, as the server's ``usage.completion_tokens`` says.

``share = 1 - worker / client``: the fraction of a token's interval spent outside the engine loop — the
worker's output path, the control plane, the gateway, the HTTP stream and the load generator's own
client (so it is an upper bound of the gateway's part). The readings are taken after the warm-up
requests and after the last measured request ended.
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from loadtest.records import GatewayShare, RequestRecord
from loadtest.scrape import metrics_page_url, read_page

ITL = "vllm:inter_token_latency_seconds"


class IntervalReading(msgspec.Struct, frozen=True):
    """``vllm:inter_token_latency_seconds`` summed over the decode-side workers' pages at one reading:
    ``sum_s`` seconds over ``count`` tokens."""

    sum_s: float
    count: float

    def minus(self, other: IntervalReading) -> IntervalReading:
        return IntervalReading(self.sum_s - other.sum_s, self.count - other.count)


def page_interval(text: str) -> IntervalReading:
    """The ``_sum`` and ``_count`` of ``vllm:inter_token_latency_seconds`` on one Prometheus text page,
    summed over its series.

    Raises ValueError if the page is not Prometheus text format or has no such histogram (not a
    decode-side worker's page: the gateway's ``/metrics`` has none).
    """
    total, count, seen = 0.0, 0.0, False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == ITL + "_sum":
                total += sample.value
                seen = True
            elif sample.name == ITL + "_count":
                count += sample.value
    if not seen:
        raise ValueError(f"no {ITL} histogram on the page (a decode or colocated worker's /metrics has one)")
    return IntervalReading(total, count)


async def read_interval(client: httpx.AsyncClient, urls: Sequence[str], timeout_s: float = 5.0
                        ) -> IntervalReading:
    """One reading of every page in ``urls`` (each worker's metrics server, ``http://host:port`` or its
    ``/metrics`` page: ``loadtest.scrape.metrics_page_url``), summed. Raises RuntimeError naming the page
    that could not be read."""
    total = IntervalReading(0.0, 0.0)
    for url in urls:
        page = await read_page(client, metrics_page_url(url), page_interval, timeout_s)
        total = IntervalReading(total.sum_s + page.sum_s, total.count + page.count)
    return total


def client_interval(records: Sequence[RequestRecord]) -> tuple[float | None, int]:
    """``(mean seconds per token, tokens counted)`` after each completed request's second token chunk
    (module docstring); None when no request had three tokens in more than two chunks."""
    seconds, tokens = 0.0, 0
    for rec in records:
        if rec.success and rec.output_tokens >= 3 and len(rec.itl_s) >= 2:
            seconds += sum(rec.itl_s[1:])
            tokens += rec.output_tokens - 2
    return (seconds / tokens if tokens else None), tokens


def gateway_share(before: IntervalReading, after: IntervalReading, records: Sequence[RequestRecord]
                  ) -> GatewayShare:
    """The run's ``GatewayShare`` from the workers' readings around it and the client's records."""
    run = after.minus(before)
    worker = run.sum_s / run.count if run.count > 0 else None
    client, tokens = client_interval(records)
    share = None if worker is None or client is None or client <= 0 else 1.0 - worker / client
    return GatewayShare(worker_itl_ms=None if worker is None else worker * 1e3, worker_tokens=int(run.count),
                        client_itl_ms=None if client is None else client * 1e3, client_tokens=tokens,
                        share=share)
