"""kvtransfer: move a request's KV blocks from a prefill worker to a decode worker, layer by layer.

Decode worker (receiver; owns the destination blocks)::

    backend = get_transfer_backend("nixl")            # or "ucx", "loopback"
    rx = backend.receiver(TransferConfig(worker_id="d0", model_id=m, backend="nixl"), kv_buffer)
    handle = rx.expect(request_id, block_ids)          # blocks from BlockManager (contiguous if possible)
    ...send `handle` (a msgspec Struct) to the prefill worker through the gateway (KVReserved)...
    rx.status(request_id) / rx.wait(request_id, timeout)   # DONE only when every layer landed
    rx.abort(request_id)                               # client went away: the sender is told to stop
    if rx.releasable(request_id): rx.release(request_id); block_manager.free(seq)
    rx.close()

Prefill worker (sender)::

    tx = get_transfer_backend("nixl").sender(TransferConfig(worker_id="p0", model_id=m, backend="nixl"),
                                              kv_buffer)
    tx.connect(handle.address)           # optional: raises IncompatiblePeerError at connect time
    tx.add_request(handle, seq.block_table)
    for layer in range(num_layers): ... compute; tx.send_layer(request_id, layer)   # from layer_hook
    tx.send_layers(request_id)           # or: every layer at once, its KV already all in kv_buffer
    tx.wait(request_id, timeout) → DONE; tx.release(request_id); free the prefill blocks
    tx.abort(request_id)                 # on abort; then wait for a terminal status and release
    tx.close()

Both sides run one background thread each; every call above is thread-safe and non-blocking except
connect() and wait(). This module imports nothing heavy (no torch).
"""

from kvtransfer.api import (
    PROTOCOL_VERSION,
    IncompatiblePeerError,
    KVHandle,
    KVLayout,
    TransferConfig,
    TransferError,
    TransferStatus,
)
from kvtransfer.backends import BACKENDS, TransferBackend, get_transfer_backend

__all__ = [
    "BACKENDS",
    "PROTOCOL_VERSION",
    "IncompatiblePeerError",
    "KVHandle",
    "KVLayout",
    "TransferBackend",
    "TransferConfig",
    "TransferError",
    "TransferStatus",
    "get_transfer_backend",
]
