"""Scheduled fault actions (``--fault "at=5s,cmd=kill -9 1234"``) and the per-phase report.

Each fault runs a shell command at a time after the measured run starts. The run is split into phases
at the fault times; a request belongs to the phase in which it was sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loadtest.records import FaultResult, PhaseReport, RequestRecord
from protocol.durations import parse_duration

_MAX_OUTPUT_CHARS = 2000


@dataclass(frozen=True)
class FaultSpec:
    """Run shell command ``cmd`` at ``at_s`` seconds into the run; kill it after ``timeout_s`` seconds."""

    at_s: float
    cmd: str
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.at_s < 0 or self.timeout_s <= 0 or not self.cmd.strip():
            raise ValueError(f"bad --fault: needs at >= 0 s, timeout > 0 s and a command, got "
                             f"at={self.at_s:g}s, timeout={self.timeout_s:g}s, cmd={self.cmd!r}")

    @classmethod
    def parse(cls, spec: str) -> FaultSpec:
        """Parse ``at=5s[,timeout=10s],cmd=...``; ``cmd`` comes last and takes the rest (commas too).

        Raises ValueError naming the problem.
        """
        head, sep, cmd = spec.partition("cmd=")
        if not sep or not cmd.strip():
            raise ValueError(f"bad --fault {spec!r}: needs cmd=... as its last field")
        fields: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in head.split(","))):
            key, eq, value = part.partition("=")
            if not eq or key not in ("at", "timeout"):
                raise ValueError(f"bad --fault {spec!r}: unknown field {part!r} (use at=, timeout=, cmd=)")
            fields[key] = value
        if "at" not in fields:
            raise ValueError(f"bad --fault {spec!r}: needs at=TIME (e.g. at=5s)")
        try:
            timeout = parse_duration(fields["timeout"]) if "timeout" in fields else 30.0
            at = parse_duration(fields["at"])
        except ValueError as exc:
            raise ValueError(f"bad --fault {spec!r}: {exc}") from None
        if timeout <= 0:
            raise ValueError(f"bad --fault {spec!r}: timeout must be > 0 s")
        return cls(at, cmd.strip(), timeout)


async def run_fault(spec: FaultSpec, t0: float, clock: Callable[[], float]) -> FaultResult:
    """Sleep until ``t0 + spec.at_s`` (``clock`` seconds), run the command, wait for it (bounded)."""
    await asyncio.sleep(max(0.0, t0 + spec.at_s - clock()))
    started = clock() - t0
    try:
        proc = await asyncio.create_subprocess_shell(
            spec.cmd,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # its own process group, so a timeout kills its children too
        )
    except OSError as exc:
        return FaultResult(at_s=spec.at_s, cmd=spec.cmd, status="error", started_s=started, output=str(exc))
    try:
        async with asyncio.timeout(spec.timeout_s):
            out, _ = await proc.communicate()
    except (TimeoutError, asyncio.CancelledError):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return FaultResult(at_s=spec.at_s, cmd=spec.cmd, status="timeout", started_s=started,
                           finished_s=clock() - t0)
    text = out.decode("utf-8", "replace")[-_MAX_OUTPUT_CHARS:]
    return FaultResult(at_s=spec.at_s, cmd=spec.cmd, status="ran", started_s=started,
                       finished_s=clock() - t0, returncode=proc.returncode, output=text)


class FaultScheduler:
    """Runs every fault of a run as an asyncio task; ``finish`` collects results in spec order."""

    def __init__(self, specs: Sequence[FaultSpec], clock: Callable[[], float] = time.perf_counter) -> None:
        self.specs = tuple(specs)
        self.clock = clock
        self._tasks: list[asyncio.Task[FaultResult]] = []

    def start(self, t0: float) -> None:
        """Schedule every fault relative to ``t0`` (a ``clock`` reading)."""
        self._tasks = [asyncio.create_task(run_fault(s, t0, self.clock)) for s in self.specs]

    async def finish(self, run_end_s: float) -> list[FaultResult]:
        """Skip faults due after ``run_end_s`` (s since t0) and wait for those already due."""
        results = []
        for spec, task in zip(self.specs, self._tasks, strict=True):
            if spec.at_s > run_end_s and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                if task.cancelled():
                    results.append(FaultResult(at_s=spec.at_s, cmd=spec.cmd, status="skipped"))
                    continue
            results.append(await task)
        return results


def phase_report(records: Sequence[RequestRecord], faults: Sequence[FaultResult]) -> list[PhaseReport]:
    """Split ``records`` by send time at each fault that ran; count completed/failed/timed out per phase.

    With no fault that ran there is one phase, ``all``. ``failed`` includes ``timed_out``.
    """
    cuts = sorted(f.started_s for f in faults if f.started_s is not None)
    bounds = [0.0, *cuts]
    phases = []
    for i, start in enumerate(bounds):
        end = bounds[i + 1] if i + 1 < len(bounds) else None
        sel = [r for r in records if r.start_s >= start and (end is None or r.start_s < end)]
        if i == 0:
            sel += [r for r in records if r.start_s < 0]
        name = "all" if not cuts else ("before fault 1" if i == 0 else f"after fault {i}")
        phases.append(
            PhaseReport(
                name=name,
                start_s=start,
                end_s=end,
                completed=sum(r.success for r in sel),
                failed=sum(not r.success for r in sel),
                timed_out=sum(r.error_kind == "timeout" for r in sel),
            )
        )
    return phases
