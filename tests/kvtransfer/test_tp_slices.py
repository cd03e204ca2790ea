"""Senders of several tensor parallel ranks write their KV-head slices into receivers of another tensor
parallel layout (one in-process endpoint per rank): every decode rank's blocks end equal to its shard of
the same whole-model KV, layer by layer, with today's lifetime rules per (request, source rank)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtransfer import TransferStatus, get_transfer_backend
from kvtransfer.head_map import HeadSlice, head_slices, rank_kv_heads
from tests.kvtransfer.helpers import BLOCKS, BS, DIM, LAYERS, config, need_nixl, release_both

S = TransferStatus
WAIT = 10.0


@pytest.fixture(params=["loopback", "nixl"])
def backend(request):
    if request.param == "nixl":
        need_nixl()
    return request.param


def shard(whole: torch.Tensor, first: int, count: int) -> torch.Tensor:
    return whole[:, :, :, :, first:first + count].contiguous()


def rank_config(worker: str, backend: str, rank: int, size: int, total: int, **kw: object):
    return dataclasses.replace(config(f"{worker}-tp{rank}", backend, **kw), tp_size=size, tp_rank=rank,
                               total_kv_heads=total)


def sub_id(rid: str, sl: HeadSlice) -> str:
    return f"{rid}/p{sl.src_rank}d{sl.dst_rank}"


@pytest.mark.parametrize(("p", "d", "total"), [(2, 1, 4), (1, 2, 4), (2, 2, 4), (4, 1, 2)])
def test_every_rank_pair_lands_its_heads(backend: str, p: int, d: int, total: int):
    g = torch.Generator().manual_seed(p * 10 + d)
    whole = torch.randn(LAYERS, 2, BLOCKS, BS, total, DIM, generator=g).to(torch.bfloat16)
    src_place, dst_place = rank_kv_heads(total, p), rank_kv_heads(total, d)
    impl = get_transfer_backend(backend)
    txs = [impl.sender(rank_config("p", backend, r, p, total), shard(whole, *src_place[r])) for r in range(p)]
    rxs = [impl.receiver(rank_config("d", backend, r, d, total),
                         torch.zeros_like(shard(whole, *dst_place[r]))) for r in range(d)]
    try:
        src_ids, dst_ids = [3, 4, 5, 9, 0], [7, 8, 1, 2, 11]
        slices = head_slices(src_place, dst_place)
        for sl in slices:  # one sub-request per (source rank, decode rank) pair that writes heads
            rid = sub_id("a", sl)
            handle = rxs[sl.dst_rank].expect(rid, dst_ids)
            txs[sl.src_rank].add_request(handle, src_ids, heads=sl)
        for layer in range(LAYERS):  # layer-streamed: every rank sends a layer once it is in its kv_buffer
            for sl in slices:
                txs[sl.src_rank].send_layer(sub_id("a", sl), layer)
        for sl in slices:
            rid = sub_id("a", sl)
            assert rxs[sl.dst_rank].wait(rid, WAIT) is S.DONE, rxs[sl.dst_rank].reason(rid)
            release_both(txs[sl.src_rank], rxs[sl.dst_rank], rid, WAIT)
        untouched = [b for b in range(BLOCKS) if b not in dst_ids]
        for rank, rx in enumerate(rxs):
            want = shard(whole, *dst_place[rank])
            assert torch.equal(rx.kv_buffer[:, :, dst_ids].view(torch.uint8),
                               want[:, :, src_ids].view(torch.uint8))
            assert rx.kv_buffer[:, :, untouched].float().abs().sum() == 0
        for ep in (*txs, *rxs):
            ep.check_no_leaks()
    finally:
        for ep in (*txs, *rxs):
            ep.close()


def test_abort_by_one_decode_rank_stops_its_source_rank(backend: str):
    """P TP=2 -> D TP=1: the receiver aborts one source rank's sub-request mid-transfer; its blocks are
    releasable once that sender says Stopped, the other source rank's sub-request completes."""
    whole = torch.randn(LAYERS, 2, BLOCKS, BS, 4, DIM).to(torch.bfloat16)
    impl = get_transfer_backend(backend)
    txs = [impl.sender(rank_config("p", backend, r, 2, 4), shard(whole, 2 * r, 2)) for r in range(2)]
    rx = impl.receiver(rank_config("d", backend, 0, 1, 4), torch.zeros_like(whole))
    try:
        slices = head_slices(rank_kv_heads(4, 2), rank_kv_heads(4, 1))
        for sl in slices:
            txs[sl.src_rank].add_request(rx.expect(f"a/p{sl.src_rank}", [1, 2]), [5, 6], heads=sl)
            txs[sl.src_rank].send_layer(f"a/p{sl.src_rank}", 0)
        assert rx.wait_until(lambda: 0 in rx.snapshot("a/p1").layers, WAIT)
        rx.abort("a/p1")
        assert txs[1].wait("a/p1", WAIT) is S.ABORTED
        txs[0].send_layers("a/p0", range(1, LAYERS))
        assert rx.wait("a/p0", WAIT) is S.DONE
        release_both(txs[0], rx, "a/p0", WAIT)
        release_both(txs[1], rx, "a/p1", WAIT)
        for ep in (*txs, rx):
            ep.check_no_leaks()
    finally:
        for ep in (*txs, rx):
            ep.close()


def test_slices_the_sender_cannot_write_are_refused():
    impl = get_transfer_backend("loopback")
    whole = torch.randn(LAYERS, 2, BLOCKS, BS, 4, DIM)
    tx = impl.sender(rank_config("p", "loopback", 1, 2, 4), shard(whole, 2, 2))
    checked = impl.sender(rank_config("q", "loopback", 1, 2, 4, checksum=True), shard(whole, 2, 2))
    rx = impl.receiver(rank_config("d", "loopback", 0, 1, 4), torch.zeros_like(whole))
    try:
        with pytest.raises(ValueError, match="destination holds 4 KV heads per block, this sender 2"):
            tx.add_request(rx.expect("a", [1]), [0])
        with pytest.raises(ValueError, match="head slice of source rank 0 given to tensor parallel rank 1"):
            tx.add_request(rx.expect("b", [1]), [0], heads=HeadSlice(0, 0, 0, 0, 2))
        with pytest.raises(ValueError, match="checksum covers whole blocks"):
            checked.add_request(rx.expect("c", [1]), [0], heads=HeadSlice(1, 0, 0, 2, 2))
        assert tx.pending() == [] and checked.pending() == []
        for rid in ("a", "b", "c"):  # never claimed: the receiver releases them at once after an abort
            rx.abort(rid)
            rx.release(rid)
        for ep in (tx, checked, rx):
            ep.check_no_leaks()
    finally:
        for ep in (tx, checked, rx):
            ep.close()
