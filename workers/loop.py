"""The worker process loop: control messages on asyncio, engine steps on one background thread.

Queues and states:
  * ``inbox``: control messages from the gateways, each with the key of the gateway it came from, applied
    between steps (the engine's scheduler is only ever touched while no step runs, so no locks are needed
    around it);
  * the engine's own queues (scheduler ``waiting`` / ``running``), advanced one step at a time by
    ``run_in_executor`` on a single thread, so heartbeats and aborts are never stalled by a forward pass;
  * ``outbox``: messages for the gateways, flushed after every phase; a message naming a request goes to
    the gateway that owns it (workers/ownership.py), any other to every gateway that accepts the worker;
    each gateway's per-request messages of the phase (a step's tokens of its running requests) go out as
    one ``OutputBatch`` frame, and the phase's prefix-cache changes as one ``KVEvents`` to every accepting
    gateway (``kv_events``; a snapshot after each accepted registration and on ``KVSnapshotRequest``).

Several gateways (workers/gateway_links.py): the worker registers with each, heartbeats to each and keeps
each request's state for its owner only. A gateway is lost when its connection drops (ZMTP heartbeats and
a socket monitor), when it answers a registration with another ``gateway_epoch`` (restarted at the same
address), when it stops taking messages, or when its address leaves DNS: a ``GatewayLost`` marker, queued
behind what it sent, drops exactly the requests it owns (engine abort, KV blocks freed, transfers
cancelled); the other gateways' requests go on. A lost gateway gets a ``RegisterWorker`` again as soon as
it is connected (and every ``REGISTER_RETRY_S`` until it answers).
Subclasses (prefill, decode, colocated) implement ``on_message`` / ``poll`` / ``has_work`` / ``step`` /
``on_step`` / ``drop``. A failing step fails only the requests it carried (``RequestFailed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import zmq

from kvtransfer.compat import KVCompat
from protocol.logging import log_event
from protocol.messages import (
    Heartbeat,
    KVCanaryReserve,
    KVCanarySend,
    KVEvents,
    KVSnapshotRequest,
    Message,
    Probe,
    RegisterAck,
    RegisterWorker,
    RequestFailed,
    RequestRejected,
    ReRegister,
    Role,
    WorkerLoad,
    WorkerShutdown,
    decode,
    new_epoch,
    request_id_of,
)
from protocol.settings import control_keys
from workers.control_client import RegistrationError
from workers.gateway_links import GatewayLink, GatewayLinks
from workers.health_server import EngineHealth, HealthServer
from workers.metrics import WorkerMetrics
from workers.outputs import batch_outputs
from workers.ownership import NO_OWNER, RequestOwners, continued_id, route, started_id
from workers.placement import kv_placement
from workers.step import StepFailed

if TYPE_CHECKING:
    from engine.engine_core import EngineCore, StepOutput
    from protocol.settings import WorkerSettings

log = logging.getLogger("pdserve.worker")


@dataclass(frozen=True)
class GatewayLost:
    """Inbox marker, local to a worker: the gateway with key ``gateway`` that sent the messages before
    this marker is gone (``reason``); applying it drops every request that gateway owns."""

    gateway: str
    reason: str
    gateway_epoch: int = 0  # the incarnation of that gateway when it was lost


REGISTER_TIMEOUT_S = 60.0  # start-up: some gateway must accept the worker within this many seconds
REGISTER_RETRY_S = 2.0  # a connected gateway that has not accepted the worker gets RegisterWorker this often
OWNERS_PRUNE_S = 1.0  # how often ids the worker no longer holds are forgotten by the ownership table


class WorkerLoop:
    """Base of the three worker roles. ``heartbeat_interval`` and ``idle_poll`` are seconds."""

    role: Role = "colocated"
    heartbeat_interval = 0.5
    idle_poll = 0.5

    def __init__(self, settings: WorkerSettings, core: EngineCore, model_path: str) -> None:
        self.settings, self.core, self.model_path = settings, core, model_path
        self.worker_id = settings.worker_id
        self.epoch = new_epoch()
        self.keys = control_keys(settings)
        if self.keys is None:
            log.warning("--insecure-control-plane: no CURVE on this worker's control sockets")
        self.gateways = GatewayLinks(settings.gateway_control, self.keys)
        self.owners = RequestOwners()
        self.received: Counter[str] = Counter()  # control messages received, by type name
        self._inbox: deque[tuple[Message | GatewayLost, str]] = deque()  # (message, gateway key)
        # (request id, why, gateway key) of frames decode_frame refused
        self._refused: deque[tuple[str, str, str]] = deque()
        self._outbox: list[tuple[Message, str | None]] = []  # (message, ownership.RequestOwners.tag)
        self._pruned_at = 0.0
        # gateway key → (its epoch, request ids): requests dropped when that gateway was lost, failed back to
        # it (RequestFailed) if the same incarnation accepts this worker again (it was alive all along)
        self._unanswered: dict[str, tuple[int, list[str]]] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"{self.role}-step")
        self._load = WorkerLoad()
        self._wake: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self.fatal: str | None = None  # why the worker stopped itself (it then exits 1), None otherwise
        self.metrics = WorkerMetrics(settings.model, core.max_model_len)
        self.health = EngineHealth(settings.engine_stall_timeout)
        self.metrics.watch(self.load, lambda: core.scheduler.num_preemptions, self.health.loop_age,
                           lambda: self.health.registered)
        self.metrics.watch_host_tier(core.host_tier_stats)
        self.health_server: HealthServer | None = None
        self._kv_log = core.block_manager.record_events()
        self._kv_seq_no = 0  # of the last KVEvents built
        self._kv_snapshot_due = False

    # ---- what a role implements -------------------------------------------------------------------
    def on_message(self, msg: Message) -> None:
        """Apply one control message (loop thread, between steps)."""
        raise NotImplementedError

    def poll(self) -> None:
        """Between steps: advance transfers, release blocks, admit requests whose KV landed."""

    def has_work(self) -> bool:
        """True when a step would schedule something."""
        return self.core.scheduler.has_unfinished() and bool(
            self.core.scheduler.waiting or self.core.scheduler.running)

    def step(self) -> list[StepOutput]:
        """One engine step (runs on the step thread). Raises ``StepFailed``."""
        raise NotImplementedError

    def on_step(self, outs: list[StepOutput]) -> None:
        """React to a step's sampled tokens (loop thread)."""
        raise NotImplementedError

    def drop(self, request_id: str) -> None:
        """Forget a request after a failure (abort it in the engine, free what can be freed)."""
        self.core.abort_request(request_id)

    def request_ids(self) -> list[str]:
        """Every request this worker holds state for (queued, running, or waiting for KV)."""
        raise NotImplementedError

    def canary_ids(self) -> list[str]:
        """Every KV canary this worker holds state for (none on roles without canaries)."""
        return []

    def compat(self) -> KVCompat:
        """The KV pairing record announced at registration (a worker that moves no KV: backend "none")."""
        from workers.setup import compat_of

        return compat_of(self.core, self.settings.model, "none")

    def transfer_address(self) -> str:
        """Where peers reach this worker's KV transport ("" if none)."""
        return ""

    def kv_sender_epoch(self) -> int:
        """This worker's KV sender incarnation, announced at registration
        (``RegisterWorker.kv_sender_epoch``); 0 for roles without a KV sender."""
        return 0

    def busy(self) -> bool:
        """True while something must be polled soon (transfers in flight)."""
        return False

    def kv_endpoint_error(self) -> str | None:
        """Why this worker's KV sender or receiver loop thread died (the exception's repr), None while it
        runs or for roles without one."""
        return None

    def close(self) -> None:
        """Release transports (called once on shutdown)."""

    def num_waiting(self) -> int:
        """Requests not yet running (the load reported in heartbeats)."""
        return len(self.core.scheduler.waiting)

    def transfer_totals(self) -> tuple[int, float]:
        """Cumulative (bytes, seconds) of this worker's completed KV transfers, reported in heartbeats
        (``WorkerLoad.kv_transfer_bytes`` / ``kv_transfer_seconds``); (0, 0.0) for roles that send none."""
        return 0, 0.0

    def control_refusals(self) -> int:
        """Peers this worker's KV control socket refused so far (``WorkerLoad.kv_control_refused``); 0 for
        roles without one."""
        return 0

    # ---- shared machinery ---------------------------------------------------------------------------
    def emit(self, msg: Message) -> None:
        """Queue a message (sent at the end of the current phase): one naming a request to the gateway
        that owns it, any other to every gateway that accepts this worker."""
        self._outbox.append((msg, self.owners.tag(msg)))

    def deliver(self, msg: Message | GatewayLost, gateway: str | None = None) -> None:
        """Queue a control message from the gateway with key ``gateway`` (None: the first one); it is
        applied at the next phase boundary."""
        self.received[type(msg).__name__] += 1
        self._inbox.append((msg, self.gateways.default_key if gateway is None else gateway))

    def accepted_by(self, ack: RegisterAck, gateway: str | None = None) -> None:
        """The gateway with key ``gateway`` (None: the first one) accepted this worker. When
        ``ack.gateway_epoch`` differs from the last one that gateway sent (it restarted at the same
        address), a ``GatewayLost`` marker is queued behind every message already received from it:
        applying it drops each request that gateway owns then, all of them its old incarnation's."""
        link = self.gateways.get(self.gateways.default_key if gateway is None else gateway)
        if link is None:
            return
        restarted = link.gateway_epoch and ack.gateway_epoch and ack.gateway_epoch != link.gateway_epoch
        if restarted and link.accepted:  # (a link no longer accepted was lost already: nothing to add)
            self.lose(link, f"gateway restarted (epoch {link.gateway_epoch} -> {ack.gateway_epoch})")
        link.gateway_epoch = ack.gateway_epoch or link.gateway_epoch
        link.accepted, link.refused = True, ""
        self._answer_dropped(link.key, link.gateway_epoch)
        self.health.registered = True
        self.want_kv_snapshot()

    def want_kv_snapshot(self) -> None:
        """Make the next ``kv_events`` a snapshot of the whole prefix cache (after a registration was
        accepted, so a gateway that knew nothing of this worker learns its cache; on
        ``KVSnapshotRequest``)."""
        self._kv_snapshot_due = True

    def kv_events(self) -> KVEvents | None:
        """The prefix-cache changes since the last call as one ``KVEvents`` (loop thread, between steps),
        or None when nothing changed. A snapshot (every cached hash, pending changes dropped) instead
        when one is due (``want_kv_snapshot``) or the change log overflowed. Each message built takes the
        next ``seq_no``. The process loop emits it at every flush; ``run_once`` leaves that to its
        caller."""
        changes = self._kv_log.drain()
        if self._kv_snapshot_due or changes.lost:
            self._kv_snapshot_due = False
            self._kv_seq_no += 1
            return KVEvents(worker_id=self.worker_id, epoch=self.epoch, seq_no=self._kv_seq_no,
                            stored=self.core.block_manager.cached_hashes(), snapshot=True)
        if not changes:
            return None
        self._kv_seq_no += 1
        return KVEvents(worker_id=self.worker_id, epoch=self.epoch, seq_no=self._kv_seq_no,
                        stored=changes.stored, removed=changes.removed)

    def lose(self, link: GatewayLink, reason: str) -> None:
        """The gateway of ``link`` is gone (``reason``): it no longer accepts this worker, and a
        ``GatewayLost`` marker queued behind its messages drops the requests it owns."""
        link.accepted = False
        self.health.registered = self.gateways.any_accepted()
        self.deliver(GatewayLost(link.key, reason, link.gateway_epoch), link.key)
        if self._wake is not None:
            self._wake.set()

    def _gateway_lost(self, lost: GatewayLost) -> None:
        held = {*self.request_ids(), *self.canary_ids()}
        owned = self.owners.of(lost.gateway)
        dropped = [rid for rid in owned if rid in held]
        for rid in owned:
            self.owners.forget(rid)
        for rid in dropped:
            with contextlib.suppress(Exception):
                self.drop(rid)
        if dropped and lost.gateway_epoch:
            self._unanswered[lost.gateway] = (lost.gateway_epoch, [*self._unanswered.get(
                lost.gateway, (0, []))[1], *dropped])
            link = self.gateways.get(lost.gateway)
            if link is not None and link.accepted:  # accepted again before this marker was applied
                self._answer_dropped(lost.gateway, link.gateway_epoch)
        log_event(log, "gateway_lost", logging.WARNING, worker_id=self.worker_id, gateway=lost.gateway,
                  reason=lost.reason, dropped=len(dropped))

    def _answer_dropped(self, gateway: str, gateway_epoch: int) -> None:
        """``gateway`` (incarnation ``gateway_epoch``) accepts this worker again: when it is the incarnation
        that was lost (a connection that dropped, or a queue that filled, while the gateway lived on), each
        request dropped then is failed back to it (``RequestFailed``), so it retries or ends them instead of
        waiting for tokens that will never come; another incarnation never knew them."""
        epoch, dropped = self._unanswered.pop(gateway, (0, []))
        if epoch != gateway_epoch:
            return
        for rid in dropped:
            self._outbox.append((RequestFailed(request_id=rid, worker_id=self.worker_id,
                                               error="the worker lost its connection to this gateway and "
                                                     "dropped the request"), gateway))

    def decode_frame(self, data: bytes, gateway: str | None = None) -> Message | None:
        """One control frame from the gateway with key ``gateway`` (None: the first one) → its message,
        or None. A frame that fails validation but names a request (e.g. a sampling parameter out of
        range) fails that request at the next phase boundary (``fail``: ``RequestFailed`` to that gateway).
        Any other bad frame is logged and dropped."""
        try:
            return decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            rid = request_id_of(data)
            if rid is None:
                log.warning("undecodable control message dropped: %s", exc)
            else:
                key = self.gateways.default_key if gateway is None else gateway
                self._refused.append((rid, f"{type(exc).__name__}: {exc}", key))
            return None

    def take_outbox(self) -> list[Message]:
        """Remove and return the messages emitted since the last flush (oldest first)."""
        return [msg for msg, _ in self._take_tagged()]

    def _take_tagged(self) -> list[tuple[Message, str | None]]:
        out, self._outbox = self._outbox, []
        return out

    def run_once(self) -> bool:
        """One phase on the calling thread: apply queued messages, ``poll``, then one engine step if
        ``has_work``. Returns True when a step ran. Emitted messages stay in the outbox
        (``take_outbox``). The process loop does the same with the step on its own thread; this
        synchronous form drives a worker without sockets or asyncio (tests, tools)."""
        self._between_steps()
        if not self.has_work():
            return False
        try:
            outs = self.step()
        except StepFailed as exc:
            self._step_failed(exc)
        else:
            self.on_step(outs)
        self._refresh_load()
        return True

    def _step_failed(self, exc: StepFailed) -> None:
        log.error("%s", exc, exc_info=exc.__cause__)
        for rid in exc.request_ids:
            self.fail(rid, str(exc))
        self._stop_if_ranks_lost()

    def _stop_if_ranks_lost(self) -> None:
        """Stop serving (deregistering on the way out) when a tensor parallel rank of the engine died:
        the engine cannot run another step, so no half-alive worker stays registered."""
        ranks = self.core.ranks
        lost = ranks.dead_followers() if ranks is not None else []
        if lost:
            log.error("tensor parallel ranks lost (%s): stopping the worker", ", ".join(lost))
            self.request_stop()

    def _stop_if_kv_endpoint_dead(self) -> None:
        """Stop serving (deregistering on the way out; the process exits 1) once the KV endpoint's loop
        thread died: no transfer to or from this worker can run again, so staying registered would take
        requests only to hang them."""
        error = self.kv_endpoint_error()
        if error is not None and self.fatal is None:
            self.fatal = f"the KV transfer loop crashed: {error}"
            log.error("%s: stopping the worker", self.fatal)
            self.request_stop()

    def fail(self, request_id: str, error: str) -> None:
        """Drop the request here and tell the gateway (``RequestFailed``); the worker keeps serving."""
        log_event(log, "request_failed", logging.WARNING, request_id=request_id, error=error)
        with contextlib.suppress(Exception):
            self.drop(request_id)
        self.emit(RequestFailed(request_id=request_id, worker_id=self.worker_id, error=error))

    def reject(self, request_id: str, error: str) -> None:
        """Drop the request here and tell the gateway it cannot be served as asked (``RequestRejected``:
        its structured output does not compile); nothing of it was scheduled."""
        log_event(log, "request_rejected", logging.INFO, request_id=request_id, error=error)
        with contextlib.suppress(Exception):
            self.drop(request_id)
        self.emit(RequestRejected(request_id=request_id, worker_id=self.worker_id, error=error))

    def load(self) -> WorkerLoad:
        """Load as of the last phase boundary: sequences waiting/running, KV blocks free/total, and the
        cumulative KV transfer bytes/seconds (``transfer_totals``)."""
        return self._load

    def _refresh_load(self) -> None:
        bm = self.core.block_manager
        sent_bytes, sent_seconds = self.transfer_totals()
        self._load = WorkerLoad(num_waiting=self.num_waiting(), num_running=len(self.core.scheduler.running),
                                num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks,
                                kv_transfer_bytes=sent_bytes, kv_transfer_seconds=sent_seconds,
                                kv_control_refused=self.control_refusals())

    def registration(self) -> RegisterWorker:
        """The ``RegisterWorker`` message of this process."""
        return RegisterWorker(role=self.role, worker_id=self.worker_id, epoch=self.epoch,
                              model=self.settings.model, model_path=self.model_path, compat=self.compat(),
                              transfer_address=self.transfer_address(), max_model_len=self.core.max_model_len,
                              max_num_seqs=self.settings.max_num_seqs, load=self._load,
                              placement=kv_placement(self.core.runner.kv_cache.device.type),
                              kv_sender_epoch=self.kv_sender_epoch())

    def flush(self) -> None:
        """Send the outbox: each accepting gateway its own messages, per-request ones in one
        ``OutputBatch``, and this phase's ``KVEvents`` to each (``kv_events``). Messages for a gateway that
        no longer accepts the worker are dropped (its requests are being dropped too)."""
        if (events := self.kv_events()) is not None:
            self.emit(events)
        tagged = self._take_tagged()
        if not tagged:
            return
        accepting = [key for key, link in self.gateways.links.items() if link.accepted]
        for key, msgs in route(tagged, accepting).items():
            link = self.gateways.links[key]
            for frame in batch_outputs(self.worker_id, msgs):
                if not self._send(link, frame):
                    break
        unowned = sum(1 for _, tag in tagged if tag == NO_OWNER)
        if unowned and log.isEnabledFor(logging.DEBUG):
            log_event(log, "messages_without_owner", logging.DEBUG, count=unowned)

    def _send(self, link: GatewayLink, msg: Message) -> bool:
        """Send ``msg`` to ``link``'s gateway now; a gateway that accepts this worker but cannot take the
        message (its queue full, or its connection gone) is lost."""
        if link.client.try_send(msg):
            return True
        if link.accepted:
            self.lose(link, "its control socket stopped taking messages (queue full or connection gone)")
        return False

    def _apply(self, msg: Message, gateway: str) -> None:
        """Apply one message from ``gateway``: a request it starts becomes its own; a message about a
        request another gateway owns is refused (never applied)."""
        started = started_id(msg)
        if started is not None:
            owner = self.owners.record(started, gateway)
            if owner != gateway:  # ids are the gateways' own: a collision, refused to the newcomer
                log_event(log, "request_id_taken", logging.WARNING, request_id=started, gateway=gateway,
                          owner=owner)
                if not isinstance(msg, KVCanaryReserve | KVCanarySend):  # a canary just times out
                    self._outbox.append((RequestFailed(request_id=started, worker_id=self.worker_id,
                                                       error=f"request id {started!r} is taken on this "
                                                             "worker by another gateway's request"), gateway))
                return
        else:
            named = continued_id(msg)
            # unknown here (dropped with a lost gateway, or never seen): the sender owns it, so the failure
            # its message causes goes back to the sender
            other = self.owners.record(named, gateway) if named is not None else None
            if other is not None and other != gateway:
                log_event(log, "foreign_request_message", logging.WARNING, type=type(msg).__name__,
                          request_id=named, gateway=gateway, owner=other)
                return
        try:
            self.on_message(msg)
        except Exception as exc:  # a bad message fails its request only
            rid = getattr(msg, "request_id", None)
            if rid is not None and _grammar_rejected(exc):  # the request's fault: the gateway says 400
                self.reject(rid, str(exc))
                return
            log.exception("handling %s failed", type(msg).__name__)
            if rid is not None:
                self.fail(rid, f"{type(exc).__name__}: {exc}")

    def _between_steps(self) -> None:
        while self._inbox:
            msg, gateway = self._inbox.popleft()
            if isinstance(msg, GatewayLost):
                self._gateway_lost(msg)
            else:
                self._apply(msg, gateway)
        while self._refused:
            rid, why, gateway = self._refused.popleft()
            if self.owners.record(rid, gateway) == gateway:
                self.fail(rid, why)
            else:  # another gateway's request has this id: answer the sender, leave that one alone
                self._outbox.append((RequestFailed(request_id=rid, worker_id=self.worker_id, error=why),
                                     gateway))
        try:
            self.poll()
        except (TimeoutError, RuntimeError):  # a dead rank's KV endpoint answers no more: stop cleanly
            if self.core.ranks is None or not self.core.ranks.dead_followers():
                raise
            log.exception("KV endpoint of a lost tensor parallel rank")
            self._stop_if_ranks_lost()
        self._refresh_load()
        now = time.monotonic()
        if now - self._pruned_at >= OWNERS_PRUNE_S:
            self._pruned_at = now
            self.owners.prune([*self.request_ids(), *self.canary_ids()])

    async def _recv_loop(self, link: GatewayLink) -> None:
        assert self._wake is not None
        while True:
            msg = self.decode_frame(await link.client.recv_frame(), link.key)
            if isinstance(msg, ReRegister):  # the gateway lost track of us: register again, same epoch
                log_event(log, "reregistering", logging.WARNING, worker_id=self.worker_id, gateway=link.key,
                          reason=msg.reason)
                self._register(link)
            elif isinstance(msg, Probe):  # the gateway checking which connection dropped: nothing to do
                pass
            elif isinstance(msg, KVSnapshotRequest):  # the gateway missed a KVEvents: resend the whole set
                self.want_kv_snapshot()
                self._wake.set()
            elif isinstance(msg, RegisterAck):
                if msg.worker_id != self.worker_id:
                    continue
                log_event(log, "registered" if msg.accepted else "registration_refused",
                          logging.INFO if msg.accepted else logging.ERROR, worker_id=self.worker_id,
                          gateway=link.key, gateway_epoch=msg.gateway_epoch, reason=msg.reason)
                if msg.accepted:
                    self.accepted_by(msg, link.key)
                    self._wake.set()
                else:
                    if link.accepted:
                        self.lose(link, f"it refused the worker: {msg.reason}")
                    link.refused = msg.reason or "refused"
            else:  # a request message, or None (a refused frame may have queued a failure)
                if msg is not None and not link.accepted and started_id(msg) is not None:
                    # sent before the connection was lost, read after: its gateway's requests are being
                    # dropped; failed back to it if the same incarnation accepts this worker again
                    rid = started_id(msg)
                    assert rid is not None
                    epoch, ids = self._unanswered.get(link.key, (link.gateway_epoch, []))
                    if epoch == link.gateway_epoch:
                        self._unanswered[link.key] = (epoch, [*ids, rid])
                    log_event(log, "request_after_gateway_lost", logging.WARNING, request_id=rid,
                              gateway=link.key)
                    continue
                if msg is not None:
                    if log.isEnabledFor(logging.DEBUG):
                        log_event(log, "message_received", logging.DEBUG, type=type(msg).__name__,
                                  request_id=getattr(msg, "request_id", None), gateway=link.key)
                    self.deliver(msg, link.key)
                self._wake.set()

    async def _watch_link(self, link: GatewayLink) -> None:
        """Follow ``link``'s connection: registered again once connected, lost when it drops."""
        while True:
            event = await link.client.next_event()
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.connected = True
                if not link.accepted and time.monotonic() - link.registered_at >= REGISTER_RETRY_S:
                    for _ in range(50):  # the connection takes messages a moment after the event
                        if self._register(link):
                            break
                        await asyncio.sleep(0.002)
            elif event == zmq.EVENT_DISCONNECTED:
                link.connected, link.registered_at = False, float("-inf")
                log_event(log, "gateway_disconnected", logging.WARNING, worker_id=self.worker_id,
                          gateway=link.key)
                if link.accepted:
                    self.lose(link, "its control connection dropped")

    def _register(self, link: GatewayLink) -> bool:
        """Send this worker's ``RegisterWorker`` to ``link``'s gateway; False when it is not connected
        (the heartbeat loop tries again)."""
        if not link.client.try_send(self.registration()):
            return False
        link.registered_at = time.monotonic()
        return True

    def _start_link(self, link: GatewayLink) -> None:
        link.tasks = [asyncio.create_task(self._guarded(self._recv_loop, link)),
                      asyncio.create_task(self._guarded(self._watch_link, link))]
        self._register(link)

    async def _guarded(self, body: Callable[[GatewayLink], Coroutine[None, None, None]],
                       link: GatewayLink) -> None:
        """Run ``body(link)``, one of ``link``'s tasks; should it fail, the worker stops (deregistering)
        rather than serve on with a gateway it no longer hears."""
        try:
            await body(link)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the task of gateway %s failed: stopping the worker", link.key)
            self.request_stop()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            self._stop_if_ranks_lost()
            self._stop_if_kv_endpoint_dead()
            beat = Heartbeat(worker_id=self.worker_id, epoch=self.epoch, load=self._load)
            now = time.monotonic()
            for link in list(self.gateways.links.values()):
                if link.accepted:
                    self._send(link, beat)
                elif not link.refused and now - link.registered_at >= REGISTER_RETRY_S:
                    self._register(link)

    async def _resolve_loop(self) -> None:
        """Look ``--gateway-control``'s host names up again every ``--gateway-resolve-interval`` s: a new
        address gets a link, a link whose address left DNS is lost and closed."""
        interval = self.settings.gateway_resolve_interval
        while True:
            await asyncio.sleep(interval)
            try:
                found = await asyncio.wait_for(asyncio.to_thread(self.gateways.lookup), max(interval, 5.0))
            except TimeoutError:
                log_event(log, "gateway_lookup_failed", logging.WARNING, error="no answer in time")
                continue
            self.update_gateways(found)

    def update_gateways(self, found: dict[str, list[str]]) -> None:
        """Apply a DNS lookup (``GatewayLinks.lookup``: entry → endpoints): each new address is a
        gateway to register with (its tasks started: call with the event loop running), each address
        gone is a lost gateway (its requests dropped) told ``WorkerShutdown`` and closed."""
        added, removed = self.gateways.refresh(found)
        for link in removed:
            self.lose(link, "its address left DNS")
            self.gateways.close_link(link, WorkerShutdown(worker_id=self.worker_id, epoch=self.epoch))
        for link in added:
            self._start_link(link)

    async def wait_registered(self, timeout: float) -> None:
        """Return once some gateway accepted this worker.

        Raises:
            RegistrationError: every gateway refused it (no DNS name that may bring others), or none
                accepted it within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while not self.gateways.any_accepted():
            links = list(self.gateways.links.values())
            if links and not self.gateways.has_names and all(link.refused for link in links):
                reasons = "; ".join(f"{link.key}: {link.refused}" for link in links)
                raise RegistrationError(f"gateway refused worker {self.worker_id}: {reasons}")
            if time.monotonic() >= deadline:
                where = (", ".join(self.gateways.links)
                         or f"none resolved from {self.settings.gateway_control}")
                raise RegistrationError(f"no RegisterAck from any gateway ({where}) within {timeout:.0f} s")
            await asyncio.sleep(0.02)

    async def _engine_loop(self) -> None:
        assert self._wake is not None and self._stop is not None
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            self.health.tick()
            self._wake.clear()
            self._between_steps()
            self.flush()
            if self.has_work():
                try:
                    outs = await loop.run_in_executor(self._executor, self.step)
                except StepFailed as exc:
                    self._step_failed(exc)
                else:
                    self.on_step(outs)
                self._refresh_load()
                self.flush()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 0.002 if self.busy() else self.idle_poll)

    def request_stop(self) -> None:
        """Ask the loop to finish its current step and shut down (signal-handler safe)."""
        if self._stop is not None and self._wake is not None:
            self._stop.set()
            self._wake.set()

    def _start_health_server(self) -> None:
        """Serve /metrics, /health and /live on ``--metrics-port`` (none when 0).

        Raises:
            OSError: the port cannot be bound.
        """
        if not self.settings.metrics_port:
            return
        try:
            server = HealthServer(self.settings.host, self.settings.metrics_port, self.metrics.registry,
                                  self.health)
        except OSError as exc:
            where = f"{self.settings.host}:{self.settings.metrics_port}"
            raise OSError(f"--metrics-port: cannot serve on {where}: {exc}") from exc
        self.health_server = server.start()
        log_event(log, "metrics_serving", worker_id=self.worker_id, host=self.settings.host,
                  port=self.health_server.port)

    async def run(self) -> None:
        """Register with every gateway, then serve until SIGTERM/SIGINT; sends ``WorkerShutdown`` to each
        on the way out. Serving starts once one gateway accepted the worker (``REGISTER_TIMEOUT_S``); the
        others are registered with as they come.

        Raises:
            RegistrationError: every gateway refused this worker, or none answered in time.
            OSError: ``--metrics-port`` cannot be bound.
        """
        self._wake, self._stop = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        self._refresh_load()
        tasks: list[asyncio.Task[None]] = []
        try:
            self._start_health_server()
            for link in self.gateways.links.values():
                self._start_link(link)
            tasks = [asyncio.create_task(self._heartbeat_loop())]
            if self.gateways.has_names:
                tasks.append(asyncio.create_task(self._resolve_loop()))
            await self.wait_registered(REGISTER_TIMEOUT_S)
            log_event(log, "worker_ready", role=self.role, worker_id=self.worker_id, epoch=self.epoch,
                      gateways=len(self.gateways.links),
                      kv_cache_dtype=str(self.core.runner.kv_cache.cache_dtype).removeprefix("torch."))
            await self._engine_loop()
        finally:
            tasks += [task for link in self.gateways.links.values() for task in link.tasks]
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self.close()
            if self.health_server is not None:
                self.health_server.stop()
            self._executor.shutdown(wait=True)
            self.gateways.close(WorkerShutdown(worker_id=self.worker_id, epoch=self.epoch))
            log_event(log, "worker_stopped", role=self.role, worker_id=self.worker_id)


def _grammar_rejected(exc: BaseException) -> bool:
    """True when ``exc`` says a request's structured output does not compile (``GrammarRejected``;
    imported here: the engine, and xgrammar with it, is loaded by then)."""
    from engine.structured_output import GrammarRejected

    return isinstance(exc, GrammarRejected)
