"""kvtransfer's public surface: the sender and receiver contracts, and the types they use (no torch).

`KVSender` and `KVReceiver` (Protocols, at the end of this file) are everything the workers call, each
call with its contract: thread-safety, blocking, errors raised, and who may free which block when.
`backends.get_transfer_backend(name).sender(...)/.receiver(...)` make started ones.

`KVLayout` describes one worker's paged KV tensor, `kv_buffer [num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]` (K = index 0, V = 1). `KVHandle` is what the decode worker hands to the
prefill worker (through the gateway): where and into which blocks to write. The snapshot and stats
types are copies for tests, benchmarks and monitoring.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgspec

if TYPE_CHECKING:
    from kvtransfer.compat import KVCompat

PROTOCOL_VERSION = 6  # of the KV control plane (wire.py): part of compat.KVCompat, so peers of two versions
# are refused at pairing time; bump it with any change to a message's encoding


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
    the whole transfer in seconds, counted by each side from when it learns of the request.
    """

    worker_id: str
    epoch: int
    request_id: str
    block_ids: tuple[int, ...]
    layout: KVLayout
    address: str
    backend: str
    timeout_s: float


@dataclass(frozen=True)
class TransferConfig:
    """Settings of one sender or receiver.

    model_id/tp_size/tp_rank/backend enter the compatibility handshake. timeout_s is the default per
    request deadline (seconds); heartbeat_interval_s and peer_timeout_s (seconds) decide when a silent
    peer is declared dead. checksum: debug setting, CRC32 of every request-layer checked on arrival.
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
    then found by heartbeats and deadlines only (liveness.py), as with every other backend.
    """

    worker_id: str
    model_id: str
    backend: str = "loopback"
    tp_size: int = 1
    tp_rank: int = 0
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


@dataclass(frozen=True, slots=True)
class SendSnapshot:
    """One request's state on the sender, copied under the sender's lock (`KVSender.snapshot`): for
    tests, monitoring and benchmarks; changes nothing.

    layers: layers handed off so far (send_layer/send_layers). direct: written straight from kv_buffer
    (else gathered into the staging ring). key: base of the request's tags (`runs.make_tag(key, layer)`).
    cuts: the source cuts its direct notices carry. begin_sent: its Begin went out to the receiver
    incarnation its handle names. answered: that Begin was answered (or can no longer be: receiver lost).
    begun: the receiver accepted it (claimed the request). inflight: request-layers gathered or being
    written. fence_pending: a Stopped or Withdraw is still to be sent. prepared: the transport holds
    prepared descriptor lists for it.
    """

    status: TransferStatus
    reason: str
    layers: frozenset[int]
    direct: bool
    key: int
    cuts: tuple[int, ...]
    begin_sent: bool
    answered: bool
    begun: bool
    inflight: int
    fence_pending: bool
    prepared: bool


@dataclass(frozen=True, slots=True)
class RecvSnapshot:
    """One request's state on the receiver, copied under the receiver's lock (`KVReceiver.snapshot`).

    layers: layers landed so far. claimed: a sender's Begin was accepted for it. stopped: that sender
    said Stopped (or every layer landed): it writes nothing more. sender_gone: that sender was dropped
    (lost, restarted, or `drop_sender`): its blocks are held until the request's deadline.
    """

    status: TransferStatus
    reason: str
    layers: frozenset[int]
    claimed: bool
    stopped: bool
    sender_gone: bool


@dataclass(frozen=True, slots=True)
class LoopStats:
    """An endpoint's loop thread. alive: running (started, not closed, not crashed); error: why it
    crashed (repr of the exception), or None; thread_id: `threading.Thread.ident` (None before start);
    steps: loop steps so far; waiting: asleep in an idle poll or a nap now; wakes: wake-up bytes sent
    to it so far (a caller's work ending a sleep)."""

    alive: bool
    error: str | None
    thread_id: int | None
    steps: int
    waiting: bool
    wakes: int


@dataclass(frozen=True, slots=True)
class SenderStats:
    """The sender's data path and peers now (`KVSender.stats`). queued: request-layers handed off and not
    yet in the pipeline; in_pipeline: gathered or being written (at most max_inflight_layers), of which
    `writing` are posted; writes: transport writes in flight; lone_write: (posted_at monotonic s,
    expected s) of the one write in flight when it has the transport to itself and a predicted end,
    else None (lookahead.py); staging_slots_in_use: staging ring slots held; posted: request-layers
    posted since start, by path ("staged", "direct"); prepared: requests whose prepared descriptor
    lists the transport holds; events_held: send_layer CUDA events not yet given back to the pool;
    receivers: each receiver's control address → its epoch (0: handshake not answered)."""

    loop: LoopStats
    queued: int
    in_pipeline: int
    writing: int
    writes: int
    lone_write: tuple[float, float] | None
    staging_slots_in_use: int
    posted: dict[str, int]
    prepared: int
    events_held: int
    receivers: dict[str, int]


@dataclass(frozen=True, slots=True)
class ReceiverStats:
    """The receiver now (`KVReceiver.stats`). senders: ids of the senders it knows (handshake done);
    receives_posted: two-sided receives posted and not yet complete."""

    loop: LoopStats
    senders: tuple[str, ...]
    receives_posted: int


class KVSender(Protocol):
    """The prefill worker's side of KV transfers (sender.SenderEndpoint; `TransferBackend.sender` makes a
    started one). It writes a request's KV from its kv_buffer into the blocks a KVHandle names, layer by
    layer as the forward pass stores them.

    Threads: one loop thread of its own does all socket and transport work; every method is
    thread-safe. Only connect(), wait(), wait_until(), close() and check_no_leaks() block; the others
    take the sender's lock briefly (send_layer: a lock, one CUDA event record on a GPU, one deque
    append, at most one wake-up byte).

    Block lifetime: the caller owns the source blocks. They must hold the request's KV from each
    layer's send_layer until the request's status is terminal; from then on nothing more is read from
    them for the request (a direct write still in flight may read reused blocks, but its bytes land only
    in blocks the receiver never uses: see send_path.py), so they may be freed or reused at once.
    release() comes later: once the request's writes completed and the receiver was told (fence).
    """

    config: TransferConfig
    layout: KVLayout
    compat: KVCompat  # this sender's pairing record (compat.py), sent in its Hello
    epoch: int  # this incarnation (random, never 0)

    def start(self) -> KVSender:
        """Start the loop thread; returns self. Does nothing on a running sender. Raises TransferError
        after close() (a closed sender cannot run again: make a new one)."""
        ...

    def connect(self, address: str, timeout: float = 5.0) -> None:
        """Handshake with the receiver at control address `address` (add_request does it too; this
        surfaces an incompatible pair early). Blocks up to `timeout` s. Raises IncompatiblePeerError
        naming each mismatch, TransferError if no answer in time or the sender is not running."""
        ...

    def add_request(self, handle: KVHandle, block_ids: list[int]) -> None:
        """Start a transfer of this worker's `block_ids` (token order) into `handle`'s blocks: the
        receiver is claimed (Begin) while the forward pass runs. Raises ValueError on a duplicate
        request id, a block count different from the handle's or a block id out of range;
        TransferError if the sender is not running (nothing is kept then)."""
        ...

    def send_layer(self, request_id: str, layer: int) -> None:
        """Queue `layer` of the request for writing: its KV must already be in kv_buffer (call after the
        layer's attention stored it; on a GPU the write waits for the caller's current stream). Raises
        KeyError for an unknown request, ValueError for a layer out of range or already sent,
        TransferError if the sender is not running. After abort() or a failure the layer is dropped."""
        ...

    def send_layers(self, request_id: str, layers: Sequence[int] | None = None) -> None:
        """send_layer for several layers at once (None: every layer, in order), e.g. a prompt whose KV
        is all in kv_buffer already: one lock, one CUDA event, one wake-up, one write per receiver.
        Everything is checked before anything is queued or marked: raises KeyError for an unknown
        request, ValueError for a layer out of range, given twice or already sent, TypeError for a
        non-integer layer, TransferError if the sender is not running."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop sending the request: ABORTED here soon (on the loop thread); the receiver is told
        (Stopped) once the request's writes in flight completed, or (Withdraw) if its Begin never went
        out. Raises KeyError for an unknown request, TransferError if the sender is not running."""
        ...

    def status(self, request_id: str) -> TransferStatus:
        """PENDING until the receiver accepted the Begin, TRANSFERRING, then DONE (the receiver has every
        layer), FAILED or ABORTED. Raises KeyError for an unknown (or released) request."""
        ...

    def reason(self, request_id: str) -> str:
        """Why the request FAILED or was ABORTED ("" otherwise). Raises KeyError if unknown."""
        ...

    def wait(self, request_id: str, timeout: float) -> TransferStatus:
        """Block up to `timeout` s until the request is terminal; returns its status then (possibly still
        non-terminal). Raises KeyError if unknown."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a terminal request. Raises RuntimeError while it is active, has request-layers in
        flight, a Stopped or Withdraw still to send or a Begin unanswered (the receiver would otherwise
        never learn that nothing more comes: retry on a later poll); KeyError if unknown."""
        ...

    def pending(self) -> list[str]:
        """Request ids not yet released."""
        ...

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop thread and release sockets and transport (waits up to `timeout` s for it).
        Idempotent; a later start() raises TransferError."""
        ...

    def check_no_leaks(self, timeout: float = 2.0) -> None:
        """Raise AssertionError if a request is still tracked, a staging slot is in use, or, once the
        loop had `timeout` s to drop queued layers and free prepared lists, a layer is still queued, a
        CUDA event not given back or the transport still holds prepared descriptor lists."""
        ...

    # ---- observation: tests, benchmarks, monitoring --------------------------------------------------
    def ended_at(self, request_id: str) -> float | None:
        """time.perf_counter() s at which the request became terminal (None while active; CLOCK_MONOTONIC
        on Linux, comparable between processes of a host). Raises KeyError if unknown."""
        ...

    def wait_until(self, pred: Callable[[], bool], timeout: float) -> bool:
        """Block up to `timeout` s until `pred()`, evaluated under the sender's lock (re-entrant: it may
        call snapshot() and status()), holds; False on timeout."""
        ...

    def snapshot(self, request_id: str) -> SendSnapshot:
        """A copy of the request's state. Raises KeyError if unknown."""
        ...

    def stats(self) -> SenderStats:
        """A copy of the data path's, peers' and loop's state now."""
        ...

    def set_trace(self, trace: list[tuple[float, str, str, int]] | None) -> None:
        """Append (time.perf_counter() s, what, request_id, layer or count) events of the data path
        (gather/post/done per request-layer, post:build/descs/init/transfer per write, loop steps and
        naps) and of the DONE round trip (done_msg, DONE) to `trace`; None turns it off. For
        benchmarks: the list grows without bound."""
        ...

    def run_in_loop(self, fn: Callable[[], None]) -> None:
        """Queue `fn` to run on the loop thread before its next step (in order with the sender's own
        commands): a seam for tests (stall the loop) and diagnostics; `fn` must not block long (the
        loop's liveness checks would suffer). Raises TransferError if not running."""
        ...


class KVReceiver(Protocol):
    """The decode worker's side of KV transfers (receiver.ReceiverEndpoint; `TransferBackend.receiver`
    makes a started one, bound at config.host:config.port). It owns the destination blocks while a
    request's KV may still land in them.

    Threads: one loop thread of its own does all socket and transport work; every method is
    thread-safe. Only wait(), wait_until() and close() block.

    Block lifetime: blocks passed to expect() belong to the receiver until release(); release() is
    refused until releasable(): DONE, the sender said it writes nothing more (Stopped, Withdraw), no
    sender ever claimed the request, or its deadline passed with its sender gone. Only then may the
    caller free (or reuse) them: a write can never land in a reused block.
    """

    config: TransferConfig
    layout: KVLayout
    compat: KVCompat  # this receiver's pairing record (compat.py), checked against each Hello
    epoch: int  # this incarnation (random, never 0): handles of an earlier one are refused
    address: str  # the control endpoint ("tcp://host:port"), in every handle; "" before start()

    def start(self) -> KVReceiver:
        """Bind the control socket (config.host, config.port; 0 = a free port) and start the loop thread;
        returns self. Does nothing on a running receiver. Raises TransferError after close(),
        zmq.ZMQError if the bind fails."""
        ...

    def expect(self, request_id: str, block_ids: list[int], timeout_s: float | None = None) -> KVHandle:
        """Register a request whose KV will land in `block_ids` (token order; contiguous runs make fewer,
        larger writes) within `timeout_s` s (default config.timeout_s, counted from now); returns the
        KVHandle for the sender. Raises ValueError on a duplicate request id, empty, repeated or
        out-of-range block ids."""
        ...

    def abort(self, request_id: str) -> None:
        """ABORTED now, and the claiming sender (if any) is told to stop; the blocks stay held until
        releasable(). Nothing for a terminal request. Raises KeyError if unknown."""
        ...

    def status(self, request_id: str) -> TransferStatus:
        """PENDING until a sender claims the request, TRANSFERRING, then DONE (every layer landed:
        the request may join the batch), FAILED or ABORTED. Raises KeyError if unknown (or released)."""
        ...

    def reason(self, request_id: str) -> str:
        """Why the request FAILED or was ABORTED ("" otherwise). Raises KeyError if unknown."""
        ...

    def wait(self, request_id: str, timeout: float) -> TransferStatus:
        """Block up to `timeout` s until the request is terminal; returns its status then. Raises
        KeyError if unknown."""
        ...

    def releasable(self, request_id: str) -> bool:
        """True when no write can still land in the request's blocks (see the class docstring). Raises
        KeyError if unknown."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a releasable request: its blocks are the caller's again. Raises RuntimeError if not
        releasable(), KeyError if unknown."""
        ...

    def pending(self) -> list[str]:
        """Request ids not yet released."""
        ...

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop thread and release socket and transport (waits up to `timeout` s for it).
        Idempotent; a later start() raises TransferError."""
        ...

    def check_no_leaks(self) -> None:
        """Raise AssertionError if a request is still tracked (not released)."""
        ...

    # ---- observation and operation: tests, benchmarks, monitoring, operators --------------------------
    def ended_at(self, request_id: str) -> float | None:
        """time.perf_counter() s at which the request became terminal (None while active). Raises
        KeyError if unknown."""
        ...

    def wait_until(self, pred: Callable[[], bool], timeout: float) -> bool:
        """Block up to `timeout` s until `pred()`, evaluated under the receiver's lock (re-entrant: it
        may call releasable(), snapshot(), status()), holds; False on timeout."""
        ...

    def snapshot(self, request_id: str) -> RecvSnapshot:
        """A copy of the request's state. Raises KeyError if unknown."""
        ...

    def stats(self) -> ReceiverStats:
        """A copy of the senders' and loop's state now."""
        ...

    def drop_sender(self, sender_id: str, reason: str) -> None:
        """Drop every known sender called `sender_id` as if it were lost (soon, on the loop thread): its
        requests FAILED with `reason`, their blocks held until their deadline; its next message is
        answered with Rehandshake. For operators (a prefill worker known dead by other means) and
        tests. Raises TransferError if not running."""
        ...

    def set_trace(self, trace: list[tuple[float, str, str, int]] | None) -> None:
        """Append (time.perf_counter() s, what, request_id, layer) events to `trace` (None: off):
        "notice" when a layer's notice was read (with the data), "done_sent" when Done is handed to zmq
        for the sender. For benchmarks (the list grows without bound)."""
        ...

    def run_in_loop(self, fn: Callable[[], None]) -> None:
        """Queue `fn` to run on the loop thread before its next step: a seam for tests and diagnostics
        (see KVSender.run_in_loop). Raises TransferError if not running."""
        ...
