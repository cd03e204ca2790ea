"""Several request-layers in flight (staging ring), fences while they are, and add_request rollback.

The loopback transport keeps posted writes in flight while `transport.deliver` is cleared, which makes
every interleaving here deterministic."""

from __future__ import annotations

import time

import pytest
import torch

from kvtransfer import TransferError, TransferStatus
from kvtransfer.staging import StagingRing
from tests.kvtransfer.helpers import (
    LAYERS,
    assert_landed,
    config,
    endpoint_pair,
    make_kv,
    patient_config,
    release_both,
    sender_settled,
)
from tests.kvtransfer.loop_probes import record_writes, stall_loop

S = TransferStatus
WAIT = 5.0
DEPTH = 3  # < LAYERS: the last layer waits in the queue while the others are in flight


@pytest.fixture(params=["staged", "direct"])
def pair(request):
    """Sender/receiver pair; "staged" disables the direct path (direct_max_pieces=0), "direct" keeps
    the default, under which every source here (at most 3 runs) is written straight from kv_buffer."""
    sender = config("p0", "loopback", checksum=True, max_inflight_layers=DEPTH,
                    direct_max_pieces=0 if request.param == "staged" else 16)
    with endpoint_pair("loopback", 1, sender, config("d0", "loopback", checksum=True)) as (tx, rx, src, dst):
        yield tx, rx, src, dst
        tx.transport.deliver.set()  # type: ignore[attr-defined]


def _in_flight(tx, n):
    """Wait until n request-layers of the sender are in flight (posted, not completed)."""
    return tx.wait_until(lambda: tx.stats().writing == n, WAIT)


def test_several_layers_in_flight_then_bit_exact(pair):
    tx, rx, src, dst = pair
    tx.add_request(rx.expect("a", [7, 8, 9]), [2, 0, 5])
    tx.transport.deliver.clear()
    for layer in range(LAYERS):
        tx.send_layer("a", layer)
    assert _in_flight(tx, DEPTH)  # DEPTH writes posted at once, none waiting for the one before
    st = tx.stats()
    assert st.in_pipeline == DEPTH and st.queued == LAYERS - DEPTH  # depth bounds both paths
    assert st.staging_slots_in_use == (DEPTH if tx.config.direct_max_pieces == 0 else 0)
    assert rx.status("a") is S.TRANSFERRING and not rx.snapshot("a").layers
    tx.transport.deliver.set()
    assert rx.wait("a", WAIT) is S.DONE, rx.reason("a")
    assert tx.wait("a", WAIT) is S.DONE
    assert_landed(src, [2, 0, 5], dst, [7, 8, 9])
    release_both(tx, rx, "a", WAIT, leaks=True)


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_abort_with_layers_in_flight_fences_until_they_complete(pair, side):
    tx, rx, _src, dst = pair
    tx.add_request(rx.expect("a", [4, 5]), [1, 2])
    tx.transport.deliver.clear()
    for layer in range(LAYERS):
        tx.send_layer("a", layer)
    assert _in_flight(tx, DEPTH)
    (tx if side == "sender" else rx).abort("a")
    assert tx.wait("a", WAIT) is S.ABORTED
    # a sender abort reaches the receiver only with the Stopped fence, after the writes in flight
    assert rx.wait("a", 0.3) is (S.ABORTED if side == "receiver" else S.TRANSFERRING)
    with pytest.raises(RuntimeError, match="in flight"):
        tx.release("a")  # its writes still read staging: no Stopped yet, blocks stay fenced
    assert not rx.wait_until(lambda: rx.releasable("a"), 0.3)
    tx.transport.deliver.set()  # the in-flight writes land (the blocks are still reserved)
    assert rx.wait("a", WAIT) is S.ABORTED
    release_both(tx, rx, "a", WAIT)
    assert dst[LAYERS - 1].abs().sum() == 0  # the queued layer was never written
    tx.check_no_leaks()
    rx.check_no_leaks()


def test_add_request_on_stopped_sender_keeps_nothing(pair):
    tx, rx, _src, _dst = pair
    handle = rx.expect("a", [1])
    tx.close()
    with pytest.raises(TransferError, match="not running"):
        tx.add_request(handle, [0])
    assert tx.pending() == []  # before the fix the request stayed tracked forever
    rx.abort("a")
    rx.release("a")
    tx.check_no_leaks()
    rx.check_no_leaks()


def test_release_refused_while_begin_unanswered():
    # long peer timeouts: the stalled receiver is not "lost"
    with endpoint_pair("loopback", 1, patient_config("p0"), patient_config("d0")) as (tx, rx, _, _):
        _begin_unanswered(tx, rx)


def _begin_unanswered(tx, rx):
    tx.connect(rx.address, timeout=WAIT)
    handle = rx.expect("a", [1, 2])
    gate = stall_loop(rx, WAIT)  # the receiver loop stalls: Begin stays unanswered
    tx.add_request(handle, [0, 1])
    tx.abort("a")
    assert tx.wait("a", WAIT) is S.ABORTED
    assert tx.wait_until(lambda: not tx.snapshot("a").fence_pending, WAIT)  # nothing to fence yet
    with pytest.raises(RuntimeError, match="Begin not answered"):
        tx.release("a")  # else the late BeginReply finds no request and Stopped is never sent
    gate.set()  # the receiver claims it now; the sender's Stopped fence frees the blocks
    assert rx.wait("a", WAIT) is S.ABORTED and "sender" in rx.reason("a")
    release_both(tx, rx, "a", WAIT, leaks=True)


def test_begin_left_unanswered_by_a_dead_receiver_is_released_once_it_is_lost():
    """The decode worker dies with a Begin in flight and the request is aborted meanwhile: the sender
    forgets it once the silent receiver is declared lost (peer_timeout_s, 1 s here), well before the
    request's deadline (30 s): nothing waits for a dead peer's answer."""
    limit = 10.0  # peer_timeout_s plus slack for a loaded machine; far below the deadline
    with endpoint_pair("loopback", 1, receiver=patient_config("d0")) as (tx, rx, _, _):
        tx.connect(rx.address, timeout=WAIT)
        handle = rx.expect("a", [1, 2])
        assert handle.timeout_s >= 3 * limit
        gate = stall_loop(rx, 3 * limit)  # silent from now on: no BeginReply, no heartbeat (as if killed)
        start = time.monotonic()
        tx.add_request(handle, [0, 1])
        tx.abort("a")
        assert tx.wait("a", WAIT) is S.ABORTED
        assert tx.wait_until(lambda: sender_settled(tx, "a") and tx.snapshot("a").answered, limit)
        assert time.monotonic() - start < limit
        tx.release("a")  # refused while the Begin was in flight ("Begin not answered yet")
        tx.check_no_leaks()
        gate.set()


def test_ready_layers_of_several_requests_go_in_one_write(pair):
    tx, rx, src, dst = pair
    tx.connect(rx.address, timeout=WAIT)
    posts = record_writes(tx)
    gate = stall_loop(rx, WAIT)  # Begins stay unanswered meanwhile
    reqs = {"a": ([3, 4], [0, 1]), "b": ([9], [5])}
    for rid, (dst_ids, src_ids) in reqs.items():
        tx.add_request(rx.expect(rid, dst_ids), src_ids)
    for rid, layer in (("a", 0), ("a", 1), ("b", 0)):
        tx.send_layer(rid, layer)
    assert tx.wait_until(lambda: tx.stats().in_pipeline == DEPTH, WAIT)  # started before Begin's answer
    assert posts == []
    tx_gate = stall_loop(tx, WAIT)  # both BeginReplies must reach the sender before its next step
    gate.set()
    assert rx.wait_until(lambda: all(rx.status(r) is S.TRANSFERRING for r in reqs), WAIT)
    time.sleep(0.2)  # the replies cross the loopback socket
    tx_gate.set()
    assert tx.wait_until(lambda: len(posts) > 0 and tx.stats().in_pipeline == 0, WAIT)
    assert posts == [[("a", 0), ("a", 1), ("b", 0)]]  # one write, one LayerNotices batch
    for rid, layer in [("a", la) for la in range(2, LAYERS)] + [("b", la) for la in range(1, LAYERS)]:
        tx.send_layer(rid, layer)
    for rid, (dst_ids, src_ids) in reqs.items():
        assert rx.wait(rid, WAIT) is S.DONE, rx.reason(rid)
        assert tx.wait(rid, WAIT) is S.DONE
        assert_landed(src, src_ids, dst, dst_ids)
        release_both(tx, rx, rid, WAIT)
    tx.check_no_leaks()
    rx.check_no_leaks()


def test_staging_ring_registers_once_and_grows_only_when_idle():
    kv = make_kv(None)
    registered: list[int] = []
    ring = StagingRing(kv, 2, lambda t: registered.append(t.numel()))
    a = ring.acquire(3)
    b = ring.acquire(3)
    assert a is not None and b is not None and {a, b} == {0, 1}
    assert ring.acquire(1) is None  # full
    assert registered == [2 * StagingRing.GRANULE]  # one registration for both slots
    assert ring.view(1, 3).data_ptr() == ring.data.data_ptr() + ring.slot_bytes
    ring.release(a)
    big = StagingRing.GRANULE // ring.bytes_for(1) + 1  # needs more than one MiB
    assert ring.acquire(big) is None  # must grow, but slot b is in use
    ring.release(b)
    slot = ring.acquire(big)
    assert slot is not None
    assert registered == [2 * StagingRing.GRANULE, 4 * StagingRing.GRANULE]
    ring.release(slot)
    assert ring.in_use == 0
    with pytest.raises(ValueError, match="not in use"):
        ring.release(slot)
    with pytest.raises(ValueError, match="depth"):
        StagingRing(kv, 0, lambda t: None)
    with pytest.raises(ValueError, match="max_inflight_layers"):
        config("p0", "loopback", max_inflight_layers=0)


def test_staging_view_shape_and_dtype():
    kv = make_kv(3, dtype=torch.float16)
    ring = StagingRing(kv, 1, lambda t: None)
    slot = ring.acquire(5)
    assert slot == 0
    view = ring.view(slot, 5)
    assert view.shape == (2, 5, *kv.shape[3:]) and view.dtype == torch.float16
