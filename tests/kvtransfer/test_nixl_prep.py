"""NIXL sender transport in one process (two agents, DRAM): prepared descriptor lists (prep_xfer_dlist
once per request, make_prepped_xfer by index per write), the merged fallback for writes mixing
requests, and the release of prepared lists (request done, peer removed, close)."""

from __future__ import annotations

import os

import pytest
import torch

from kvtransfer.transports.base import KV
from kvtransfer.transports.nixl_prep import PreppedRequest, merge_descs
from kvtransfer.types import TransferError

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
pytestmark = pytest.mark.timeout(60)
NBYTES, PIECE = 1 << 16, 256
PEER = "rx"
SENDER = "tx"  # the receiver's peer key of tx: poll() names each notification's sender by it


def test_merge_descs_joins_only_pairs_contiguous_on_both_sides():
    local = [(100, 10, 0), (110, 5, 0), (115, 5, 0), (200, 4, 0), (204, 4, 1)]
    remote = [(500, 10, 0), (510, 5, 0), (900, 5, 0), (905, 4, 0), (909, 4, 0)]
    # 0+1 merge; 2 breaks on the remote side; 3 breaks on the local side; 4 changes device
    assert merge_descs(local, remote) == (
        [(100, 15, 0), (115, 5, 0), (200, 4, 0), (204, 4, 1)],
        [(500, 15, 0), (900, 5, 0), (905, 4, 0), (909, 4, 0)])
    assert merge_descs([], []) == ([], [])
    with pytest.raises(ValueError, match="2 local descriptors for 1 remote"):
        merge_descs(local[:2], remote[:1])


def test_prepped_request_indexes_each_layer():
    req = PreppedRequest(("a", 0, 0, "DRAM"), None, None, [[(0, 1, 0)] * 2, [], [(0, 1, 0)] * 3], [])
    assert req.idx == [[0, 1], [], [2, 3, 4]]


@pytest.fixture
def link():
    from kvtransfer.transports.nixl import NixlRecvTransport, NixlSendTransport

    src = torch.arange(NBYTES, dtype=torch.int32).to(torch.uint8)
    dst = torch.zeros(NBYTES, dtype=torch.uint8)
    rx = NixlRecvTransport(f"prep-rx-{os.getpid()}", dst)
    tx = NixlSendTransport(f"prep-tx-{os.getpid()}")
    tx.register_kv(src)
    tx.add_peer(PEER, rx.metadata())
    rx.add_peer(SENDER, tx.metadata())
    tx.trace = []
    yield tx, rx, src, dst
    tx.close()
    rx.close()


def _layers(base: int, n_layers: int, gap: int) -> list[list[tuple[int, int, int, int]]]:
    """Two pieces (K, V) per layer from source offset base; `gap` bytes between consecutive pieces
    (0: all contiguous, so the whole request is one range). Destination = source offsets."""
    out, off = [], base
    for _ in range(n_layers):
        layer = []
        for _kv in (0, 1):
            layer.append((KV, off, off, PIECE))
            off += PIECE + gap
        out.append(layer)
    return out


def _post_and_wait(tx, rx, parts, notice: bytes) -> None:
    """Post, then poll both sides as their loops do (a DRAM receiver has no NIXL progress thread: its
    polls progress the rendezvous) until the write completed and its notification arrived."""
    handle = tx.post_prepared(PEER, parts, notice, 0)
    done, notices = False, []
    for _ in range(100000):
        done = done or tx.test(handle)
        got, _ = rx.poll()
        notices += got
        if done and notices:
            assert notices == [(SENDER, notice)]
            return
    raise AssertionError(f"write complete: {done}, notifications: {notices}")


def _landed(src, dst, layers) -> bool:
    spans = [(s, n) for layer in layers for _, s, _, n in layer]
    return all(torch.equal(src[s:s + n], dst[s:s + n]) for s, n in spans)


@pytest.mark.parametrize("gap", [0, 64])
def test_one_request_posts_by_index_from_prepared_lists(link, gap):
    tx, rx, src, dst = link
    layers = _layers(0, 4, gap)
    parts = tx.prepare_layers(PEER, layers)
    assert tx.prepared_count() == 1 and len(parts) == 4
    _post_and_wait(tx, rx, parts[1:3], b"layers 1-2")  # one write of two layers, by index
    assert _landed(src, dst, layers[1:3]) and not _landed(src, dst, layers[:1])
    descs = [n for _, what, _, n in tx.trace if what == "post:descs"]
    assert descs == [4]  # indices of 2 layers x (K, V): no descriptor lists built
    assert [w for _, w, _, _ in tx.trace] == ["post:build", "post:descs", "post:init", "post:transfer"]
    _post_and_wait(tx, rx, [parts[0], parts[3]], b"layers 0, 3")
    assert _landed(src, dst, layers)
    tx.release_prepared(parts)
    tx.release_prepared(parts)  # idempotent
    assert tx.prepared_count() == 0
    with pytest.raises(TransferError, match="changed since the write was prepared"):
        tx.post_prepared(PEER, parts[:1], b"x", 0)


def test_write_mixing_requests_builds_merged_lists(link):
    tx, rx, src, dst = link
    a = tx.prepare_layers(PEER, _layers(0, 2, 0))  # bytes [0, 1024): one range
    b_layers = _layers(4096, 2, 0)  # bytes [4096, 5120)
    b = tx.prepare_layers(PEER, b_layers)
    staged = tx.prepare(PEER, [(KV, 8192, 8192, PIECE)])  # a prepare() part in the same write
    _post_and_wait(tx, rx, [*a, *b, staged], b"mixed")
    assert _landed(src, dst, _layers(0, 2, 0) + b_layers + [[(KV, 8192, 8192, PIECE)]])
    assert [n for _, w, _, n in tx.trace if w == "post:descs"] == [3]  # 9 pieces merged into 3 ranges
    assert dst[1024:4096].sum() == 0 and dst[5120:8192].sum() == 0  # nothing between them written
    tx.release_prepared(a)
    assert tx.prepared_count() == 1
    tx.release_prepared(b)
    assert tx.prepared_count() == 0


def test_remove_peer_releases_its_prepared_lists(link):
    tx, rx, _src, _dst = link
    parts = tx.prepare_layers(PEER, _layers(0, 2, 0))
    tx.remove_peer(PEER)
    assert tx.prepared_count() == 0
    with pytest.raises(TransferError, match="no NIXL connection"):
        tx.post_prepared(PEER, parts, b"x", 0)
    with pytest.raises(TransferError, match="no NIXL connection"):
        tx.prepare_layers(PEER, _layers(0, 1, 0))
    tx.release_prepared(parts)  # already released with the peer: no error
    tx.add_peer(PEER, rx.metadata())
    with pytest.raises(TransferError, match="changed since the write was prepared"):
        tx.post_prepared(PEER, parts, b"x", 0)  # prepared for the old connection
    assert tx.prepared_count() == 0


def test_unregistered_region_and_empty_write_are_refused(link):
    tx, _rx, _src, _dst = link
    with pytest.raises(TransferError, match="not registered"):
        tx.prepare_layers(PEER, [[(0, 0, 0, PIECE)]])  # STAGING was never set
    with pytest.raises(TransferError, match="empty NIXL write"):
        tx.post_prepared(PEER, [], b"x", 0)
    assert tx.prepared_count() == 0
