"""Which of the gateway's processes this one is (``pdserve gateway --workers N``).

The N processes serve one HTTP port together (each binds its own listening socket with
``SO_REUSEPORT``: the kernel spreads new connections over them) and each has its own control socket
(``GatewaySettings.control_endpoints``); every worker registers with all of them. A request lives in the
process whose connection took it. ``metrics_dir`` is the ``PROMETHEUS_MULTIPROC_DIR`` the processes
share (gateway/metrics.py), None for a single process.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayProcess:
    """Process ``index`` (0-based) of ``count`` gateway processes; ``metrics_dir``: the directory their
    prometheus-client multiprocess files share (None: one process, metrics in memory)."""

    index: int = 0
    count: int = 1
    metrics_dir: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"gateway process index {self.index} not in [0, {self.count})")
        if self.count > 1 and not self.metrics_dir:
            raise ValueError("several gateway processes need a shared metrics directory")
