"""kvtransfer: move a request's KV blocks from a prefill worker to a decode worker, layer by layer.

The workers' surface is `api.KVSender` and `api.KVReceiver` (each call's contract: threads, blocking,
errors, block lifetime); `get_transfer_backend(name)` makes started ones over a transport.

Decode worker (receiver; owns the destination blocks)::

    rx = get_transfer_backend("nixl").receiver(TransferConfig(worker_id="d0", model_id=m, backend="nixl"),
                                               kv_buffer)
    handle = rx.expect(request_id, block_ids)          # blocks from BlockManager (contiguous if possible)
    ...send `handle` (a msgspec Struct) to the prefill worker through the gateway (KVReserved)...
    rx.status(request_id)                              # DONE only when every layer landed
    rx.abort(request_id)                               # client went away: the sender is told to stop
    if rx.releasable(request_id): rx.release(request_id); block_manager.free(seq)
    rx.close()

Prefill worker (sender)::

    tx = get_transfer_backend("nixl").sender(TransferConfig(worker_id="p0", model_id=m, backend="nixl"),
                                              kv_buffer)
    tx.add_request(handle, seq.block_table)            # claims the blocks while the forward pass runs
    for layer in range(num_layers): ... compute; tx.send_layer(request_id, layer)   # from layer_hook
    tx.status(request_id) → DONE: free the prefill blocks; tx.release(request_id) once it allows it
    tx.abort(request_id)                               # on abort; then wait for a terminal status
    tx.close()

Objects (composition; each owns its state, none inherits another's). api.py: the KVSender and
KVReceiver contracts; types.py: handle, layout, status, config, errors; stats.py: snapshot/stats copies.

    sender.SenderEndpoint          the KVSender: public calls, its loop step and waits
      ├─ requests.RequestTable     the lock + each request's SendState (SendPlan fixed at add_request)
      ├─ loop.LoopThread           the one thread: commands, then a step, until closed (+ wakeup.Waker)
      ├─ peers.ReceiverPeers       receivers: sockets, Hello/HelloReply (compat.py), liveness, KeepAlive
      ├─ send_path.SendPath        hand-off queue → pipeline.LayerPipeline (staging.StagingRing, writes in
      │                            flight, lookahead.WriteRate) → transport → completions; busy naps
      ├─ send_control.SendControl  Begin, replies, Stopped/Withdraw fences, deadlines, peer loss
      └─ send_wait.SenderWait      when the loop sleeps and how long (idle poll, busy naps, look-ahead)
    receiver.ReceiverEndpoint      the KVReceiver: public calls, its loop step and waits, block lifetime
      ├─ requests.RequestTable     the lock + each request's RecvState
      ├─ loop.LoopThread
      ├─ senders.SenderPeers       senders: handshakes, liveness, dropped ones, which notices to trust
      └─ recv_control.RecvControl  Hello, Begin, notices and landings, Stopped/Withdraw, deadlines, drops
    transports/                    the data plane: base.SendTransport / RecvTransport (ABCs) and the
                                   loopback (in-process, tests), ucx (ucxx tag send/recv) and nixl
                                   (one-sided WRITE) implementations
    wire.py                        the control-plane messages (msgspec, over pyzmq)
    compat.py                      KVCompat + mismatches: the one pairing check (also the gateway's)
    head_map.py                    tensor parallel head placements, which rank writes which heads, and
                                   the byte copies of a head slice
    ranked.py                      one request between tensor parallel workers: a transfer per rank pair
                                   (RankedReceive on the decode ranks, RankedSend on the prefill ranks)
    runs.py, staging.py, events.py pieces and offsets, gather and checksums, reusable CUDA events

This module imports nothing heavy (no torch): the gateway imports kvtransfer.compat through it.
"""

from kvtransfer.api import KVReceiver, KVSender
from kvtransfer.backends import BACKENDS, TransferBackend, get_transfer_backend
from kvtransfer.compat import KVCompat, kv_compat, mismatches
from kvtransfer.types import (
    PROTOCOL_VERSION,
    IncompatiblePeerError,
    KVHandle,
    KVLayout,
    TransferConfig,
    TransferError,
    TransferStatus,
)

__all__ = [
    "BACKENDS",
    "PROTOCOL_VERSION",
    "IncompatiblePeerError",
    "KVCompat",
    "KVHandle",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "TransferBackend",
    "TransferConfig",
    "TransferError",
    "TransferStatus",
    "get_transfer_backend",
    "kv_compat",
    "mismatches",
]
