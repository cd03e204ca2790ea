"""The gateway over N processes on one host (``bench.gateway.overhead --gateway-processes``): the
``disagg`` target with an N-process gateway (``pdserve gateway --workers N``), driven by several
load-generating processes that start measuring together; aggregate output tokens/s and req/s, the CPU of
each client, fake worker and the gateway (all its processes, and each one), and how many gateway processes
took requests (``ScaleLevel``).

Tokens/s are counted twice: over the whole run (the first client's start to the last one's end) and over
the steady window, where every stream of every client is streaming (``steady_window``): from the latest
moment, over the clients, at which each of a client's first wave of requests has had its first token, to
the earliest moment at which a client sent its last request (after it, that client's streams run dry one
by one). The whole-run rate counts the ramp-up and the drain, which weigh more when a level's run is
short (the same ``--requests`` over more streams at larger N: fewer requests per stream), so the ratios
between levels use the steady rate. With a ``CorePlan`` (``--pin-cpus``, bench/gateway/cpu_pinning.py) each
gateway process is pinned to its own cores once all are ready, the pool's parent to their union, and the
fake workers and client processes to the load side's cores.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import os
import time
from pathlib import Path

import msgspec

from bench.gateway.clock_probe import ClockProbe, units_per_second
from bench.gateway.cpu_pinning import CorePlan, format_cpus, pin_process
from bench.gateway.overhead_targets import (
    OverheadConfig,
    check_no_leaks,
    cpu_seconds,
    decode_worker_ids,
    gateway_pids,
    run_level,
    start_target,
)
from loadtest.records import RequestRecord
from pdserve.supervisor import Supervisor


class ClientShare(msgspec.Struct, kw_only=True):
    """What one load-generating process measured: requests sent and completed (all tokens), output
    tokens, its first error, its measured part's start and end (``time.monotonic()``, shared by every
    process of the host) and its own CPU seconds over that part; for the steady window: when its first
    wave of requests had all had a first token (``all_streaming``), when it sent its last request
    (``last_send``), and when each token chunk of its completed requests arrived (``arrivals``, with the
    tokens each carried in ``weights``), all on the same clock."""

    sent: int
    completed: int
    tokens: int
    first_error: str
    start: float
    end: float
    cpu_s: float
    all_streaming: float = 0.0
    last_send: float = 0.0
    arrivals: list[float] = []
    weights: list[float] = []


def client_timeline(records: list[RequestRecord], origin: float, concurrency: int
                    ) -> tuple[float, float, list[float], list[float]]:
    """One client's part of the steady window, on the clock of ``origin`` (the absolute time the
    records' ``start_s`` is relative to). Returns (``all_streaming``: the latest first-token time among
    the ``concurrency`` earliest-sent requests, ``last_send``: the latest send time, ``arrivals``: every
    token chunk's arrival time of the successful requests, ``weights``: the tokens each chunk carried,
    the request's ``output_tokens`` spread evenly over its chunks). Raises ValueError with no record."""
    if not records:
        raise ValueError("no request records")
    by_send = sorted(records, key=lambda r: r.start_s)
    first_wave = by_send[:max(1, concurrency)]
    firsts = [origin + r.start_s + r.ttft_s for r in first_wave if r.ttft_s is not None]
    all_streaming = max(firsts) if len(firsts) == len(first_wave) else float("inf")
    arrivals: list[float] = []
    weights: list[float] = []
    for r in records:
        if not r.success or r.ttft_s is None:
            continue
        t = origin + r.start_s + r.ttft_s
        times = [t]
        for gap in r.itl_s:
            t += gap
            times.append(t)
        arrivals += times
        weights += [r.output_tokens / len(times)] * len(times)
    return all_streaming, origin + by_send[-1].start_s, arrivals, weights


def steady_window(shares: list[ClientShare]) -> tuple[float, float]:
    """The window where every client's every stream is streaming (module docstring) and the output
    tokens that arrived in it: (seconds, tokens). (0.0, 0.0) when the window is empty (a client ran out
    of requests before another's first wave was streaming: too few requests per stream)."""
    start = max(s.all_streaming for s in shares)
    end = min(s.last_send for s in shares)
    if not end > start:
        return 0.0, 0.0
    tokens = sum(w for s in shares for t, w in zip(s.arrivals, s.weights, strict=True) if start <= t < end)
    return end - start, tokens


class ScaleLevel(msgspec.Struct, kw_only=True):
    """``--gateway-processes``: one gateway of ``processes`` processes at ``concurrency`` streams from
    ``clients`` client processes. Rates over ``wall_s``; CPU as shares of one core over the measured
    time (``gateway_cores``: all the gateway's processes together); ``processes_used``: how many of the
    gateway's processes took requests; ``leaks`` as ``check_no_leaks``. ``process_cores``: each gateway
    process's CPU (index order; with N > 1 the pool's parent is in ``gateway_cores`` only);
    ``gateway_cpus``: the cores each gateway process's main thread was allowed at the start of the
    measurement (``taskset -c`` form; every core of the host when not pinned). ``steady_s`` and
    ``steady_tokens_s``: the steady window's length and output tokens/s (``steady_window``; 0.0 when it
    was empty). ``process_requests``: the requests (warm-up included) each gateway process passed to the
    fake prefill worker, in index order: how the kernel spread the connections over the processes.
    ``load_cores``: the client processes' and fake workers' CPU together (shares of one core; the load
    side's cores bound it). ``probe_units_s``: the clock probe's rate over the measured time
    (bench/gateway/clock_probe.py; 0.0 without ``--clock-probe``)."""

    processes: int
    clients: int
    concurrency: int
    sent: int
    completed: int
    tokens: int
    first_error: str
    wall_s: float
    tokens_s: float
    req_s: float
    gateway_cores: float
    busiest_client_core: float
    busiest_worker_core: float
    processes_used: int
    leaks: str
    decode_workers: int = 1
    steady_s: float = 0.0
    steady_tokens_s: float = 0.0
    process_requests: list[int] = []
    process_cores: list[float] = []
    gateway_cpus: list[str] = []
    load_cores: float = 0.0
    probe_units_s: float = 0.0


def _client_process(url: str, cfg: OverheadConfig, concurrency: int, barrier: object,
                    results: multiprocessing.SimpleQueue[ClientShare]) -> None:
    """One load-generating process of ``--gateway-processes``: warm up, wait for the others at
    ``barrier`` (a ``multiprocessing.Barrier``), run ``cfg.requests`` at ``concurrency`` streams, put its
    ``ClientShare`` on ``results``."""
    asyncio.run(run_level(url, dataclasses.replace(cfg, requests=max(cfg.warmup, 1), warmup=0), concurrency))
    barrier.wait(120.0)  # type: ignore[attr-defined]
    cpu0, start = time.process_time(), time.monotonic()
    origin: list[float] = []
    records, _ = asyncio.run(run_level(url, dataclasses.replace(cfg, warmup=0), concurrency, origin))
    end, cpu = time.monotonic(), time.process_time() - cpu0
    to_monotonic = time.monotonic() - time.perf_counter()  # the records' clock onto the shared one
    ok = [r for r in records if r.success and r.output_tokens == cfg.max_tokens]
    bad = [r for r in records if r not in ok]
    streaming, last_send, arrivals, weights = client_timeline(ok or records, origin[0] + to_monotonic,
                                                              concurrency)
    results.put(ClientShare(sent=len(records), completed=len(ok), tokens=sum(r.output_tokens for r in ok),
                            first_error=(bad[0].error or f"{bad[0].output_tokens} tokens") if bad else "",
                            start=start, end=end, cpu_s=cpu, all_streaming=streaming, last_send=last_send,
                            arrivals=arrivals, weights=weights))


def run_scale_level(cfg: OverheadConfig, tokenizer_dir: Path, log_dir: Path, processes: int,
                    concurrency: int, clients: int, decode_workers: int = 1,
                    plan: CorePlan | None = None) -> ScaleLevel:
    """One N of ``--gateway-processes`` (see the module docstring), pinned by ``plan`` when given. Raises
    RuntimeError when the target does not start, a gateway process does not answer ``/v1/status`` within
    60 s, pinning fails, or a client process does not report within ``cfg.timeout_s`` + 120 s; ValueError
    when ``plan`` has fewer gateway core sets than ``processes``."""
    if plan is not None and len(plan.gateway) < processes:
        raise ValueError(f"--pin-cpus: the core plan has {len(plan.gateway)} gateway sets, {processes} "
                         "needed")
    sup = Supervisor(grace=5.0)
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(clients + 1)
    results: multiprocessing.SimpleQueue[ClientShare] = ctx.SimpleQueue()
    share = dataclasses.replace(cfg, requests=max(1, -(-cfg.requests // clients)))
    procs: list[multiprocessing.process.BaseProcess] = []
    probe = ClockProbe(plan.probe) if plan is not None and plan.probe else None
    try:
        if probe is not None:
            probe.start()
        url = start_target("disagg", cfg, tokenizer_dir, sup, log_dir, processes, decode_workers)
        kids = sup.children
        pids = gateway_pids(url, processes, 60.0)
        if len(pids) != processes:
            raise RuntimeError(f"only gateway processes {sorted(pids)} of {processes} answered /v1/status")
        gateway = [pids[i] for i in range(processes)]
        workers = [kids[n].pid for n in kids if n != "gateway"]
        if plan is not None:
            if processes > 1:  # the pool's parent (it only supervises) on the gateway cores
                pin_process(kids["gateway"].pid, plan.gateway_union)
            for i, pid in enumerate(gateway):
                pin_process(pid, plan.gateway[i])
            for pid in workers:
                pin_process(pid, plan.load)
        procs = [ctx.Process(target=_client_process, args=(url, share, max(1, concurrency // clients),
                                                           barrier, results)) for _ in range(clients)]
        for p in procs:
            p.start()
            if plan is not None and p.pid is not None:
                pin_process(p.pid, plan.load)
        allowed = [format_cpus(os.sched_getaffinity(pid)) for pid in gateway]
        barrier.wait(180.0)
        gw0, wk0, t0 = cpu_seconds(kids["gateway"].pid), [cpu_seconds(w) for w in workers], time.monotonic()
        each0 = [cpu_seconds(pid) for pid in gateway]
        probe0 = probe.count() if probe is not None else None
        # read every share before joining: a share larger than the pipe's buffer (its token arrival
        # times) keeps its process in put() until it is read, so joining first would wait forever
        deadline = time.monotonic() + cfg.timeout_s * share.requests + 120.0
        shares: list[ClientShare] = []
        while len(shares) < len(procs):
            if results.empty():
                if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    raise RuntimeError("a client process failed or did not report: exit codes "
                                       f"{[p.exitcode for p in procs]}")
                time.sleep(0.05)
                continue
            shares.append(results.get())
        for p in procs:
            p.join(120.0)
        gw, wall_all = cpu_seconds(kids["gateway"].pid) - gw0, time.monotonic() - t0
        probe_rate = 0.0
        if probe is not None and probe0 is not None:
            probe_rate = units_per_second(probe0, probe.count())
        each = [cpu_seconds(pid) - c0 for pid, c0 in zip(gateway, each0, strict=True)]
        wk = [cpu_seconds(w) - w0 for w, w0 in zip(workers, wk0, strict=True)]
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a client process failed: exit codes {[p.exitcode for p in procs]}")
        leaks = check_no_leaks(url, decode_worker_ids(decode_workers))
        lines = (log_dir / "prefill.jsonl").read_text().splitlines()
        # the fake worker names the gateway a request came through only when it has several
        through = [json.loads(line).get("gateway", 0) for line in lines if '"PrefillRequest"' in line]
        per_process = [through.count(i) for i in range(processes)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if probe is not None:
            probe.stop()
        sup.stop_all()
    wall = max(s.end for s in shares) - min(s.start for s in shares)
    rate = 1 / wall if wall > 0 else 0.0
    steady_s, steady_tokens = steady_window(shares)
    tokens, completed = sum(s.tokens for s in shares), sum(s.completed for s in shares)
    return ScaleLevel(processes=processes, clients=clients, decode_workers=decode_workers,
                      concurrency=max(1, concurrency // clients) * clients,
                      sent=sum(s.sent for s in shares), completed=completed, tokens=tokens,
                      first_error=next((s.first_error for s in shares if s.first_error), ""), wall_s=wall,
                      tokens_s=tokens * rate, req_s=completed * rate, gateway_cores=gw / wall_all,
                      busiest_client_core=max(s.cpu_s / max(s.end - s.start, 1e-9) for s in shares),
                      busiest_worker_core=max(wk) / wall_all, processes_used=sum(1 for n in per_process if n),
                      process_requests=per_process, leaks=leaks,
                      process_cores=[c / wall_all for c in each], gateway_cpus=allowed,
                      steady_s=steady_s, steady_tokens_s=steady_tokens / steady_s if steady_s > 0 else 0.0,
                      load_cores=sum(s.cpu_s / max(s.end - s.start, 1e-9) for s in shares)
                      + sum(wk) / wall_all,
                      probe_units_s=probe_rate)
