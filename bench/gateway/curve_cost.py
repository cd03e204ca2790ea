"""CURVE's CPU cost in the gateway (``bench.gateway.overhead --curve-cost``): the ``disagg`` target with
CURVE and without (``disagg-insecure``) started side by side and measured in alternated rounds; per round
and arm the gateway's CPU seconds per output token, the part of it in libzmq's I/O threads (where CURVE's
encryption runs) and the fake workers' CPU (``CurveRound``, ``CurveCost``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from pathlib import Path

import msgspec

from bench.gateway.overhead_targets import (
    INSECURE,
    OverheadConfig,
    check_no_leaks,
    cpu_seconds,
    run_level,
    start_target,
    summarize_level,
)
from pdserve.supervisor import Supervisor

CURVE_ARMS = ("disagg", INSECURE)  # --curve-cost: with CURVE, without


class CurveRound(msgspec.Struct, kw_only=True):
    """One arm's part of one ``--curve-cost`` round: ``tokens`` output tokens streamed by ``completed`` of
    ``requests`` requests in ``wall_s``; CPU seconds (user + system) of the gateway process, of its libzmq
    I/O threads (part of it: where CURVE's encryption runs) and of the fake workers over the round; the
    round's p50 added TPOT (ms). ``*_us_per_token`` = those CPU µs per output token."""

    arm: str
    round: int
    requests: int
    completed: int
    tokens: int
    wall_s: float
    gateway_cpu_s: float
    workers_cpu_s: float
    gateway_us_per_token: float
    workers_us_per_token: float
    added_tpot_p50_ms: float | None
    gateway_zmq_io_cpu_s: float = 0.0
    gateway_zmq_io_us_per_token: float = 0.0


class CurveCost(msgspec.Struct, kw_only=True):
    """``--curve-cost``: every round of both arms, at ``concurrency`` streams; leak check per arm; the
    load average (1, 5, 15 min) before and after."""

    concurrency: int
    rounds: list[CurveRound]
    leaks: dict[str, str]
    loadavg_start: tuple[float, float, float]
    loadavg_end: tuple[float, float, float]


def zmq_io_cpu_seconds(pid: int) -> float:
    """CPU seconds so far of process ``pid``'s libzmq I/O threads (named ``ZMQbg/IO/<n>``): where libzmq
    frames, and with CURVE encrypts and decrypts, every message of its sockets. Read from each thread's
    ``/proc/<pid>/task/<tid>/schedstat`` (time on a CPU, nanoseconds: far finer than the clock tick of
    ``cpu_seconds``); threads that exited are not counted (libzmq's live as long as their context).
    Raises FileNotFoundError if ``pid`` is gone."""
    total_ns = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            if (task / "comm").read_text().startswith("ZMQbg/IO"):
                total_ns += int((task / "schedstat").read_text().split()[0])
    return total_ns / 1e9


def run_curve_rounds(cfg: OverheadConfig, tokenizer_dir: Path, log_dir: Path, concurrency: int,
                     rounds: int) -> CurveCost:
    """``--curve-cost`` (see the module docstring): both arms started side by side, ``cfg.warmup``
    requests each, then ``rounds`` alternated rounds of ``cfg.requests`` requests per arm; the leak check
    of each arm at the end. Raises RuntimeError when an arm does not start."""
    sups = {arm: Supervisor(grace=5.0) for arm in CURVE_ARMS}
    load0 = os.getloadavg()
    out: list[CurveRound] = []
    leaks: dict[str, str] = {}
    try:
        urls = {}
        for arm in CURVE_ARMS:
            arm_dir = log_dir / arm
            arm_dir.mkdir()
            urls[arm] = start_target(arm, cfg, tokenizer_dir, sups[arm], arm_dir)
        measured = dataclasses.replace(cfg, warmup=0)
        for arm in CURVE_ARMS:
            asyncio.run(run_level(urls[arm], dataclasses.replace(cfg, requests=max(cfg.warmup, 1), warmup=0),
                                  concurrency))
        for r in range(rounds):
            for arm in CURVE_ARMS if r % 2 == 0 else CURVE_ARMS[::-1]:
                kids = sups[arm].children
                gw_pid, worker_pids = kids["gateway"].pid, [kids[n].pid for n in ("prefill", "decode")]
                gw0, io0 = cpu_seconds(gw_pid), zmq_io_cpu_seconds(gw_pid)
                wk0 = sum(map(cpu_seconds, worker_pids))
                records, wall = asyncio.run(run_level(urls[arm], measured, concurrency))
                gw, wk = cpu_seconds(gw_pid) - gw0, sum(map(cpu_seconds, worker_pids)) - wk0
                io = zmq_io_cpu_seconds(gw_pid) - io0
                tokens = sum(rec.output_tokens for rec in records)
                lv = summarize_level(arm, concurrency, records, wall, cfg)
                per_token = 1e6 / tokens if tokens else 0.0
                out.append(CurveRound(
                    arm=arm, round=r, requests=len(records), completed=lv.completed, tokens=tokens,
                    wall_s=wall, gateway_cpu_s=gw, workers_cpu_s=wk, gateway_us_per_token=gw * per_token,
                    workers_us_per_token=wk * per_token, gateway_zmq_io_cpu_s=io,
                    gateway_zmq_io_us_per_token=io * per_token,
                    added_tpot_p50_ms=lv.added_tpot_ms.median if lv.added_tpot_ms else None))
        for arm in CURVE_ARMS:
            leaks[arm] = check_no_leaks(urls[arm], "fake-decode")
    finally:
        for sup in sups.values():
            sup.stop_all()
    return CurveCost(concurrency=concurrency, rounds=out, leaks=leaks, loadavg_start=load0,
                     loadavg_end=os.getloadavg())
