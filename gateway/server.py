"""``pdserve gateway``: run the app under uvicorn.

One process (``--workers 1``): ``serve``, uvicorn binding ``--host:--port`` itself. Process i of N
(``serve_process``, started by ``pdserve.gateway_pool``): binds its own socket at ``--host:--port`` with
``SO_REUSEPORT`` (Linux spreads new connections over every listening socket of the group) and hands it to
uvicorn (``Server.serve(sockets=...)``); the socket starts listening only once the app's start-up is done
(asyncio's ``create_server`` calls ``listen``), so no connection waits on a process that is not ready.
The process tells its parent ``ready`` or ``failed: <reason>`` over a pipe, stops when the parent is gone,
and binds control port P + i (``GatewaySettings.control_endpoints``). Either way a stop signal drains
(``DrainingServer``): no new connection, the requests in flight finish within ``--drain-timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import functools
import logging
import math
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from types import FrameType

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.app import create_app
from gateway.process import GatewayProcess
from gateway.service import GatewayService
from protocol.logging import configure_logging, log_event
from protocol.settings import GatewaySettings

log = logging.getLogger("pdserve.gateway")
PARENT_CHECK_S = 0.5  # how often a gateway process checks that its parent is still there


def serve(settings: GatewaySettings) -> None:
    """Serve until stopped (``DrainingServer``). Raises OSError when the HTTP or control address cannot be
    bound."""
    app = create_app(settings)
    DrainingServer(app, settings, app.state.service.orchestrator.stop_requests).run()


DRAIN_BACKSTOP_S = 5  # uvicorn's own cut, in case a request outlives the drain's cut (whole seconds)
CUT_GRACE_S = 1.0  # after the requests in flight were told they end: their connections' last chance to close


class StopPhase(enum.Enum):
    """Where a ``DrainingServer`` is in its stop: serving; draining (a stop signal came: no new
    connection, the responses in flight go on); told (the responses still in flight were answered with
    why, ``stop_requests``); cut (their connections aborted and handlers cancelled)."""

    SERVING = "serving"
    DRAINING = "draining"
    TOLD = "told"
    CUT = "cut"


class DrainingServer(uvicorn.Server):
    """uvicorn serving ``app`` for ``settings`` (no access log, pdserve's logging), stopped by a drain: at
    the first SIGTERM or SIGINT it stops listening and closes idle connections at once (uvicorn's graceful
    shutdown) while the responses in flight, streams included, go on for up to ``--drain-timeout`` seconds
    (log event ``gateway_draining``); then, or at a second signal of either kind, or at once with
    ``--drain-timeout 0``, those still running are cut, with one warning ``requests_cut`` naming how many
    and why, no traceback: first each is answered with why (``stop_requests``, the orchestrator's: a 503
    before any output, an error event and ``[DONE]`` on a stream that has begun; its workers are told to
    drop it), then ``CUT_GRACE_S`` later, or at once at a further signal, the connections still open are
    aborted and their handlers cancelled (which ends their requests on the workers). The app's shutdown
    runs either way (the workers are told the gateway leaves). A third signal stops without it (uvicorn's
    forced exit)."""

    def __init__(self, app: ASGIApp, settings: GatewaySettings,
                 stop_requests: Callable[[str], int] | None = None) -> None:
        super().__init__(uvicorn.Config(self._serve_request, host=settings.host, port=settings.port,
                                        log_level=settings.log_level, access_log=False, log_config=None,
                                        interface="asgi3",
                                        timeout_graceful_shutdown=math.ceil(settings.drain_timeout)
                                        + DRAIN_BACKSTOP_S))
        self._app, self.drain_timeout, self._stop_requests = app, settings.drain_timeout, stop_requests
        self._phase = StopPhase.SERVING
        self._deadline: asyncio.TimerHandle | None = None  # the drain's deadline, while it may still come
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stopping = asyncio.Event()  # set at the first stop signal (on the event loop)
        self._signals = 0
        self._first_signal = 0  # its number (0: none)

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        """Serve until stopped; a stop by a signal exits with status 128 + the first signal (130 Ctrl-C,
        143 SIGTERM), without the ``KeyboardInterrupt`` traceback asyncio raises once uvicorn passes
        SIGINT on, and also where uvicorn's passing it on ends nothing (a signal the process inherited as
        ignored)."""
        try:
            super().run(sockets=sockets)
        except KeyboardInterrupt:
            raise SystemExit(128 + signal.SIGINT) from None
        if self._first_signal:
            raise SystemExit(128 + self._first_signal)

    async def _serve_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app uvicorn runs: ``app``, with a cancellation by ``_cut_requests`` ending the request
        quietly (its connection is gone already) instead of as an "Exception in ASGI application"."""
        try:
            await self._app(scope, receive, send)
        except asyncio.CancelledError:
            if self._phase is not StopPhase.CUT:
                raise

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        if self._signals:  # a stop signal came before the loop was known
            self.stopping.set()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # a signal handler may run inside the loop's or logging's own code: its work is handed to the loop
        self._signals += 1
        if self._signals == 1:
            self._first_signal = sig
            self._later(self.stopping.set)
            self._later(self._start_drain)
            super().handle_exit(sig, frame)
        elif self._signals == 2:
            self._later(functools.partial(self._cut_requests, "a second stop signal"))
        else:
            self.force_exit = True
            super().handle_exit(sig, frame)

    def _later(self, call: Callable[[], object]) -> None:
        """Run ``call`` on the event loop soon (a no-op before the server started)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(call)

    def _start_drain(self) -> None:
        self._phase = StopPhase.DRAINING
        if self.drain_timeout <= 0:
            self._cut_requests("--drain-timeout 0")
            return
        if self.server_state.tasks:
            log_event(log, "gateway_draining", requests=len(self.server_state.tasks),
                      drain_timeout_s=self.drain_timeout)
        assert self._loop is not None
        self._deadline = self._loop.call_later(self.drain_timeout, self._cut_requests, "the drain's deadline")

    def _cut_requests(self, why: str) -> None:
        """End the responses still in flight: the first time (with ``stop_requests``) by answering each
        with why, the connections still open aborted ``CUT_GRACE_S`` later; otherwise, or once they were
        told, at once (``_abort_connections``)."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        tasks = [task for task in self.server_state.tasks if not task.done()]
        if not tasks:
            return
        if self._phase is StopPhase.TOLD:
            self._abort_connections()
            return
        log_event(log, "requests_cut", logging.WARNING, requests=len(tasks), why=why)
        if self._stop_requests is None:
            self._abort_connections()
            return
        self._phase = StopPhase.TOLD
        self._stop_requests(f"the gateway is shutting down ({why})")
        assert self._loop is not None
        self._loop.call_later(CUT_GRACE_S, self._abort_connections)

    def _abort_connections(self) -> None:
        """Abort the connections of the responses still in flight, then cancel their handlers (after each
        connection is marked gone, so uvicorn reports no unfinished response)."""
        tasks = [task for task in self.server_state.tasks if not task.done()]
        if not tasks:
            return
        self._phase = StopPhase.CUT
        for connection in list(self.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()
        assert self._loop is not None
        for task in tasks:
            self._loop.call_soon(task.cancel)


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEADDR`` and ``SO_REUSEPORT``, not listening yet.

    Raises:
        OSError: the address cannot be resolved or bound (the message names it).
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise OSError(f"cannot resolve --host {host!r}: {exc}") from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind the HTTP socket at {host}:{port}: {exc.strerror or exc}") from exc
    sock.set_inheritable(False)
    return sock


class _Report:
    """Tells the parent, once, that this process is serving (``ready``) or why it could not start."""

    def __init__(self, conn: Connection) -> None:
        self._conn, self._sent = conn, False

    def __call__(self, message: str) -> None:
        if not self._sent:
            self._sent = True
            with contextlib.suppress(OSError):
                self._conn.send(message)


def _reporting_lifespan(app: FastAPI, report: Callable[[str], None], hold_s: float,
                        stopping: asyncio.Event, sockets: list[socket.socket]) -> None:
    """Wrap the app's lifespan so that a start-up failure (e.g. the control port taken) reaches the
    parent as one line before uvicorn exits, and so that start-up ends (and the socket listens) only once
    the process can serve or ``hold_s`` seconds have passed (0: at once; a restarted process,
    gateway/process.py), or at once when ``stopping`` is set (a stop signal during the hold: the process
    then stops, telling its workers it leaves, without waiting out the hold). ``sockets``: the list
    uvicorn is given, from which it starts listening once the start-up is done; a process stopped during
    its hold empties it (and closes its socket), so it never listens."""
    inner = app.router.lifespan_context
    svc: GatewayService = app.state.service

    @contextlib.asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            try:
                await stack.enter_async_context(inner(a))
            except Exception as exc:
                report(f"failed: {exc}")
                raise
            if hold_s > 0:
                log.info("gateway process %d: restarted; waiting up to %g s for workers before listening",
                         svc.process.index, hold_s)
                if await svc.wait_ready(hold_s, stop=stopping):
                    log.info("gateway process %d: workers registered; listening", svc.process.index)
                elif stopping.is_set():
                    log.info("gateway process %d: asked to stop while waiting for workers", svc.process.index)
                    for sock in sockets:
                        sock.close()
                    sockets.clear()
                else:
                    log.warning("gateway process %d: no usable worker after %g s; listening anyway",
                                svc.process.index, hold_s)
            yield

    app.router.lifespan_context = lifespan


class _ProcessServer(DrainingServer):
    """The draining server that reports ``ready`` once its socket listens and exits when its parent dies."""

    def __init__(self, app: ASGIApp, settings: GatewaySettings, report: Callable[[str], None],
                 stop_requests: Callable[[str], int] | None = None) -> None:
        super().__init__(app, settings, stop_requests)
        self._report = report
        self._parent = os.getppid()
        self._watch: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.stopping.is_set():
            self._watch = asyncio.create_task(self._watch_parent())
            self._report("ready")

    async def _watch_parent(self) -> None:
        while os.getppid() == self._parent:
            await asyncio.sleep(PARENT_CHECK_S)
        log.warning("gateway process: its parent %d is gone; stopping", self._parent)
        self.handle_exit(signal.SIGTERM, None)  # a drain, as a stop signal would


def serve_process(settings: GatewaySettings, process: GatewayProcess, conn: Connection) -> None:
    """Run gateway process ``process.index`` of ``process.count`` (the target of a spawned child; the
    parent set ``PROMETHEUS_MULTIPROC_DIR`` to ``process.metrics_dir`` in its environment). Sends
    ``ready`` or ``failed: <reason>`` on ``conn``; a process that could not start exits non-zero.
    Runs in a process group of its own, so a terminal's Ctrl-C reaches only the parent, which stops it."""
    os.setpgrp()
    configure_logging(settings.log_level, settings.log_format)
    report = _Report(conn)
    control = settings.control_endpoints()[process.index]
    mine = dataclasses.replace(settings, control_bind=control, workers=1)
    try:
        sock = reuse_port_socket(settings.host, settings.port)
        app = create_app(mine, process)
    except Exception as exc:
        report(f"failed: {exc}")
        raise SystemExit(1) from exc
    server = _ProcessServer(app, settings, report, app.state.service.orchestrator.stop_requests)
    sockets = [sock]
    _reporting_lifespan(app, report, process.listen_hold_s(settings.heartbeat_timeout), server.stopping,
                        sockets)
    log.info("gateway process %d/%d (pid %d): http://%s:%d, control socket %s", process.index,
             process.count, os.getpid(), settings.host, settings.port, control)
    server.run(sockets=sockets)
