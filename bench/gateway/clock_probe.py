"""A clock probe for ``bench.gateway.overhead --gateway-processes ... --pin-cpus --clock-probe``: how fast
one core of the host runs a fixed piece of Python work while a level's load runs on the other cores.

Why: tokens per gateway core have been seen to fall as gateway processes are added (docs/benchmarks/
gateway.md), on virtual machines whose cores share a host's clock budget (turbo frequencies fall as more
cores are busy), caches and memory bandwidth with each other and with other tenants. A process alone on
a core of its own (``CorePlan.probe``), repeating the same work, runs slower exactly when those shared
resources slow every core; so the probe's rate at each level, against the first level's, tells how much
of a per-core loss is the host's rather than the gateway's.

The work unit (``work_unit``): build 200 small dicts of ints, a string and a list, JSON-encode each and
add up the lengths: interpreter dispatch, allocation and C string building, the kind of work a gateway's
per-token path does. ``ClockProbe`` runs it in a loop in a spawned process pinned to its cores and counts
units in shared memory; ``units_per_second`` is units per second of wall time between two ``count`` reads.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.sharedctypes
import time
from dataclasses import dataclass

from bench.gateway.cpu_pinning import pin_process


def work_unit() -> int:
    """One unit of probe work (module docstring); returns the summed lengths so nothing is optimised away."""
    total = 0
    for i in range(200):
        total += len(json.dumps({"id": i, "text": "tok" * (i % 7), "v": [i, i + 1, i + 2]}))
    return total


def _probe_loop(counter: multiprocessing.sharedctypes.Synchronized) -> None:  # type: ignore[type-arg]
    """The probe process: run ``work_unit`` forever, adding 1 to ``counter`` after each."""
    while True:
        work_unit()
        counter.value += 1


@dataclass(frozen=True)
class ProbeReading:
    """A ``ClockProbe.count`` read: units done so far and when (``time.monotonic()``, seconds)."""

    units: int
    at: float


class ClockProbe:
    """The probe process pinned to ``cpus`` (``CorePlan.probe``); ``start`` spawns it and pins it, ``stop``
    kills it. Raises RuntimeError (from ``pin_process``) when pinning fails, FileNotFoundError when the
    process died before it was pinned."""

    def __init__(self, cpus: frozenset[int]) -> None:
        self.cpus = cpus
        ctx = multiprocessing.get_context("spawn")
        self._counter = ctx.Value("q", 0, lock=False)
        self._proc = ctx.Process(target=_probe_loop, args=(self._counter,), daemon=True)

    def start(self) -> ClockProbe:
        self._proc.start()
        assert self._proc.pid is not None
        pin_process(self._proc.pid, self.cpus)
        return self

    def count(self) -> ProbeReading:
        return ProbeReading(units=int(self._counter.value), at=time.monotonic())

    def stop(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(10.0)


def units_per_second(first: ProbeReading, last: ProbeReading) -> float:
    """Probe units per second between two readings (0.0 when no time passed)."""
    dt = last.at - first.at
    return (last.units - first.units) / dt if dt > 0 else 0.0
