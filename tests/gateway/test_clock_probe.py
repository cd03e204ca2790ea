"""``bench.gateway.clock_probe``: the probe process runs pinned and counts its work units; the rate."""

from __future__ import annotations

import os
import time

import pytest

from bench.gateway.clock_probe import ClockProbe, ProbeReading, units_per_second, work_unit


def test_rate_is_units_per_second_between_readings() -> None:
    assert units_per_second(ProbeReading(units=10, at=5.0), ProbeReading(units=40, at=7.0)) == 15.0
    assert units_per_second(ProbeReading(units=10, at=5.0), ProbeReading(units=10, at=5.0)) == 0.0
    assert work_unit() == work_unit() > 0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pinning needs Linux")
def test_probe_process_runs_pinned_and_counts() -> None:
    cpu = min(os.sched_getaffinity(0))
    probe = ClockProbe(frozenset({cpu})).start()
    try:
        pid = probe._proc.pid
        assert pid is not None and os.sched_getaffinity(pid) == {cpu}
        first = probe.count()
        deadline = time.monotonic() + 30.0
        while probe.count().units - first.units < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        last = probe.count()
        assert last.units - first.units >= 3 and units_per_second(first, last) > 0
    finally:
        probe.stop()
    assert not probe._proc.is_alive()
