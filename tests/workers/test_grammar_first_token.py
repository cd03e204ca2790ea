"""A sampled token the request's grammar rejects fails that request alone, with an error naming the grammar,
and never reaches the gateway as a token: on the prefill worker (its first token, with and without a KV
transfer started), on a colocated worker and on a decode worker. The grammar mask is switched off in these
tests (``engine.sampler.apply_grammar_mask`` made a no-op) so that the greedy token of the tiny random
model is one the grammar does not allow. Every test ends with the leak check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import engine.sampler
from engine.models.dummy_tokenizer import write_dummy_tokenizer
from engine.sampling_params import SamplingParams, StructuredOutput
from protocol.messages import (
    ColocatedRequest,
    DecodeRequest,
    FirstToken,
    KVReserved,
    NextToken,
    PrefillRequest,
    RequestFailed,
    RequestFinished,
    ReserveKV,
)
from tests.engine.test_loader import tiny_config
from tests.workers.helpers import (
    VOCAB,
    FakeReceiver,
    assert_clean,
    close,
    colocated_worker,
    decode_worker,
    of_type,
    prefill_worker,
    pump,
    run,
    wire,
    write_model_dir,
)

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def tok_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with the synthetic tokenizer (``t<id>`` words) the grammar engine needs."""
    path = write_model_dir(tmp_path_factory.mktemp("grammar") / "tiny-llama")
    write_dummy_tokenizer(path, tiny_config("LlamaForCausalLM", vocab=VOCAB).to_dict())
    return path


def _greedy_first(worker: Any) -> int:
    """The tiny model's greedy first token after ``PROMPT`` (from a throwaway max_tokens=1 request)."""
    msgs: list[Any] = []
    req = (PrefillRequest(request_id="probe", prompt_token_ids=PROMPT, sampling=wire(1), kv_handle=None,
                          decode_worker_id=None) if hasattr(worker, "sender")
           else ColocatedRequest(request_id="probe", prompt_token_ids=PROMPT, sampling=wire(1)))
    worker.deliver(req)
    pump([worker], lambda: bool(of_type(msgs, RequestFinished) or of_type(msgs, FirstToken)), sink=msgs)
    [first] = of_type(msgs, FirstToken)
    if not hasattr(worker, "sender"):
        pump([worker], lambda: bool(of_type(msgs, RequestFinished)), sink=msgs)
    return int(first.token_id)


def _forbidding(token: int, max_tokens: int = 4) -> SamplingParams:
    """Greedy params whose grammar (a one-word choice) does not allow ``token`` first."""
    word = 40 if token != 40 else 41
    return wire(max_tokens, structured_output=StructuredOutput(kind="choice", spec=json.dumps([f"t{word}"])))


def _no_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.sampler, "apply_grammar_mask", lambda logits, mask: None)


def _assert_grammar_failure(msgs: list[Any], rid: str, token: int) -> None:
    [failed] = of_type(msgs, RequestFailed, rid)
    assert "choice grammar" in failed.error and f"token {token}" in failed.error, failed.error
    assert failed.kind == "structured_output"  # the gateway retries it nowhere
    assert of_type(msgs, FirstToken, rid) == [] and of_type(msgs, NextToken, rid) == []


@pytest.mark.parametrize("with_transfer", [False, True])
def test_prefill_first_token_rejected_by_the_grammar_fails_that_request(tok_model_dir, monkeypatch,
                                                                        with_transfer):
    prefill = prefill_worker(tok_model_dir)
    fake = FakeReceiver(prefill.core.runner.kv_cache.kv_buffer)
    try:
        token = _greedy_first(prefill)
        _no_mask(monkeypatch)
        handle = fake.handle("bad", [0, 1]) if with_transfer else None
        prefill.deliver(PrefillRequest(request_id="bad", prompt_token_ids=PROMPT,
                                       sampling=_forbidding(token, 4 if with_transfer else 1),
                                       kv_handle=handle, decode_worker_id="d" if with_transfer else None))
        prefill.deliver(PrefillRequest(request_id="good", prompt_token_ids=PROMPT, sampling=wire(1),
                                       kv_handle=None, decode_worker_id=None))
        msgs: list[Any] = []
        pump([prefill], lambda: (fake.serve(), bool(of_type(msgs, RequestFailed)) and not prefill.busy())[1],
             sink=msgs)
        _assert_grammar_failure(msgs, "bad", token)
        [good] = of_type(msgs, FirstToken, "good")
        assert good.token_id == token and good.finish_reason == "length"
        assert_clean(prefill)
    finally:
        fake.close()
        close(prefill)


def test_colocated_token_rejected_by_the_grammar_fails_that_request_alone(tok_model_dir, monkeypatch):
    colo = colocated_worker(tok_model_dir)
    try:
        token = _greedy_first(colo)
        _no_mask(monkeypatch)
        msgs: list[Any] = []
        colo.deliver(ColocatedRequest(request_id="bad", prompt_token_ids=PROMPT, sampling=_forbidding(token)))
        colo.deliver(ColocatedRequest(request_id="good", prompt_token_ids=PROMPT,
                                      sampling=wire(3, ignore_eos=True)))
        pump([colo], lambda: bool(of_type(msgs, RequestFinished, "good")), sink=msgs)
        _assert_grammar_failure(msgs, "bad", token)
        assert [type(m) for m in msgs if getattr(m, "request_id", None) == "good"] == [
            FirstToken, NextToken, NextToken, RequestFinished]
        assert_clean(colo)
    finally:
        close(colo)


def test_decode_first_token_rejected_by_the_grammar_fails_that_request(tok_model_dir):
    """A first token the grammar rejects handed to the decode worker (which replays it into its own
    matcher; here the gateway names another token than the prefill worker's) fails the request there,
    its blocks freed."""
    decode = decode_worker(tok_model_dir)
    prefill = prefill_worker(tok_model_dir)
    try:
        token = _greedy_first(prefill)
        sampling = _forbidding(token)
        [res] = of_type(run(decode, ReserveKV(request_id="r", prompt_token_ids=PROMPT, sampling=sampling,
                                              prefill_worker_id="p0",
                                              prefill_sender_epoch=prefill.sender.epoch)), KVReserved)
        prefill.deliver(PrefillRequest(request_id="r", prompt_token_ids=PROMPT, sampling=sampling,
                                       kv_handle=res.kv_handle, decode_worker_id="d0"))
        msgs: list[Any] = []
        pump([prefill, decode], lambda: bool(of_type(msgs, FirstToken)) and not prefill.sending, sink=msgs)
        [first] = of_type(msgs, FirstToken)
        assert first.token_id != token  # the prefill side masked its token
        msgs += run(decode, DecodeRequest(request_id="r", first_token_id=token))
        pump([decode], lambda: bool(of_type(msgs, RequestFailed)), sink=msgs)
        [failed] = of_type(msgs, RequestFailed, "r")
        assert "choice grammar" in failed.error and f"token {token}" in failed.error, failed.error
        assert failed.kind == "structured_output"
        assert of_type(msgs, NextToken) == []
        assert_clean(prefill, decode)
    finally:
        close(decode)
        close(prefill)
