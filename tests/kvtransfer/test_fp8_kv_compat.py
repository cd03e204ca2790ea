"""An FP8 KV cache (``--kv-cache-dtype fp8``) across the KV transfer: a bf16/fp8 pair is refused at the
handshake and by the gateway's pairing, with the dtype mismatch named; an fp8/fp8 pair moves the blocks
bit-exact (loopback transport, checksums on)."""

from __future__ import annotations

import pytest
import torch

from kvtransfer import IncompatiblePeerError, TransferStatus, get_transfer_backend
from kvtransfer.compat import kv_compat, mismatches
from kvtransfer.staging import layout_of
from tests.kvtransfer.helpers import LAYERS, config, make_kv, release_both

FP8 = torch.float8_e4m3fn
WAIT = 5.0
DTYPE_MISMATCH = "dtype 'float8_e4m3fn' != 'bfloat16'"


def test_bf16_fp8_pair_refused_at_the_handshake_naming_the_dtypes() -> None:
    backend = get_transfer_backend("loopback")
    rx = backend.receiver(config("d0", "loopback"), make_kv(None))  # bf16
    tx = backend.sender(config("p0", "loopback"), make_kv(1).to(FP8))
    try:
        with pytest.raises(IncompatiblePeerError) as info:
            tx.connect(rx.address, timeout=WAIT)
        text = str(info.value)
        assert DTYPE_MISMATCH in text
        assert "block_size" not in text and "block_strides" not in text  # only the dtype differs
        # a handle of that receiver (the prefill worker fails the request with this message) is refused
        # before anything is sent: fp8 and bf16 blocks differ in size
        handle = rx.expect("a", [1])
        with pytest.raises(ValueError,
                           match="dtype 'float8_e4m3fn' != 'bfloat16', bytes per KV head of a block 32"):
            tx.add_request(handle, [0])
        rx.abort("a")
        rx.release("a")
        tx.check_no_leaks()
        rx.check_no_leaks()
    finally:
        tx.close()
        rx.close()


def test_gateway_pairing_names_the_dtype_mismatch() -> None:
    bf16 = kv_compat("m", "nixl", layout_of(make_kv(None)))
    fp8 = kv_compat("m", "nixl", layout_of(make_kv(None).to(FP8)))
    assert mismatches(fp8, bf16) == [DTYPE_MISMATCH]
    assert mismatches(fp8, kv_compat("m", "nixl", layout_of(make_kv(None).to(FP8)))) == []


def test_fp8_pair_moves_blocks_bit_exact() -> None:
    backend = get_transfer_backend("loopback")
    src, dst = make_kv(1).to(FP8), make_kv(None).to(FP8)
    tx = backend.sender(config("p0", "loopback", checksum=True), src)
    rx = backend.receiver(config("d0", "loopback", checksum=True), dst)
    try:
        tx.connect(rx.address, timeout=WAIT)
        tx.add_request(rx.expect("r", [7, 3, 30]), [0, 12, 5])
        for layer in range(LAYERS):
            tx.send_layer("r", layer)
        assert rx.wait("r", WAIT) is TransferStatus.DONE, rx.reason("r")
        assert tx.wait("r", WAIT) is TransferStatus.DONE
        assert torch.equal(dst[:, :, [7, 3, 30]].view(torch.uint8), src[:, :, [0, 12, 5]].view(torch.uint8))
        assert bool((src[:, :, [0, 12, 5]].view(torch.uint8) != 0).any())  # real data moved, not zeros
        release_both(tx, rx, "r", WAIT)
        tx.check_no_leaks()
        rx.check_no_leaks()
    finally:
        tx.close()
        rx.close()
