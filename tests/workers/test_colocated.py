"""Colocated worker (workers/colocated.py): ColocatedRequest → FirstToken, one NextToken per later
token, RequestFinished; abort mid-decode; a bad request fails alone; a step's messages for all its
requests leave in one OutputBatch frame. Ends with the leak check."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from engine.sampling_params import SamplingParams
from protocol.messages import (
    AbortRequest,
    ColocatedRequest,
    FirstToken,
    KVCanaryResult,
    NextToken,
    OutputBatch,
    RequestFailed,
    RequestFinished,
    encode,
)
from tests.workers.helpers import assert_clean, close, colocated_worker, make_core, of_type, pump, run, wire
from workers.outputs import batch_outputs

PROMPT = list(range(50, 63))  # 13 tokens


@pytest.fixture
def colo(model_dir):
    w = colocated_worker(model_dir, max_num_batched_tokens=8)  # the prompt runs in two chunks
    yield w
    close(w)


def _req(rid: str, prompt: list[int] = PROMPT, max_tokens: int = 5) -> ColocatedRequest:
    sampling = wire(max_tokens, ignore_eos=True)
    return ColocatedRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)


def test_first_token_next_tokens_then_finished(model_dir, colo):
    msgs: list[Any] = run(colo, _req("r"))
    assert msgs == []  # first chunk: nothing sampled
    pump([colo], lambda: bool(of_type(msgs, RequestFinished)), sink=msgs)
    assert [type(m) for m in msgs] == [FirstToken] + [NextToken] * 4 + [RequestFinished]
    assert msgs[0].finish_reason is None and msgs[0].num_cached_tokens == 0
    tokens = [m.token_id for m in msgs[:-1]]
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
    pump([colo], lambda: len(of_type(msgs, NextToken, "r")) >= 2, sink=msgs)
    assert colo.core.block_manager.num_free_blocks < colo.core.block_manager.num_blocks
    n = len(of_type(msgs, NextToken, "r"))
    msgs += run(colo, AbortRequest(request_id="r"))
    pump([colo], lambda: bool(of_type(msgs, RequestFinished, "other")), sink=msgs)
    assert len(of_type(msgs, NextToken, "r")) == n and of_type(msgs, RequestFinished, "r") == []
    assert_clean(colo)


def _frame(**fields: Any) -> bytes:
    """A ColocatedRequest frame as a gateway would send it, with any (also invalid) field values."""
    return msgspec.msgpack.encode({"type": "ColocatedRequest", "request_id": "neg", "prompt_token_ids": [3],
                                   "sampling": {"max_tokens": 2}, **fields})


def test_bad_request_fails_alone(colo):
    # sampling params are validated when a frame is decoded: max_tokens=0 never becomes a message
    assert colo.decode_frame(_frame(sampling={"max_tokens": 0})) is None
    msgs = run(colo, _req("bad", prompt=[1, 999]), _req("good", max_tokens=2))
    failed = {m.request_id: m.error for m in of_type(msgs, RequestFailed)}
    assert set(failed) == {"bad", "neg"} and "vocab_size" in failed["bad"] and "max_tokens" in failed["neg"]
    pump([colo], lambda: bool(of_type(msgs, RequestFinished, "good")), sink=msgs)
    assert len(of_type(msgs, FirstToken, "good")) == 1
    assert_clean(colo)


def test_frames_decode_or_are_dropped(colo):
    assert colo.decode_frame(encode(_req("x"))) == _req("x")
    assert colo.decode_frame(b"\xc1 not msgpack") is None
    assert colo.decode_frame(_frame(request_id=7)) is None  # no request to fail: dropped
    assert run(colo) == []


def test_each_step_sends_one_output_batch_for_all_its_requests(colo):
    """Three requests decode together: every phase's messages are one OutputBatch frame (a canary answer
    beside it stays its own frame), in the order the worker made them; the finish rides in the batch."""
    phases: list[list[Any]] = []
    for rid in ("a", "b", "c"):
        colo.deliver(_req(rid, max_tokens=4 if rid == "b" else 3))
    while len(of_type([m for ph in phases for m in ph], RequestFinished)) < 3:
        assert len(phases) < 50, "requests did not finish"
        colo.run_once()
        phases.append(colo.take_outbox())
    assert any({m.request_id for m in of_type(ph, NextToken)} == {"a", "b", "c"} for ph in phases)
    canary = KVCanaryResult(canary_id="k", worker_id="c0", ok=True, num_bytes=1, seconds=0.1, transport="x")
    for ph in phases:
        frames = batch_outputs("c0", [canary, *ph])
        if not ph:
            assert frames == [canary]
            continue
        assert frames[0] == canary and len(frames) == 2 and isinstance(frames[1], OutputBatch)
        assert frames[1].worker_id == "c0" and frames[1].messages == ph  # all of them, in order
    last = next(ph for ph in reversed(phases) if of_type(ph, RequestFinished, "b"))
    assert [type(m) for m in last] == [NextToken, RequestFinished]  # b's 4th token and its finish, together
    assert_clean(colo)
