"""The gateway's own added latency and throughput ceiling, measured with instant fake workers.

Run: ``.venv/bin/python -m bench.gateway.overhead [--requests 300] [--concurrency 1,8] [--max-tokens 16]
[--token-delay 0] [--prefill-delay 0] [--tokenizer smollm2-135m] [--targets disagg,colocated,baseline]
[--curve-cost [--curve-rounds 6] [--curve-concurrency 32]]
[--gateway-processes 1,2,4 [--scale-concurrency 64] [--client-processes 8] [--fake-decode-workers 1]]
[--json out.json]
[--out /tmp/gateway-overhead.md]``.

Three targets, started in turn on free 127.0.0.1 ports and stopped after their runs:
``disagg`` (``pdserve gateway`` + one fake prefill + one fake decode worker, ``tests/fakes/fake_worker.py``),
``colocated`` (a second gateway + one fake colocated worker) and ``baseline`` (a trivial FastAPI/uvicorn
SSE endpoint sending the same number of OpenAI-shaped chunks with no work, the peer the gateway is a ratio
to). Each target gets ``--requests`` streaming ``/v1/completions`` requests per concurrency level, closed
loop, through httpx (``loadtest.client.send_request``). Client-observed TTFT, per-token ITL and E2E
(seconds) minus the fake workers' configured delays (prefill delay; token delay per later token) is the
gateway's added latency; completed requests / wall seconds at the highest concurrency is its ceiling.
Metric definitions as in ``loadtest.metrics`` (vLLM serving benchmark). After each gateway target every
request must be out of flight and every fake decode KV block free (``leaks`` = "ok").

The gateway targets' control plane is CURVE (a key pair made for the run, kvtransfer/curve.py), as in
production; the target ``disagg-insecure`` is the same as ``disagg`` with ``--insecure-control-plane`` on
the gateway and plain sockets on the fake workers.

``--curve-cost`` (after the targets above; ``--targets ""`` runs it alone) measures CURVE's cost as CPU,
not latency: both arms (``disagg`` with CURVE, ``disagg-insecure`` without) are started side by side and
measured in ``--curve-rounds`` alternated rounds (CURVE first in even rounds, plain first in odd ones) of
``--requests`` streamed requests at ``--curve-concurrency`` streams each, after ``--warmup`` per arm. Per
round and arm: the CPU seconds (user + system, ``psutil``, the process and its descendants, clock-tick
resolution) the gateway process spent during the round, over the output tokens streamed in it = the
gateway's CPU per output token; the part of it in the gateway's libzmq I/O threads (``ZMQbg/IO/<n>``,
where libzmq encrypts and decrypts CURVE frames: where CURVE's cost goes); the fake workers' CPU per
token likewise (CURVE costs them too); and the round's p50
added TPOT (latency, noisy on a shared machine). The report gives each arm's median and spread (min–max
over rounds), the ratio of the medians and each round's CURVE / plain ratio. CPU time is what CURVE
costs the gateway (its encryption and ZAP work), independent of how long other jobs on the machine
keep it waiting, which is what made latency ratios unstable.

``--gateway-processes 1,2,4`` (after the above; ``--targets ""`` runs it alone) measures how the gateway
scales over processes on one host (``pdserve gateway --workers N``): for each N in turn, the ``disagg``
target with an N-process gateway, one fake prefill and ``--fake-decode-workers`` fake decode workers
(one fake decode worker streams every token in one Python process and can become the limit before the
gateway does), all given the N control endpoints, and
``--scale-concurrency`` streams in all, driven by ``--client-processes`` separate load-generating
processes (each its own httpx client and event loop, with an equal share of the streams and of the
``--requests``; they start measuring together after their warm-up), so that one Python client's event
loop does not cap the rate. Per N: aggregate output tokens/s and req/s (all clients' tokens and completed
requests over the wall time from the first client's start to the last one's end), and the ratio of each
to N = 1 measured in the same run (the first N in the list is the reference). Beside them, whether the
load side kept up: the CPU each client process and each fake worker used over the measured time, as a
share of one core (near 1.0: that process, not the gateway, may be the limit) and the gateway's CPU in
cores (all its processes), and how many of the N processes took requests (from the fake prefill
worker's record of which control socket each request came through). Leak check after each N.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import multiprocessing
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import msgspec
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.gateway.overhead_report import machine_info, render_markdown
from bench.gateway.sse_baseline import baseline_app
from gateway.text import TextProcessor, TokenizerNotFoundError, resolve_tokenizer_dir
from kvtransfer.curve import generate_keys
from loadtest.client import RequestIds, send_request
from loadtest.metrics import latency_stats
from loadtest.records import LatencyStats, RequestRecord
from pdserve.launcher import wait_ready
from pdserve.ports import free_port_range, free_ports
from pdserve.supervisor import Supervisor

ROOT = Path(__file__).resolve().parents[2]
REPLY = "Hello world, this is a fake reply from an instant worker. The end."
PROMPT = "Summarize the plot of a short story about a lighthouse keeper and a message in a bottle."
TARGETS = ("disagg", "colocated", "baseline")  # the default run
INSECURE = "disagg-insecure"  # disagg without CURVE on its control plane (--curve-cost)
TOTAL_BLOCKS = 4096  # fake decode worker's KV blocks (plenty: leaks show as a shortfall)
CURVE_ARMS = ("disagg", INSECURE)  # --curve-cost: with CURVE, without


@dataclass(frozen=True)
class OverheadConfig:
    """What to run. Delays are the fake workers' (seconds); ``requests`` per level, after ``warmup``.

    Raises ValueError naming the field when a value is out of range.
    """

    requests: int = 300
    concurrency: tuple[int, ...] = (1, 8)
    max_tokens: int = 16
    prefill_delay_s: float = 0.0
    token_delay_s: float = 0.0
    warmup: int = 5
    timeout_s: float = 30.0
    tokenizer: str = "smollm2-135m"

    def __post_init__(self) -> None:
        checks = [(self.requests >= 1, "requests", "must be >= 1"),
                  (bool(self.concurrency) and min(self.concurrency) >= 1, "concurrency", "must be >= 1"),
                  (self.max_tokens >= 2, "max_tokens", "must be >= 2 (ITL needs two tokens)"),
                  (self.prefill_delay_s >= 0, "prefill_delay_s", "must be >= 0"),
                  (self.token_delay_s >= 0, "token_delay_s", "must be >= 0"),
                  (self.warmup >= 0, "warmup", "must be >= 0"),
                  (self.timeout_s > 0, "timeout_s", "must be > 0")]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")


class LevelResult(msgspec.Struct, kw_only=True):
    """One target at one concurrency. Latencies in ms; ``added_*`` = observed minus configured delays.
    TPOT per request = (E2E - TTFT) / (tokens - 1): with back-to-back tokens, the gateway's cost per token."""

    target: str
    concurrency: int
    requests: int
    completed: int
    failed: int
    first_error: str
    wall_s: float
    req_s: float
    ttft_ms: LatencyStats | None
    itl_ms: LatencyStats | None
    e2e_ms: LatencyStats | None
    added_ttft_ms: LatencyStats | None
    added_tpot_ms: LatencyStats | None
    added_itl_ms: LatencyStats | None
    added_e2e_ms: LatencyStats | None


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


class ClientShare(msgspec.Struct, kw_only=True):
    """What one load-generating process measured: requests sent and completed (all tokens), output
    tokens, its first error, its measured part's start and end (``time.monotonic()``, shared by every
    process of the host) and its own CPU seconds over that part."""

    sent: int
    completed: int
    tokens: int
    first_error: str
    start: float
    end: float
    cpu_s: float


class ScaleLevel(msgspec.Struct, kw_only=True):
    """``--gateway-processes``: one gateway of ``processes`` processes at ``concurrency`` streams from
    ``clients`` client processes. Rates over ``wall_s``; CPU as shares of one core over the measured
    time (``gateway_cores``: all the gateway's processes together); ``processes_used``: how many of the
    gateway's processes took requests; ``leaks`` as ``check_no_leaks``."""

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


class OverheadResult(msgspec.Struct, kw_only=True):
    """The whole run: configuration, machine, date, every level, leak check per gateway target, and
    CURVE's CPU cost when asked (``--curve-cost``), the scaling over gateway processes when asked
    (``--gateway-processes``)."""

    config: dict[str, object]
    machine: dict[str, object]
    date: str
    command: str
    levels: list[LevelResult]
    leaks: dict[str, str]
    curve_cost: CurveCost | None = None
    scale: list[ScaleLevel] | None = None


def _spawn(sup: Supervisor, name: str, argv: list[str], log_dir: Path) -> None:
    with open(log_dir / f"{name}.log", "ab") as out:
        sup.children[name] = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=out,
                                              stderr=subprocess.STDOUT, env=dict(os.environ))


def start_target(target: str, cfg: OverheadConfig, tokenizer_dir: Path, sup: Supervisor,
                 log_dir: Path, processes: int = 1, decode_workers: int = 1) -> str:
    """Start ``target``'s processes under ``sup``; returns its base URL once ``/ready`` is 200 (with
    ``processes`` > 1 gateway processes: once every one of them answered ready, ``wait_processes``).
    The fake prefill worker records its requests in ``log_dir/prefill.jsonl``. ``decode_workers`` > 1
    (``disagg`` only) starts that many fake decode workers, ``decode_worker_ids(decode_workers)``.

    Raises RuntimeError (with the log tail) when a process dies or it is not ready within 60 s.
    """
    [port] = free_ports(1)
    control_port = free_port_range(processes, exclude=(port,))
    secure: list[str] = []
    if target == INSECURE:
        gateway_secure = ["--insecure-control-plane"]
    else:
        keys = log_dir / f"keys-{control_port}"
        generate_keys(keys)
        gateway_secure = secure = ["--curve-keys", str(keys)]
    if target == "baseline":
        _spawn(sup, "baseline", ["-m", "bench.gateway.overhead", "--serve-baseline", str(port),
                                 "--max-tokens", str(cfg.max_tokens)], log_dir)
    else:
        control = f"tcp://127.0.0.1:{control_port}"
        pool = ["--workers", str(processes)] if processes > 1 else []
        _spawn(sup, "gateway", ["-m", "pdserve.cli", "gateway", "--port", str(port),
                                "--control-bind", control, "--tokenizer", str(tokenizer_dir),
                                "--log-level", "warning", *pool, *gateway_secure], log_dir)
        reply = ",".join(map(str, TextProcessor.from_dir(tokenizer_dir).encode(REPLY)))
        roles = [("colocated", "fake-colocated")] if target == "colocated" else [
            ("prefill", "fake-prefill"), *(("decode", w) for w in decode_worker_ids(decode_workers))]
        controls = ",".join(f"tcp://127.0.0.1:{control_port + i}" for i in range(processes))
        for role, worker_id in roles:
            record = ["--record", str(log_dir / "prefill.jsonl")] if role == "prefill" else []
            name = role if worker_id == f"fake-{role}" else worker_id.removeprefix("fake-")
            _spawn(sup, name, ["-m", "tests.fakes.fake_worker", "--role", role, "--worker-id", worker_id,
                               "--gateway-control", controls, "--output-ids", reply, *secure, *record,
                               "--total-blocks", str(TOTAL_BLOCKS), "--max-model-len", "4096",
                               "--prefill-delay", str(cfg.prefill_delay_s),
                               "--token-delay", str(cfg.token_delay_s)], log_dir)
    url = f"http://127.0.0.1:{port}"
    why = wait_ready(sup, url, 60.0, [])
    if why is None and processes > 1:
        why = wait_processes(url, processes, 60.0)
    if why is not None:
        logs = "".join((log_dir / f"{n}.log").read_text()[-1500:] for n in sup.children)
        raise RuntimeError(f"{target} did not start: {why}\n{logs}")
    return url


async def run_level(url: str, cfg: OverheadConfig, concurrency: int) -> tuple[list[RequestRecord], float]:
    """``cfg.warmup`` then ``cfg.requests`` streamed completions, ``concurrency`` in flight (closed loop).
    Returns the measured records and the wall seconds of the measured part."""
    body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": cfg.max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=cfg.timeout_s, limits=limits) as client:
        async def loop(todo: Iterator[int], t0: float, out: list[RequestRecord]) -> None:
            for i in todo:  # shared iterator: each free slot takes the next request (closed loop)
                ids = RequestIds(index=i, session_id=i, turn=0, start_s=time.perf_counter() - t0)
                out.append((await send_request(client, "/v1/completions", body, ids, cfg.timeout_s))[0])

        warm: list[RequestRecord] = []
        todo = iter(range(cfg.warmup))
        await asyncio.gather(*[loop(todo, time.perf_counter(), warm) for _ in range(concurrency)])
        records: list[RequestRecord] = []
        t0, todo = time.perf_counter(), iter(range(cfg.requests))
        await asyncio.gather(*[loop(todo, t0, records) for _ in range(concurrency)])
        return records, time.perf_counter() - t0


def wait_processes(url: str, processes: int, timeout_s: float) -> str | None:
    """Poll ``/v1/status`` over fresh connections until each of the gateway's ``processes`` processes
    has answered ready; None then, else why not."""
    seen: set[int] = set()
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with contextlib.suppress(httpx.HTTPError), httpx.Client(timeout=2.0) as client:
            body = client.get(url + "/v1/status").json()
            if body["ready"]:
                seen.add(body["process"]["index"])
        if len(seen) == processes:
            return None
        time.sleep(0.05)
    return f"only gateway processes {sorted(seen)} of {processes} ready after {timeout_s:g} s"


def summarize_level(target: str, concurrency: int, records: Sequence[RequestRecord], wall_s: float,
                    cfg: OverheadConfig) -> LevelResult:
    """Aggregate one level. A request counts as completed only with all ``cfg.max_tokens`` tokens.
    Configured delays are subtracted for gateway targets (the baseline has none)."""
    ok = [r for r in records if r.success and r.output_tokens == cfg.max_tokens]
    bad = [r for r in records if r not in ok]
    first_error = (bad[0].error or f"{bad[0].output_tokens} tokens, want {cfg.max_tokens}") if bad else ""
    pre, tok = (0.0, 0.0) if target == "baseline" else (cfg.prefill_delay_s, cfg.token_delay_s)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [g for r in ok for g in r.itl_s]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    return LevelResult(
        target=target, concurrency=concurrency, requests=len(records), completed=len(ok), failed=len(bad),
        first_error=first_error, wall_s=wall_s, req_s=len(ok) / wall_s if wall_s > 0 else 0.0,
        ttft_ms=latency_stats(ttft), itl_ms=latency_stats(itl), e2e_ms=latency_stats(e2e),
        added_ttft_ms=latency_stats([t - pre for t in ttft]),
        added_itl_ms=latency_stats([g - tok for g in itl]),
        added_tpot_ms=latency_stats([(r.e2e_s - r.ttft_s) / (cfg.max_tokens - 1) - tok for r in ok
                                     if r.e2e_s is not None and r.ttft_s is not None]),
        added_e2e_ms=latency_stats([t - pre - tok * (cfg.max_tokens - 1) for t in e2e]))


def decode_worker_ids(n: int) -> list[str]:
    """Worker ids of ``n`` fake decode workers: ``fake-decode`` alone, else ``fake-decode-0`` ...."""
    return ["fake-decode"] if n == 1 else [f"fake-decode-{i}" for i in range(n)]


def check_no_leaks(url: str, decode_id: str | Sequence[str] | None, deadline_s: float = 5.0) -> str:
    """"ok" when the gateway has no request in flight and every decode worker named by ``decode_id`` (one
    id, several, or none) has all its KV blocks free (polled up to ``deadline_s`` seconds); else what is
    left."""
    ids = [] if decode_id is None else [decode_id] if isinstance(decode_id, str) else list(decode_id)
    end, why = time.monotonic() + deadline_s, "not checked"
    while time.monotonic() < end:
        samples = {(s.name, s.labels.get("worker_id")): s.value
                   for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text)
                   for s in fam.samples}
        in_flight = samples.get(("pdserve_requests_in_flight", None))
        free = {d: samples.get(("pdserve_kv_blocks_free", d)) for d in ids}
        if in_flight == 0 and all(f == TOTAL_BLOCKS for f in free.values()):
            return "ok"
        why = f"in flight {in_flight}, " + ", ".join(f"free blocks on {d} {f} of {TOTAL_BLOCKS}"
                                                     for d, f in free.items())
        time.sleep(0.1)
    return why


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its live descendants (and their reaped children)
    so far; resolution one clock tick (10 ms on Linux). Raises psutil.NoSuchProcess if ``pid`` is gone."""
    proc = psutil.Process(pid)
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


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


def _client_process(url: str, cfg: OverheadConfig, concurrency: int, barrier: object,
                    results: multiprocessing.SimpleQueue[ClientShare]) -> None:
    """One load-generating process of ``--gateway-processes``: warm up, wait for the others at
    ``barrier`` (a ``multiprocessing.Barrier``), run ``cfg.requests`` at ``concurrency`` streams, put its
    ``ClientShare`` on ``results``."""
    asyncio.run(run_level(url, dataclasses.replace(cfg, requests=max(cfg.warmup, 1), warmup=0), concurrency))
    barrier.wait(120.0)  # type: ignore[attr-defined]
    cpu0, start = time.process_time(), time.monotonic()
    records, _ = asyncio.run(run_level(url, dataclasses.replace(cfg, warmup=0), concurrency))
    end, cpu = time.monotonic(), time.process_time() - cpu0
    ok = [r for r in records if r.success and r.output_tokens == cfg.max_tokens]
    bad = [r for r in records if r not in ok]
    results.put(ClientShare(sent=len(records), completed=len(ok), tokens=sum(r.output_tokens for r in ok),
                            first_error=(bad[0].error or f"{bad[0].output_tokens} tokens") if bad else "",
                            start=start, end=end, cpu_s=cpu))


def run_scale_level(cfg: OverheadConfig, tokenizer_dir: Path, log_dir: Path, processes: int,
                    concurrency: int, clients: int, decode_workers: int = 1) -> ScaleLevel:
    """One N of ``--gateway-processes`` (see the module docstring). Raises RuntimeError when the target
    does not start or a client process does not report within ``cfg.timeout_s`` + 120 s."""
    sup = Supervisor(grace=5.0)
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(clients + 1)
    results: multiprocessing.SimpleQueue[ClientShare] = ctx.SimpleQueue()
    share = dataclasses.replace(cfg, requests=max(1, -(-cfg.requests // clients)))
    procs: list[multiprocessing.process.BaseProcess] = []
    try:
        url = start_target("disagg", cfg, tokenizer_dir, sup, log_dir, processes, decode_workers)
        procs = [ctx.Process(target=_client_process, args=(url, share, max(1, concurrency // clients),
                                                           barrier, results)) for _ in range(clients)]
        for p in procs:
            p.start()
        kids = sup.children
        workers = [kids[n].pid for n in kids if n != "gateway"]
        barrier.wait(180.0)
        gw0, wk0, t0 = cpu_seconds(kids["gateway"].pid), [cpu_seconds(w) for w in workers], time.monotonic()
        for p in procs:
            p.join(cfg.timeout_s * share.requests + 120.0)
        gw, wall_all = cpu_seconds(kids["gateway"].pid) - gw0, time.monotonic() - t0
        wk = [cpu_seconds(w) - w0 for w, w0 in zip(workers, wk0, strict=True)]
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a client process failed: exit codes {[p.exitcode for p in procs]}")
        shares = [results.get() for _ in procs]
        leaks = check_no_leaks(url, decode_worker_ids(decode_workers))
        lines = (log_dir / "prefill.jsonl").read_text().splitlines()
        # the fake worker names the gateway a request came through only when it has several
        used = {json.loads(line).get("gateway", 0) for line in lines if '"PrefillRequest"' in line}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        sup.stop_all()
    wall = max(s.end for s in shares) - min(s.start for s in shares)
    rate = 1 / wall if wall > 0 else 0.0
    tokens, completed = sum(s.tokens for s in shares), sum(s.completed for s in shares)
    return ScaleLevel(processes=processes, clients=clients, decode_workers=decode_workers,
                      concurrency=max(1, concurrency // clients) * clients,
                      sent=sum(s.sent for s in shares), completed=completed, tokens=tokens,
                      first_error=next((s.first_error for s in shares if s.first_error), ""), wall_s=wall,
                      tokens_s=tokens * rate, req_s=completed * rate, gateway_cores=gw / wall_all,
                      busiest_client_core=max(s.cpu_s / max(s.end - s.start, 1e-9) for s in shares),
                      busiest_worker_core=max(wk) / wall_all, processes_used=len(used), leaks=leaks)


def run(cfg: OverheadConfig, command: str = "", targets: Sequence[str] = TARGETS,
        curve_rounds: int = 0, curve_concurrency: int = 32, gateway_processes: Sequence[int] = (),
        scale_concurrency: int = 64, client_processes: int = 4,
        fake_decode_workers: int = 1) -> OverheadResult:
    """Start each target, measure every concurrency level, stop it; then, with ``curve_rounds`` > 0,
    CURVE's CPU cost (run_curve_rounds). Raises ValueError for an unknown target or tokenizer dir,
    RuntimeError when a target does not start."""
    unknown = [t for t in targets if t not in (*TARGETS, INSECURE)]
    if unknown:
        raise ValueError(f"unknown targets {unknown}; choose from {(*TARGETS, INSECURE)}")
    if curve_rounds < 0 or curve_concurrency < 1:
        raise ValueError(f"curve_rounds must be >= 0 and curve_concurrency >= 1, got {curve_rounds} and "
                         f"{curve_concurrency}")
    if fake_decode_workers < 1:
        raise ValueError(f"fake decode workers must be >= 1, got {fake_decode_workers}")
    if any(n < 1 for n in gateway_processes) or client_processes < 1 or scale_concurrency < client_processes:
        raise ValueError(f"gateway processes must be >= 1 (got {list(gateway_processes)}), client processes "
                         f">= 1 (got {client_processes}) and the scale concurrency >= the client processes "
                         f"(got {scale_concurrency})")
    tokenizer_dir = resolve_tokenizer_dir(cfg.tokenizer, None)  # TokenizerNotFoundError before any start
    machine = machine_info()
    levels, leaks = [], {}
    curve = None
    with tempfile.TemporaryDirectory(prefix="gw-overhead-") as tmp:
        for target in targets:
            sup = Supervisor(grace=5.0)
            try:
                url = start_target(target, cfg, tokenizer_dir, sup, Path(tmp))
                for conc in cfg.concurrency:
                    records, wall = asyncio.run(run_level(url, cfg, conc))
                    levels.append(summarize_level(target, conc, records, wall, cfg))
                if target != "baseline":
                    leaks[target] = check_no_leaks(url, None if target == "colocated" else "fake-decode")
            finally:
                sup.stop_all()
        if curve_rounds:
            curve = run_curve_rounds(cfg, tokenizer_dir, Path(tmp), curve_concurrency, curve_rounds)
        scale: list[ScaleLevel] = []
        for n in gateway_processes:
            level_dir = Path(tmp) / f"processes-{n}-{len(scale)}"
            level_dir.mkdir()
            scale.append(run_scale_level(cfg, tokenizer_dir, level_dir, n, scale_concurrency,
                                         client_processes, fake_decode_workers))
    return OverheadResult(config=asdict(cfg), machine=machine, levels=levels, leaks=leaks, command=command,
                          date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                          curve_cost=curve, scale=scale or None)


def main(argv: list[str] | None = None) -> int:
    """CLI entry. Returns 0 when every request completed and nothing leaked, 1 otherwise, 2 bad arguments."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", default="1,8", help="comma-separated levels")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prefill-delay", type=float, default=0.0, help="fake workers' prefill delay (s)")
    p.add_argument("--token-delay", type=float, default=0.0, help="fake workers' per-token delay (s)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--tokenizer", default="smollm2-135m", help="tokenizer dir or cached alias")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--curve-cost", action="store_true",
                   help=f"then CURVE's CPU cost: disagg against {INSECURE}, side by side, alternated rounds")
    p.add_argument("--curve-rounds", type=int, default=None, help="--curve-cost rounds per arm [6]")
    p.add_argument("--curve-concurrency", type=int, default=None, help="--curve-cost streams [32]")
    p.add_argument("--gateway-processes", default="",
                   help="then the gateway over N processes each (pdserve gateway --workers N), e.g. 1,2,4: "
                        "aggregate tokens/s and req/s, ratios to the first")
    p.add_argument("--scale-concurrency", type=int, default=64, help="--gateway-processes: streams in all")
    p.add_argument("--client-processes", type=int, default=4,
                   help="--gateway-processes: load-generating processes sharing the streams")
    p.add_argument("--fake-decode-workers", type=int, default=1,
                   help="--gateway-processes: fake decode workers sharing the streams (one fake worker "
                        "streaming every token can become the limit)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="Markdown report path")
    p.add_argument("--serve-baseline", type=int, default=None, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_baseline is not None:
        import uvicorn

        uvicorn.run(baseline_app(args.max_tokens), host="127.0.0.1", port=args.serve_baseline,
                    log_level="warning", access_log=False, log_config=None)
        return 0
    try:
        cfg = OverheadConfig(requests=args.requests, max_tokens=args.max_tokens, warmup=args.warmup,
                             concurrency=tuple(int(x) for x in args.concurrency.split(",")),
                             prefill_delay_s=args.prefill_delay, token_delay_s=args.token_delay,
                             tokenizer=args.tokenizer)
        command = "python -m bench.gateway.overhead " + shlex.join(sys.argv[1:] if argv is None else argv)
        targets = [t for t in args.targets.split(",") if t]
        if not args.curve_cost and (args.curve_rounds is not None or args.curve_concurrency is not None):
            raise ValueError("--curve-rounds and --curve-concurrency need --curve-cost")
        rounds = 6 if args.curve_rounds is None else args.curve_rounds
        if args.curve_cost and rounds < 1:
            raise ValueError(f"--curve-rounds must be >= 1, got {rounds}")
        processes = tuple(int(x) for x in args.gateway_processes.split(",") if x)
        res = run(cfg, command, tuple(targets), curve_rounds=rounds if args.curve_cost else 0,
                  curve_concurrency=32 if args.curve_concurrency is None else args.curve_concurrency,
                  gateway_processes=processes, scale_concurrency=args.scale_concurrency,
                  client_processes=args.client_processes, fake_decode_workers=args.fake_decode_workers)
    except (ValueError, TokenizerNotFoundError) as exc:
        print(f"gateway_overhead: {exc}", file=sys.stderr)
        return 2
    if args.json:
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(res)))
    text = render_markdown(res)
    if args.out:
        args.out.write_text(text)
    print(text)
    curve = res.curve_cost
    failed = (any(lv.failed for lv in res.levels) or any(v != "ok" for v in res.leaks.values())
              or (curve is not None and (any(r.completed < r.requests for r in curve.rounds)
                                         or any(v != "ok" for v in curve.leaks.values())))
              or any(sc.completed < sc.sent or sc.leaks != "ok" for sc in res.scale or ()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
