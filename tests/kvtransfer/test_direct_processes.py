"""The direct path (and the staged fallback) over nixl and ucx between real processes: the parent is
the decode side, a spawned child the prefill side (see test_processes.py)."""

from __future__ import annotations

import pytest

from kvtransfer import TransferStatus
from tests.kvtransfer.helpers import LAYERS, assert_landed, make_kv
from tests.kvtransfer.test_direct import REQUESTS
from tests.kvtransfer.test_processes import (
    SEED,
    WAIT,
    Child,
    add_in_child,
    backend,
    release_in_both,
    rx,
    send_layerwise,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
S = TransferStatus
__all__ = ["backend", "rx"]  # fixtures used below


def test_direct_and_staged_layerwise_bit_exact(backend, rx):
    """Contiguous source into shuffled destination blocks, a two-run source into one destination run
    (ucx: the receiver splits its receives at the notice's source cuts) and a fragmented source
    (staged), interleaved layer by layer; CRC32 checked on arrival, then byte-compared."""
    child = Child(backend)
    try:
        send_layerwise(child, rx, REQUESTS)
        assert child("posted") == {"direct": 2 * LAYERS, "staged": LAYERS}
        assert child("leaks") is None
        rx.check_no_leaks()
    finally:
        child.close()


def test_direct_abort_mid_transfer_leaves_nothing_pending(backend, rx):
    child = Child(backend)
    try:
        add_in_child(child, rx, "a", [20, 21, 22, 23], [4, 5, 6, 7])
        assert child("layers", "a", [0]) is None
        assert rx.wait_until(lambda: 0 in rx.snapshot("a").layers, WAIT)
        assert child("abort", "a") is None
        assert rx.wait("a", WAIT) is S.ABORTED
        assert child("layers", "a", [1, 2, 3]) is None  # after the abort: never written
        release_in_both(child, rx, "a")
        assert child("posted") == {"direct": 1, "staged": 0}
        assert rx.kv_buffer[1:].abs().sum() == 0
        assert_landed(make_kv(SEED)[:1], [4, 5, 6, 7], rx.kv_buffer[:1], [20, 21, 22, 23])
        assert child("leaks") is None
        rx.check_no_leaks()
    finally:
        child.close()
