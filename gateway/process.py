"""Which of the gateway's processes this one is (``pdserve gateway --workers N``).

The N processes serve one HTTP port together (each binds its own listening socket with
``SO_REUSEPORT``: the kernel spreads new connections over them) and each has its own control socket
(``GatewaySettings.control_endpoints``); every worker registers with all of them: a worker given one of
them learns the others' ports from its ``RegisterAck`` (``sibling_ports``). A request lives in the
process whose connection took it. ``metrics_dir`` is the ``PROMETHEUS_MULTIPROC_DIR`` the processes
share (gateway/metrics.py), None for a single process.

A process started again after it died (``restarted``) takes no connection until the workers have
registered with it: its socket listens once it is ready (a usable prefill/decode pair or a colocated
worker) or ``RESTART_HOLD_HEARTBEATS`` heartbeat timeouts (at most ``RESTART_HOLD_MAX_S``) have
passed, so the kernel does not hand new connections to a process that could only answer 503 while its
siblings serve.
"""

from __future__ import annotations

from dataclasses import dataclass

RESTART_HOLD_HEARTBEATS = 2.0  # a restarted process listens at the latest after this many heartbeat timeouts
RESTART_HOLD_MAX_S = 10.0  # and at the latest after this many seconds (the pool waits 120 s for "ready")


@dataclass(frozen=True)
class GatewayProcess:
    """Process ``index`` (0-based) of ``count`` gateway processes; ``metrics_dir``: the directory their
    prometheus-client multiprocess files share (None: one process, metrics in memory); ``restarted``:
    started again after it died (it listens only once ready, or after the hold; module docstring);
    ``control_ports``: the control port of each process, by index (empty: unknown, or one process)."""

    index: int = 0
    count: int = 1
    metrics_dir: str | None = None
    restarted: bool = False
    control_ports: tuple[int, ...] = ()

    def sibling_ports(self) -> tuple[int, ...]:
        """The control ports of the other processes of the pool, in index order (empty for one process
        or unknown ports): what this process's ``RegisterAck`` names, so that a worker given only this
        process's address registers with every process."""
        return tuple(port for i, port in enumerate(self.control_ports) if i != self.index)

    def own_port(self) -> int:
        """This process's control port (0 when the pool's ports are unknown, or for one process)."""
        return self.control_ports[self.index] if self.control_ports else 0

    def listen_hold_s(self, heartbeat_timeout: float) -> float:
        """Seconds this process may wait for its workers before its socket listens: 0 for a first start,
        ``RESTART_HOLD_HEARTBEATS`` x ``heartbeat_timeout`` (seconds), at most ``RESTART_HOLD_MAX_S``,
        for a restart."""
        if not self.restarted:
            return 0.0
        return min(RESTART_HOLD_HEARTBEATS * heartbeat_timeout, RESTART_HOLD_MAX_S)

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"gateway process index {self.index} not in [0, {self.count})")
        if self.count > 1 and not self.metrics_dir:
            raise ValueError("several gateway processes need a shared metrics directory")
        if self.control_ports and len(self.control_ports) != self.count:
            raise ValueError(f"{len(self.control_ports)} control ports for {self.count} gateway processes")
