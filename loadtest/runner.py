"""Run the load: open loop (arrival times) or closed loop (fixed concurrency), one run per sweep point.

Every run ends on its own: issuing stops after ``num_requests`` requests or ``duration_s`` seconds,
each request is bounded by ``request_timeout_s``, and the final drain is bounded too. Faults, if any,
are scheduled relative to the start of each measured run. Warm-up requests go first and are not recorded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from tqdm import tqdm

from loadtest.arrivals import arrival_times
from loadtest.client import RequestIds, send_request
from loadtest.config import BenchConfig
from loadtest.conversation import PATHS, Conversation
from loadtest.faults import FaultScheduler, phase_report
from loadtest.gateway_share import IntervalReading, gateway_share, read_interval
from loadtest.metrics import summarize
from loadtest.records import BenchResult, GatewayShare, KVScrape, RequestRecord, RunResult
from loadtest.scrape import scrape_after, scrape_before
from loadtest.workload import Session, make_sessions

_WARMUP_SEED_OFFSET = 1_000_003
_DRAIN_SLACK_S = 5.0


def make_client(cfg: BenchConfig) -> httpx.AsyncClient:
    """An httpx client bound to ``cfg.base_url`` only: no proxies from the environment, no redirects."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    return httpx.AsyncClient(
        base_url=cfg.base_url,
        headers=headers,
        timeout=httpx.Timeout(cfg.request_timeout_s),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        trust_env=False,
        follow_redirects=False,
    )


class _Run:
    """Shared state of one measured run: the request budget, the records, the progress bar."""

    def __init__(self, cfg: BenchConfig, client: httpx.AsyncClient, clock: Callable[[], float]) -> None:
        self.cfg, self.client, self.clock = cfg, client, clock
        self.t0 = clock()
        self.issued = 0
        self.records: list[RequestRecord] = []
        self.bar: tqdm[Any] | None = None

    def claim(self) -> int | None:
        """The next request index, or None once the count or the duration is used up."""
        cfg = self.cfg
        if cfg.num_requests is not None and self.issued >= cfg.num_requests:
            return None
        if cfg.duration_s is not None and self.clock() - self.t0 >= cfg.duration_s:
            return None
        self.issued += 1
        return self.issued - 1

    async def session(self, session: Session, first_index: int | None = None) -> None:
        """Send the session's turns in order, each on top of the replies so far; stop on a failure."""
        conv = Conversation(self.cfg.endpoint)
        for turn_no, turn in enumerate(session.turns):
            index = first_index if turn_no == 0 and first_index is not None else self.claim()
            if index is None:
                return
            ids = RequestIds(index, session.session_id, turn_no, self.clock() - self.t0)
            body = conv.body(turn, self.cfg.model, ignore_eos=self.cfg.ignore_eos,
                             temperature=self.cfg.temperature)
            rec, text = await send_request(
                self.client, PATHS[self.cfg.endpoint], body, ids, self.cfg.request_timeout_s, self.clock
            )
            self.records.append(rec)
            if self.bar is not None:
                self.bar.update(1)
            if not rec.success:
                return
            conv.add_reply(turn, text)


async def _drain(tasks: set[asyncio.Task[None]], timeout_s: float) -> None:
    """Wait for ``tasks`` at most ``timeout_s`` seconds, then cancel what is left (a safety net).

    Re-raises the first exception a task ended with (a harness bug must not pass silently).
    """
    if not tasks:
        return
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]


async def _open_loop(run: _Run, sessions: Iterator[Session], rate: float) -> None:
    cfg = run.cfg
    tasks: set[asyncio.Task[None]] = set()
    for session, at in zip(sessions, arrival_times(cfg.arrival, rate, cfg.seed, cfg.burstiness),
                           strict=False):
        if cfg.duration_s is not None and at >= cfg.duration_s:
            break
        delay = run.t0 + at - run.clock()
        if delay > 0:
            await asyncio.sleep(delay)
        index = run.claim()
        if index is None:
            break
        tasks.add(asyncio.create_task(run.session(session, index)))
    await _drain(tasks, cfg.request_timeout_s * max(1, cfg.workload.num_turns) + _DRAIN_SLACK_S)


async def _closed_loop(run: _Run, sessions: Iterator[Session]) -> None:
    async def worker() -> None:
        while (index := run.claim()) is not None:
            await run.session(next(sessions), index)

    tasks = {asyncio.create_task(worker()) for _ in range(run.cfg.concurrency)}
    bound = run.cfg.duration_s or 0.0
    budget = run.cfg.num_requests or 0
    await _drain(tasks, bound + (budget + run.cfg.workload.num_turns) * run.cfg.request_timeout_s
                 + _DRAIN_SLACK_S)


async def _warmup(cfg: BenchConfig, client: httpx.AsyncClient) -> None:
    """Send ``cfg.warmup`` single-turn requests, ``cfg.concurrency`` at a time; results are dropped."""
    sessions = make_sessions(cfg.workload, cfg.seed + _WARMUP_SEED_OFFSET)
    sem = asyncio.Semaphore(cfg.concurrency)

    async def one(i: int, session: Session) -> None:
        async with sem:
            body = Conversation(cfg.endpoint).body(session.turns[0], cfg.model, ignore_eos=cfg.ignore_eos,
                                                   temperature=cfg.temperature)
            await send_request(client, PATHS[cfg.endpoint], body, RequestIds(i, -1, 0, 0.0),
                               cfg.request_timeout_s)

    await asyncio.gather(*(one(i, next(sessions)) for i in range(cfg.warmup)))


async def run_once(cfg: BenchConfig, rate: float | None, clock: Callable[[], float] = time.perf_counter
                   ) -> RunResult:
    """One measured run at ``rate`` requests/s (None: closed loop at ``cfg.concurrency``).

    Raises ValueError/OSError for a bad workload before any traffic is sent.
    """
    sessions = make_sessions(cfg.workload, cfg.seed)
    # Objects alive now (imports, datasets) move to the permanent generation, so that a full garbage
    # collection during the run does not stall the event loop and inflate the latencies measured.
    gc.collect()
    gc.freeze()
    label = f"concurrency={cfg.concurrency}" if rate is None else f"rate={rate:g}/s"
    async with make_client(cfg) as client:
        before, kv_error = await _scrape_before(cfg, client)
        await _warmup(cfg, client)
        share_before, share_error = await _read_interval(cfg, client)
        run, faults = _Run(cfg, client, clock), FaultScheduler(cfg.faults, clock)
        faults.start(run.t0)
        with tqdm(total=cfg.num_requests, desc=label, unit="req", disable=not cfg.progress) as bar:
            run.bar = bar
            await (_closed_loop(run, sessions) if rate is None else _open_loop(run, sessions, rate))
        elapsed = clock() - run.t0
        share_after, after_error = await _read_interval(cfg, client)
        fault_results = await faults.finish(elapsed)
        kv = KVScrape(error=kv_error)
        if before is not None and cfg.metrics_path:
            kv = await scrape_after(client, cfg.metrics_path, before, cfg.leak_settle_s)
    records = sorted(run.records, key=lambda r: r.index)
    share: GatewayShare | None = None
    if cfg.decode_metrics:
        share = (gateway_share(share_before, share_after, records)
                 if share_before is not None and share_after is not None
                 else GatewayShare(error=share_error or after_error))
    return RunResult(
        label=label, rate=rate, concurrency=cfg.concurrency if rate is None else None,
        summary=summarize(records, elapsed, cfg.slo), records=records, faults=fault_results,
        phases=phase_report(records, fault_results), kv=kv, gateway_share=share,
    )


async def _read_interval(cfg: BenchConfig, client: httpx.AsyncClient) -> tuple[IntervalReading | None, str]:
    """The decode-side workers' step-interval reading (None and no error without ``--decode-metrics``;
    None and the error when a page could not be read)."""
    if not cfg.decode_metrics:
        return None, ""
    try:
        return await read_interval(client, cfg.decode_metrics), ""
    except RuntimeError as exc:
        return None, str(exc)


async def _scrape_before(cfg: BenchConfig, client: httpx.AsyncClient) -> tuple[float | None, str]:
    if not cfg.metrics_path:
        return None, "metrics scrape off"
    settle = cfg.leak_settle_s
    try:  # a settled baseline: the gauge lags by a heartbeat (loadtest/scrape.py)
        return await scrape_before(client, cfg.metrics_path, min(1.0, settle), settle), ""
    except RuntimeError as exc:
        return None, str(exc)


async def check_decode_pages(cfg: BenchConfig) -> None:
    """Read the ``--decode-metrics`` pages once, before any traffic, so that a page that cannot be read
    (a wrong port, not a decode-side worker's page) ends the bench before its load rather than leaving
    the measurement empty after it. Raises RuntimeError naming the page and the problem."""
    if not cfg.decode_metrics:
        return
    async with httpx.AsyncClient(trust_env=False, follow_redirects=False) as client:
        try:
            await read_interval(client, cfg.decode_metrics)
        except RuntimeError as exc:
            raise RuntimeError(f"--decode-metrics: {exc} (no load was sent)") from None


async def run_bench(cfg: BenchConfig) -> BenchResult:
    """Every sweep point in turn (one closed-loop run when ``cfg.arrival == "closed"``)."""
    rates: list[float | None] = [None] if cfg.arrival == "closed" else list(cfg.rates)
    runs = [await run_once(cfg, rate) for rate in rates]
    return BenchResult(config=config_dict(cfg), runs=runs)


def config_dict(cfg: BenchConfig) -> dict[str, Any]:
    """``cfg`` as plain data for the JSON output; the API key is redacted, infinite rates become "inf"."""
    data = dataclasses.asdict(cfg)
    data["api_key"] = "***" if cfg.api_key else None
    data["rates"] = [r if r != float("inf") else "inf" for r in cfg.rates]
    return data
