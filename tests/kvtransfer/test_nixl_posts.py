"""The post path over NIXL (DRAM, sender and receiver in this process): a direct request's descriptor lists
are prepared once when its Begin is answered, every write of its layers is made from them by index
(make_prepped_xfer) and started once (transfer), every xfer handle is released exactly once, and the
lists are released once the request is terminal (done or aborted) with nothing in flight."""

from __future__ import annotations

import pytest

from kvtransfer import TransferStatus, get_transfer_backend
from kvtransfer import wire as m
from kvtransfer.runs import make_tag
from tests.kvtransfer.helpers import LAYERS, assert_landed, config, make_kv, need_nixl, release_both

need_nixl()
pytestmark = pytest.mark.timeout(60)
S = TransferStatus
WAIT = 10.0
SRC, DST = list(range(6)), [14, 3, 9, 10, 27, 0]  # one source run: direct (5 destination runs)


@pytest.fixture(params=[False, True], ids=["plain", "checksum"])
def pair(request):
    backend = get_transfer_backend("nixl")
    src, dst = make_kv(11), make_kv(None)
    tx = backend.sender(config("p0", "nixl", checksum=request.param), src)
    rx = backend.receiver(config("d0", "nixl", checksum=request.param), dst)
    yield tx, rx, src, dst
    tx.close()
    rx.close()


def _spy(tx, rx) -> dict[str, list]:
    """Record, from the next call on: xfer handles made (make_prepped_xfer), released (by id, each
    release_xfer_handle call), started (transfer), the sender transport's post calls, and the notices
    the receiver read (decoded, per notification)."""
    agent, seen = tx.transport.agent, {"made": [], "released": [], "started": [], "posts": [],
                                      "notices": []}

    def wrap(obj, name, record):
        orig = getattr(obj, name)

        def call(*args, **kwargs):
            out = orig(*args, **kwargs)
            record(args, out)
            return out
        setattr(obj, name, call)
    wrap(agent, "make_prepped_xfer", lambda a, out: seen["made"].append(out))
    wrap(agent, "release_xfer_handle", lambda a, out: seen["released"].append(id(a[0])))
    wrap(agent, "transfer", lambda a, out: seen["started"].append(id(a[0])))
    wrap(tx.transport, "post_prepared", lambda a, out: seen["posts"].append("by index"))
    wrap(rx.transport, "poll", lambda a, out: seen["notices"].extend(m.decode_notices(n) for _, n in out[0]))
    return seen


def _add(tx, rx, rid: str) -> None:
    tx.add_request(rx.expect(rid, DST), SRC)
    assert tx.wait_until(lambda: tx.snapshot(rid).prepared, WAIT)


def test_send_layers_of_a_direct_request_is_one_write_by_index(pair):
    tx, rx, src, dst = pair
    seen = _spy(tx, rx)
    _add(tx, rx, "a")
    key, cuts = tx.snapshot("a").key, tx.snapshot("a").cuts
    assert not seen["made"]  # the Begin answer prepares lists only: nothing made before a layer goes
    tx.send_layers("a")
    assert rx.wait("a", WAIT) is S.DONE, rx.reason("a")
    assert tx.wait("a", WAIT) is S.DONE
    assert_landed(src, SRC, dst, DST)
    assert seen["posts"] == ["by index"]  # one write of every layer
    assert len(seen["made"]) == 1 and seen["started"] == [id(seen["made"][0])]
    crc = tx.config.checksum
    got = [[(n.request_id, n.layer, n.tag, n.cuts, n.checksum is not None) for n in batch]
           for batch in seen["notices"]]
    assert got == [[("a", la, make_tag(key, la), cuts, crc) for la in range(LAYERS)]]
    release_both(tx, rx, "a", leaks=True)
    assert sorted(seen["released"]) == sorted(id(h) for h in seen["made"])  # each exactly once
    assert tx.transport.prepared_count() == 0


def test_layer_by_layer_hand_off_posts_each_write_by_index(pair):
    tx, rx, src, dst = pair
    seen = _spy(tx, rx)
    _add(tx, rx, "a")
    tx.send_layer("a", 0)
    assert rx.wait_until(lambda: rx.snapshot("a").layers == {0}, WAIT)
    tx.send_layers("a", range(1, LAYERS))
    assert rx.wait("a", WAIT) is S.DONE, rx.reason("a")
    assert tx.wait("a", WAIT) is S.DONE
    assert_landed(src, SRC, dst, DST)
    assert seen["posts"] == ["by index", "by index"]
    assert len(seen["made"]) == 2 and seen["started"] == [id(h) for h in seen["made"]]  # one per write
    release_both(tx, rx, "a", leaks=True)
    assert sorted(seen["released"]) == sorted(id(h) for h in seen["made"])  # each exactly once
    assert tx.transport.prepared_count() == 0


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_abort_before_the_hand_off_releases_the_prepared_lists(pair, side):
    tx, rx, _src, dst = pair
    seen = _spy(tx, rx)
    _add(tx, rx, "a")
    (tx if side == "sender" else rx).abort("a")
    assert tx.wait("a", WAIT) is S.ABORTED
    assert rx.wait("a", WAIT) is S.ABORTED
    assert tx.wait_until(lambda: not tx.snapshot("a").prepared, WAIT)  # lists released
    assert not seen["made"] and not seen["started"] and not seen["released"]
    release_both(tx, rx, "a", leaks=True)
    assert tx.transport.prepared_count() == 0 and dst.abs().sum() == 0  # nothing was written
