"""Fixtures of the live conformance suite: one real pdserve system per session (tests/live_system.py),
with the same caps as the fake-worker bad-input suite (API key, ``--max-n 4``, ``--max-stop 3``,
``--max-prompt-tokens 100``, 1 MiB body cap) so its cases are reused as data; and the model's own
Hugging Face tokenizer (transformers), independent of the gateway's, for exact usage counts."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conformance.helpers import Endpoint, Outcome, assert_same, call, client
from tests.live_system import MODEL, System, start_system

API_KEY = "k-123"
BODY_CAP = 1 << 20
# 10 s heartbeat timeout (tests/system uses 2 s): on a loaded 2-core CI machine a busy worker can miss
# 2 s of heartbeats, which the gateway rightly treats as a dead worker (a 502 mid-request).
GATEWAY_FLAGS = ("--max-n", "4", "--max-stop", "3", "--max-prompt-tokens", "100",
                 "--max-body-bytes", str(BODY_CAP), "--heartbeat-timeout", "10")


@pytest.fixture(scope="session")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    """Both gateways (disaggregated, colocated) and their three workers, for the whole session."""
    with start_system(tmp_path_factory.mktemp("conformance_logs"), GATEWAY_FLAGS, API_KEY) as sys_:
        yield sys_


@pytest.fixture(scope="session")
def hf_tokenizer() -> Any:
    """The served model's tokenizer and chat template, loaded by transformers from the model dir."""
    from transformers import AutoTokenizer

    from engine.models.registry import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(MODEL)))


Quad = Callable[..., Outcome]


@pytest.fixture(scope="session")
def quad(live: System) -> Quad:
    """``quad(endpoint, tol=0.0, **fields) -> Outcome``: the request four ways — disaggregated and
    colocated, each non-streamed and streamed — asserting all four give the same outcome (text, finish
    reasons, usage, tokens exactly; logprobs exactly unless ``tol`` is given: a lone sequence runs the
    same engine code on both paths and NIXL copies KV bytes exactly, so single-choice requests allow no
    tolerance); returns the outcome (the disaggregated non-streamed one)."""

    def run(endpoint: Endpoint, tol: float = 0.0, **fields: Any) -> Outcome:
        ref: Outcome | None = None
        for name, url in (("disagg", live.disagg_url), ("colo", live.colo_url)):
            for stream in (False, True):
                out = call(client(url, live.api_key), endpoint, stream, **copy.deepcopy(fields))
                if ref is None:
                    ref = out
                else:
                    assert_same(ref, out, f"{endpoint} {name} stream={stream} vs disagg non-stream {fields}",
                                tol)
        assert ref is not None
        return ref

    return run
