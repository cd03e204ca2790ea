"""KVSender.send_layers over nixl (DRAM) and ucx between real processes on 127.0.0.1: the parent is the
decode side, a spawned child the prefill side (see test_processes.py)."""

from __future__ import annotations

import pytest

from kvtransfer import TransferStatus
from tests.kvtransfer.helpers import LAYERS, assert_landed, make_kv
from tests.kvtransfer.test_direct import REQUESTS
from tests.kvtransfer.test_processes import SEED, WAIT, Child, add_in_child, backend, release_in_both, rx

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
S = TransferStatus
__all__ = ["backend", "rx"]  # fixtures used below


def test_send_layers_whole_requests_bit_exact(backend, rx):
    """Three requests (a contiguous source into shuffled destination blocks, a two-run source, a
    fragmented one: staged), each handed off by one send_layers call; CRC32 checked on arrival, then
    byte-compared, as the per-layer path does (test_direct_processes.py)."""
    child = Child(backend)
    try:
        for rid, (src_ids, dst_ids) in REQUESTS.items():
            add_in_child(child, rx, rid, dst_ids, src_ids)
        for rid in REQUESTS:
            assert child("send_layers", rid, None) is None
        for rid, (src_ids, dst_ids) in REQUESTS.items():
            assert rx.wait(rid, WAIT) is S.DONE, rx.reason(rid)
            assert child("wait", rid, WAIT) == "DONE"
            assert_landed(make_kv(SEED), src_ids, rx.kv_buffer, dst_ids)
            release_in_both(child, rx, rid)
        assert child("posted") == {"direct": 2 * LAYERS, "staged": LAYERS}
        used = {b for _, ids in REQUESTS.values() for b in ids}
        assert rx.kv_buffer[:, :, [b for b in range(32) if b not in used]].abs().sum() == 0
        assert child("leaks") is None
        rx.check_no_leaks()
    finally:
        child.close()


def test_send_layers_subset_rejects_then_per_layer_rest(backend, rx):
    """A subset by send_layers, refused calls (unknown request, a layer out of range or already sent:
    nothing queued), then the rest by send_layer: the request lands bit-exact, each layer once."""
    child = Child(backend)
    src_ids, dst_ids = REQUESTS["a"]
    try:
        add_in_child(child, rx, "a", dst_ids, src_ids)
        assert child("send_layers", "a", [LAYERS - 1, 0]) is None
        assert rx.wait_until(lambda: rx.snapshot("a").layers == {0, LAYERS - 1}, WAIT)
        refused = ((("nope", None), "KeyError"),
                   (("a", [1, LAYERS]), f"ValueError: layer {LAYERS} out of range"),
                   (("a", [1, 0]), "ValueError: layer(s) [0]"))
        for bad, why in refused:
            err = child("send_layers", *bad)
            assert isinstance(err, str) and err.startswith(why), err
        assert child("layers", "a", list(range(1, LAYERS - 1))) is None  # 1 was not marked by the refusal
        assert rx.wait("a", WAIT) is S.DONE, rx.reason("a")
        assert_landed(make_kv(SEED), src_ids, rx.kv_buffer, dst_ids)
        release_in_both(child, rx, "a")
        assert child("posted") == {"direct": LAYERS, "staged": 0}  # no layer queued twice
        assert child("leaks") is None
        rx.check_no_leaks()
    finally:
        child.close()
