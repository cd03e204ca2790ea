"""One request between two tensor parallel workers as one transfer per rank pair (kvtransfer.ranked), over
in-process endpoints per rank: DONE only when every pair is, blocks releasable only when no pair can still
write, an abort reaches every pair, a failed expect keeps nothing."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch

from kvtransfer import TransferStatus, get_transfer_backend
from kvtransfer.head_map import rank_kv_heads
from kvtransfer.ranked import RankedHandles, RankedReceive, RankedSend, combined_status
from tests.kvtransfer.helpers import BLOCKS, BS, DIM, LAYERS, config, need_nixl, sender_settled

S = TransferStatus
WAIT = 10.0


@pytest.fixture(params=["loopback", "nixl"])
def backend(request):
    if request.param == "nixl":
        need_nixl()
    return request.param


def shard(whole: torch.Tensor, first: int, count: int) -> torch.Tensor:
    return whole[:, :, :, :, first:first + count].contiguous()


class Pair:
    """A prefill worker of `p` ranks and a decode worker of `d` ranks over one random whole-model KV."""

    def __init__(self, backend: str, p: int, d: int, total: int = 4) -> None:
        self.whole = torch.randn(LAYERS, 2, BLOCKS, BS, total, DIM).to(torch.bfloat16)
        self.src_place, self.dst_place = rank_kv_heads(total, p), rank_kv_heads(total, d)
        impl = get_transfer_backend(backend)

        def cfg(worker: str, rank: int, size: int):
            return dataclasses.replace(config(f"{worker}-tp{rank}", backend), tp_size=size, tp_rank=rank,
                                       total_kv_heads=total)
        self.senders = [impl.sender(cfg("p", r, p), shard(self.whole, *self.src_place[r])) for r in range(p)]
        self.receivers = [impl.receiver(cfg("d", r, d),
                                        torch.zeros_like(shard(self.whole, *self.dst_place[r])))
                          for r in range(d)]
        self.send = RankedSend(self.senders)
        self.recv = RankedReceive(self.receivers, self.dst_place)

    def start(self, rid: str, src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, str]]:
        handles = self.recv.expect(rid, dst_ids, self.src_place)
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(handles), type=RankedHandles)  # as it travels
        assert wire == handles
        return self.send.add_request(wire, src_ids)

    def release_senders(self, pairs: list[tuple[int, str]]) -> None:
        for rank, sub in pairs:
            tx = self.senders[rank]
            assert tx.wait_until(lambda tx=tx, sub=sub: sender_settled(tx, sub), WAIT)
            tx.release(sub)

    def close(self) -> None:
        for ep in (*self.senders, *self.receivers):
            ep.close()


@pytest.mark.parametrize(("p", "d"), [(2, 1), (1, 2), (2, 2)])
def test_request_done_when_every_pair_is(backend: str, p: int, d: int):
    w = Pair(backend, p, d)
    try:
        src_ids, dst_ids = [2, 3, 4, 10], [6, 7, 0, 1]
        pairs = w.start("r", src_ids, dst_ids)
        assert len(pairs) == max(p, d)
        for layer in range(LAYERS):  # each rank streams its own layers
            assert w.recv.status("r") is not S.DONE
            for rank, sub in pairs:
                w.senders[rank].send_layer(sub, layer)
        assert w.recv.wait("r", WAIT) is S.DONE, w.recv.reason("r")
        for rank, rx in enumerate(w.receivers):
            want = shard(w.whole, *w.dst_place[rank])
            assert torch.equal(rx.kv_buffer[:, :, dst_ids].view(torch.uint8),
                               want[:, :, src_ids].view(torch.uint8))
        assert w.receivers[0].wait_until(lambda: w.recv.releasable("r"), WAIT)
        w.recv.release("r")
        w.release_senders(pairs)
        w.recv.check_no_leaks()
        for tx in w.senders:
            tx.check_no_leaks()
    finally:
        w.close()


def test_blocks_held_until_every_source_rank_stopped(backend: str):
    """P TP=2 -> D TP=1: one source rank gives up its pair; the request is ABORTED naming that pair, yet
    its blocks stay held while the other source rank may still write; the decode side's abort reaches it,
    and only after its Stopped may the blocks go."""
    w = Pair(backend, 2, 1)
    try:
        pairs = w.start("r", [0, 1], [5, 6])
        for rank, sub in pairs:
            w.senders[rank].send_layer(sub, 0)
        (r0, sub0), (r1, sub1) = pairs
        rx = w.receivers[0]  # both pairs claimed and writing before anything stops
        assert rx.wait_until(lambda: all(0 in rx.snapshot(sub).layers for sub in (sub0, sub1)), WAIT)
        w.senders[r1].abort(sub1)
        assert w.recv.wait("r", WAIT) is S.ABORTED
        assert w.recv.reason("r").startswith(f"{sub1}: ")
        assert not w.senders[r0].status(sub0).is_terminal
        assert not w.recv.releasable("r")  # rank 0's pair is still claimed and running
        with pytest.raises(RuntimeError, match=f"pair {sub0}"):
            w.recv.release("r")
        w.recv.abort("r")
        assert w.senders[r0].wait(sub0, WAIT) is S.ABORTED
        assert w.receivers[0].wait_until(lambda: w.recv.releasable("r"), WAIT)
        w.recv.release("r")
        w.release_senders(pairs)
        w.recv.check_no_leaks()
    finally:
        w.close()


def test_failed_expect_keeps_nothing():
    w = Pair("loopback", 1, 2)
    try:
        w.receivers[1].expect("r/tp0-1", [3])  # a clash on rank 1: the second pair cannot be expected
        with pytest.raises(ValueError, match="already expected"):
            w.recv.expect("r", [3], w.src_place)
        assert w.receivers[0].pending() == [] and w.recv.pending() == []
        with pytest.raises(ValueError, match=r"destination heads \[2, 3\] are held by no source rank"):
            w.recv.expect("q", [3], ((0, 2),))
        w.receivers[1].abort("r/tp0-1")
        w.receivers[1].release("r/tp0-1")
        w.recv.check_no_leaks()
    finally:
        w.close()


def test_combined_status():
    assert combined_status([S.DONE, S.DONE]) is S.DONE
    assert combined_status([S.DONE, S.TRANSFERRING]) is S.TRANSFERRING
    assert combined_status([S.PENDING, S.PENDING]) is S.PENDING
    assert combined_status([S.DONE, S.ABORTED, S.FAILED]) is S.FAILED
    assert combined_status([S.ABORTED, S.TRANSFERRING]) is S.ABORTED
