"""The worker process loop: control messages on asyncio, engine steps on one background thread.

Queues and states:
  * ``inbox``: control messages from the gateway, applied between steps (the engine's scheduler is only
    ever touched while no step runs, so no locks are needed around it);
  * the engine's own queues (scheduler ``waiting`` / ``running``), advanced one step at a time by
    ``run_in_executor`` on a single thread, so heartbeats and aborts are never stalled by a forward pass;
  * ``outbox``: messages for the gateway, flushed after every phase; the phase's per-request messages
    (a step's tokens of every running request) go out as one ``OutputBatch`` frame, and the phase's
    prefix-cache changes as one ``KVEvents`` (``kv_events``; a snapshot after each accepted
    registration and on ``KVSnapshotRequest``).
Subclasses (prefill, decode, colocated) implement ``on_message`` / ``poll`` / ``has_work`` / ``step`` /
``on_step`` / ``drop``. A failing step fails only the requests it carried (``RequestFailed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from kvtransfer.compat import KVCompat
from protocol.logging import log_event
from protocol.messages import (
    Heartbeat,
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
from workers.control_client import ControlClient
from workers.health_server import EngineHealth, HealthServer
from workers.metrics import WorkerMetrics
from workers.outputs import batch_outputs
from workers.placement import kv_placement
from workers.step import StepFailed

if TYPE_CHECKING:
    from engine.engine_core import EngineCore, StepOutput
    from protocol.settings import WorkerSettings

log = logging.getLogger("pdserve.worker")


@dataclass(frozen=True)
class GatewayChanged:
    """Inbox marker, local to a worker: the gateway that accepts it now (epoch ``new``) is not the one
    that sent the messages before this marker (epoch ``old``)."""

    old: int
    new: int


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
        self.control = ControlClient(settings.gateway_control, self.keys)
        self.received: Counter[str] = Counter()  # control messages received, by type name
        self._inbox: deque[Message | GatewayChanged] = deque()
        self._refused: deque[tuple[str, str]] = deque()  # (request id, why) of frames decode_frame refused
        self._outbox: list[Message] = []
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"{self.role}-step")
        self._load = WorkerLoad()
        self.gateway_epoch = 0  # the incarnation of the gateway that last accepted this worker
        self._wake: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self.metrics = WorkerMetrics(settings.model, core.max_model_len)
        self.health = EngineHealth(settings.engine_stall_timeout)
        self.metrics.watch(self.load, lambda: core.scheduler.num_preemptions, self.health.loop_age,
                           lambda: self.health.registered)
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
        """Queue a message for the gateway (sent at the end of the current phase)."""
        self._outbox.append(msg)

    def deliver(self, msg: Message | GatewayChanged) -> None:
        """Queue a control message from the gateway; it is applied at the next phase boundary."""
        self.received[type(msg).__name__] += 1
        self._inbox.append(msg)

    def accepted_by(self, ack: RegisterAck) -> None:
        """The gateway accepted this worker. When ``ack.gateway_epoch`` differs from the last one seen (the
        gateway restarted), a ``GatewayChanged`` marker is queued behind every message already received:
        applying it drops each request the worker holds then, all of them the old gateway's."""
        if self.gateway_epoch and ack.gateway_epoch and ack.gateway_epoch != self.gateway_epoch:
            self.deliver(GatewayChanged(self.gateway_epoch, ack.gateway_epoch))
        self.gateway_epoch = ack.gateway_epoch or self.gateway_epoch
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

    def _gateway_changed(self, change: GatewayChanged) -> None:
        dropped = self.request_ids()
        for rid in dropped:
            with contextlib.suppress(Exception):
                self.drop(rid)
        log_event(log, "gateway_changed", logging.WARNING, worker_id=self.worker_id,
                  old_gateway_epoch=change.old, new_gateway_epoch=change.new, dropped=len(dropped))

    def decode_frame(self, data: bytes) -> Message | None:
        """One control frame from the gateway → its message, or None. A frame that fails validation but
        names a request (e.g. a sampling parameter out of range) fails that request at the next phase
        boundary (``fail``: ``RequestFailed`` to the gateway). Any other bad frame is logged and dropped."""
        try:
            return decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            rid = request_id_of(data)
            if rid is None:
                log.warning("undecodable control message dropped: %s", exc)
            else:
                self._refused.append((rid, f"{type(exc).__name__}: {exc}"))
            return None

    def take_outbox(self) -> list[Message]:
        """Remove and return the messages emitted since the last flush (oldest first)."""
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

    async def _flush(self) -> None:
        if (events := self.kv_events()) is not None:
            self.emit(events)
        for msg in batch_outputs(self.worker_id, self.take_outbox()):
            await self.control.send(msg)

    def _between_steps(self) -> None:
        while self._inbox:
            msg = self._inbox.popleft()
            if isinstance(msg, GatewayChanged):
                self._gateway_changed(msg)
                continue
            try:
                self.on_message(msg)
            except Exception as exc:  # a bad message fails its request only
                rid = getattr(msg, "request_id", None)
                if rid is not None and _grammar_rejected(exc):  # the request's fault: the gateway says 400
                    self.reject(rid, str(exc))
                    continue
                log.exception("handling %s failed", type(msg).__name__)
                if rid is not None:
                    self.fail(rid, f"{type(exc).__name__}: {exc}")
        while self._refused:
            self.fail(*self._refused.popleft())
        self.poll()
        self._refresh_load()

    async def _recv_loop(self) -> None:
        assert self._wake is not None
        while True:
            msg = self.decode_frame(await self.control.recv_frame())
            if isinstance(msg, ReRegister):  # the gateway lost track of us: register again, same epoch
                log_event(log, "reregistering", logging.WARNING, worker_id=self.worker_id, reason=msg.reason)
                await self.control.send(self.registration())
            elif isinstance(msg, Probe):  # the gateway checking which connection dropped: nothing to do
                pass
            elif isinstance(msg, KVSnapshotRequest):  # the gateway missed a KVEvents: resend the whole set
                self.want_kv_snapshot()
                self._wake.set()
            elif isinstance(msg, RegisterAck):
                log_event(log, "registered" if msg.accepted else "registration_refused",
                          logging.INFO if msg.accepted else logging.ERROR, worker_id=self.worker_id,
                          reason=msg.reason)
                if msg.accepted:
                    self.accepted_by(msg)
                    self._wake.set()
                else:
                    self.health.registered = False
            else:  # a request message, or None (a refused frame may have queued a failure)
                if msg is not None:
                    if log.isEnabledFor(logging.DEBUG):
                        log_event(log, "message_received", logging.DEBUG, type=type(msg).__name__,
                                  request_id=getattr(msg, "request_id", None))
                    self.deliver(msg)
                self._wake.set()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            self._stop_if_ranks_lost()
            await self.control.send(Heartbeat(worker_id=self.worker_id, epoch=self.epoch, load=self._load))

    async def _engine_loop(self) -> None:
        assert self._wake is not None and self._stop is not None
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            self.health.tick()
            self._wake.clear()
            self._between_steps()
            await self._flush()
            if self.has_work():
                try:
                    outs = await loop.run_in_executor(self._executor, self.step)
                except StepFailed as exc:
                    self._step_failed(exc)
                else:
                    self.on_step(outs)
                self._refresh_load()
                await self._flush()
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
        """Register, then serve until SIGTERM/SIGINT; sends ``WorkerShutdown`` on the way out.

        Raises:
            RegistrationError: the gateway refused this worker or never answered.
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
            self.accepted_by(await self.control.register(self.registration()))
            log_event(log, "worker_ready", role=self.role, worker_id=self.worker_id, epoch=self.epoch)
            tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._heartbeat_loop())]
            await self._engine_loop()
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self.close()
            if self.health_server is not None:
                self.health_server.stop()
            self._executor.shutdown(wait=True)
            await self.control.close(WorkerShutdown(worker_id=self.worker_id, epoch=self.epoch))
            log_event(log, "worker_stopped", role=self.role, worker_id=self.worker_id)


def _grammar_rejected(exc: BaseException) -> bool:
    """True when ``exc`` says a request's structured output does not compile (``GrammarRejected``;
    imported here: the engine, and xgrammar with it, is loaded by then)."""
    from engine.structured_output import GrammarRejected

    return isinstance(exc, GrammarRejected)
