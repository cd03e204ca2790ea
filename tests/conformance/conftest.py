"""Fixtures of the live conformance suite, on the session's shared live system (``live``, tests/live.py:
it carries the caps of the fake-worker bad-input suite, so that suite's cases are reused as data): the
model's own Hugging Face tokenizer (transformers), independent of the gateway's, for exact usage counts,
and ``quad``, one request four ways."""

from __future__ import annotations

import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from pdserve.live_system import MODEL, SystemPair
from tests.conformance.helpers import Endpoint, Outcome, assert_same, call, client


@pytest.fixture(scope="session")
def hf_tokenizer() -> Any:
    """The served model's tokenizer and chat template, loaded by transformers from the model dir."""
    from transformers import AutoTokenizer

    from engine.models.registry import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(MODEL)))


Quad = Callable[..., Outcome]


# Logprobs of a request whose prompt was in the prefix cache against the same request computed from
# scratch (nats): the cached path attends over the stored prefix in another summation order (the
# deterministic mode, --prefill-grid, is off on the live systems, as by default), ~6e-6 seen in fp32.
CACHE_HIT_TOL = 1e-4


@pytest.fixture(scope="session")
def quad(live_session: SystemPair) -> Quad:
    """``quad(endpoint, tol=0.0, **fields) -> Outcome``: the request four ways — disaggregated and
    colocated, each non-streamed then streamed — asserting all four give the same outcome (text, finish
    reasons, usage, tokens exactly). Logprobs: exactly (unless ``tol`` is given) between the two systems'
    first sends and between their second sends, which meet the same prefix-cache state on each system (a
    lone sequence runs the same engine code on both paths and NIXL copies KV bytes exactly); within
    ``CACHE_HIT_TOL`` between a system's first and second send, since the second may find the prompt
    cached by the first. The two systems (their own processes) are sent to at once, each in its own
    thread, non-streamed then streamed: each still serves one request at a time, in that order. Returns
    the outcome (the disaggregated non-streamed one)."""

    def both_ways(url: str, endpoint: Endpoint, fields: dict[str, Any]) -> list[Outcome]:
        return [call(client(url, live_session.api_key), endpoint, stream, **copy.deepcopy(fields))
                for stream in (False, True)]

    def run(endpoint: Endpoint, tol: float = 0.0, **fields: Any) -> Outcome:
        with ThreadPoolExecutor(max_workers=2) as pool:
            sent = {name: pool.submit(both_ways, url, endpoint, fields)
                    for name, url in (("disagg", live_session.disagg_url), ("colo", live_session.colo_url))}
            outs = {(name, stream): out for name, future in sent.items()
                    for stream, out in zip((False, True), future.result(), strict=True)}
        ref = outs["disagg", False]
        for stream in (False, True):
            assert_same(outs["disagg", stream], outs["colo", stream],
                        f"{endpoint} colo vs disagg, stream={stream} {fields}", tol)
        for name in ("disagg", "colo"):
            assert_same(outs[name, False], outs[name, True],
                        f"{endpoint} {name} stream=True vs stream=False {fields}", max(tol, CACHE_HIT_TOL))
        return ref

    return run
