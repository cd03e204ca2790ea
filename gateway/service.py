"""Gateway service: control-plane dispatch, worker liveness, admission, and the request lifecycle.

Lifecycle (disaggregated; see protocol/messages.py): ``submit`` routes and sends ``ReserveKV`` to decode
(or ``PrefillRequest`` / ``ColocatedRequest``); ``stream`` reacts to ``KVReserved`` (→ ``PrefillRequest``
to prefill), ``FirstToken`` (→ ``DecodeRequest`` to decode), ``TokenBatch`` and ``RequestFinished``, and
turns tokens into text deltas with stop strings; ``release`` sends ``AbortRequest`` to every worker
still holding state unless the request ended on the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from gateway.control_socket import ControlSocket
from gateway.errors import queue_full
from gateway.handle import Delta, GenerationFailed, GenerationInput, RequestHandle, WorkerLost
from gateway.metrics import GatewayMetrics
from gateway.prefix_index import PrefixIndex
from gateway.registry import WorkerEntry, WorkerRegistry
from gateway.router import Router
from gateway.stream import run_stream
from gateway.text import TextProcessor, resolve_tokenizer_dir
from protocol.logging import log_event
from protocol.messages import (
    AbortRequest,
    ColocatedRequest,
    Heartbeat,
    Message,
    PrefillRequest,
    RegisterAck,
    RegisterWorker,
    RequestFailed,
    RequestFinished,
    ReRegister,
    ReserveKV,
    WorkerShutdown,
)
from protocol.settings import GatewaySettings

log = logging.getLogger("pdserve.gateway")
RECENT_IDS = 1 << 16  # released worker request ids remembered, so a reused X-Request-Id gets a new one
_PER_REQUEST = ("KVReserved", "FirstToken", "TokenBatch", "RequestFinished", "RequestFailed")


class GatewayService:
    """Owns the registry, router, control socket and live requests of one gateway process."""

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics,
                 text: TextProcessor | None = None) -> None:
        self.settings, self.metrics, self._text = settings, metrics, text
        self.registry = WorkerRegistry(settings.heartbeat_timeout)
        self.router = Router(self.registry, PrefixIndex(), settings.disagg_threshold,
                             settings.allow_local_prefill)
        self.requests: dict[str, RequestHandle] = {}
        self.released: OrderedDict[str, None] = OrderedDict()  # worker ids that workers may still hold
        self.control: ControlSocket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        """Bind the control socket and start the receive and reaper loops. Raises OSError on bind."""
        self.control = ControlSocket(self.settings.control_bind)
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._reap_loop())]

    async def stop(self) -> None:
        """Stop loops and close the socket."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.control is not None:
            self.control.close()

    def text(self) -> TextProcessor:
        """The tokenizer (loaded on first use from --tokenizer or a worker's model_path).

        Raises:
            TokenizerNotFoundError: no usable tokenizer dir yet.
        """
        if self._text is None:
            path = resolve_tokenizer_dir(self.settings.tokenizer, self.registry.first_model_path())
            self._text = TextProcessor.from_dir(path)
        return self._text

    async def send(self, worker: WorkerEntry, msg: Message) -> bool:
        """Send a message to a worker; False if it is gone."""
        assert self.control is not None
        return await self.control.send(worker.identity, msg)

    # ---- control plane -------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        assert self.control is not None
        while True:
            identity, msg = await self.control.recv()
            if msg is not None:
                try:
                    await self._dispatch(identity, msg)
                except Exception:
                    log.exception("control message handling failed")

    async def _dispatch(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, RegisterWorker):
            await self._on_register(identity, msg)
        elif isinstance(msg, Heartbeat):
            entry = self.registry.touch(msg.worker_id, msg.epoch, msg.load)
            if entry is not None:
                self.metrics.set_worker_load(entry.worker_id, entry.role, msg.load)
            else:  # restarted gateway, or a worker reaped after a stall: ask it to register again
                await self._ask_reregister(identity, msg)
        elif isinstance(msg, WorkerShutdown):
            entry = self.registry.remove(msg.worker_id, msg.epoch)
            if entry is not None:
                self._worker_gone(entry, "worker shut down", announced=True)
        elif type(msg).__name__ in _PER_REQUEST:
            await self._on_request_message(identity, msg)

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
            self._worker_gone(old, f"worker {old.worker_id} restarted (epoch {msg.epoch})")
        assert self.control is not None
        await self.control.send(identity, RegisterAck(worker_id=msg.worker_id, epoch=msg.epoch,
                                                      accepted=not reason, reason=reason))
        log_event(log, "worker_registered" if not reason else "worker_refused", worker_id=msg.worker_id,
                  role=msg.role, epoch=msg.epoch, reason=reason)
        if not reason:
            self.metrics.set_worker_load(msg.worker_id, msg.role, msg.load)
            self._update_worker_counts()
            await self._preload_tokenizer()

    async def _on_request_message(self, identity: bytes, msg: Message) -> None:
        worker_id: str = getattr(msg, "worker_id", "")
        request_id: str = getattr(msg, "request_id", "")
        entry = self.registry.get(worker_id)
        if entry is not None:
            self.registry.touch(worker_id, entry.info.epoch)
        handle = self.requests.get(request_id)
        if handle is not None:
            handle.inbox.put_nowait(msg)
        elif not isinstance(msg, RequestFinished | RequestFailed) and self.control is not None:
            await self.control.send(identity, AbortRequest(request_id=request_id, reason="unknown request"))

    def _worker_gone(self, entry: WorkerEntry, reason: str, announced: bool = False) -> None:
        """Forget a worker; its requests get ``WorkerLost``. ``announced``: it said so itself (a clean
        shutdown, logged at INFO when it held no request; WARNING otherwise)."""
        self.metrics.worker_deaths.inc()
        self.metrics.drop_worker(entry.worker_id, entry.role)
        self.router.prefix_index.remove_worker(entry.worker_id)
        level = logging.INFO if announced and not entry.requests else logging.WARNING
        log_event(log, "worker_lost", level, worker_id=entry.worker_id, reason=reason)
        for request_id in list(entry.requests):
            handle = self.requests.get(request_id)
            if handle is not None:
                handle.holders.pop(entry.worker_id, None)
                handle.inbox.put_nowait(WorkerLost(entry.worker_id, reason))
        if entry.requests and self.control is not None:  # a stalled (not dead) worker frees them
            for request_id in entry.requests:
                self._spawn(self.control.send(entry.identity, AbortRequest(
                    request_id=request_id, reason=f"worker declared lost: {reason}")))
        entry.requests.clear()
        self._update_worker_counts()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` as a task kept referenced (in ``_background``) until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _update_worker_counts(self) -> None:
        for role in ("prefill", "decode", "colocated"):
            self.metrics.workers.labels(role).set(len(self.registry.live(role)))  # type: ignore[arg-type]

    async def _reap_loop(self) -> None:
        period = min(0.5, self.settings.heartbeat_timeout / 4)
        while True:
            await asyncio.sleep(period)
            for entry in self.registry.reap():
                self._worker_gone(entry, f"no heartbeat for {self.settings.heartbeat_timeout} s")

    # ---- requests ------------------------------------------------------------------------------
    async def submit(self, inp: GenerationInput) -> RequestHandle:
        """Admit, route and send the first message of a request.

        Raises:
            APIError: 429 when ``--max-queue`` requests are in flight.
            NoWorkerError: no live worker can serve it (→ 503).
        """
        if len(self.requests) >= self.settings.max_queue:
            raise queue_full()
        route = self.router.route(inp.prompt_token_ids, inp.sampling.max_tokens)
        handle = RequestHandle(inp, route)
        self.requests[inp.request_id] = handle
        self.metrics.in_flight.set(len(self.requests))
        self.metrics.routes.labels(route.kind).inc()
        if route.fallback:
            self.metrics.fallbacks.inc()
        if route.kind == "disaggregated":
            assert route.decode is not None and route.prefill is not None
            first: Message = ReserveKV(request_id=inp.request_id, prompt_token_ids=inp.prompt_token_ids,
                                       sampling=inp.sampling, prefill_worker_id=route.prefill.worker_id)
            await self.hold_and_send(handle, route.decode, first)
        elif route.kind == "prefill_only":
            assert route.prefill is not None
            await self.hold_and_send(handle, route.prefill, PrefillRequest(
                request_id=inp.request_id, prompt_token_ids=inp.prompt_token_ids, sampling=inp.sampling))
        else:
            assert route.colocated is not None
            await self.hold_and_send(handle, route.colocated, ColocatedRequest(
                request_id=inp.request_id, prompt_token_ids=inp.prompt_token_ids, sampling=inp.sampling))
        log_event(log, "request_routed", request_id=inp.request_id, kind=route.kind,
                  prompt_tokens=len(inp.prompt_token_ids), fallback=route.fallback)
        return handle

    async def hold_and_send(self, handle: RequestHandle, worker: WorkerEntry, msg: Message) -> None:
        """Mark ``worker`` as holding state for the request, then send; a failed send → WorkerLost."""
        handle.holders[worker.worker_id] = worker.identity
        worker.requests.add(handle.request_id)
        if not await self.send(worker, msg):
            handle.inbox.put_nowait(WorkerLost(worker.worker_id, "worker unreachable"))

    def drop_holder(self, handle: RequestHandle, worker_id: str) -> None:
        """The worker no longer holds state for this request."""
        handle.holders.pop(worker_id, None)
        entry = self.registry.get(worker_id)
        if entry is not None:
            entry.requests.discard(handle.request_id)

    def worker_request_id(self, request_id: str) -> str:
        """The id workers see for a new request: ``request_id`` itself, or ``request_id~k`` (smallest free
        k ≥ 1) when that id is in flight or was released recently. Workers may still hold a released
        request (an abort in flight, a KV send finishing), and their late messages are matched by id,
        so a client that reuses an X-Request-Id must not get the old incarnation's tokens or collide
        with it in a worker's scheduler. (``~`` never occurs in client ids: see gateway/middleware.py.)"""
        candidate, k = request_id, 0
        while candidate in self.requests or candidate in self.released:
            k += 1
            candidate = f"{request_id}~{k}"
        return candidate

    @staticmethod
    def client_request_id(worker_request_id: str) -> str:
        """The X-Request-Id-derived id a worker request id was made from (``worker_request_id`` undone)."""
        return worker_request_id.partition("~")[0]

    def stream(self, handle: RequestHandle) -> AsyncIterator[Delta]:
        """Text deltas of the request (see gateway/stream.py). Raises GenerationFailed."""
        return run_stream(self, handle)

    def release(self, handle: RequestHandle) -> None:
        """End the request now; aborts go out in a background task (safe inside a cancelled scope)."""
        if self.requests.pop(handle.request_id, None) is None:
            return
        self.released[handle.request_id] = None
        while len(self.released) > RECENT_IDS:
            self.released.popitem(last=False)
        self._spawn(self._finish(handle))

    async def _finish(self, handle: RequestHandle) -> None:
        self.metrics.in_flight.set(len(self.requests))
        assert self.control is not None
        for worker_id, identity in list(handle.holders.items()):
            await self.control.send(identity, AbortRequest(request_id=handle.request_id))
            self.drop_holder(handle, worker_id)
            log_event(log, "abort_sent", request_id=handle.request_id, worker_id=worker_id)
        if handle.finished:
            self.metrics.observe_tokens(handle.arrival, handle.token_times)
        log_event(log, "request_done", request_id=handle.request_id, finished=handle.finished,
                  tokens=len(handle.token_times), e2e_s=round(time.monotonic() - handle.arrival, 4))


__all__ = ["GatewayService", "GenerationFailed"]
