"""A worker's KV endpoint over all its tensor parallel ranks (workers.tp_kv), over in-process loopback
endpoints per rank: between one-rank workers the plain path (a KVHandle under the request's id); otherwise
one transfer per rank pair behind the worker's request id (RankedHandles), each rank's layers sent by that
rank, the heads landing where a one-rank worker holds them; a plain handle given to a worker of several
ranks is refused; a pair added before a failing one is aborted and released later, never held forever."""

from __future__ import annotations

import pytest
import torch

from kvtransfer import TransferStatus
from kvtransfer.ranked import RankedHandles
from kvtransfer.types import KVHandle
from tests.kvtransfer.helpers import LAYERS
from tests.kvtransfer.test_ranked import Pair
from workers.tp_kv import RankReceiver, RankSender, decode_kv_handle, handle_blocks, rank_sender_id

S = TransferStatus
WAIT = 10.0
TOTAL = 4


def settle(sender: RankSender, receiver: RankReceiver, rid: str) -> None:
    """Wait (deadline WAIT) until both sides may forget `rid`, then release it on both."""
    assert receiver.local.wait_until(lambda: receiver.releasable(rid), WAIT)
    receiver.release(rid)
    for rank, sub in sender.rank_pairs(rid):
        tx = sender.ranks[rank]
        assert tx.wait_until(lambda tx=tx, sub=sub: tx.snapshot(sub).status.is_terminal
                             and tx.snapshot(sub).inflight == 0 and not tx.snapshot(sub).fence_pending, WAIT)
    sender.release(rid)


@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_worker_request_moves_every_rank_heads(p: int, d: int):
    w = Pair("loopback", p, d, total=TOTAL)
    sender, receiver = RankSender(w.senders), RankReceiver(w.receivers, TOTAL)
    try:
        src_ids, dst_ids = [2, 3, 4], [7, 0, 1]
        data = receiver.expect("r", dst_ids, p)
        handle = decode_kv_handle(data)
        assert isinstance(handle, KVHandle if (p, d) == (1, 1) else RankedHandles)
        assert handle.request_id == "r" and handle_blocks(handle) == dst_ids
        sender.add_request(handle, src_ids)
        pairs = sender.rank_pairs("r")
        assert sorted({rank for rank, _ in pairs}) == list(range(p))
        assert receiver.status("r") is not S.DONE
        for layer in range(LAYERS):
            sender.send_layer("r", layer)  # rank 0's pairs
            for rank, sub in pairs:  # the other ranks', as their rank note makes them
                if rank != 0:
                    sender.ranks[rank].send_layer(sub, layer)
        assert receiver.local.wait_until(lambda: receiver.status("r").is_terminal
                                         and sender.status("r").is_terminal, WAIT)
        assert receiver.status("r") is S.DONE and sender.status("r") is S.DONE, receiver.reason("r")
        for rank, rx in enumerate(w.receivers):
            first, count = w.dst_place[rank]
            want = w.whole[:, :, src_ids, :, first:first + count]
            torch.testing.assert_close(rx.kv_buffer[:, :, dst_ids], want, rtol=0, atol=0)
        settle(sender, receiver, "r")
        assert sender.pending() == [] and receiver.pending() == []
        assert sender.leaks() == [] and receiver.leaks() == []
    finally:
        w.close()


def test_a_plain_handle_is_refused_by_a_worker_of_two_ranks():
    w = Pair("loopback", 2, 1, total=TOTAL)
    sender = RankSender(w.senders)
    try:
        plain = w.receivers[0].expect("r", [1, 2])
        with pytest.raises(ValueError, match="2 tensor parallel ranks"):
            sender.add_request(plain, [3, 4])
        assert sender.pending() == [] and all(tx.pending() == [] for tx in w.senders)
        w.receivers[0].abort("r")
        w.receivers[0].release("r")
    finally:
        w.close()


def test_pairs_added_before_a_failing_one_are_reaped():
    w = Pair("loopback", 2, 1, total=TOTAL)
    sender, receiver = RankSender(w.senders), RankReceiver(w.receivers, TOTAL)
    try:
        handle = decode_kv_handle(receiver.expect("r", [5, 6], 2))

        def refuse(*args, **kwargs):
            raise ValueError("rank 1 refuses")
        w.senders[1].add_request = refuse  # type: ignore[method-assign]
        with pytest.raises(ValueError, match="rank 1 refuses"):
            sender.add_request(handle, [1, 2])
        assert sender.pending() == [] and sender.has_orphans()
        assert any("r/tp0-0" in held for held in sender.leaks())
        assert w.senders[0].wait_until(lambda: w.senders[0].status("r/tp0-0").is_terminal, WAIT)
        receiver.abort("r")
        deadline_ok = w.senders[0].wait_until(lambda: (sender.reap_orphans(), not sender.has_orphans())[1],
                                              WAIT)
        assert deadline_ok, sender.leaks()
        assert sender.leaks() == []
        assert receiver.local.wait_until(lambda: receiver.releasable("r"), WAIT)
        receiver.release("r")
        assert receiver.leaks() == []
    finally:
        w.close()


def test_sender_ids_of_ranks():
    assert [rank_sender_id("p", r) for r in range(3)] == ["p", "p-tp1", "p-tp2"]


def test_a_rank_that_does_not_answer_is_unreachable_from_then_on(tmp_path):
    import time

    from workers.rank_kv import RemoteEndpoint

    remote = RemoteEndpoint(f"ipc://{tmp_path}/nobody", 1, timeout_s=0.2)
    try:
        with pytest.raises(TimeoutError, match="rank 1: no answer to pending within 200 ms"):
            remote.pending()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 is unreachable: no answer to pending"):
            remote.status("r")
        assert time.monotonic() - started < 0.1  # no second wait
    finally:
        remote.close()


@pytest.mark.parametrize(("p", "d", "total", "want"), [(2, 1, 4, 4), (1, 2, 4, 4), (2, 2, 4, 4), (1, 4, 2, 4),
                                                       (4, 1, 2, 2)])
def test_heads_written_count_every_rank_pair(p: int, d: int, total: int, want: int):
    # the prefill worker's transfer totals count every rank's bytes: with replicated heads (fewer KV
    # heads than decode ranks) each decode rank's copy is written, so more than the model's heads
    from workers.tp_kv import heads_written

    w = Pair("loopback", p, d, total=total)
    receiver = RankReceiver(w.receivers, total)
    try:
        handle = decode_kv_handle(receiver.expect("r", [1], p))
        assert heads_written(handle, local_heads=total // p if total >= p else 1) == want
        receiver.abort("r")
        receiver.release("r")
    finally:
        w.close()


def test_a_plain_handle_writes_the_senders_heads():
    from workers.tp_kv import heads_written

    w = Pair("loopback", 1, 1, total=TOTAL)
    try:
        plain = w.receivers[0].expect("r", [1])
        assert heads_written(plain, local_heads=TOTAL) == TOTAL
        w.receivers[0].abort("r")
        w.receivers[0].release("r")
    finally:
        w.close()
