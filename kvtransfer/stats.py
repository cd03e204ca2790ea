"""Copies of an endpoint's state for tests, benchmarks and monitoring (`snapshot()`, `stats()`; no torch).

Each is taken under the endpoint's lock (or read from counters the loop thread keeps) and changes
nothing; reading one costs a lock acquisition and a few list copies.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.types import TransferStatus


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
