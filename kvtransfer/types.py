"""kvtransfer's data types: protocol version, status, KV layout and handle, config, errors (no torch).

`KVLayout` describes one worker's paged KV tensor, `kv_buffer [num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]` (K = index 0, V = 1). `KVHandle` is what the decode worker hands to the
prefill worker (through the gateway): where and into which blocks to write.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgspec

from kvtransfer.curve import CurveKeys

PROTOCOL_VERSION = 8  # of the KV control plane (wire.py) and the KVHandle: part of compat.KVCompat, so peers
# of two versions are refused at pairing time; bump it with any change to a message's encoding or meaning


class TransferStatus(enum.Enum):
    """State of one request's KV transfer, on either side.

    PENDING: known, nothing written yet. TRANSFERRING: the sender has started (at least the handshake
    for the request is done). DONE: every layer landed (receiver) / the receiver confirmed it (sender).
    FAILED: deadline, dead peer, transport error or checksum mismatch. ABORTED: aborted by either side.
    """

    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def is_terminal(self) -> bool:
        """True for DONE, FAILED and ABORTED."""
        return self in (TransferStatus.DONE, TransferStatus.FAILED, TransferStatus.ABORTED)


class KVLayout(msgspec.Struct, frozen=True):
    """Shape of a paged KV tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`.

    `dtype` is the torch dtype name without prefix ("bfloat16"); `strides` are element strides of all
    six dims (torch `Tensor.stride()`); `itemsize` is bytes per element.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    itemsize: int
    strides: tuple[int, ...]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer, K or V: block_size * num_kv_heads * head_dim * itemsize."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def layer_stride_bytes(self) -> int:
        """Bytes from one layer's start to the next one's (strides[0] * itemsize)."""
        return self.strides[0] * self.itemsize

    def offset(self, layer: int, kv: int, block: int) -> int:
        """Byte offset of block `block` of K (kv=0) or V (kv=1) of `layer` from the tensor's start."""
        s = self.strides
        return (layer * s[0] + kv * s[1] + block * s[2]) * self.itemsize


class KVHandle(msgspec.Struct, frozen=True):
    """Destination of one request's KV, created by `KVReceiver.expect` on the decode worker.

    worker_id/epoch: the receiving worker and its incarnation (a restart changes the epoch, which makes
    old handles stale). block_ids: destination blocks in token order. address: the receiver's control
    endpoint (zmq, e.g. "tcp://127.0.0.1:5555"); transport-specific metadata (NIXL agent metadata, ucxx
    worker address) travels in the connect handshake, not in every handle. timeout_s: the deadline of
    the transfer in seconds, counted by the receiver from the sender's Begin and each landed layer
    (before the Begin, the receiver's claim deadline applies: KVReceiver.expect), by the sender from
    add_request and each layer handed off. num_cached_blocks: the prompt's leading blocks the receiver
    already holds (its prefix cache); `block_ids` are the destinations of the blocks after them, so the
    sender sends its blocks `num_cached_blocks ..` only (0: the whole prompt).
    """

    worker_id: str
    epoch: int
    request_id: str
    block_ids: tuple[int, ...]
    layout: KVLayout
    address: str
    backend: str
    timeout_s: float
    num_cached_blocks: int = 0


@dataclass(frozen=True)
class TransferConfig:
    """Settings of one sender or receiver.

    model_id/tp_size/tp_rank/total_kv_heads/backend enter the compatibility handshake (total_kv_heads: the
    model's KV heads over all tensor parallel ranks; 0: the kv_buffer's heads × tp_size, compat.kv_compat).
    timeout_s is the default per request deadline (seconds); heartbeat_interval_s and peer_timeout_s
    (seconds) decide when a silent peer is declared dead. checksum: debug setting, CRC32 of every
    request-layer checked on arrival.
    host/port: where a receiver binds its control socket (port 0 = pick a free one).
    max_inflight_layers: request-layers a sender keeps in flight at once (gathered or being written),
    each in its own slot of one staging ring: staging memory = this × the largest request-layer.
    direct_max_pieces: a request-layer whose source and destination runs give at most this many pieces
    (K and V counted; see runs.joint_runs) is written straight from kv_buffer without a gather (the
    direct path); 0 disables it. Fragmented sources go through the staging ring.
    busy_wait_s: longest nap (seconds) of a sender loop that has request-layers queued or in flight but
    nothing it can do now (waiting for CUDA events or write completions), and of a receiver loop while a
    request is TRANSFERRING (from its Begin, i.e. during the sender's prefill, to its last layer): the
    most latency a loop adds to noticing a completion or a landed layer (plus the kernel's timer slack:
    50 µs by default on Linux, 1 µs for the loop threads, wakeup.set_timer_slack). Capped at the loops'
    idle poll (10 ms). A command, a useful send_layer or a control message ends the nap at once.
    fine_wait_s: the sender's look interval (seconds) around the predicted end of its one write in
    flight (send_path.SendPath.nap_busy, lookahead.py); > 0 and <= busy_wait_s.
    nixl_error_handling: the nixl backend's UCX ucx_error_handling_mode (NIXL UCX plugin parameter).
    "peer" (NIXL's default): UCX reports a dead peer's transfers as errors, but endpoints with peer
    error handling exclude UCX's shared-memory transports, so within one host NIXL's notifications
    (the LayerNotices) travel over TCP loopback. "none": shared memory carries them; a dead peer is
    then found by heartbeats and deadlines only (peers.py, senders.py), as with every other backend.
    curve: the fleet's CURVE key pair (curve.py): the receiver's control socket is a CURVE server that
    accepts only clients holding it, the sender's sockets CURVE clients; None: plain sockets, any peer.
    fence_senders: a receiver answers a Hello (and adds the sender's transport metadata) only from the
    (sender id, epoch) pair last admitted for that id with `KVReceiver.admit_sender` (the decode worker
    admits each prefill worker the gateway names to it, with the KV sender epoch it registered); any
    other Hello (an id never admitted, or an admitted id with another epoch: a restarted or impostor
    sender) is refused (its HelloReply names why) and counted.
    sender_epoch: a sender's incarnation (KVSender.epoch; 0: a fresh one, wire.new_epoch): the tensor
    parallel ranks of one prefill worker share rank 0's, so a receiver admits them together. A receiver's
    epoch is always fresh.
    """

    worker_id: str
    model_id: str
    backend: str = "loopback"
    tp_size: int = 1
    tp_rank: int = 0
    total_kv_heads: int = 0
    timeout_s: float = 30.0
    heartbeat_interval_s: float = 0.2
    peer_timeout_s: float = 2.0
    checksum: bool = False
    host: str = "127.0.0.1"
    port: int = 0
    max_inflight_layers: int = 4
    direct_max_pieces: int = 16
    busy_wait_s: float = 50e-6
    fine_wait_s: float = 5e-6
    nixl_error_handling: str = "peer"
    curve: CurveKeys | None = None
    fence_senders: bool = False
    sender_epoch: int = 0

    def __post_init__(self) -> None:
        if self.max_inflight_layers < 1:
            raise ValueError(f"max_inflight_layers must be >= 1, got {self.max_inflight_layers}")
        if self.direct_max_pieces < 0:
            raise ValueError(f"direct_max_pieces must be >= 0, got {self.direct_max_pieces}")
        if not self.busy_wait_s > 0:  # also refuses NaN
            raise ValueError(f"busy_wait_s must be > 0 seconds, got {self.busy_wait_s}")
        if not 0 < self.fine_wait_s <= self.busy_wait_s:  # also refuses NaN
            raise ValueError(f"fine_wait_s must be > 0 and <= busy_wait_s ({self.busy_wait_s} s), "
                             f"got {self.fine_wait_s}")
        if self.nixl_error_handling not in ("peer", "none"):
            raise ValueError(f"nixl_error_handling must be 'peer' or 'none', "
                             f"got {self.nixl_error_handling!r}")
        if self.timeout_s <= 0 or self.heartbeat_interval_s <= 0:
            raise ValueError("timeout_s and heartbeat_interval_s must be > 0")
        if self.peer_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("peer_timeout_s must exceed heartbeat_interval_s")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} out of range for tp_size {self.tp_size}")


class TransferError(RuntimeError):
    """A transport operation failed (peer gone, deadline passed, transport error)."""


class IncompatiblePeerError(RuntimeError):
    """The peer's model/layout/backend/protocol differ; `mismatches` names each differing field."""

    def __init__(self, peer: str, mismatches: list[str]) -> None:
        self.mismatches = mismatches
        super().__init__(f"incompatible KV peer {peer}: " + "; ".join(mismatches))
