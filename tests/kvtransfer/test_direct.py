"""The direct path over loopback: KV written straight from the sender's kv_buffer when its source
blocks form few runs, the staged fallback for fragmented sources, and writes stuck to a lost peer."""

from __future__ import annotations

import pytest

from kvtransfer import TransferStatus, get_transfer_backend
from kvtransfer.transports.base import KV, STAGING
from tests.kvtransfer.helpers import LAYERS, assert_landed, config, make_kv, release_both

S = TransferStatus
WAIT = 5.0
# three requests over 32 blocks: a contiguous source into shuffled destination blocks; a source of two
# runs into one destination run (pieces split where the source breaks); a source with no two adjacent
# blocks (9 runs = 18 pieces > direct_max_pieces 16: staged)
REQUESTS = {
    "a": (list(range(6)), [14, 3, 9, 10, 27, 0]),
    "b": ([10, 11, 12, 20, 21, 22], [4, 5, 6, 7, 8, 11]),
    "c": ([31, 29, 27, 25, 23, 19, 17, 15, 13], [1, 2, 12, 13, 15, 16, 17, 18, 19]),
}


@pytest.fixture
def pair():
    backend = get_transfer_backend("loopback")
    src, dst = make_kv(1), make_kv(None)
    tx = backend.sender(config("p0", "loopback", checksum=True, max_inflight_layers=3), src)
    rx = backend.receiver(config("d0", "loopback", checksum=True), dst)
    yield tx, rx, src, dst
    tx.transport.deliver.set()  # type: ignore[attr-defined]
    tx.close()
    rx.close()


def _regions(tx) -> dict[str, set[int]]:
    """Record the source regions each request's pieces were written from."""
    seen: dict[str, set[int]] = {}
    orig = tx.transport.post

    def recording(peer, pieces, notice, tag):
        from kvtransfer import wire

        regions = {p[0] for p in pieces}  # one request per batch in this test: a batch has one path
        for n in wire.decode_notices(notice):
            seen.setdefault(n.request_id, set()).update(regions)
        return orig(peer, pieces, notice, tag)
    tx.transport.post = recording
    return seen


def test_direct_and_staged_requests_layerwise_bit_exact(pair):
    tx, rx, src, dst = pair
    tx.connect(rx.address, timeout=WAIT)
    for rid, (src_ids, dst_ids) in REQUESTS.items():
        tx.add_request(rx.expect(rid, dst_ids), src_ids)
    assert [tx.snapshot(r).direct for r in REQUESTS] == [True, True, False]
    for layer in range(LAYERS):
        for rid in REQUESTS:
            tx.send_layer(rid, layer)
    for rid, (src_ids, dst_ids) in REQUESTS.items():
        assert rx.wait(rid, WAIT) is S.DONE, rx.reason(rid)  # the checksums matched too
        assert tx.wait(rid, WAIT) is S.DONE
        assert_landed(src, src_ids, dst, dst_ids)
        release_both(tx, rx, rid)
    assert tx.stats().posted == {"direct": 2 * LAYERS, "staged": LAYERS}
    used = {b for _, ids in REQUESTS.values() for b in ids}
    assert dst[:, :, [b for b in range(32) if b not in used]].abs().sum() == 0
    tx.check_no_leaks()
    rx.check_no_leaks()


def test_direct_writes_read_kv_buffer_and_staged_read_the_ring(pair):
    tx, rx, src, dst = pair
    seen = _regions(tx)
    for rid in ("a", "c"):
        src_ids, dst_ids = REQUESTS[rid]
        tx.add_request(rx.expect(rid, dst_ids), src_ids)
        for layer in range(LAYERS):
            tx.send_layer(rid, layer)
        assert rx.wait(rid, WAIT) is S.DONE, rx.reason(rid)
        assert_landed(src, src_ids, dst, dst_ids)
        release_both(tx, rx, rid)
    assert seen == {"a": {KV}, "c": {STAGING}}
    tx.check_no_leaks()
    rx.check_no_leaks()


def test_direct_disabled_goes_staged():
    backend = get_transfer_backend("loopback")
    src, dst = make_kv(2), make_kv(None)
    tx = backend.sender(config("p0", "loopback", direct_max_pieces=0), src)
    rx = backend.receiver(config("d0", "loopback"), dst)
    try:
        tx.add_request(rx.expect("a", [5, 6]), [0, 1])
        for layer in range(LAYERS):
            tx.send_layer("a", layer)
        assert rx.wait("a", WAIT) is S.DONE and tx.wait("a", WAIT) is S.DONE
        assert_landed(src, [0, 1], dst, [5, 6])
        assert tx.stats().posted == {"direct": 0, "staged": LAYERS}
        release_both(tx, rx, "a", leaks=True)
    finally:
        tx.close()
        rx.close()
    with pytest.raises(ValueError, match="direct_max_pieces"):
        config("p0", "loopback", direct_max_pieces=-1)


def test_writes_stuck_to_a_lost_peer_are_cancelled_and_freed(pair):
    """A write to a SIGKILLed decode worker may never complete nor fail (seen in CI): once the peer is
    declared lost every posted write to it is cancelled, also those of requests already terminal."""
    tx, rx, _src, _dst = pair
    for rid in ("a", "c"):  # one direct, one staged (holds a ring slot)
        src_ids, dst_ids = REQUESTS[rid]
        tx.add_request(rx.expect(rid, dst_ids), src_ids)
    assert tx.wait_until(lambda: all(tx.snapshot(r).begun for r in ("a", "c")), WAIT)
    tx.transport.deliver.clear()  # posted writes never complete from now on
    for rid in ("a", "c"):
        tx.send_layer(rid, 0)
    assert tx.wait_until(lambda: tx.stats().writing == 2, WAIT)
    tx.abort("a")  # terminal, but its write is still in flight: no Stopped, not releasable
    assert tx.wait("a", WAIT) is S.ABORTED
    with pytest.raises(RuntimeError, match="in flight"):
        tx.release("a")
    rx.close()  # the decode worker dies: no more heartbeats
    assert tx.wait("c", 3 * tx.config.peer_timeout_s) is S.FAILED and "lost" in tx.reason("c")
    assert tx.wait_until(lambda: tx.stats().in_pipeline == 0, WAIT)
    assert tx.stats().staging_slots_in_use == 0
    assert all(tx.snapshot(r).inflight == 0 for r in ("a", "c"))
    assert tx.status("a") is S.ABORTED  # terminal states are final
    for rid in ("a", "c"):
        assert tx.wait_until(lambda r=rid: not tx.snapshot(r).fence_pending, WAIT)
        tx.release(rid)
    tx.check_no_leaks()
