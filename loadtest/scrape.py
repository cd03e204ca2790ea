"""Read the server's KV-block gauge from its Prometheus ``/metrics`` page, to catch leaked blocks.

The gauge is ``pdserve_kv_blocks_used`` (one series per worker); the harness sums every series. The page
is parsed with prometheus-client's text-format parser. The gateway updates it from worker heartbeats
(every 0.5 s), so a reading can lag: the baseline before a run is therefore the settled minimum
(``scrape_before``), not one reading, or blocks still shown for finished earlier work would hide a leak.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.records import KVScrape

KV_GAUGE = "pdserve_kv_blocks_used"
T = TypeVar("T")


def kv_blocks_used(metrics_text: str, name: str = KV_GAUGE) -> float | None:
    """Sum of every sample of gauge ``name`` (blocks) in a Prometheus text page; None if absent.

    Raises ValueError if the page is not valid Prometheus text format.
    """
    total: float | None = None
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name:
                total = (total or 0.0) + sample.value
    return total


def metrics_page_url(url: str) -> str:
    """The Prometheus page of a worker's metrics server, given either as the server
    (``http://host:port``) or as the page itself (``http://host:port/metrics``, as ``pdserve up`` prints
    it): the URL with ``/metrics`` at its end exactly once. The one reading of a worker metrics URL the
    bench takes (``--decode-metrics``, ``--system ...,prefill=,decode=``)."""
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


async def read_page(client: httpx.AsyncClient, url: str, parse: Callable[[str], T], timeout_s: float) -> T:
    """GET ``url`` (or a path on the client's base URL), a Prometheus text page, and return ``parse`` of it.

    Raises RuntimeError naming the problem (connection, HTTP status, a page ``parse`` refuses with
    ValueError).
    """
    try:
        resp = await client.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"GET {url} failed: {type(exc).__name__}: {exc}") from exc
    if resp.status_code != 200:
        raise RuntimeError(f"GET {url} answered HTTP {resp.status_code}")
    try:
        return parse(resp.text)
    except ValueError as exc:
        raise RuntimeError(f"GET {url}: not Prometheus text format: {exc}") from exc


async def scrape_kv(client: httpx.AsyncClient, path: str, timeout_s: float = 5.0) -> float:
    """GET ``path`` on the client's base URL and return the summed gauge (blocks).

    Raises RuntimeError naming the problem (HTTP status, missing gauge, bad page, connection).
    """
    value = await read_page(client, path, kv_blocks_used, timeout_s)
    if value is None:
        raise RuntimeError(f"GET {path}: no {KV_GAUGE} gauge on the page")
    return value


async def scrape_before(client: httpx.AsyncClient, path: str, window_s: float, settle_s: float) -> float:
    """The baseline gauge before a run (blocks): poll every 0.1 s, keeping the lowest reading, until it has
    not dropped for ``window_s`` seconds or ``settle_s`` seconds have passed (one reading if either is 0).

    Raises RuntimeError as ``scrape_kv``.
    """
    started = time.monotonic()
    best = await scrape_kv(client, path)
    since = started
    while window_s > 0 and time.monotonic() - since < window_s and time.monotonic() - started < settle_s:
        await asyncio.sleep(0.1)
        value = await scrape_kv(client, path)
        if value < best:
            best, since = value, time.monotonic()
    return best


async def scrape_after(client: httpx.AsyncClient, path: str, before: float, settle_s: float) -> KVScrape:
    """Poll the gauge until it is back to ``before`` or ``settle_s`` seconds pass; report the leak.

    The server may free blocks a moment after the last stream ends, hence the settling time.
    """
    deadline = time.monotonic() + settle_s
    while True:
        try:
            after = await scrape_kv(client, path)
        except RuntimeError as exc:
            return KVScrape(before=before, error=str(exc))
        if after <= before or time.monotonic() >= deadline:
            return KVScrape(before=before, after=after, leaked=after - before)
        await asyncio.sleep(0.1)
