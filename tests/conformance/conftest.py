"""Fixtures of the live conformance suite, on the session's shared live system (``live``, tests/live.py:
it carries the caps of the fake-worker bad-input suite, so that suite's cases are reused as data): the
model's own Hugging Face tokenizer (transformers), independent of the gateway's, for exact usage counts,
and ``quad``, one request four ways."""

from __future__ import annotations

import copy
from collections.abc import Callable
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


@pytest.fixture(scope="session")
def quad(live_session: SystemPair) -> Quad:
    """``quad(endpoint, tol=0.0, **fields) -> Outcome``: the request four ways — disaggregated and
    colocated, each non-streamed and streamed — asserting all four give the same outcome (text, finish
    reasons, usage, tokens exactly; logprobs exactly unless ``tol`` is given: a lone sequence runs the
    same engine code on both paths and NIXL copies KV bytes exactly, so single-choice requests allow no
    tolerance); returns the outcome (the disaggregated non-streamed one)."""

    def run(endpoint: Endpoint, tol: float = 0.0, **fields: Any) -> Outcome:
        ref: Outcome | None = None
        for name, url in (("disagg", live_session.disagg_url), ("colo", live_session.colo_url)):
            for stream in (False, True):
                out = call(client(url, live_session.api_key), endpoint, stream, **copy.deepcopy(fields))
                if ref is None:
                    ref = out
                else:
                    assert_same(ref, out, f"{endpoint} {name} stream={stream} vs disagg non-stream {fields}",
                                tol)
        assert ref is not None
        return ref

    return run
