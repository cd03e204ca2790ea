"""The gateways' prefix index fed by real workers' KV events, on the shared live system (tests/live.py).

A prompt no other test sends goes through the disaggregated gateway twice. The first request makes the
prefill worker store the prompt's full blocks and publish them; the gateway's index then counts them
(``pdserve_prefix_index_blocks``), the decode worker's too once the KV landed, and the second request is
routed with every full block of the prompt reported cached (``pdserve_prefix_cached_blocks_total``: only
blocks a worker reported count there, not the gateway's own pending guesses), which the prefill worker
confirms by its prefix hit (``cached_tokens``). The colocated gateway's index learns its worker's blocks
the same way. Counters are compared as differences: other suites share the system.
"""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from pdserve.live_system import SystemPair, metric_samples, worker_id
from tests.live import API_KEY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "smollm2-135m"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
BLOCK_SIZE = 16  # the workers' default --block-size


def prompt(n: int) -> list[int]:
    """``n`` token ids no other test sends (so nothing of it is in a prefix cache yet)."""
    seed = uuid.uuid4().int
    return [1000 + (seed >> (3 * i)) % 20000 + i for i in range(n)]


def complete(url: str, token_ids: list[int]) -> dict:
    body = {"model": MODEL, "prompt": token_ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"{url}/v1/completions", json=body, headers=HEADERS, timeout=120, trust_env=False)
    resp.raise_for_status()
    out: dict = resp.json()
    return out


def value(url: str, name: str, **labels: str) -> float:
    """Sum of the gateway's samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in metric_samples(url).items() if n == name and want <= set(ls))


def wait_index(url: str, worker: str, at_least: int, timeout: float = 20.0) -> float:
    """Poll the gateway's ``pdserve_prefix_index_blocks`` of ``worker`` until it reaches ``at_least``;
    returns it. Raises AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        got = value(url, "pdserve_prefix_index_blocks", worker_id=worker)
        if got >= at_least:
            return got
        assert time.monotonic() < deadline, f"{worker}: the index holds {got} blocks, not {at_least}"
        time.sleep(0.1)


def test_gateway_index_holds_the_blocks_workers_report(live: SystemPair) -> None:
    url, full = live.disagg_url, 3
    tokens = prompt(full * BLOCK_SIZE + 5)
    prompt_blocks = value(url, "pdserve_prefix_prompt_blocks_total")
    cached_blocks = value(url, "pdserve_prefix_cached_blocks_total")
    assert value(url, "pdserve_kv_events_total", kind="snapshot") >= 2  # one per worker at registration
    first = complete(url, tokens)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_index(url, worker_id("prefill"), full)
    wait_index(url, worker_id("decode"), full)
    second = complete(url, tokens)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == full * BLOCK_SIZE
    assert value(url, "pdserve_prefix_prompt_blocks_total") - prompt_blocks == 2 * full
    assert value(url, "pdserve_prefix_cached_blocks_total") - cached_blocks == full  # the second request's

    complete(live.colo_url, prompt(full * BLOCK_SIZE + 5))
    wait_index(live.colo_url, worker_id("colocated"), full)
