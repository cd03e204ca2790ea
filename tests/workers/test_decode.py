"""Decode worker state machine (decode_worker/worker.py), driven phase by phase with captured messages:
ReserveKV → KVReserved (contiguous blocks when possible) → KV landed + DecodeRequest in either order →
running → RequestFinished; failures, aborts while KV is in flight (the release fence), waiting for
blocks with a deadline. Every test ends with the leak check (blocks free, nothing pending)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvtransfer import KVHandle, TransferStatus
from kvtransfer import wire as km
from protocol.messages import (
    AbortRequest,
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
from tests.kvtransfer.helpers import FakeSender
from tests.workers.helpers import (
    assert_clean,
    close,
    colocated_worker,
    decode_worker,
    of_type,
    prefill_worker,
    pump,
    run,
    wire,
)
from workers.setup import decode_handle

NO_SENDER = 1  # the KV sender epoch named in ReserveKV: these decode workers are unfenced

@pytest.fixture
def decode(model_dir):
    w = decode_worker(model_dir, num_blocks=8)  # 8 blocks of 4 tokens
    yield w
    close(w)


def _reserve(worker, rid: str, num_tokens: int, **params: object) -> list[Any]:
    sampling = wire(params.pop("max_tokens", 4), **params)  # type: ignore[arg-type]
    return run(worker, ReserveKV(request_id=rid, prompt_token_ids=list(range(3, 3 + num_tokens)),
                                 sampling=sampling, prefill_worker_id="p0", prefill_sender_epoch=NO_SENDER))


def _handle(msgs: list[Any], rid: str) -> KVHandle:
    [res] = of_type(msgs, KVReserved, rid)
    return decode_handle(res.kv_handle)


def _abort_all(worker, *rids: str) -> None:
    for rid in rids:
        worker.deliver(AbortRequest(request_id=rid))


def test_reserve_returns_handle_of_reserved_blocks_contiguous_when_possible(decode):
    handles = {rid: _handle(_reserve(decode, rid, n), rid) for rid, n in [("a", 8), ("b", 4), ("c", 5),
                                                                         ("e", 8)]}
    for rid, h in handles.items():
        assert list(h.block_ids) == decode.in_flight[rid].block_table
        assert list(h.block_ids) == list(range(h.block_ids[0], h.block_ids[0] + len(h.block_ids)))
        assert h.request_id == rid and h.address == decode.receiver.address
    assert decode.core.block_manager.num_free_blocks == 1
    run(decode, AbortRequest(request_id="b"))  # no sender ever claimed it: freed at once
    assert decode.core.block_manager.num_free_blocks == 2
    f = _handle(_reserve(decode, "f", 6), "f")  # two free blocks, not adjacent: falls back
    assert sorted(f.block_ids) == sorted({*range(8)} - {b for h in handles.values() for b in h.block_ids}
                                         | set(handles["b"].block_ids))
    assert list(f.block_ids) == decode.in_flight["f"].block_table
    _abort_all(decode, "a", "c", "e", "f")
    assert_clean(decode)


def _colocated_tokens(colo, prompt: list[int], sampling) -> list[int]:
    ref = run(colo, ColocatedRequest(request_id="c", prompt_token_ids=prompt, sampling=sampling))
    pump([colo], lambda: bool(of_type(ref, RequestFinished)), sink=ref)
    return [of_type(ref, FirstToken)[0].token_id] + [m.token_id for m in of_type(ref, NextToken)]


@pytest.mark.parametrize("decode_request_first", [True, False])
def test_kv_landed_and_decode_request_in_either_order_then_finish(model_dir, decode_request_first):
    prompt, sampling = list(range(20, 31)), wire(5, ignore_eos=True)  # 11 tokens, greedy, 5 out
    prefill, decode, colo = prefill_worker(model_dir), decode_worker(model_dir), colocated_worker(model_dir)
    try:
        ref_tokens = _colocated_tokens(colo, prompt, sampling)
        [res] = of_type(run(decode, ReserveKV(request_id="r", prompt_token_ids=prompt, sampling=sampling,
                                              prefill_worker_id="p0",
                                              prefill_sender_epoch=prefill.sender.epoch)), KVReserved)
        if decode_request_first:  # the first token is known before any KV was sent
            assert run(decode, DecodeRequest(request_id="r", first_token_id=ref_tokens[0])) == []
            assert decode.first_tokens == {"r": ref_tokens[0]}
            assert decode.receiver.status("r") is TransferStatus.PENDING and "r" in decode.in_flight
        req = PrefillRequest(request_id="r", prompt_token_ids=prompt, sampling=sampling,
                             kv_handle=res.kv_handle)
        [first] = of_type(run(prefill, req), FirstToken)
        assert first.token_id == ref_tokens[0]
        if not decode_request_first:
            assert decode.receiver.wait("r", 10.0) is TransferStatus.DONE
            for _ in range(3):  # KV landed, first token unknown: not running yet
                assert run(decode) == []
            assert "r" in decode.in_flight and not decode.core.scheduler.running
            decode.deliver(DecodeRequest(request_id="r", first_token_id=first.token_id))
        msgs: list[Any] = []
        pump([prefill, decode], lambda: bool(of_type(msgs, RequestFinished)) and not prefill.busy(),
             sink=msgs)
        tokens = [first.token_id] + [m.token_id for m in of_type(msgs, NextToken)]
        [fin] = of_type(msgs, RequestFinished)
        assert (fin.finish_reason, fin.num_prompt_tokens, fin.num_output_tokens) == ("length", 11, 5)
        assert tokens == ref_tokens  # greedy: disaggregated == colocated
        # the KV of the prompt's 11 tokens landed in ceil(11 / block_size) whole blocks on the decode side
        blocks = -(-len(prompt) // decode.core.config.cache.block_size)
        labels = {"model_name": decode.settings.model, "engine": "0"}
        received = decode.metrics.registry.get_sample_value("pdserve_worker_kv_received_bytes_total", labels)
        assert received == blocks * decode.core.runner.kv_cache.bytes_per_block
        assert_clean(prefill, decode, colo)
    finally:
        for w in (prefill, decode, colo):
            close(w)


def test_abort_while_kv_in_flight_frees_blocks_only_after_sender_stopped(decode):
    h = _handle(_reserve(decode, "r", 12), "r")  # 3 of 8 blocks
    sender = FakeSender(decode.receiver.address, kv_like=decode.core.runner.kv_cache.kv_buffer, model="tiny")
    try:
        sender.claim(h.request_id, h.epoch)
        assert decode.receiver.status("r") is TransferStatus.TRANSFERRING
        assert run(decode, AbortRequest(request_id="r")) == []
        pump([decode], lambda: bool([m for m in sender.drain() if isinstance(m, km.Abort)]))
        for _ in range(3):
            assert run(decode) == []
        # the sender has not confirmed it stopped: a write may still land, the blocks stay reserved
        assert "r" in decode.fenced and not decode.receiver.releasable("r")
        assert decode.core.block_manager.num_free_blocks == 5
        # heartbeats say why the blocks are in use with nothing waiting or running (/v1/status shows it)
        load = decode.load()
        assert (load.kv_fenced_blocks, load.num_free_blocks) == (3, 5)
        assert (load.num_waiting, load.num_running) == (0, 0)
        other = _handle(_reserve(decode, "s", 20), "s")  # takes all 5 free blocks, none of r's
        assert not set(other.block_ids) & set(h.block_ids)
        sender.send(km.Stopped("r", True))
        pump([decode], lambda: not decode.fenced)
        assert decode.core.block_manager.num_free_blocks == 3
        assert run(decode) == [] and decode.load().kv_fenced_blocks == 0
        _abort_all(decode, "s")
        assert_clean(decode)
    finally:
        sender.close()


def test_sender_failure_sends_request_failed_and_frees_blocks(decode):
    h = _handle(_reserve(decode, "r", 9), "r")
    sender = FakeSender(decode.receiver.address, kv_like=decode.core.runner.kv_cache.kv_buffer, model="tiny")
    try:
        sender.claim(h.request_id, h.epoch)
        sender.send(km.Stopped("r", False, "transport error"))
        msgs: list[Any] = []
        pump([decode], lambda: bool(of_type(msgs, RequestFailed)), sink=msgs)
        [failed] = msgs
        assert failed.request_id == "r" and "transport error" in failed.error
        assert_clean(decode)
    finally:
        sender.close()


def test_transfer_deadline_fails_request(model_dir):
    decode = decode_worker(model_dir, timeout_s=0.3)
    decode.kv_claim_timeout_s = 0.3  # no prefill worker ever begins
    try:
        _reserve(decode, "r", 5)
        msgs: list[Any] = []
        pump([decode], lambda: bool(of_type(msgs, RequestFailed)), sink=msgs)
        [failed] = of_type(msgs, RequestFailed, "r")
        assert "deadline" in failed.error and failed.kind == "worker"  # another worker may serve it
        assert_clean(decode)
    finally:
        close(decode)


def test_not_enough_blocks_waits_in_order_then_fails_after_deadline(decode):
    assert of_type(_reserve(decode, "a", 20), KVReserved)          # 5 of 8 blocks
    assert _reserve(decode, "b", 16) == []                          # needs 4: waits
    assert _reserve(decode, "c", 4) == []                           # fits, but queues behind b
    assert [p[0].request_id for p in decode.pending] == ["b", "c"] and decode.num_waiting() == 3
    msgs = run(decode, AbortRequest(request_id="a"))
    assert [m.request_id for m in of_type(msgs, KVReserved)] == ["b", "c"]
    decode.reserve_timeout = 0.2
    assert _reserve(decode, "e", 16) == []                          # 3 free, needs 4
    msgs = []
    pump([decode], lambda: bool(of_type(msgs, RequestFailed)), sink=msgs)
    [failed] = msgs
    assert failed.request_id == "e" and "no free KV blocks" in failed.error
    _abort_all(decode, "b", "c")
    assert_clean(decode)


def test_duplicate_reserve_while_waiting_for_blocks_fails_without_crashing(decode):
    # bug fix: a second ReserveKV for an id still waiting for blocks made poll() raise (worker crash)
    assert of_type(_reserve(decode, "a", 20), KVReserved)
    assert _reserve(decode, "x", 16) == []
    [failed] = _reserve(decode, "x", 16)
    assert isinstance(failed, RequestFailed) and "already" in failed.error
    msgs = run(decode, AbortRequest(request_id="a"))
    assert of_type(msgs, KVReserved) == []  # the failed id is gone everywhere
    assert_clean(decode)


def test_decode_request_without_reservation_fails(decode):
    [failed] = run(decode, DecodeRequest(request_id="nope", first_token_id=5))
    assert isinstance(failed, RequestFailed) and "no KV reservation" in failed.error
    assert_clean(decode)


def test_abort_running_request_frees_blocks(model_dir):
    prompt, sampling = list(range(40, 46)), wire(50, ignore_eos=True)
    prefill, decode = prefill_worker(model_dir), decode_worker(model_dir)
    try:
        [res] = of_type(run(decode, ReserveKV(request_id="r", prompt_token_ids=prompt, sampling=sampling,
                                              prefill_worker_id="p0",
                                              prefill_sender_epoch=prefill.sender.epoch)), KVReserved)
        req = PrefillRequest(request_id="r", prompt_token_ids=prompt, sampling=sampling,
                             kv_handle=res.kv_handle)
        [first] = of_type(run(prefill, req), FirstToken)
        decode.deliver(DecodeRequest(request_id="r", first_token_id=first.token_id))
        msgs: list[Any] = []
        pump([prefill, decode], lambda: len(of_type(msgs, NextToken)) >= 2, sink=msgs)
        assert run(decode, AbortRequest(request_id="r")) == []
        assert run(decode) == [] and of_type(msgs, RequestFinished) == []
        assert_clean(prefill, decode)
    finally:
        close(prefill)
        close(decode)


def test_request_queued_for_prefill_longer_than_the_kv_deadline_completes(model_dir):
    """The KV deadline counts from the prefill worker's Begin, not from the reservation: a request that
    waits in the prefill queue longer than that deadline still completes (it failed with "deadline of
    36.0s passed" under a burst of long prompts against one CPU prefill worker)."""
    prompt, sampling = list(range(20, 31)), wire(3, ignore_eos=True)
    prefill, decode = prefill_worker(model_dir), decode_worker(model_dir, timeout_s=0.3)
    decode.kv_deadline_per_token_s = 0.0
    try:
        [res] = of_type(run(decode, ReserveKV(request_id="r", prompt_token_ids=prompt, sampling=sampling,
                                              prefill_worker_id="p0",
                                              prefill_sender_epoch=prefill.sender.epoch)), KVReserved)
        assert decode_handle(res.kv_handle).timeout_s == pytest.approx(0.3)
        end = time.monotonic() + 0.9  # queued behind other prompts: three times the KV deadline
        while time.monotonic() < end:
            assert run(decode) == []
            time.sleep(0.01)
        assert decode.receiver.status("r") is TransferStatus.PENDING
        req = PrefillRequest(request_id="r", prompt_token_ids=prompt, sampling=sampling,
                             kv_handle=res.kv_handle)
        [first] = of_type(run(prefill, req), FirstToken)
        decode.deliver(DecodeRequest(request_id="r", first_token_id=first.token_id))
        msgs: list[Any] = []
        pump([prefill, decode], lambda: bool(of_type(msgs, RequestFinished)) and not prefill.busy(),
             sink=msgs)
        assert of_type(msgs, RequestFailed) == [] and len(of_type(msgs, NextToken)) == 2
        assert_clean(prefill, decode)
    finally:
        close(prefill)
        close(decode)


def test_kv_deadline_grows_with_the_prompt(decode):
    """The KV deadline (from the prefill worker's Begin, which comes with the prompt's last chunk) grows
    with the prompt: a long last chunk on a slow CPU prefill worker takes longer than a flat 30 s."""
    base = decode.receiver.config.timeout_s
    short = _handle(_reserve(decode, "s", 4), "s")
    long = _handle(_reserve(decode, "l", 20), "l")
    assert short.timeout_s == pytest.approx(base + 4 * decode.kv_deadline_per_token_s)
    assert long.timeout_s == pytest.approx(base + 20 * decode.kv_deadline_per_token_s)
    assert decode.kv_deadline_s(5000) >= base + 100  # a 5000-token prompt gets minutes, not 30 s
    _abort_all(decode, "s", "l")


@pytest.mark.parametrize("tp_size", [2**63 - 1, 65, 0])
def test_a_reservation_naming_an_impossible_prefill_tp_size_fails_it_at_once(decode, tp_size: int) -> None:
    """A ``ReserveKV`` whose ``prefill_tp_size`` no worker can have (at most 64 ranks, at least 1) is
    refused as it is decoded and its request failed; 2**63 - 1 used to have the decode worker admit that
    many sender ids, its loop stuck (found by the control-plane fuzz)."""
    import msgspec

    from protocol.messages import encode

    raw = msgspec.msgpack.decode(encode(ReserveKV(
        request_id="huge", prompt_token_ids=[3, 4, 5], sampling=wire(4), prefill_worker_id="p0",
        prefill_sender_epoch=NO_SENDER)))
    raw["prefill_tp_size"] = tp_size
    assert decode.decode_frame(msgspec.msgpack.encode(raw)) is None
    start = time.monotonic()
    decode.run_once()
    [failed] = of_type(decode.take_outbox(), RequestFailed, "huge")
    assert time.monotonic() - start < 5 and "prefill_tp_size" in failed.error
    assert_clean(decode)
