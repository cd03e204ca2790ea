"""Colocated worker (workers/colocated.py): ColocatedRequest → FirstToken, one TokenBatch per later
token, RequestFinished; abort mid-decode; a bad request fails alone. Ends with the leak check."""

from __future__ import annotations

from typing import Any

import pytest

from engine.sampling_params import SamplingParams
from protocol.messages import (
    AbortRequest,
    ColocatedRequest,
    FirstToken,
    RequestFailed,
    RequestFinished,
    TokenBatch,
)
from tests.workers.helpers import assert_clean, close, colocated_worker, make_core, of_type, pump, run, wire

PROMPT = list(range(50, 63))  # 13 tokens


@pytest.fixture
def colo(model_dir):
    w = colocated_worker(model_dir, max_num_batched_tokens=8)  # the prompt runs in two chunks
    yield w
    close(w)


def _req(rid: str, prompt: list[int] = PROMPT, max_tokens: int = 5) -> ColocatedRequest:
    sampling = wire(max_tokens, ignore_eos=True)
    return ColocatedRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)


def test_first_token_token_batches_then_finished(model_dir, colo):
    msgs: list[Any] = run(colo, _req("r"))
    assert msgs == []  # first chunk: nothing sampled
    pump([colo], lambda: bool(of_type(msgs, RequestFinished)), sink=msgs)
    assert [type(m) for m in msgs] == [FirstToken] + [TokenBatch] * 4 + [RequestFinished]
    assert msgs[0].finish_reason is None and msgs[0].num_cached_tokens == 0
    tokens = [msgs[0].token_id] + [t for b in msgs[1:-1] for t in b.token_ids]
    fin = msgs[-1]
    assert (fin.finish_reason, fin.num_prompt_tokens, fin.num_output_tokens) == ("length", 13, 5)
    core = make_core(model_dir)  # the plain engine, same weights: same greedy tokens
    core.add_request("ref", PROMPT, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    ref: list[int] = []
    while core.has_unfinished():
        ref += [o.token_id for o in core.step()]
    assert tokens == ref
    assert_clean(colo)


def test_abort_mid_decode_frees_blocks(colo):
    msgs: list[Any] = run(colo, _req("r", max_tokens=100), _req("other", max_tokens=3))
    pump([colo], lambda: len(of_type(msgs, TokenBatch, "r")) >= 2, sink=msgs)
    assert colo.core.block_manager.num_free_blocks < colo.core.block_manager.num_blocks
    n = len(of_type(msgs, TokenBatch, "r"))
    msgs += run(colo, AbortRequest(request_id="r"))
    pump([colo], lambda: bool(of_type(msgs, RequestFinished, "other")), sink=msgs)
    assert len(of_type(msgs, TokenBatch, "r")) == n and of_type(msgs, RequestFinished, "r") == []
    assert_clean(colo)


def test_bad_request_fails_alone(colo):
    msgs = run(colo, _req("bad", prompt=[1, 999]), _req("good", max_tokens=2),
               ColocatedRequest(request_id="neg", prompt_token_ids=[3], sampling=wire(0)))
    failed = {m.request_id: m.error for m in of_type(msgs, RequestFailed)}
    assert set(failed) == {"bad", "neg"} and "vocab_size" in failed["bad"] and "max_tokens" in failed["neg"]
    pump([colo], lambda: bool(of_type(msgs, RequestFinished, "good")), sink=msgs)
    assert len(of_type(msgs, FirstToken, "good")) == 1
    assert_clean(colo)
