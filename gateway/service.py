"""The gateway process's control plane: the control socket, worker registration, heartbeats and
liveness (the reaper), the tokenizer, and the ``Orchestrator`` that owns the live requests.

Control messages from workers: ``RegisterWorker`` (→ ``RegisterAck``, naming the control ports of this
process's siblings in a ``--workers N`` pool; a higher epoch replaces the old incarnation, whose requests
fail), ``Heartbeat`` (load; an unknown worker is asked to ``ReRegister``),
``WorkerShutdown``, ``KVEvents`` (the worker's prefix-cache changes, fed to the router's ``PrefixIndex``;
a gap in their numbers → ``KVSnapshotRequest``); per-request messages go to the orchestrator
(gateway/orchestrator.py), after counting as a sign of life of their worker; an ``OutputBatch`` (a
worker phase's per-request messages in one frame) is applied message by message, in order. A worker
silent for ``--heartbeat-timeout`` s is declared lost; so is, at once, a worker a send fails to reach
(its connection is gone: ``SendOutcome.UNREACHABLE``), and each dropped connection that had completed
its handshake (not a refused peer's) makes the gateway probe every worker (``Probe``) to find whose it
was. A send that only would block (a slow worker) drops
nobody. A lost worker is back when it registers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from gateway.admission import Admission
from gateway.canary import CanaryTracker
from gateway.control_socket import ControlSocket, SendOutcome
from gateway.metrics import GatewayMetrics
from gateway.openai_responses import GatewayProcessStatus
from gateway.orchestrator import Orchestrator
from gateway.prefix_index import PrefixIndex
from gateway.process import GatewayProcess
from gateway.registry import WorkerEntry, WorkerRegistry, pairing_mismatch
from gateway.request_state import WorkerMessage
from gateway.router import Router
from gateway.status import readiness
from gateway.text import TextProcessor, resolve_tokenizer_dir
from kvtransfer.curve import Refusals
from protocol.logging import log_event
from protocol.messages import (
    GatewayShutdown,
    Heartbeat,
    KVCanaryReserved,
    KVCanaryResult,
    KVEvents,
    KVSnapshotRequest,
    Message,
    OutputBatch,
    Probe,
    RegisterAck,
    RegisterWorker,
    ReRegister,
    WorkerShutdown,
    new_epoch,
)
from protocol.settings import GatewaySettings, control_keys

log = logging.getLogger("pdserve.gateway")

# after a dropped connection, probe the workers at these delays (seconds): the ROUTER forgets a peer's
# identity once it has processed the connection's end, which may come a little after the event
PROBE_DELAYS = (0.0, 0.05, 0.25, 1.0)
SHUTDOWN_LINGER_MS = 500  # how long a stopping gateway's GatewayShutdown notices get to go out
SHUTDOWN_NOTICE_S = 0.2  # between the notices and closing the socket: read before the connection drops


class GatewayService:
    """Owns the registry, router, control socket and orchestrator (the live requests) of one gateway
    process. ``control`` is None until ``start``; ``epoch`` is this process's incarnation, sent in every
    ``RegisterAck`` (a worker drops the requests of an earlier gateway when it sees it change);
    ``process`` says which of the gateway's processes this is (``--workers``)."""

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics,
                 text: TextProcessor | None = None, process: GatewayProcess | None = None) -> None:
        self.settings, self.metrics, self._text = settings, metrics, text
        self.process = process or GatewayProcess()
        self.epoch = new_epoch()
        self.registry = WorkerRegistry(settings.heartbeat_timeout)
        self.canaries = CanaryTracker(self.registry, metrics, self.send, settings.kv_canary_timeout,
                                      settings.kv_canary_period, round(settings.kv_canary_mib * (1 << 20)))
        self.router = Router(self.registry, PrefixIndex(), settings.disagg_threshold,
                             settings.allow_local_prefill, blocked=self.canaries.blocked)
        self.orchestrator = Orchestrator(self.router, metrics, self.send, settings.max_queue,
                                         settings.request_timeout,
                                         Admission(self.registry, settings.admission_budget, metrics),
                                         settings.max_retries, settings.max_migrations)
        self.control: ControlSocket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Bind the control socket (a CURVE server with ``--curve-keys``) and start the receive, reaper,
        probe and canary loops. Raises OSError on bind, ValueError for an unusable key directory."""
        keys = control_keys(self.settings)
        if keys is None:
            log.warning("--insecure-control-plane: the control socket at %s accepts any process that "
                        "reaches it (it may register as a worker and receive prompts)",
                        self.settings.control_bind)
        refusals = Refusals(f"gateway control socket {self.settings.control_bind}",
                            lambda kind: self.metrics.control_auth_refused.labels(kind).inc())
        self.control = ControlSocket(self.settings.control_bind, keys, refusals)
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._reap_loop()),
                       asyncio.create_task(self._probe_loop()), asyncio.create_task(self._canary_loop())]

    async def stop(self) -> None:
        """Stop loops, tell every registered worker this gateway leaves (``GatewayShutdown``: each then
        drops what this gateway still owns, and its connection's drop is no failure) and close the socket
        (``SHUTDOWN_LINGER_MS`` for those messages to go out)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.control is not None:
            notice = GatewayShutdown(gateway_epoch=self.epoch)
            for entry in self.registry.live():
                await self.control.send_outcome(entry.identity, notice)
            if self.registry.live():  # each worker reads the notice before its connection drops
                await asyncio.sleep(SHUTDOWN_NOTICE_S)
            self.control.close(SHUTDOWN_LINGER_MS if self.registry.live() else 0)

    async def wait_ready(self, timeout: float, poll: float = 0.05, stop: asyncio.Event | None = None) -> bool:
        """Wait until this process can serve (``gateway.status.readiness``: a usable prefill/decode pair or
        a colocated worker registered), looking every ``poll`` s, at most ``timeout`` s, and no longer once
        ``stop`` is set. Returns whether it can. Call with the control socket started (``start``), so
        workers can register meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not readiness(self.registry, self.canaries).ready:
            if loop.time() >= deadline or (stop is not None and stop.is_set()):
                return False
            await asyncio.sleep(poll)
        return True

    def process_status(self) -> GatewayProcessStatus:
        """This process's place among the gateway's processes, its pid and its bound control endpoint
        (``--control-bind`` until ``start``)."""
        control = self.control.endpoint if self.control is not None else self.settings.control_bind
        return GatewayProcessStatus(self.process.index, self.process.count, os.getpid(), control)

    def text(self) -> TextProcessor:
        """The tokenizer (loaded on first use from --tokenizer or a worker's model_path).

        Raises:
            TokenizerNotFoundError: no usable tokenizer dir yet.
        """
        if self._text is None:
            path = resolve_tokenizer_dir(self.settings.tokenizer, self.registry.first_model_path())
            self._text = TextProcessor.from_dir(path)
        return self._text

    async def send(self, identity: bytes, msg: Message) -> bool:
        """Send a message to the worker with zmq routing ``identity``; False if not delivered (or the
        socket is not bound yet). A worker found unreachable leaves routing at once (``worker_gone``);
        one whose queue is full (slow) stays."""
        if self.control is None:
            return False
        outcome = await self.control.send_outcome(identity, msg)
        if outcome is SendOutcome.UNREACHABLE:
            entry = self.registry.remove_identity(identity)
            if entry is not None:
                self.worker_gone(entry, f"unreachable: its control connection is gone "
                                        f"(a {type(msg).__name__} could not be sent)")
        elif outcome is SendOutcome.BUSY:
            entry = self.registry.by_identity(identity)
            log_event(log, "control_send_busy", logging.WARNING, msg_type=type(msg).__name__,
                      worker_id=entry.worker_id if entry is not None else None)
        return outcome is SendOutcome.SENT

    # ---- control plane -------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        assert self.control is not None
        while True:
            for identity, msg in await self.control.recv_many():
                if msg is not None:
                    try:
                        await self.on_control_message(identity, msg)
                    except Exception:
                        log.exception("control message handling failed")

    async def _probe_loop(self) -> None:
        assert self.control is not None
        while True:
            await self.control.disconnects()
            log_event(log, "control_connection_dropped", workers=len(self.registry.live()))
            for delay in PROBE_DELAYS:
                await asyncio.sleep(delay)
                await self.probe_all()

    async def probe_all(self) -> None:
        """Send a ``Probe`` to every registered worker: those no longer connected leave routing."""
        for entry in self.registry.live():
            await self.send(entry.identity, Probe(worker_id=entry.worker_id, epoch=entry.info.epoch))

    async def on_control_message(self, identity: bytes, msg: Message) -> None:
        """Apply one message from the worker with zmq routing ``identity``."""
        if isinstance(msg, RegisterWorker):
            await self._on_register(identity, msg)
        elif isinstance(msg, Heartbeat):
            before = self.registry.get(msg.worker_id)
            was_draining = before is not None and before.load.draining
            entry = self.registry.touch(msg.worker_id, msg.epoch, msg.load)
            if entry is not None:
                self.metrics.set_worker_load(entry.worker_id, entry.role, msg.load)
                if msg.load.draining and not was_draining:  # out of routing; its requests go on
                    log_event(log, "worker_draining", worker_id=entry.worker_id, role=entry.role,
                              requests=len(entry.requests) + len(entry.unsent))
            else:  # restarted gateway, or a worker reaped after a stall: ask it to register again
                await self._ask_reregister(identity, msg)
        elif isinstance(msg, WorkerShutdown):
            entry = self.registry.remove(msg.worker_id, msg.epoch)
            if entry is not None:
                self.worker_gone(entry, "worker shut down", announced=True)
        elif isinstance(msg, KVCanaryReserved | KVCanaryResult):
            self._heard_from(msg.worker_id)
            if isinstance(msg, KVCanaryReserved):
                await self.canaries.on_reserved(msg)
            else:
                await self.canaries.on_result(msg)
        elif isinstance(msg, KVEvents):
            await self._on_kv_events(identity, msg)
        elif isinstance(msg, OutputBatch):
            self._heard_from(msg.worker_id)
            for item in msg.messages:
                await self.orchestrator.on_worker_message(identity, item)
        elif isinstance(msg, WorkerMessage):
            self._heard_from(msg.worker_id)
            await self.orchestrator.on_worker_message(identity, msg)

    def _heard_from(self, worker_id: str) -> None:
        """A registered worker's message counts as a sign of life (its current epoch's)."""
        entry = self.registry.get(worker_id)
        if entry is not None:
            self.registry.touch(worker_id, entry.info.epoch)

    async def _on_kv_events(self, identity: bytes, msg: KVEvents) -> None:
        """Apply a worker's prefix-cache changes to the prefix index; ask for a snapshot after a gap.
        Events of an unregistered worker or of another incarnation than the registered one are dropped
        (a registered worker sends a snapshot once accepted)."""
        entry = self.registry.get(msg.worker_id)
        if entry is None or entry.info.epoch != msg.epoch:
            return
        self.registry.touch(msg.worker_id, msg.epoch)
        index = self.router.prefix_index
        outcome = index.apply(msg)
        if outcome in ("snapshot", "delta", "gap"):
            self.metrics.kv_events.labels(outcome).inc()
        if outcome == "gap":
            log_event(log, "kv_events_gap", logging.INFO, worker_id=msg.worker_id, seq_no=msg.seq_no)
            await self.send(identity, KVSnapshotRequest(worker_id=msg.worker_id, epoch=msg.epoch))
        blocks = index.num_cached(entry.worker_id)
        self.metrics.prefix_index_blocks.labels(entry.worker_id, entry.role).set(blocks)

    async def _ask_reregister(self, identity: bytes, msg: Heartbeat) -> None:
        assert self.control is not None
        stale = self.registry.get(msg.worker_id)
        if stale is not None and stale.info.epoch > msg.epoch:
            return  # an older incarnation of a restarted worker: it is being replaced
        await self.control.send(identity, ReRegister(worker_id=msg.worker_id, epoch=msg.epoch,
                                                     reason="unknown to the gateway"))

    async def _preload_tokenizer(self) -> None:
        """Load the tokenizer in a thread at the first registration, so no request (and no heartbeat
        handling) ever waits on the event loop for it."""
        if self._text is not None:
            return
        try:
            await asyncio.to_thread(self.text)
        except Exception as exc:  # requests will report it (TokenizerNotFoundError → 503)
            log_event(log, "tokenizer_not_loaded", logging.WARNING, error=str(exc))

    async def _on_register(self, identity: bytes, msg: RegisterWorker) -> None:
        old, reason = self.registry.register(msg, identity)
        if old is not None:
            self.worker_gone(old, f"worker {old.worker_id} restarted (epoch {msg.epoch})", replaced=True)
        assert self.control is not None
        await self.control.send(identity, RegisterAck(worker_id=msg.worker_id, epoch=msg.epoch,
                                                      accepted=not reason, reason=reason,
                                                      gateway_epoch=self.epoch,
                                                      sibling_ports=self.process.sibling_ports(),
                                                      control_port=self.process.own_port()))
        log_event(log, "worker_registered" if not reason else "worker_refused", worker_id=msg.worker_id,
                  role=msg.role, epoch=msg.epoch, reason=reason, draining=msg.load.draining)
        if not reason:
            self.metrics.set_worker_load(msg.worker_id, msg.role, msg.load)
            self._update_worker_counts()
            self._log_refused_pairs(msg)
            await self.canaries.tick()  # the pairing canary of each new compatible pair
            await self._preload_tokenizer()

    def _log_refused_pairs(self, msg: RegisterWorker) -> None:
        """Log each pair the new worker cannot form with a registered counterpart, naming the fields."""
        other = {"prefill": "decode", "decode": "prefill"}.get(msg.role)
        if other is None:
            return
        for peer in self.registry.live(other):  # type: ignore[arg-type]
            p, d = (msg, peer.info) if msg.role == "prefill" else (peer.info, msg)
            mismatch = pairing_mismatch(p, d)
            if mismatch is not None:
                log_event(log, "pair_refused", logging.WARNING, prefill=p.worker_id, decode=d.worker_id,
                          reason=mismatch)

    def worker_gone(self, entry: WorkerEntry, reason: str, announced: bool = False,
                    replaced: bool = False) -> None:
        """Forget a worker (already out of the registry); its requests fail (``Orchestrator.worker_lost``).
        ``announced``: it said so itself (a clean shutdown, logged at INFO when it held no request;
        WARNING otherwise). ``replaced``: a new incarnation registered (not listed as dropped)."""
        if not replaced:
            self.registry.record_dropped(entry, reason)
        self.metrics.worker_deaths.inc()
        self.metrics.drop_worker(entry.worker_id, entry.role)
        self.router.prefix_index.remove_worker(entry.worker_id)
        level = logging.INFO if announced and not entry.requests else logging.WARNING
        log_event(log, "worker_lost", level, worker_id=entry.worker_id, reason=reason)
        self.orchestrator.worker_lost(entry, reason)
        self._update_worker_counts()

    def _update_worker_counts(self) -> None:
        for role in ("prefill", "decode", "colocated"):
            self.metrics.workers.labels(role).set(len(self.registry.live(role)))  # type: ignore[arg-type]

    async def _canary_loop(self) -> None:
        period = min(0.25, self.settings.kv_canary_timeout / 4)
        while True:
            await asyncio.sleep(period)
            try:
                await self.canaries.tick()
            except Exception:
                log.exception("KV canary round failed")

    async def _reap_loop(self) -> None:
        period = min(0.5, self.settings.heartbeat_timeout / 4)
        while True:
            await asyncio.sleep(period)
            for entry in self.registry.reap():
                self.worker_gone(entry, f"no heartbeat for {self.settings.heartbeat_timeout} s")
