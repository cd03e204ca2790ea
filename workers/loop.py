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
    gateway (``kv_events``: workers/kv_events.py; a snapshot after each accepted registration and on
    ``KVSnapshotRequest``).

Several gateways (workers/gateway_sessions.py): the worker registers with each, heartbeats to each and
keeps each request's state for its owner only; a lost gateway's ``GatewayLost`` marker, queued in the inbox
behind what it sent, drops exactly the requests it owns.
Subclasses (prefill, decode, colocated) implement ``on_message`` / ``poll`` / ``has_work`` / ``step`` /
``on_step`` / ``drop``. A failing step fails only the requests it carried (``RequestFailed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import weakref
from collections import Counter, deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import msgspec

from kvtransfer.compat import KVCompat
from protocol.logging import log_event
from protocol.messages import (
    ColocatedRequest,
    FailureKind,
    Heartbeat,
    KVCanaryReserve,
    KVCanarySend,
    KVEvents,
    Message,
    PrefillRequest,
    RegisterWorker,
    RequestFailed,
    RequestRejected,
    Role,
    WorkerLoad,
    decode,
    new_epoch,
    request_id_of,
)
from protocol.settings import control_keys
from workers.gateway_sessions import REGISTER_TIMEOUT_S, GatewayLost, GatewaySessions
from workers.health_server import EngineHealth, HealthServer
from workers.kv_events import KVEventFeed
from workers.metrics import WorkerMetrics
from workers.ownership import NO_OWNER, RequestOwners, continued_id, started_id
from workers.placement import kv_placement
from workers.step import StepFailed

if TYPE_CHECKING:
    from engine.engine_core import EngineCore, StepOutput
    from engine.sequence import Sequence
    from protocol.settings import WorkerSettings

log = logging.getLogger("pdserve.worker")


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
        self.sessions = GatewaySessions(settings.gateway_control, self.keys, self)
        self.owners = RequestOwners()
        self.received: Counter[str] = Counter()  # control messages received, by type name
        self._inbox: deque[tuple[Message | GatewayLost, str]] = deque()  # (message, gateway key)
        # (request id, why, gateway key) of frames decode_frame refused
        self._refused: deque[tuple[str, str, str]] = deque()
        self._outbox: list[tuple[Message, str | None]] = []  # (message, ownership.RequestOwners.tag)
        self._pruned_at = 0.0
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"{self.role}-step")
        self._load = WorkerLoad()
        # per request, the prefix its gateway expected cached here (``expect_cached``); gone with the request
        self._expected_cached: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()
        self._wake: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self.fatal: str | None = None  # why the worker stopped itself (it then exits 1), None otherwise
        self._stop_signals = 0  # SIGTERM / SIGINT received (``on_stop_signal``)
        self._drain_deadline: float | None = None  # monotonic seconds; set while draining
        self._serving = False  # the engine loop runs (registered with a gateway)
        self.metrics = WorkerMetrics(settings.model, core.max_model_len)
        self.health = EngineHealth(settings.engine_stall_timeout)
        self.metrics.watch(self.load, lambda: core.scheduler.num_preemptions, self.health.loop_age,
                           lambda: self.health.registered)
        self.metrics.watch_host_tier(core.host_tier_stats)
        self.metrics.watch_queue(lambda: bool(core.scheduler.waiting) or any(
            isinstance(msg, PrefillRequest | ColocatedRequest) for msg, _ in self._inbox))
        self.health_server: HealthServer | None = None
        self.kv_feed = KVEventFeed(self.worker_id, self.epoch, core.block_manager)

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

    def awaiting_first_token(self) -> Iterable[Sequence]:
        """The requests this worker holds whose first token it will compute and has not yet (the backlog
        it reports, ``prefill_backlog``); none on roles that compute no prompts."""
        return ()

    def expect_cached(self, seq: Sequence, tokens: int) -> None:
        """Note the prompt prefix (tokens) the gateway expected this worker's cache to hold for ``seq``
        (``expected_cached_tokens`` of its request): its backlog counts the rest until it is scheduled."""
        if tokens > 0:
            self._expected_cached[seq] = tokens

    def prefill_backlog(self) -> int:
        """Prompt tokens this worker expects to compute for ``awaiting_first_token``: each its prompt minus
        the tokens computed so far (cache hits included) once it holds blocks, else minus the prefix the
        gateway expected cached; at least 1, and at most what the prefill rate judges
        (``PrefillRate.judged``) — the ``WorkerLoad.prefill_backlog_tokens`` of its heartbeats."""
        rate, expected = self.metrics.prefill_rate, self._expected_cached
        total = 0.0
        for seq in self.awaiting_first_token():
            done = seq.num_computed_tokens if seq.block_table else expected.get(seq, 0)
            total += rate.judged(max(1, seq.num_prompt_tokens - done))
        return round(total)

    def transfer_totals(self) -> tuple[int, float]:
        """Cumulative (bytes, seconds) of this worker's completed KV transfers, reported in heartbeats
        (``WorkerLoad.kv_transfer_bytes`` / ``kv_transfer_seconds``); (0, 0.0) for roles that send none."""
        return 0, 0.0

    def control_refusals(self) -> int:
        """Peers this worker's KV control socket refused so far (``WorkerLoad.kv_control_refused``); 0 for
        roles without one."""
        return 0

    def fenced_blocks(self) -> int:
        """KV blocks held for dropped requests until no write can land in them
        (``WorkerLoad.kv_fenced_blocks``); 0 for roles that receive no KV."""
        return 0

    # ---- shared machinery ---------------------------------------------------------------------------
    def emit(self, msg: Message) -> None:
        """Queue a message (sent at the end of the current phase): one naming a request to the gateway
        that owns it, any other to every gateway that accepts this worker."""
        self._outbox.append((msg, self.owners.tag(msg)))

    def emit_to(self, msg: Message, gateway: str) -> None:
        """Queue a message for the gateway with key ``gateway`` only (sent at the end of the current
        phase)."""
        self._outbox.append((msg, gateway))

    def wake(self) -> None:
        """Run the next phase now instead of after the idle poll (no-op before ``run``)."""
        if self._wake is not None:
            self._wake.set()

    def held_ids(self) -> set[str]:
        """Every request and KV canary id this worker holds state for."""
        return {*self.request_ids(), *self.canary_ids()}

    def deliver(self, msg: Message | GatewayLost, gateway: str | None = None) -> None:
        """Queue a control message from the gateway with key ``gateway`` (None: the first one); it is
        applied at the next phase boundary."""
        self.received[type(msg).__name__] += 1
        self._inbox.append((msg, self.sessions.gateways.default_key if gateway is None else gateway))

    def want_kv_snapshot(self) -> None:
        """Make the next ``kv_events`` a snapshot of the whole prefix cache (after a registration was
        accepted, so a gateway that knew nothing of this worker learns its cache; on
        ``KVSnapshotRequest``)."""
        self.kv_feed.want_snapshot()

    def kv_events(self) -> KVEvents | None:
        """The prefix-cache changes since the last call as one ``KVEvents`` (loop thread, between steps;
        ``KVEventFeed.next``), or None when nothing changed. The process loop emits it at every flush;
        ``run_once`` leaves that to its caller."""
        return self.kv_feed.next()

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
                key = self.sessions.gateways.default_key if gateway is None else gateway
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

    def fail(self, request_id: str, error: str, kind: FailureKind = "worker") -> None:
        """Drop the request here and tell the gateway (``RequestFailed`` of ``kind``: ``"structured_output"``
        when the request's grammar rejected its token, else ``"worker"``); the worker keeps serving."""
        log_event(log, "request_failed", logging.WARNING, request_id=request_id, error=error, kind=kind)
        with contextlib.suppress(Exception):
            self.drop(request_id)
        self.emit(RequestFailed(request_id=request_id, worker_id=self.worker_id, error=error, kind=kind))

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

    def seed_prefill_rate(self, tokens: int, seconds: float, ended: float) -> None:
        """Start the reported prefill rate from the start-up probe (``workers.boot.probe_core``):
        ``tokens`` prompt tokens computed in ``seconds``, ending at ``ended`` (monotonic seconds)."""
        self.metrics.prefill_rate.observe(tokens, ended - seconds, ended)
        self._refresh_load()

    def _refresh_load(self) -> None:
        bm = self.core.block_manager
        sent_bytes, sent_seconds = self.transfer_totals()
        rate = self.metrics.prefill_rate
        self._load = WorkerLoad(num_waiting=self.num_waiting(), num_running=len(self.core.scheduler.running),
                                num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks,
                                kv_transfer_bytes=sent_bytes, kv_transfer_seconds=sent_seconds,
                                kv_control_refused=self.control_refusals(),
                                kv_fenced_blocks=self.fenced_blocks(),
                                prefill_tokens_per_s=rate.tokens_per_s() or 0.0,
                                prefill_largest_tokens=round(rate.largest),
                                draining=self._drain_deadline is not None)

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
        self.sessions.send_routed(tagged)
        unowned = sum(1 for _, tag in tagged if tag == NO_OWNER)
        if unowned and log.isEnabledFor(logging.DEBUG):
            log_event(log, "messages_without_owner", logging.DEBUG, count=unowned)

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
                    self.emit_to(RequestFailed(request_id=started, worker_id=self.worker_id,
                                               error=f"request id {started!r} is taken on this "
                                                     "worker by another gateway's request"), gateway)
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
                self.sessions.drop_requests_of(msg)
            else:
                self._apply(msg, gateway)
        while self._refused:
            rid, why, gateway = self._refused.popleft()
            if self.owners.record(rid, gateway) == gateway:
                self.fail(rid, why)
            else:  # another gateway's request has this id: answer the sender, leave that one alone
                self.emit_to(RequestFailed(request_id=rid, worker_id=self.worker_id, error=why), gateway)
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

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            self._stop_if_ranks_lost()
            self._stop_if_kv_endpoint_dead()
            load = self.heartbeat_load()
            self.sessions.beat(Heartbeat(worker_id=self.worker_id, epoch=self.epoch, load=load))

    def heartbeat_load(self) -> WorkerLoad:
        """The load a heartbeat carries: the last phase boundary's, with the backlog counted now
        (``prefill_backlog``, while a step may run) plus the prompts of the requests received and not yet
        applied (a long step holds them in the inbox), each its prompt minus the prefix its gateway
        expected cached, as the rate judges it."""
        if self.role not in ("prefill", "colocated"):
            return self._load
        rate = self.metrics.prefill_rate
        received = sum(rate.judged(max(1, len(msg.prompt_token_ids) - msg.expected_cached_tokens))
                       for msg, _ in list(self._inbox) if isinstance(msg, PrefillRequest | ColocatedRequest))
        backlog = self.prefill_backlog() + round(received)
        return msgspec.structs.replace(self._load, prefill_backlog_tokens=backlog)

    async def _engine_loop(self) -> None:
        assert self._wake is not None and self._stop is not None
        loop = asyncio.get_running_loop()
        self._serving = True
        while not self._stop.is_set():
            self.health.tick()
            self._wake.clear()
            self._between_steps()
            self._drain_step()
            if self._stop.is_set():  # drained, or the drain's deadline passed: no further step
                break
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
                    async with asyncio.timeout(0.002 if self.busy() else self.idle_poll):
                        await self._wake.wait()

    def on_stop_signal(self) -> None:
        """SIGTERM / SIGINT (event loop thread): the first one drains, noted here and started at the next
        phase boundary (``_drain_step``; with ``--drain-timeout 0``, or before the worker serves, e.g.
        while it registers, it stops at once); a second one stops at once."""
        self._stop_signals += 1
        if self._stop_signals > 1 or self.settings.drain_timeout <= 0 or not self._serving:
            if self._drain_deadline is not None:
                log_event(log, "drain_cut_short", logging.WARNING, worker_id=self.worker_id,
                          requests=len(self.request_ids()))
            self.request_stop()
        else:
            self.wake()

    def _drain_step(self) -> None:
        """At a phase boundary of a worker asked to stop (``on_stop_signal``): start draining (every gateway
        is told at once by a heartbeat whose load says ``draining``, so none routes a new request here; what
        a gateway sent before it knew is still served), and stop once this worker holds no request or KV
        canary, or when ``--drain-timeout`` has passed (the requests still held then fail as on any stop:
        ``WorkerShutdown``, the gateway ends or moves them)."""
        if not self._stop_signals or self._stop is None or self._stop.is_set():
            return
        held = self.held_ids()
        now = time.monotonic()
        if self._drain_deadline is None:
            if not held:
                self.request_stop()
                return
            self._drain_deadline = now + self.settings.drain_timeout
            self._refresh_load()
            log_event(log, "worker_draining", worker_id=self.worker_id, requests=len(held),
                      drain_timeout_s=self.settings.drain_timeout)
            self.sessions.beat(Heartbeat(worker_id=self.worker_id, epoch=self.epoch,
                                         load=self.heartbeat_load()))
        elif not held:
            log_event(log, "worker_drained", worker_id=self.worker_id)
            self.request_stop()
        elif now >= self._drain_deadline:
            log_event(log, "drain_timeout", logging.WARNING, worker_id=self.worker_id, requests=len(held),
                      drain_timeout_s=self.settings.drain_timeout)
            self.request_stop()

    def _drop_held(self) -> None:
        """On the way out: drop every request still held (a drain cut short, or a stop without one), so
        their KV blocks are freed and their transfers aborted before the transports close."""
        held = self.request_ids()
        for rid in held:
            with contextlib.suppress(Exception):
                self.drop(rid)
        if held:
            log_event(log, "requests_dropped_at_stop", logging.WARNING, worker_id=self.worker_id,
                      requests=len(held))

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
            loop.add_signal_handler(sig, self.on_stop_signal)
        self._refresh_load()
        tasks: list[asyncio.Task[None]] = []
        try:
            self._start_health_server()
            self.sessions.start()
            tasks = [asyncio.create_task(self._heartbeat_loop())]
            if self.sessions.gateways.has_names:
                tasks.append(asyncio.create_task(
                    self.sessions.resolve_loop(self.settings.gateway_resolve_interval)))
            await self.sessions.wait_registered(REGISTER_TIMEOUT_S, self._stop)
            if self._stop.is_set():  # asked to stop while registering
                return
            log_event(log, "worker_ready", role=self.role, worker_id=self.worker_id, epoch=self.epoch,
                      gateways=len(self.sessions.gateways.links),
                      kv_cache_dtype=str(self.core.runner.kv_cache.cache_dtype).removeprefix("torch."))
            await self._engine_loop()
        finally:
            tasks += self.sessions.link_tasks()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._drop_held()
            self.close()
            if self.health_server is not None:
                self.health_server.stop()
            self._executor.shutdown(wait=True)
            self.sessions.close()
            log_event(log, "worker_stopped", role=self.role, worker_id=self.worker_id)


def _grammar_rejected(exc: BaseException) -> bool:
    """True when ``exc`` says a request's structured output does not compile (``GrammarRejected``;
    imported here: the engine, and xgrammar with it, is loaded by then)."""
    from engine.structured_output import GrammarRejected

    return isinstance(exc, GrammarRejected)
