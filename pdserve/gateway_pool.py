"""``pdserve gateway --workers N`` (N > 1): N gateway processes serving one HTTP port, supervised.

The parent starts N children (multiprocessing ``spawn``: the settings, API keys included, travel through
a pipe, not the command line), each running ``gateway.server.serve_process``: process i binds the HTTP
port with ``SO_REUSEPORT`` and its own control socket at ``--control-bind`` port P + i. A worker may be
given any one of the N control endpoints: each process's ``RegisterAck`` names the others' ports, and the
worker registers with every one of them (all N, comma-separated, are logged once all are ready). The
parent owns the prometheus-client multiprocess directory (a fresh private temporary directory,
``PROMETHEUS_MULTIPROC_DIR`` in the children's environment, removed at exit) through which any child's
``/metrics`` serves the per-process series summed over all (gateway/metrics.py).

Supervision: each child reports ``ready`` (its socket listens) or why it could not start. A child that
does not start (reports a failure, exits, or is not ready within ``start_timeout`` s), at first or
when restarted, stops everything: the parent prints one line naming the process and the reason and
exits 1. A ready child that dies is restarted after ``RestartPolicy``'s backoff (1 s, doubling to 30 s);
the restarted process listens only once the workers have registered with it (or after a hold of two
heartbeat timeouts: gateway/process.py), so its siblings take every new connection meanwhile;
its ``max_exits``-th exit within ``window_s`` s stops everything too (exit 1), so a crash loop is not
hidden. SIGTERM, SIGINT and SIGHUP stop every child (SIGTERM: each drains its requests in flight for up
to ``--drain-timeout``; a second signal is passed on and stops them at once; SIGKILL after ``grace`` s)
and the parent exits 128 + the signal number, as ``pdserve up`` does. Children run in process groups of their
own (a terminal's Ctrl-C reaches only the parent) and stop by themselves if the parent disappears.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import FrameType

from prometheus_client.multiprocess import mark_process_dead

from gateway.process import GatewayProcess
from gateway.server import serve_process
from pdserve.launcher import STOP_SIGNALS
from pdserve.ports import gateway_bind_problem
from pdserve.supervisor import STOP_MARGIN_S, RestartPolicy
from protocol.logging import say, say_refused
from protocol.settings import GatewaySettings

log = logging.getLogger("pdserve.gateway")
START_TIMEOUT_S = 120.0  # a child not ready by then (tokenizer load, socket bind) stops the pool
TICK_S = 0.2  # longest the supervision loop sleeps between looks at signals and restart times


@dataclass
class _Child:
    """One gateway process slot: its current process (None while waiting to restart), the pipe it
    reports on, when it started, whether it reported ready, its recent exit times and its restart time
    (``time.monotonic()`` seconds), how many times it was started."""

    index: int
    process: BaseProcess | None = None
    conn: Connection | None = None
    started_at: float = 0.0
    ready: bool = False
    exits: list[float] = field(default_factory=list)
    restart_at: float | None = None
    starts: int = 0


class PoolFailed(Exception):
    """The pool cannot go on; the message is the one line the parent prints."""


class GatewayPool:
    """Starts and supervises the N gateway processes (see the module docstring)."""

    def __init__(self, settings: GatewaySettings, metrics_dir: str, policy: RestartPolicy,
                 start_timeout: float, grace: float) -> None:
        self.settings, self.metrics_dir, self.policy = settings, metrics_dir, policy
        self.start_timeout, self.grace = start_timeout, grace
        self.endpoints = settings.control_endpoints()
        self.control_ports = tuple(int(e.rpartition(":")[2]) for e in self.endpoints)
        self.children = [_Child(i) for i in range(settings.workers)]
        self._ctx = multiprocessing.get_context("spawn")
        self._announced = False

    def start(self, child: _Child) -> None:
        """Start (or restart) ``child``'s process."""
        reader, writer = self._ctx.Pipe(duplex=False)
        process = GatewayProcess(child.index, self.settings.workers, self.metrics_dir, child.starts > 0,
                                 self.control_ports)
        child.starts += 1
        proc = self._ctx.Process(target=serve_process, args=(self.settings, process, writer),
                                 name=f"pdserve-gateway-{child.index}")
        proc.start()
        writer.close()
        child.process, child.conn, child.started_at, child.ready = proc, reader, time.monotonic(), False
        log.info("gateway process %d started (pid %s, control socket %s)", child.index, proc.pid,
                 self.endpoints[child.index])

    def step(self, now: float) -> None:
        """One look at every child: read reports, restart the dead, start those due.

        Raises:
            PoolFailed: a child could not start, or crashed ``max_exits`` times within the window.
        """
        for child in self.children:
            if child.process is None:
                if child.restart_at is not None and now >= child.restart_at:
                    child.restart_at = None
                    self.start(child)
                continue
            if not child.ready:
                self._check_start(child, now)
            elif child.process.exitcode is not None:
                self._on_exit(child, now)
        if not self._announced and all(c.ready for c in self.children):
            self._announced = True
            log.info("gateway: %d processes serving http://%s:%d; give workers --gateway-control %s (or any "
                     "one of these: a worker learns the others from it)", len(self.children),
                     self.settings.host, self.settings.port, ",".join(self.endpoints))

    def _check_start(self, child: _Child, now: float) -> None:
        assert child.process is not None and child.conn is not None
        message = ""
        with contextlib.suppress(EOFError, OSError):
            if child.conn.poll():
                message = str(child.conn.recv())
        name = f"gateway process {child.index} ({self.endpoints[child.index]})"
        if message == "ready":
            child.ready = True
            log.info("%s ready (pid %s)", name, child.process.pid)
        elif message.startswith("failed: "):
            raise PoolFailed(f"{name} could not start: {message.removeprefix('failed: ')}")
        elif child.process.exitcode is not None:
            raise PoolFailed(f"{name} exited with code {child.process.exitcode} before it was ready")
        elif now - child.started_at > self.start_timeout:
            raise PoolFailed(f"{name} not ready after {self.start_timeout:g} s")

    def _on_exit(self, child: _Child, now: float) -> None:
        assert child.process is not None
        code, pid = child.process.exitcode, child.process.pid
        self._forget(child)
        child.exits = [t for t in child.exits if now - t < self.policy.window_s] + [now]
        if len(child.exits) >= self.policy.max_exits:
            raise PoolFailed(f"gateway process {child.index} exited {len(child.exits)} times within "
                             f"{self.policy.window_s:g} s (last exit code {code})")
        delay = self.policy.delay(len(child.exits))
        child.restart_at = now + delay
        log.warning("gateway process %d (pid %s) exited with code %s; restarting it in %g s", child.index,
                    pid, code, delay)

    def _forget(self, child: _Child) -> None:
        """Drop an exited child's process: reap it, close its pipe, retire its live-gauge files."""
        if child.process is not None:
            child.process.join(0)
            if child.process.pid is not None:
                mark_process_dead(child.process.pid, self.metrics_dir)
            child.process.close()
        if child.conn is not None:
            child.conn.close()
        child.process, child.conn, child.ready = None, None, False

    @staticmethod
    def _signal(children: list[_Child]) -> None:
        """SIGTERM each of ``children`` still running."""
        for child in children:
            if child.process is not None and child.process.exitcode is None and child.process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.process.pid, signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        """Sleep until a child reports or exits, or ``timeout`` s pass."""
        objects: list[Connection | int] = []
        for child in self.children:
            if child.process is not None:
                objects.append(child.process.sentinel)
                if child.conn is not None and not child.ready:
                    objects.append(child.conn)
        if objects:
            multiprocessing.connection.wait(objects, timeout)
        else:
            time.sleep(timeout)

    def stop_all(self, signals: list[int] | None = None) -> None:
        """SIGTERM every live child (each drains: gateway/server.py), wait up to ``grace`` s, SIGKILL the
        rest; all are reaped on return. A signal added to ``signals`` meanwhile (a second Ctrl-C or
        SIGTERM) is passed on as another SIGTERM, which stops each child at once."""
        live = [c for c in self.children if c.process is not None and c.process.exitcode is None]
        seen = len(signals) if signals is not None else 0
        self._signal(live)
        deadline = time.monotonic() + self.grace
        while (running := [c.process for c in live if c.process is not None and c.process.exitcode is None]):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if signals is not None and len(signals) > seen:
                seen = len(signals)
                self._signal(live)
            multiprocessing.connection.wait([p.sentinel for p in running], min(left, TICK_S))
        for child in live:
            assert child.process is not None
            child.process.join(0)
            if child.process.exitcode is None:
                log.warning("gateway process %d did not stop within %g s: killing it", child.index,
                            self.grace)
                child.process.kill()
                child.process.join()
        for child in self.children:
            self._forget(child)


def run_pool(settings: GatewaySettings, policy: RestartPolicy | None = None,
             start_timeout: float = START_TIMEOUT_S, grace: float | None = None) -> int:
    """Run ``settings.workers`` gateway processes until a signal (returns 128 + its number) or a failure
    (prints one line on stderr, returns 1; an HTTP address or a process's control socket that cannot be
    bound, e.g. a port in use, is refused before any process starts, returning 2). ``grace``: seconds
    between the children's SIGTERM and SIGKILL (default: ``--drain-timeout`` + ``STOP_MARGIN_S``)."""
    if (busy := gateway_bind_problem(settings.host, settings.port, settings.control_endpoints())) is not None:
        say_refused("gateway", busy)
        return 2
    stop: list[int] = []

    def on_signal(signum: int, _: FrameType | None) -> None:
        stop.append(signum)

    metrics_dir = tempfile.mkdtemp(prefix="pdserve-gateway-metrics-")
    previous_env = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # the spawned children inherit it
    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    grace = settings.drain_timeout + STOP_MARGIN_S if grace is None else grace
    pool = GatewayPool(settings, metrics_dir, policy or RestartPolicy(), start_timeout, grace)
    failure = ""
    try:
        for child in pool.children:
            pool.start(child)
        while not stop:
            pool.step(time.monotonic())
            pool.wait(TICK_S)
        log.info("gateway: signal %d, stopping %d processes", stop[0], len(pool.children))
    except PoolFailed as exc:
        failure = str(exc)
    finally:
        pool.stop_all(stop)
        for s, handler in previous.items():
            signal.signal(s, handler)
        if previous_env is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous_env
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if failure:  # after the children stopped, so the line is the last one on the terminal
        say(log, failure, f"pdserve gateway: {failure}", logging.ERROR)  # a JSON event with --log-format json
        return 1
    return 128 + stop[0]
