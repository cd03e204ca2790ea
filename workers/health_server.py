"""A worker's HTTP endpoint (``--metrics-port``): ``/metrics``, ``/health`` and ``/live``, on a stdlib
HTTP server in a daemon thread (the engine loop never waits on it).

* ``GET /metrics``: the worker's registry in the Prometheus text format (``workers.metrics``);
* ``GET /health``: 200 while the engine loop has ticked within ``--engine-stall-timeout`` seconds and
  some gateway accepts this worker, else 503 with the reason (Kubernetes readiness);
* ``GET /live``: the same without the registration condition (Kubernetes liveness: a worker whose
  gateway is away should wait for it, not be restarted).

The engine loop ticks between phases and at least every idle poll (0.5 s), so a loop stuck in a step
(a hung kernel, a deadlock) stops ticking and the probes turn 503.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class EngineHealth:
    """Whether the engine loop is alive (``tick`` within ``stall_timeout_s`` seconds of ``clock()``) and
    the worker registered. ``clock``: seconds, ``time.monotonic`` unless a test gives its own.

    Raises:
        ValueError: ``stall_timeout_s`` <= 0.
    """

    def __init__(self, stall_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if stall_timeout_s <= 0:
            raise ValueError(f"--engine-stall-timeout: must be > 0 seconds, got {stall_timeout_s}")
        self.stall_timeout_s, self.clock = stall_timeout_s, clock
        self.last_tick: float | None = None
        self.registered = False

    def tick(self) -> None:
        """The engine loop went round once."""
        self.last_tick = self.clock()

    def loop_age(self) -> float | None:
        """Seconds since the last tick, None before the first."""
        return None if self.last_tick is None else self.clock() - self.last_tick

    def live(self) -> str | None:
        """None while the engine loop ticks, else why not."""
        age = self.loop_age()
        if age is None:
            return "engine loop not started"
        if age > self.stall_timeout_s:
            return f"engine loop stalled: last tick {age:.1f} s ago (limit {self.stall_timeout_s:g} s)"
        return None

    def ready(self) -> str | None:
        """None while live and registered with some gateway, else why not."""
        why = self.live()
        if why is None and not self.registered:
            why = "not registered with any gateway"
        return why


class _Handler(BaseHTTPRequestHandler):
    server: HealthServer

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._answer(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
        elif path in ("/health", "/live"):
            why = self.server.health.ready() if path == "/health" else self.server.health.live()
            body = b"ok\n" if why is None else (why + "\n").encode()
            self._answer(200 if why is None else 503, body, "text/plain; charset=utf-8")
        else:
            self._answer(404, b"not found: /metrics, /health, /live\n", "text/plain; charset=utf-8")

    def _answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # probes and scrapes every few seconds: not worth a log line each


class HealthServer(ThreadingHTTPServer):
    """Serves ``registry`` and ``health`` on ``host:port`` (port 0: any free one; ``port`` then names it)
    from a daemon thread started by ``start``. Raises ``OSError`` when the address cannot be bound."""

    daemon_threads = True

    def __init__(self, host: str, port: int, registry: CollectorRegistry, health: EngineHealth) -> None:
        if ":" in host:  # an IPv6 address such as "::"
            self.address_family = socket.AF_INET6
        super().__init__((host.strip("[]"), port), _Handler)
        self.registry, self.health = registry, health
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound TCP port."""
        return int(self.server_address[1])

    def start(self) -> HealthServer:
        """Serve in a daemon thread; returns self."""
        self._thread = threading.Thread(target=self.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket (waits for the thread, at most 5 s)."""
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(5.0)
