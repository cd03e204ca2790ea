"""kvtransfer's public surface: the sender and receiver contracts the workers program against (no torch).

`KVSender` and `KVReceiver` (Protocols) are everything the workers call, each call with its contract:
thread-safety, blocking, errors raised, and who may free which block when.
`backends.get_transfer_backend(name).sender(...)/.receiver(...)` make started ones
(sender.SenderEndpoint, receiver.ReceiverEndpoint). The types they use are types.py (handle, layout,
status, config, errors) and stats.py (the copies `snapshot()` and `stats()` return).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from kvtransfer.stats import ReceiverStats, RecvSnapshot, SenderStats, SendSnapshot
from kvtransfer.types import KVHandle, KVLayout, TransferConfig, TransferStatus

if TYPE_CHECKING:
    from kvtransfer.compat import KVCompat
    from kvtransfer.head_map import HeadSlice


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

    def add_request(self, handle: KVHandle, block_ids: list[int], heads: HeadSlice | None = None) -> None:
        """Start a transfer of this worker's `block_ids` (token order) into `handle`'s blocks: the
        receiver is claimed (Begin) while the forward pass runs. `heads`: write only that head slice
        (head_map.head_slices: this tensor parallel rank's share of the handle's rank's heads), straight
        from kv_buffer; required when the handle's blocks hold another number of KV heads than ours.
        Raises ValueError on a duplicate request id, a block count different from the handle's, a block
        id out of range, a missing head slice, or a slice this sender cannot write (another rank's, a
        two-sided transport, a non-contiguous kv_buffer or direct_max_pieces=0, checksum on);
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

    def wire_seconds(self, request_id: str) -> float | None:
        """Seconds from just after the request's first write was posted to when its last write was seen
        complete: the data's time on the transport, without the control round trips and the wait for
        the receiver's Begin answer (None before a write completed). Raises KeyError if unknown."""
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

    def expect(self, request_id: str, block_ids: list[int], timeout_s: float | None = None,
               claim_timeout_s: float | None = None, *, num_cached_blocks: int = 0) -> KVHandle:
        """Register a request whose KV will land in `block_ids` (token order; contiguous runs make fewer,
        larger writes); returns the KVHandle for the sender. `num_cached_blocks`: leading blocks of the
        request this side holds already (its prefix cache; they precede `block_ids` and are not
        written), carried in the handle so the sender skips them. Two deadlines, in seconds: a sender must
        claim the request (Begin; a prefill worker begins in the step that runs the prompt's last chunk)
        within `claim_timeout_s` from now (default: `timeout_s`), then a layer must land within
        `timeout_s` (default config.timeout_s) of that Begin and of each landed layer, so neither time
        spent in the sender's queue nor a slow but progressing prefill step fails the transfer. Raises
        ValueError on a duplicate request id, empty, repeated or out-of-range block ids, a timeout <= 0
        or a negative `num_cached_blocks`.
        """
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

    def refused_handshakes(self) -> int:
        """Peers refused so far: handshakes of the CURVE control socket (config.curve set: a peer
        without the fleet's key pair; curve.py) and, with config.fence_senders, Hellos of senders not
        admitted (unknown id, or an admitted id with another epoch). Any thread."""
        ...

    def admit_sender(self, sender_id: str, epoch: int) -> None:
        """Let the sender `sender_id` of incarnation `epoch` (its KVSender.epoch) complete the KV
        handshake (config.fence_senders: only the pair last admitted for an id may; the worker admits
        those named to it over the authenticated control plane). Admitting another epoch for an id
        replaces the one admitted before: Hellos of the earlier incarnation are refused from then on.
        Any thread."""
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
