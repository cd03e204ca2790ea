"""The sender's cheaper post path over loopback: prepared lists per direct request (prepare_layers,
released once the request is terminal with nothing in flight), one write per request where the
transport asks for it (write_per_request), reused send_layer events (events.EventPool, with fake CUDA
events on CPU) and the trace of the data path and of the DONE round trip."""

from __future__ import annotations

import pytest
import torch

from kvtransfer import TransferStatus, get_transfer_backend
from kvtransfer.events import EventPool
from tests.kvtransfer.helpers import LAYERS, assert_landed, config, make_kv, release_both, sender_with
from tests.kvtransfer.loop_probes import record_writes, stall_loop

S = TransferStatus
WAIT = 5.0
A, B = ([0, 1, 2], [10, 11, 12]), ([5, 6], [20, 21])  # (source, destination) ids: direct requests


class FakeEvent:
    """Stands for torch.cuda.Event on CPU: records which stream it was recorded on, always complete."""

    def __init__(self) -> None:
        self.records: list[object] = []

    def record(self, stream: object) -> None:
        self.records.append(stream)

    def query(self) -> bool:
        return True


@pytest.fixture
def pair():
    backend = get_transfer_backend("loopback")
    src, dst = make_kv(3), make_kv(None)
    tx = backend.sender(config("p0", "loopback", checksum=True, max_inflight_layers=2 * LAYERS), src)
    rx = backend.receiver(config("d0", "loopback", checksum=True), dst)
    yield tx, rx, src, dst
    tx.transport.deliver.set()  # type: ignore[attr-defined]
    tx.close()
    rx.close()


def _count_preps(tx) -> dict[str, int]:
    """Count prepare_layers / release_prepared calls of the sender's transport."""
    calls = {"prepared": 0, "released": 0}
    prepare, release = tx.transport.prepare_layers, tx.transport.release_prepared

    def counting_prepare(peer, layers):
        calls["prepared"] += 1
        return prepare(peer, layers)

    def counting_release(parts):
        calls["released"] += 1
        release(parts)
    tx.transport.prepare_layers, tx.transport.release_prepared = counting_prepare, counting_release
    return calls


def _begun(tx, *rids: str) -> None:
    assert tx.wait_until(lambda: all(tx.snapshot(r).begun for r in rids), WAIT)


@pytest.mark.parametrize("per_request", [False, True])
def test_direct_requests_share_a_write_unless_the_transport_wants_one_each(pair, per_request):
    tx, rx, src, dst = pair
    tx.transport.write_per_request = per_request
    calls, writes = _count_preps(tx), record_writes(tx)
    for rid, (s, d) in (("a", A), ("b", B)):
        tx.add_request(rx.expect(rid, d), s)
    _begun(tx, "a", "b")
    gate = stall_loop(tx, WAIT)  # every layer is queued before the loop takes any up: one step posts them all
    for layer in range(LAYERS):
        for rid in ("a", "b"):
            tx.send_layer(rid, layer)
    gate.set()
    for rid, (s, d) in (("a", A), ("b", B)):
        assert rx.wait(rid, WAIT) is S.DONE, rx.reason(rid)
        assert tx.wait(rid, WAIT) is S.DONE
        assert_landed(src, s, dst, d)
    requests = [sorted({rid for rid, _ in w}) for w in writes]
    assert requests == ([["a"], ["b"]] if per_request else [["a", "b"]])  # all layers ready at once
    assert calls["prepared"] == 2
    for rid in ("a", "b"):
        release_both(tx, rx, rid)
    tx.check_no_leaks()  # waits for the loop to release both prepared lists
    assert calls["released"] == 2
    rx.check_no_leaks()


def test_prepared_lists_of_an_aborted_request_are_released_before_release(pair):
    tx, rx, _src, _dst = pair
    calls = _count_preps(tx)
    tx.add_request(rx.expect("a", A[1]), A[0])
    _begun(tx, "a")
    assert calls["prepared"] == 1 and tx.snapshot("a").prepared and tx.stats().prepared == 1
    tx.transport.deliver.clear()
    tx.send_layer("a", 0)
    assert tx.wait_until(lambda: tx.stats().writing > 0, WAIT)
    tx.abort("a")
    assert tx.wait("a", WAIT) is S.ABORTED
    assert calls["released"] == 0  # a write is still in flight: its lists stay
    tx.transport.deliver.set()
    assert tx.wait_until(lambda: calls["released"] == 1, WAIT)  # terminal, nothing in flight
    assert "a" in tx.pending() and tx.stats().prepared == 0  # before release()
    assert not tx.snapshot("a").prepared
    release_both(tx, rx, "a", leaks=True)
    assert calls == {"prepared": 1, "released": 1}


def test_send_layer_events_come_back_to_the_pool(pair):
    """Every event recorded by send_layer returns to the pool once its layer's write was posted (direct)
    or its gather queued behind it (staged; no side stream on CPU: returned when the op finishes)."""
    _, rx, src, dst = pair
    pool = EventPool(0, FakeEvent, lambda device: f"stream-{device}", limit=2 * LAYERS)
    tx = sender_with(config("p1", "loopback", checksum=True, max_inflight_layers=2 * LAYERS), src,
                     events=pool)
    for rnd in range(2):
        rid = f"a{rnd}"
        tx.add_request(rx.expect(rid, A[1]), A[0])
        for layer in range(LAYERS):
            tx.send_layer(rid, layer)
        assert rx.wait(rid, WAIT) is S.DONE and tx.wait(rid, WAIT) is S.DONE, rx.reason(rid)
        assert_landed(src, A[0], dst, A[1])
        release_both(tx, rx, rid, leaks=True)
        assert pool.free == pool.created  # leak check: none held
    assert 1 <= pool.created <= LAYERS  # the second request reused the first one's events
    assert pool.created < 2 * LAYERS
    tx.close()


def test_event_pool_reuses_and_bounds():
    pool = EventPool(3, FakeEvent, lambda device: f"stream-{device}", limit=1)
    e1 = pool.record()
    e2 = pool.record()
    assert e1 is not e2 and pool.created == 2 and e1.records == ["stream-3"]
    pool.give_back(e1)
    pool.give_back(e2)  # over the limit: dropped
    pool.give_back(None)
    assert pool.free == 1
    assert pool.record() is e1 and e1.records == ["stream-3", "stream-3"] and pool.created == 2
    with pytest.raises(ValueError, match="limit"):
        EventPool(0, FakeEvent, limit=-1)


def test_trace_covers_the_post_path_and_the_done_round_trip(pair):
    tx, rx, _src, _dst = pair
    events: list[tuple[float, str, str, int]] = []
    rx_events: list[tuple[float, str, str, int]] = []
    tx.set_trace(events)
    rx.set_trace(rx_events)
    tx.add_request(rx.expect("a", A[1]), A[0])
    for layer in range(LAYERS):
        tx.send_layer("a", layer)
    assert tx.wait("a", WAIT) is S.DONE
    tx.set_trace(None)
    rx.set_trace(None)
    kinds = [w for _, w, _, _ in events]
    for what in ("gather", "post", "done"):
        assert sorted(la for _, w, _, la in events if w == what) == list(range(LAYERS))
    assert kinds.count("done_msg") == 1 and kinds.count("DONE") == 1 and "post:start" in kinds
    assert sorted(la for _, w, _, la in rx_events if w == "notice") == list(range(LAYERS))
    at = {w: t for t, w, _, _ in sorted(events + rx_events, reverse=True)}  # first time of each
    assert at["gather"] <= at["post"] <= at["notice"] <= at["done_sent"] <= at["done_msg"] <= at["DONE"]
    release_both(tx, rx, "a", leaks=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("direct_max_pieces", [0, 16])  # staged (gathered on a side stream), direct
def test_cuda_send_layer_events_are_reused_and_kv_lands(direct_max_pieces):
    """On a GPU: send_layer's pooled (reused) events still order each layer's write or gather after
    the caller's stream (the KV is stored there, behind a spin, right before send_layer; the staged
    gather runs on a side stream that must wait for it), every event comes back, nothing leaks."""
    src, dst = torch.zeros_like(make_kv(4)).cuda(), make_kv(None).cuda()
    ref = make_kv(4).cuda()
    pool = EventPool(0)  # real CUDA events, as the sender makes for a CUDA kv_buffer
    tx = sender_with(config("p0", "loopback", checksum=True, direct_max_pieces=direct_max_pieces), src,
                     events=pool)
    rx = get_transfer_backend("loopback").receiver(config("d0", "loopback", checksum=True), dst)
    try:
        for rnd in range(2):
            rid = f"a{rnd}"
            tx.add_request(rx.expect(rid, A[1]), A[0])
            for layer in range(LAYERS):
                torch.cuda._sleep(1_000_000)  # a slow "attention" before the store
                src[layer].copy_(ref[layer])
                tx.send_layer(rid, layer)
            assert rx.wait(rid, WAIT) is S.DONE and tx.wait(rid, WAIT) is S.DONE, rx.reason(rid)
            assert_landed(ref, A[0], dst, A[1])
            release_both(tx, rx, rid, leaks=True)
            src.zero_()
            dst.zero_()
            torch.cuda.synchronize()
            assert pool.free == pool.created
        assert pool.created <= LAYERS + 1  # the second request reused the first one's events
    finally:
        tx.close()
        rx.close()
