"""KV canaries between a real prefill and decode worker over the loopback transport: blocks from each
worker's BlockManager (one, or as many as the canary's size asks within an eighth of the free ones and
the blocks of the decode worker's max_model_len - 1 tokens), every layer sent, the result with its
transport and speed, both blocks free afterwards (leak check); a wedged path (loopback writes held back)
ends by the gateway's abort at the deadline, and its blocks come back only once no write can land in
them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtransfer import TransferStatus
from protocol.messages import AbortRequest, KVCanaryReserve, KVCanaryReserved, KVCanaryResult, KVCanarySend
from tests.workers.helpers import (
    assert_clean,
    close,
    decode_worker,
    of_type,
    prefill_worker,
    pump,
    run,
)

NO_SENDER = 1  # the KV sender epoch named where no prefill worker sends (these decode workers are unfenced)


@pytest.fixture
def pair(model_dir: Path) -> Iterator[tuple[Any, Any]]:
    p, d = prefill_worker(model_dir), decode_worker(model_dir)
    yield p, d
    for w in (p, d):
        close(w)


def _reserve(decode: Any, cid: str, timeout_s: float = 5.0, epoch: int = NO_SENDER) -> KVCanaryReserved:
    [res] = of_type(run(decode, KVCanaryReserve(canary_id=cid, prefill_worker_id="p0",
                                                prefill_sender_epoch=epoch, timeout_s=timeout_s)),
                    KVCanaryReserved)
    return res


def test_canary_lands_reports_transport_and_speed_and_frees_its_blocks(pair: tuple[Any, Any]) -> None:
    prefill, decode = pair
    kv_p, kv_d = prefill.core.runner.kv_cache.kv_buffer, decode.core.runner.kv_cache.kv_buffer
    with torch.no_grad():
        kv_p.copy_(torch.randn_like(kv_p))
    res = _reserve(decode, "c1", epoch=prefill.sender.epoch)
    assert res.kv_handle is not None and res.error == ""
    assert decode.core.block_manager.num_free_blocks == decode.core.block_manager.num_blocks - 1
    [dst] = decode.canaries["c1"].block_table
    prefill.on_message(KVCanarySend(canary_id="c1", kv_handle=res.kv_handle))  # what run_once would do
    seq = prefill.canaries["c1"].seq
    assert seq is not None
    [src] = seq.block_table  # the canary's source block, held until the transfer is terminal
    msgs: list[Any] = []
    pump([prefill, decode], lambda: bool(of_type(msgs, KVCanaryResult)), sink=msgs)
    [result] = of_type(msgs, KVCanaryResult)
    assert result.ok and result.error == "" and result.transport == "loopback"
    assert result.num_bytes == prefill.core.runner.kv_cache.bytes_per_block
    assert 0 < result.seconds < 5 and result.num_bytes / result.seconds > 0
    assert 0 < result.wire_seconds <= result.seconds  # the writes' time, within the end-to-end time
    assert torch.equal(kv_p[:, :, src], kv_d[:, :, dst])  # every layer, K and V, landed
    assert_clean(prefill, decode)


def test_canary_of_several_blocks_within_an_eighth_of_the_free_ones(model_dir: Path) -> None:
    prefill, decode = prefill_worker(model_dir, num_blocks=64), decode_worker(model_dir, num_blocks=64)
    try:
        per_block = decode.core.runner.kv_cache.bytes_per_block
        assert decode.canary_blocks(0) == 1 and decode.canary_blocks(per_block + 1) == 2
        assert decode.canary_blocks(100 * per_block) == 64 // 8  # capped: an eighth of the free blocks
        kv_p, kv_d = prefill.core.runner.kv_cache.kv_buffer, decode.core.runner.kv_cache.kv_buffer
        with torch.no_grad():
            kv_p.copy_(torch.randn_like(kv_p))
        [res] = of_type(run(decode, KVCanaryReserve(canary_id="c1", prefill_worker_id="p0", timeout_s=5.0,
                                                    prefill_sender_epoch=prefill.sender.epoch,
                                                    num_bytes=3 * per_block)), KVCanaryReserved)
        assert res.kv_handle is not None
        dst = list(decode.canaries["c1"].block_table)
        assert len(dst) == 3
        prefill.on_message(KVCanarySend(canary_id="c1", kv_handle=res.kv_handle))
        seq = prefill.canaries["c1"].seq
        assert seq is not None
        src = list(seq.block_table)
        msgs: list[Any] = []
        pump([prefill, decode], lambda: bool(of_type(msgs, KVCanaryResult)), sink=msgs)
        [result] = of_type(msgs, KVCanaryResult)
        assert result.ok and result.num_bytes == 3 * per_block and not result.skipped
        assert torch.equal(kv_p[:, :, src], kv_d[:, :, dst])
        assert_clean(prefill, decode)
    finally:
        close(prefill)
        close(decode)


@pytest.mark.parametrize("max_model_len", [10, 12, 13])
def test_canary_stays_below_the_decode_workers_max_model_len(model_dir: Path, max_model_len: int) -> None:
    """A canary of more tokens than ``max_model_len`` allows is cut to the blocks of max_model_len - 1
    tokens (the scheduler's limit), and it lands; its bytes are those of the blocks sent. The prefill
    worker sends the blocks of the handle whatever its own max_model_len."""
    prefill = prefill_worker(model_dir, num_blocks=64, max_model_len=4)
    decode = decode_worker(model_dir, num_blocks=64, max_model_len=max_model_len)
    try:
        per_block = decode.core.runner.kv_cache.bytes_per_block
        assert decode.core.max_model_len == max_model_len
        want = -(-(max_model_len - 1) // 4)  # blocks of max_model_len - 1 tokens (block size 4)
        assert decode.canary_blocks(100 * per_block) == want < 64 // 8
        [res] = of_type(run(decode, KVCanaryReserve(canary_id="c1", prefill_worker_id="p0", timeout_s=5.0,
                                                    prefill_sender_epoch=prefill.sender.epoch,
                                                    num_bytes=100 * per_block)), KVCanaryReserved)
        assert res.kv_handle is not None and res.error == ""
        assert len(decode.canaries["c1"].block_table) == want
        prefill.on_message(KVCanarySend(canary_id="c1", kv_handle=res.kv_handle))
        msgs: list[Any] = []
        pump([prefill, decode], lambda: bool(of_type(msgs, KVCanaryResult)), sink=msgs)
        [result] = of_type(msgs, KVCanaryResult)
        assert result.ok and not result.skipped and result.num_bytes == want * per_block
        assert_clean(prefill, decode)
    finally:
        close(prefill)
        close(decode)


def test_canary_the_prefill_worker_has_no_blocks_for_is_skipped(model_dir: Path) -> None:
    prefill, decode = prefill_worker(model_dir, num_blocks=2), decode_worker(model_dir, num_blocks=64)
    try:
        per_block = decode.core.runner.kv_cache.bytes_per_block
        [res] = of_type(run(decode, KVCanaryReserve(canary_id="c1", prefill_worker_id="p0", timeout_s=5.0,
                                                    prefill_sender_epoch=prefill.sender.epoch,
                                                    num_bytes=4 * per_block)), KVCanaryReserved)
        assert res.kv_handle is not None
        sent = run(prefill, KVCanarySend(canary_id="c1", kv_handle=res.kv_handle))
        [result] = of_type(sent, KVCanaryResult)
        assert result.skipped and not result.ok and "4 free KV blocks" in result.error
        assert "c1" not in prefill.canaries
        run(decode, AbortRequest(request_id="c1", reason="KV canary skipped"))  # the gateway frees it
        assert_clean(prefill, decode)
    finally:
        close(prefill)
        close(decode)


def test_canary_without_a_free_block_is_refused(model_dir: Path) -> None:
    decode = decode_worker(model_dir, num_blocks=2)
    try:
        held = [_reserve(decode, "c1"), _reserve(decode, "c2")]
        third = _reserve(decode, "c3")
        assert all(r.kv_handle is not None for r in held)
        assert third.kv_handle is None and third.error == "no free KV block"
        assert run(decode, KVCanaryReserve(canary_id="c1", prefill_worker_id="p0",
                                           prefill_sender_epoch=NO_SENDER, timeout_s=1.0))[0].error
        for cid in ("c1", "c2"):  # no sender ever claimed them: free at once
            run(decode, AbortRequest(request_id=cid))
        assert_clean(decode)
    finally:
        close(decode)


def test_wedged_canary_is_aborted_and_frees_blocks_once_nothing_can_land(pair: tuple[Any, Any]) -> None:
    prefill, decode = pair
    prefill.sender.transport.deliver.clear()  # writes are posted, never delivered
    res = _reserve(decode, "c1", timeout_s=10.0, epoch=prefill.sender.epoch)
    assert res.kv_handle is not None
    msgs = run(prefill, KVCanarySend(canary_id="c1", kv_handle=res.kv_handle))
    deadline = time.monotonic() + 0.3  # the gateway's deadline, shorter here than the receiver's
    pump([prefill, decode], lambda: time.monotonic() > deadline, sink=msgs)
    assert of_type(msgs, KVCanaryResult) == []  # nothing landed: no result
    for w in (prefill, decode):  # the gateway at the deadline
        w.deliver(AbortRequest(request_id="c1", reason="KV canary deadline"))
    pump([prefill, decode], lambda: bool(of_type(msgs, KVCanaryResult)), sink=msgs)
    [result] = of_type(msgs, KVCanaryResult)
    assert not result.ok and result.error.startswith("aborted")
    assert prefill.core.block_manager.num_free_blocks == prefill.core.block_manager.num_blocks  # source freed
    time.sleep(0.2)
    run(decode)
    assert "c1" in decode.canaries  # a write may still land: the block stays held
    assert decode.receiver.status("c1") in (TransferStatus.ABORTED, TransferStatus.FAILED)
    prefill.sender.transport.deliver.set()
    assert_clean(prefill, decode)
