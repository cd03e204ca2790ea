"""Regression: a stall of an endpoint's OWN loop must not make it declare its peer lost.

Bench failure (2-core box, nixl, 8 requests in flight): a sender loop step took 1.8 s (a starved
gather and write) and a receiver step 1.56 s (a starved NIXL get_new_notifs); each side then checked
liveness right after its stall, before reading the heartbeats waiting in its socket, and both declared
the other lost ("no heartbeat for 2.0s") although neither had been silent that long. Liveness is now
checked right after the control socket is drained. Each test stalls one side for 1.5 s × its
peer_timeout_s (1.0 s) at the point where the old code went wrong; the other side never times out.
"""

from __future__ import annotations

import time

from kvtransfer import TransferStatus
from tests.kvtransfer.helpers import (
    LAYERS,
    assert_landed,
    endpoint_pair,
    patient_config,
    release_both,
    stall_once,
)

S = TransferStatus
WAIT = 5.0
STALL_S = 1.5  # > peer_timeout_s (1.0 s, helpers.config)


def _transfer(tx, rx, src, dst) -> None:
    tx.add_request(rx.expect("a", [4, 5, 6]), [1, 2, 3])
    for layer in range(LAYERS):
        tx.send_layer("a", layer)
    assert rx.wait("a", WAIT + STALL_S) is S.DONE, rx.reason("a")
    assert tx.wait("a", WAIT) is S.DONE, tx.reason("a")
    assert_landed(src, [1, 2, 3], dst, [4, 5, 6])
    release_both(tx, rx, "a", WAIT, leaks=True)


def test_sender_stalled_in_a_write_keeps_its_receiver():
    # the sender's peer_timeout_s is 1.0; the receiver heartbeats every 0.1 s and never gives up on it
    with endpoint_pair("loopback", 1, receiver=patient_config("d0")) as (tx, rx, src, dst):
        stalled = stall_once(tx.transport, "post", STALL_S)  # the loop blocks 1.5 s inside its first write
        _transfer(tx, rx, src, dst)
        assert stalled
        assert all(tx.stats().receivers.values())  # the receiver was never declared lost


def test_receiver_stalled_in_its_transport_keeps_its_sender():
    # the receiver's peer_timeout_s is 1.0
    with endpoint_pair("loopback", 2, sender=patient_config("p0")) as (tx, rx, src, dst):
        tx.connect(rx.address)
        assert rx.wait_until(lambda: len(rx.stats().senders) == 1, WAIT)
        stalled = stall_once(rx.transport, "poll", STALL_S)  # the loop blocks 1.5 s polling its transport
        assert rx.wait_until(lambda: bool(stalled), WAIT)
        time.sleep(0.3)  # a few more loop steps after the stall
        assert len(rx.stats().senders) == 1  # the sender was never dropped
        _transfer(tx, rx, src, dst)
