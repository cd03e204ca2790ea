"""Decode-side prefix reuse on the shared live system (tests/live.py: one prefill and one decode worker
behind the disaggregated gateway, KV over NIXL; one colocated worker behind the other gateway).

A second turn whose prompt extends the first one's: the decode worker takes the first turn's full prompt
blocks from its own prefix cache, and only the blocks after them cross the wire (the decode worker's
``pdserve_worker_kv_received_*`` and ``pdserve_worker_kv_reused_blocks_total``: the bytes of turn 2 are
exactly its suffix blocks' bytes). Greedy answers equal the colocated worker's, a fresh prompt there and
the same prompt again, and an identical request sent again equals the first. Counters are compared as
differences: other suites share the system; the fixture's leak check runs after the module.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from pdserve.live_system import SystemPair, metric_samples
from tests.live import API_KEY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "smollm2-135m"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
BLOCK_SIZE = 16  # the workers' default --block-size
KV = ("pdserve_worker_kv_received_blocks_total", "pdserve_worker_kv_received_bytes_total",
      "pdserve_worker_kv_reused_blocks_total")


def prompt(n: int) -> list[int]:
    """``n`` token ids no other test sends (so nothing of it is in a prefix cache yet)."""
    seed = uuid.uuid4().int
    return [1000 + (seed >> (3 * i)) % 20000 + i for i in range(n)]


def complete(url: str, token_ids: list[int]) -> str:
    body = {"model": MODEL, "prompt": token_ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"{url}/v1/completions", json=body, headers=HEADERS, timeout=120, trust_env=False)
    resp.raise_for_status()
    text: str = resp.json()["choices"][0]["text"]
    return text


def kv_counts(url: str) -> tuple[float, ...]:
    samples = metric_samples(url)
    return tuple(sum(v for (n, _), v in samples.items() if n == name) for name in KV)


def test_second_turn_receives_only_its_suffix_and_answers_as_colocated(live: SystemPair) -> None:
    decode = live.disagg.metrics_urls["decode"]
    first = prompt(2 * BLOCK_SIZE + 5)  # 3 blocks: 2 full
    before = kv_counts(decode)
    complete(live.disagg_url, first)
    blocks, nbytes, reused = (a - b for a, b in zip(kv_counts(decode), before, strict=True))
    assert (blocks, reused) == (3, 0)
    per_block = nbytes / blocks
    second = first + prompt(20)  # 57 tokens, 4 blocks: the first 2 cached on the decode worker
    before = kv_counts(decode)
    answer = complete(live.disagg_url, second)
    blocks, nbytes, reused = (a - b for a, b in zip(kv_counts(decode), before, strict=True))
    assert (blocks, reused) == (2, 2)
    assert nbytes == 2 * per_block  # the KV bytes of turn 2 are its suffix blocks' own
    assert complete(live.colo_url, second) == answer  # a fresh prompt on the colocated worker
    assert complete(live.colo_url, second) == answer  # and again, from its prefix cache
    before = kv_counts(decode)
    assert complete(live.disagg_url, second) == answer  # an identical request again
    blocks, nbytes, reused = (a - b for a, b in zip(kv_counts(decode), before, strict=True))
    assert (blocks, reused) == (1, 3)  # only the block holding the last prompt token is sent
    assert nbytes == per_block
