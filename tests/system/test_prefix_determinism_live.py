"""A prefix-cache hit does not change the answer, through real processes: a disaggregated system (the
prefill worker's cache hit) and a colocated one, both with ``--prefill-grid 32``, serving the embedded
SmolLM2 on the CPU (fp32). The same greedy completion (146 token ids, 3 tokens, top-1 logprobs) is sent
twice to each; the second is served from the prefix cache (128 tokens: whole grid chunks) and must equal
the first bit for bit: token ids, text, logprobs and top logprobs. The same prompt through a
grid-less engine shifts the logprobs (``tests/engine/test_prefix_determinism.py``, ``no-grid``).

The workers also run the host KV tier (``--kv-host-cache-gib 0.05``: about 70 blocks of SmolLM2 in fp32)
beside a device pool of 16 blocks: another 146-token prompt, then a 250-token one that takes every
device block (every cached block of the first moves to the tier), then the first again: its 128-token
prefix comes back from the tier (the prefill or colocated worker's ``pdserve_worker_kv_host_hit_blocks``
grows by 8, bytes move both ways) and the answer equals the first bit for bit. The decode worker's
blocks, evicted when it reserves blocks for the next prompt, are saved too.
Its own system (the shared one runs no grid and no tier); ends with a KV leak check and no dead child.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdserve.live_system import MODEL, SystemPair, live_pair, metric_samples, wait_all_free
from tests.engine.test_prefix_determinism import prompt_ids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
GRID = 32


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemPair]:
    logs = tmp_path_factory.mktemp("prefix_determinism_live")
    flags = ("--prefill-grid", str(GRID), "--kv-host-cache-gib", "0.05")
    with live_pair(logs, num_blocks=16, worker_flags=flags, heartbeat_timeout_s=10.0) as started:
        yield started


def complete(url: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 1,
            "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def answer(reply: dict[str, Any]) -> tuple[Any, ...]:
    (choice,) = reply["choices"]
    lp = choice["logprobs"]
    return choice["text"], lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], choice["finish_reason"]


def cached(reply: dict[str, Any]) -> int:
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("mode", ["disagg", "colo"])
def test_second_greedy_request_equals_the_first_bit_for_bit(pair: SystemPair, mode: str) -> None:
    system = pair.disagg if mode == "disagg" else pair.colo
    prompt = prompt_ids()
    first = complete(system.url, prompt)
    wait_all_free(system.url, system.worker_ids)  # 16 blocks: the gateway admits once the first's are free
    second = complete(system.url, prompt)
    assert (cached(first), cached(second)) == (0, 128)
    assert answer(second) == answer(first)
    assert len(answer(first)[2]) == 3 and all(isinstance(v, float) for v in answer(first)[2])
    wait_all_free(system.url, system.worker_ids)
    assert system.sup.dead() == []


def tier(url: str) -> dict[str, float]:
    found = metric_samples(url)

    def one(name: str, **labels: str) -> float:
        return sum(v for (n, ls), v in found.items() if n == name and set(labels.items()) <= set(ls))

    return {"hits": one("pdserve_worker_kv_host_hit_blocks_total"),
            "to_host": one("pdserve_worker_kv_host_bytes_total", direction="to_host"),
            "to_device": one("pdserve_worker_kv_host_bytes_total", direction="to_device"),
            "capacity": one("pdserve_worker_kv_host_capacity_blocks")}


@pytest.mark.parametrize("mode", ["disagg", "colo"])
def test_a_prefix_evicted_to_the_host_tier_comes_back_with_the_same_answer(pair: SystemPair,
                                                                         mode: str) -> None:
    system = pair.disagg if mode == "disagg" else pair.colo
    computing = system.metrics_urls["prefill" if mode == "disagg" else "colocated"]
    before = tier(computing)
    assert before["capacity"] > 16
    prompt = [t + 1 for t in prompt_ids()]  # not cached by the tests above
    first = complete(system.url, prompt)
    wait_all_free(system.url, system.worker_ids)  # the filler needs every block: wait for the heartbeats
    filler = complete(system.url, [(t * 7 + 11) % 20000 + 100 for t in range(250)])
    assert cached(filler) == 0
    wait_all_free(system.url, system.worker_ids)
    second = complete(system.url, prompt)
    assert (cached(first), cached(second)) == (0, 128)
    assert answer(second) == answer(first)
    after = tier(computing)
    assert after["hits"] - before["hits"] == 128 // 16
    assert after["to_device"] - before["to_device"] > 0 and after["to_host"] - before["to_host"] > 0
    if mode == "disagg":
        assert tier(system.metrics_urls["decode"])["to_host"] > 0
    wait_all_free(system.url, system.worker_ids)
    assert system.sup.dead() == []


def test_disagg_and_colocated_agree(pair: SystemPair) -> None:
    """Both systems cut the prompt on the same grid: the same bits either way (after the hits above,
    or fresh if this test runs alone)."""
    prompt = prompt_ids()
    assert answer(complete(pair.disagg.url, prompt)) == answer(complete(pair.colo.url, prompt))
    for url, workers in pair.pairs():
        wait_all_free(url, workers)
    assert pair.dead() == []
