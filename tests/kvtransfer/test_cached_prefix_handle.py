"""A receiver that holds a request's leading blocks already (its prefix cache): ``expect`` with
``num_cached_blocks`` puts the count in the ``KVHandle``; the sender, given the source blocks from that
index on, writes exactly those into the handle's blocks (loopback transport, bit-exact), and the blocks
before them are not touched."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvtransfer import KVHandle, TransferStatus, get_transfer_backend
from tests.kvtransfer.helpers import assert_landed, config, make_kv, release_both

WAIT = 5.0


def test_suffix_only_transfer_lands_bit_exact_and_leaves_the_cached_blocks_alone() -> None:
    backend = get_transfer_backend("loopback")
    src, dst = make_kv(1), make_kv(2)
    tx = backend.sender(config("p0", "loopback", checksum=True), src)
    rx = backend.receiver(config("d0", "loopback", checksum=True), dst)
    try:
        prompt_src = [7, 3, 12, 4, 5]  # the prefill side's blocks of a 5-block prompt
        cached_dst, suffix_dst = [20, 21], [9, 10, 11]  # the decode side holds the first 2 already
        before = dst[:, :, cached_dst].clone()
        handle = rx.expect("r", suffix_dst, num_cached_blocks=len(cached_dst))
        assert handle.num_cached_blocks == 2 and list(handle.block_ids) == suffix_dst
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(handle), type=KVHandle) == handle
        tx.add_request(handle, prompt_src[handle.num_cached_blocks:])
        tx.send_layers("r")
        assert rx.wait("r", WAIT) is TransferStatus.DONE, rx.reason("r")
        assert tx.wait("r", WAIT) is TransferStatus.DONE
        assert_landed(src, prompt_src[2:], dst, suffix_dst)
        assert torch.equal(dst[:, :, cached_dst], before)
        release_both(tx, rx, "r", WAIT)
        tx.check_no_leaks()
        rx.check_no_leaks()
    finally:
        tx.close()
        rx.close()


def test_negative_cached_count_refused_and_the_default_is_none_cached() -> None:
    backend = get_transfer_backend("loopback")
    rx = backend.receiver(config("d0", "loopback"), make_kv(None))
    try:
        with pytest.raises(ValueError, match="num_cached_blocks must be >= 0"):
            rx.expect("a", [1, 2], num_cached_blocks=-1)
        handle = rx.expect("a", [1, 2])
        assert handle.num_cached_blocks == 0
        rx.abort("a")
        rx.release("a")
        rx.check_no_leaks()
    finally:
        rx.close()
