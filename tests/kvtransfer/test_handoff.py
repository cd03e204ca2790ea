"""KVSender.send_layers over loopback: a request's finished KV handed off in one call (one lock, one
event shared by its layers, one wake-up), taken up in one step and posted as one write; rejected calls
queue and mark nothing; the shared event goes back to the pool once, after its last layer."""

from __future__ import annotations

import pytest
import torch

from kvtransfer import TransferError, TransferStatus, get_transfer_backend
from kvtransfer.events import EventPool
from kvtransfer.pipeline import LayerPipeline
from kvtransfer.transports.loopback import LoopbackSendTransport
from tests.kvtransfer.helpers import LAYERS, assert_landed, config, make_kv, release_both, sender_with
from tests.kvtransfer.loop_probes import record_writes, stall_loop

S = TransferStatus
WAIT = 5.0
# (source, destination) block ids: a contiguous source into shuffled, non-adjacent destination blocks
# (direct unless direct_max_pieces=0), and a shuffled source (always staged: 9 runs > 16 / 2)
DIRECT = ([3, 4, 5, 6], [17, 2, 29, 9])
STAGED = ([31, 7, 19, 2, 25, 12, 0, 15, 22], [8, 21, 1, 14, 27, 5, 11, 18, 24])


class FakeEvent:
    """Stands for torch.cuda.Event on CPU: always complete; counts its queries."""

    def __init__(self) -> None:
        self.queries = 0

    def record(self, stream: object) -> None:
        pass

    def query(self) -> bool:
        self.queries += 1
        return True


@pytest.fixture(params=[16, 0], ids=["direct", "staged"])
def pair(request):
    """(sender, receiver, src, dst, the sender's event pool): a loopback pair (checksums on) whose sender
    uses a pool of fake events (as on a GPU) and, with direct_max_pieces=0, sends every request staged."""
    src, dst = make_kv(5), make_kv(None)
    pool = EventPool(0, FakeEvent, lambda device: None)
    tx = sender_with(config("p0", "loopback", checksum=True, max_inflight_layers=2 * LAYERS,
                            direct_max_pieces=request.param), src, events=pool)
    rx = get_transfer_backend("loopback").receiver(config("d0", "loopback", checksum=True), dst)
    yield tx, rx, src, dst, pool
    tx.transport.deliver.set()  # type: ignore[attr-defined]
    tx.close()
    rx.close()


def _begun(tx, rx, rid: str, ids: tuple[list[int], list[int]]) -> None:
    tx.add_request(rx.expect(rid, ids[1]), ids[0])
    assert tx.wait_until(lambda: tx.snapshot(rid).begun, WAIT)


def _idle(tx) -> bool:
    """Wait until the sender has nothing queued or in flight and every event is back in the pool."""
    def idle() -> bool:
        st = tx.stats()
        return st.queued == 0 and st.in_pipeline == 0 and st.events_held == 0
    return tx.wait_until(idle, WAIT)


def _done(tx, rx, rid: str, ids: tuple[list[int], list[int]], src, dst) -> None:
    assert rx.wait(rid, WAIT) is S.DONE, rx.reason(rid)  # every layer's checksum matched
    assert tx.wait(rid, WAIT) is S.DONE, tx.reason(rid)
    assert_landed(src, ids[0], dst, ids[1])


def test_send_layers_lands_like_send_layer_in_one_write_and_one_event(pair):
    tx, rx, src, dst, pool = pair
    direct = tx.config.direct_max_pieces > 0
    writes = record_writes(tx)
    _begun(tx, rx, "a", DIRECT)
    tx.send_layers("a")
    _done(tx, rx, "a", DIRECT, src, dst)
    assert tx.snapshot("a").direct is direct
    assert writes == [[("a", la) for la in range(LAYERS)]]  # taken up in one step: one write, in order
    assert pool.created == 1 and pool.held == 0 and pool.free == 1  # one event, given back once
    release_both(tx, rx, "a")
    # the same blocks again by the per-layer path, into the staged request's destination: same bytes
    dst_b = STAGED[1][:len(DIRECT[0])]
    tx.add_request(rx.expect("b", dst_b), DIRECT[0])
    for layer in range(LAYERS):
        tx.send_layer("b", layer)
    _done(tx, rx, "b", (DIRECT[0], dst_b), src, dst)
    assert torch.equal(dst[:, :, DIRECT[1]].view(torch.uint8), dst[:, :, dst_b].view(torch.uint8))
    release_both(tx, rx, "b", leaks=True)
    assert pool.held == 0 and pool.free == pool.created


def test_staged_source_by_send_layers_bit_exact(pair):
    tx, rx, src, dst, pool = pair
    _begun(tx, rx, "c", STAGED)
    tx.send_layers("c")
    _done(tx, rx, "c", STAGED, src, dst)
    assert not tx.snapshot("c").direct  # fragmented source: gathered into the ring
    assert tx.stats().posted == {"direct": 0, "staged": LAYERS}
    release_both(tx, rx, "c", leaks=True)
    assert pool.held == 0 and pool.free == pool.created == 1
    used = set(STAGED[1])
    assert dst[:, :, [b for b in range(dst.shape[2]) if b not in used]].abs().sum() == 0


@pytest.mark.parametrize("per_request", [False, True])
def test_depth_bounds_the_batch_not_the_writes(per_request):
    """A batch of LAYERS layers is one write with depth >= LAYERS (also when the transport writes per
    request, like NIXL); with depth 3 it is split by the pipeline only: writes of 3 and 1 layers."""
    for depth, expected in ((LAYERS, [list(range(LAYERS))]), (3, [[0, 1, 2], [3]])):
        backend = get_transfer_backend("loopback")
        src, dst = make_kv(6), make_kv(None)
        tx = backend.sender(config("p0", "loopback", max_inflight_layers=depth), src)
        rx = backend.receiver(config("d0", "loopback"), dst)
        try:
            tx.transport.write_per_request = per_request
            writes = record_writes(tx)
            _begun(tx, rx, "a", DIRECT)
            tx.send_layers("a", range(LAYERS))
            _done(tx, rx, "a", DIRECT, src, dst)
            assert [[la for _, la in w] for w in writes] == expected, depth
            release_both(tx, rx, "a", leaks=True)
        finally:
            tx.close()
            rx.close()


def test_subset_then_send_layer_for_the_rest(pair):
    tx, rx, src, dst, pool = pair
    writes = record_writes(tx)
    _begun(tx, rx, "a", DIRECT)
    tx.send_layers("a", [2, 0])
    assert _idle(tx) and len(writes) == 1
    assert rx.status("a") is S.TRANSFERRING  # layers 1 and 3 still due
    with pytest.raises(ValueError, match=r"\[0\] of 'a' already sent"):
        tx.send_layers("a", [1, 0])  # nothing queued or marked: 1 may still be sent
    tx.send_layer("a", 1)
    assert _idle(tx) and len(writes) == 2
    tx.send_layers("a", [3])
    _done(tx, rx, "a", DIRECT, src, dst)
    assert writes == [[("a", 2), ("a", 0)], [("a", 1)], [("a", 3)]]
    release_both(tx, rx, "a", leaks=True)
    assert pool.created == 1 and pool.held == 0  # each event came back before the next call


def test_rejected_calls_queue_and_mark_nothing(pair):
    tx, rx, src, dst, pool = pair
    _begun(tx, rx, "a", DIRECT)
    gate = stall_loop(tx, WAIT)  # the loop takes nothing up: whatever a call queued stays visible
    tx.send_layer("a", 0)
    bad: list[tuple[type[Exception], str, tuple[object, ...]]] = [
        (ValueError, "out of range", ("a", [1, LAYERS])),
        (ValueError, "out of range", ("a", [-1])),
        (ValueError, "given twice", ("a", [1, 2, 1])),
        (ValueError, "already sent", ("a", None)),  # every layer, but 0 is sent
        (ValueError, "already sent", ("a", [2, 0])),
        (TypeError, "integer", ("a", [1.0])),
        (KeyError, "unknown request_id", ("nope", [1])),
    ]
    for exc, match, args in bad:
        with pytest.raises(exc, match=match):
            tx.send_layers(*args)
        assert tx.snapshot("a").layers == {0} and tx.stats().queued == 1, args
        assert pool.created == 1 and pool.held == 1, args  # no event recorded
    tx.send_layers("a", [])  # nothing to send: no event, nothing queued
    assert tx.stats().queued == 1 and pool.held == 1
    gate.set()
    for layer in range(1, LAYERS):
        tx.send_layer("a", layer)  # the request still completes by the per-layer path
    _done(tx, rx, "a", DIRECT, src, dst)
    assert sum(tx.stats().posted.values()) == LAYERS  # no layer went twice
    release_both(tx, rx, "a", leaks=True)
    assert pool.held == 0 and pool.free == pool.created
    tx.close()
    with pytest.raises(TransferError, match="not running"):
        tx.send_layers("a")


def test_aborted_request_gives_the_shared_event_back_once(pair):
    """Layers of a request aborted while they wait in the queue are dropped; their shared event comes
    back to the pool once, after the last of them (a give-back too many raises)."""
    tx, rx, _src, dst, pool = pair
    _begun(tx, rx, "a", DIRECT)
    gate = stall_loop(tx, WAIT)
    tx.send_layers("a")
    tx.abort("a")  # runs after the stall, before the queued layers are taken up
    assert pool.held == 1
    gate.set()
    assert tx.wait("a", WAIT) is S.ABORTED
    assert rx.wait("a", WAIT) is S.ABORTED
    release_both(tx, rx, "a", leaks=True)
    assert pool.held == 0 and pool.free == 1
    assert dst.abs().sum() == 0  # nothing was written


def test_shared_event_counts_its_uses():
    pool = EventPool(0, FakeEvent, lambda device: None)
    ev = pool.record(3)
    pool.give_back(ev)
    pool.give_back(ev)
    assert pool.held == 1 and pool.free == 0  # one layer still waits on it: not reusable yet
    assert pool.record() is not ev and pool.created == 2
    pool.give_back(ev)
    assert pool.free == 1 and pool.held == 1  # the second event is still out
    with pytest.raises(ValueError, match="more often"):
        pool.give_back(ev)
    with pytest.raises(ValueError, match="uses"):
        pool.record(0)


def test_ready_queries_a_shared_event_once():
    """LayerPipeline.ready() (every loop step) asks a CUDA event shared by several request-layers once."""
    kv = make_kv(None)
    pipe = LayerPipeline(kv, LoopbackSendTransport(), depth=2 * LAYERS, direct=True)
    src = torch.tensor(DIRECT[0])
    shared, alone = FakeEvent(), FakeEvent()
    items = [("a", la, src, shared, True) for la in range(LAYERS)] + [("b", 0, src, alone, True)]
    assert pipe.start(items) == LAYERS + 1
    expected = [("a", la) for la in range(LAYERS)] + [("b", 0)]
    assert [(op.request_id, op.layer) for op in pipe.ready()] == expected
    assert (shared.queries, alone.queries) == (1, 1)
    pipe.ready()
    assert (shared.queries, alone.queries) == (2, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("direct_max_pieces", [0, 16])  # staged (gathered on a side stream), direct
def test_cuda_send_layers_waits_for_the_callers_stream(direct_max_pieces):
    """On a GPU: every layer's KV is stored behind a spin on the caller's stream, then ONE send_layers:
    its one event (from the pool) orders every write or gather after the stores, and comes back once."""
    ref = make_kv(4).cuda()
    src, dst = torch.zeros_like(ref), make_kv(None).cuda()
    pool = EventPool(0)  # real CUDA events, as the sender makes for a CUDA kv_buffer
    tx = sender_with(config("p0", "loopback", checksum=True, direct_max_pieces=direct_max_pieces,
                            max_inflight_layers=LAYERS), src, events=pool)
    rx = get_transfer_backend("loopback").receiver(config("d0", "loopback", checksum=True), dst)
    try:
        for rnd in range(2):
            rid = f"a{rnd}"
            tx.add_request(rx.expect(rid, DIRECT[1]), DIRECT[0])
            torch.cuda._sleep(5_000_000)  # a slow "forward pass" before the stores
            src.copy_(ref)
            tx.send_layers(rid)
            _done(tx, rx, rid, DIRECT, ref, dst)
            release_both(tx, rx, rid, leaks=True)
            src.zero_()
            dst.zero_()
            torch.cuda.synchronize()
            assert pool.held == 0 and pool.free == pool.created
        assert pool.created == 1  # one event per call, reused by the second request
    finally:
        tx.close()
        rx.close()
