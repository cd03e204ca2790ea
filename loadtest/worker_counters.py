"""Counters read from the workers' own Prometheus pages (each worker's ``--metrics-port``), summed per side.

The multi-turn benchmark reads them between its turns, so that the difference of two readings belongs to
one turn index. Names (vLLM's, beside pdserve's own; ``workers/metrics.py``):

* ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``: prompt tokens looked up in /
  found in the prefix cache (the device tier, the KV cache itself) of the worker that computed the prompt;
* ``pdserve_worker_kv_sent_bytes_total`` (prefill side) and ``pdserve_worker_kv_received_bytes_total``
  (decode side): KV bytes moved between them;
* ``pdserve_worker_kv_reused_blocks_total`` / ``pdserve_worker_kv_received_blocks_total`` (decode side):
  prompt KV blocks a decode worker found in its own prefix cache / received from the prefill side. The
  decode side's hit rate is ``reused / (reused + received)`` (``SideCounters.block_hit_rate``): a decode
  worker does not count prefix-cache queries in tokens.
* ``vllm:request_queue_time_seconds`` and ``vllm:request_prefill_time_seconds`` (``_sum`` / ``_count``):
  seconds a worker's requests waited before their first step / spent from it to their first token,
  observed when the request's part on the worker ends (``workers/metrics.py``); on the prefill side they
  split the server's share of a turn's TTFT into waiting and computing.

A counter a page does not have counts as 0 (a vLLM pod has no pdserve counters; a decode worker that
looks nothing up has no prefix-cache queries), so a side's hit rate is None when it made no query. A
tier beside the GPU one (a host-memory KV tier) is one more entry of ``TIER_COUNTERS``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from loadtest.scrape import metrics_page_url, read_page

# tier → (hits counter, queries counter), in tokens, as exposed (with ``_total``)
TIER_COUNTERS: dict[str, tuple[str, str]] = {
    "gpu": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
}
KV_SENT = "pdserve_worker_kv_sent_bytes_total"
KV_RECEIVED = "pdserve_worker_kv_received_bytes_total"
KV_REUSED_BLOCKS = "pdserve_worker_kv_reused_blocks_total"
KV_RECEIVED_BLOCKS = "pdserve_worker_kv_received_blocks_total"
QUEUE_S = "vllm:request_queue_time_seconds_sum"
PREFILL_S = "vllm:request_prefill_time_seconds_sum"
TIMED = "vllm:request_prefill_time_seconds_count"
READ = (KV_SENT, KV_RECEIVED, KV_REUSED_BLOCKS, KV_RECEIVED_BLOCKS, QUEUE_S, PREFILL_S, TIMED,
        *(name for pair in TIER_COUNTERS.values() for name in pair))


class SideCounters(msgspec.Struct, kw_only=True):
    """One side's (prefill or decode) counters summed over its workers: prefix-cache hits and queries per
    tier (tokens), KV bytes sent and received, prompt KV blocks reused from the own prefix cache and
    received (decode side), and over the requests whose part on the side ended (``timed``) the seconds
    they waited in the queue (``queue_s``) and spent from their first step to their first token
    (``prefill_s``)."""

    hits: dict[str, float] = msgspec.field(default_factory=dict)
    queries: dict[str, float] = msgspec.field(default_factory=dict)
    kv_sent_bytes: float = 0.0
    kv_received_bytes: float = 0.0
    kv_reused_blocks: float = 0.0
    kv_received_blocks: float = 0.0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    timed: float = 0.0

    def minus(self, other: SideCounters) -> SideCounters:
        """``self - other`` field by field (the change between two readings)."""
        return SideCounters(
            hits={t: v - other.hits.get(t, 0.0) for t, v in self.hits.items()},
            queries={t: v - other.queries.get(t, 0.0) for t, v in self.queries.items()},
            kv_sent_bytes=self.kv_sent_bytes - other.kv_sent_bytes,
            kv_received_bytes=self.kv_received_bytes - other.kv_received_bytes,
            kv_reused_blocks=self.kv_reused_blocks - other.kv_reused_blocks,
            kv_received_blocks=self.kv_received_blocks - other.kv_received_blocks,
            queue_s=self.queue_s - other.queue_s, prefill_s=self.prefill_s - other.prefill_s,
            timed=self.timed - other.timed)

    def mean_ms(self) -> tuple[float, float] | None:
        """(queue, first step to first token) per timed request, milliseconds; None when none ended."""
        if self.timed <= 0:
            return None
        return 1000 * self.queue_s / self.timed, 1000 * self.prefill_s / self.timed

    def hit_rate(self, tier: str = "gpu") -> float | None:
        """hits / queries of ``tier`` (0..1), None when nothing was looked up."""
        queries = self.queries.get(tier, 0.0)
        return None if queries <= 0 else self.hits.get(tier, 0.0) / queries

    def block_hit_rate(self) -> float | None:
        """Prompt KV blocks reused / (reused + received) (0..1): a decode side's prefix hit rate; None
        when no prompt block arrived or was reused."""
        total = self.kv_reused_blocks + self.kv_received_blocks
        return None if total <= 0 else self.kv_reused_blocks / total


class Counters(msgspec.Struct, kw_only=True):
    """Both sides at one reading."""

    prefill: SideCounters
    decode: SideCounters

    def minus(self, other: Counters) -> Counters:
        return Counters(prefill=self.prefill.minus(other.prefill), decode=self.decode.minus(other.decode))


def page_totals(text: str) -> dict[str, float]:
    """Sum of every sample of each name in ``READ`` on one Prometheus text page (absent: 0).

    Raises ValueError if the page is not Prometheus text format.
    """
    out = dict.fromkeys(READ, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


async def _side(client: httpx.AsyncClient, urls: Sequence[str], timeout_s: float) -> SideCounters:
    totals = dict.fromkeys(READ, 0.0)
    for url in urls:
        page = await read_page(client, metrics_page_url(url), page_totals, timeout_s)
        for name, value in page.items():
            totals[name] += value
    return SideCounters(hits={t: totals[h] for t, (h, _) in TIER_COUNTERS.items()},
                        queries={t: totals[q] for t, (_, q) in TIER_COUNTERS.items()},
                        kv_sent_bytes=totals[KV_SENT], kv_received_bytes=totals[KV_RECEIVED],
                        kv_reused_blocks=totals[KV_REUSED_BLOCKS],
                        kv_received_blocks=totals[KV_RECEIVED_BLOCKS], queue_s=totals[QUEUE_S],
                        prefill_s=totals[PREFILL_S], timed=totals[TIMED])


async def read_counters(client: httpx.AsyncClient, prefill: Sequence[str], decode: Sequence[str],
                        timeout_s: float = 5.0) -> Counters:
    """One reading of every worker page (absolute URLs of the workers' metrics servers or of their
    ``/metrics`` pages: ``loadtest.scrape.metrics_page_url``).

    Raises RuntimeError naming the page that could not be read.
    """
    return Counters(prefill=await _side(client, prefill, timeout_s),
                    decode=await _side(client, decode, timeout_s))


async def settled_counters(client: httpx.AsyncClient, prefill: Sequence[str], decode: Sequence[str],
                           settle_s: float, interval_s: float = 0.2) -> Counters:
    """Read until two readings ``interval_s`` apart agree (a prefill worker counts a transfer when it sees
    it complete, which can be a moment after the client's stream ended), at most ``settle_s`` seconds;
    returns the last reading. Raises RuntimeError as ``read_counters``."""
    deadline = time.monotonic() + settle_s
    last = await read_counters(client, prefill, decode)
    while time.monotonic() < deadline:
        await asyncio.sleep(interval_s)
        now = await read_counters(client, prefill, decode)
        if now == last:
            return now
        last = now
    return last
