"""A bad NIXL notification (DRAM, senders and receiver in this process) neither crashes the receiver nor
counts as a landed layer: garbage is skipped with a warning naming the peer, a layer out of range and a
notice for a request another peer claimed (or from an agent that is no peer) are ignored; the request
then completes with the real sender's data."""

from __future__ import annotations

import logging
import time

import msgspec
import pytest

from kvtransfer import TransferStatus, get_transfer_backend
from kvtransfer import wire as m
from kvtransfer.transports.nixl import NixlRecvMeta, make_agent
from tests.kvtransfer.helpers import LAYERS, assert_landed, config, make_kv, need_nixl, release_both

need_nixl()
pytestmark = pytest.mark.timeout(60)
PAIR_BACKEND, PAIR_SEED = "nixl", 5  # the `pair` fixture (conftest.py)
S = TransferStatus
WAIT = 10.0
SRC, DST = [0, 1, 2], [7, 8, 9]


def _begin(tx, rx, rid: str, dst: list[int] = DST) -> None:
    """Expect `rid` on rx and hand it to tx; wait until rx saw its Begin (TRANSFERRING)."""
    tx.add_request(rx.expect(rid, dst), SRC)
    assert rx.wait_until(lambda: rx.status(rid) is S.TRANSFERRING, WAIT)


def _notify(agent, rx, payload: bytes) -> None:
    """Send `payload` as a standalone NIXL notification from `agent` (already a remote of rx's agent),
    progressing `agent` (a DRAM agent has no progress thread; get_new_notifs progresses its worker)
    until rx's agent handed it to rx's loop; then give the loop time to judge it (its next steps)."""
    agent_rx, got = rx.transport.agent, []
    orig = agent_rx.get_new_notifs

    def counted():
        out = orig()
        got.extend(n for msgs in out.values() for n in msgs)
        return out
    agent_rx.get_new_notifs = counted
    agent.send_notif(agent_rx.name, payload)
    deadline = time.monotonic() + WAIT
    while payload not in got and time.monotonic() < deadline:
        assert not agent.get_new_notifs()  # nothing is ever sent to a sender's agent
        time.sleep(0.001)
    assert payload in got, "the notification never reached the receiver"
    time.sleep(0.2)


def _notices(rid: str, layers: list[int]) -> bytes:
    return m.encode(m.LayerNotices([m.LayerNotice(rid, la, 0, None, ()) for la in layers]))


def _finish(tx, rx, src, dst, rid: str) -> None:
    """The real sender's layers still complete the request, bit-exact."""
    tx.send_layers(rid)
    assert rx.wait(rid, WAIT) is S.DONE, rx.reason(rid)
    assert tx.wait(rid, WAIT) is S.DONE
    assert_landed(src, SRC, dst, DST)
    release_both(tx, rx, rid)


def test_undecodable_notification_is_skipped_and_logged(pair, caplog):
    tx, rx, src, dst = pair
    _begin(tx, rx, "a")
    with caplog.at_level(logging.WARNING, logger="kvtransfer"):
        _notify(tx.transport.agent, rx, b"\xc1 not msgpack")
    assert rx.stats().loop.alive  # the loop lives on
    assert rx.status("a") is S.TRANSFERRING, rx.reason("a")  # nothing failed
    peer = f"p0:{tx.epoch}".encode().hex()  # the receiver's peer key of tx: its zmq identity, hex
    warned = [r.getMessage() for r in caplog.records if "undecodable" in r.getMessage()]
    assert len(warned) == 1 and peer in warned[0]
    _finish(tx, rx, src, dst, "a")


def test_layer_out_of_range_is_never_counted(pair):
    tx, rx, src, dst = pair
    _begin(tx, rx, "a")
    _notify(tx.transport.agent, rx, _notices("a", [-1, LAYERS, LAYERS + 1, 10 ** 6]))
    assert rx.status("a") is S.TRANSFERRING, rx.reason("a")  # 4 bogus layers did not make it DONE
    assert rx.snapshot("a").layers == set()
    _finish(tx, rx, src, dst, "a")


@pytest.mark.parametrize("who", ["other sender", "stranger agent"])
def test_notice_from_a_peer_that_did_not_claim_the_request_is_ignored(pair, who):
    tx, rx, src, dst = pair
    _begin(tx, rx, "a")
    backend = get_transfer_backend("nixl")
    tx2 = backend.sender(config("p1", "nixl"), make_kv(6))
    try:
        if who == "other sender":  # a real peer of rx (handshaken for its own request "b")
            _begin(tx2, rx, "b", [20, 21, 22])
            agent = tx2.transport.agent
        else:  # an agent that loaded rx's metadata but never said Hello
            agent = make_agent("stranger-agent")
            agent.add_remote_agent(msgspec.msgpack.decode(rx.transport.metadata(), type=NixlRecvMeta).agent)
        _notify(agent, rx, _notices("a", list(range(LAYERS))))
        assert rx.status("a") is S.TRANSFERRING, rx.reason("a")  # not DONE on another peer's word
        assert rx.snapshot("a").layers == set()
        _finish(tx, rx, src, dst, "a")
    finally:
        tx2.close()
