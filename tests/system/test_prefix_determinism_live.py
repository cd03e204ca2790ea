"""A prefix-cache hit does not change the answer, through real processes: a disaggregated system (the
prefill worker's cache hit) and a colocated one, both with ``--prefill-grid 32``, serving the embedded
SmolLM2 on the CPU (fp32). The same greedy completion (146 token ids, 3 tokens, top-1 logprobs) is sent
twice to each; the second is served from the prefix cache (128 tokens: whole grid chunks) and must equal
the first bit for bit: token ids, text, logprobs and top logprobs. The same prompt through a
grid-less engine shifts the logprobs (``tests/engine/test_prefix_determinism.py``, ``no-grid``).
Its own system (the shared one runs no grid); ends with a KV leak check and no dead child.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdserve.live_system import MODEL, SystemPair, live_pair, wait_all_free
from tests.engine.test_prefix_determinism import prompt_ids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
GRID = 32


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemPair]:
    logs = tmp_path_factory.mktemp("prefix_determinism_live")
    with live_pair(logs, num_blocks=128, worker_flags=("--prefill-grid", str(GRID)),
                   heartbeat_timeout_s=10.0) as started:
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
    second = complete(system.url, prompt)
    assert (cached(first), cached(second)) == (0, 128)
    assert answer(second) == answer(first)
    assert len(answer(first)[2]) == 3 and all(isinstance(v, float) for v in answer(first)[2])
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
