"""The measurement primitives of ``bench.gateway.overhead``: what to run (``OverheadConfig``), the
targets it measures (``start_target``: ``pdserve gateway`` with instant fake workers from
``tests/fakes/fake_worker.py``, or a bare SSE endpoint), one closed-loop level of streamed completions
against a target (``run_level``) and its summary with the fake workers' delays subtracted
(``summarize_level``: ``LevelResult``, latencies in ms), the leak check after a run (``check_no_leaks``)
and a process tree's CPU seconds (``cpu_seconds``). Metric definitions as in ``loadtest.metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import psutil
from prometheus_client.parser import text_string_to_metric_families

from gateway.text import TextProcessor
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


async def run_level(url: str, cfg: OverheadConfig, concurrency: int,
                    origin: list[float] | None = None) -> tuple[list[RequestRecord], float]:
    """``cfg.warmup`` then ``cfg.requests`` streamed completions, ``concurrency`` in flight (closed loop).
    Returns the measured records and the wall seconds of the measured part. ``origin``, when given, gets
    the measured part's start appended (``time.perf_counter()`` seconds: the records' ``start_s`` is
    relative to it)."""
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
        if origin is not None:
            origin.append(t0)
        await asyncio.gather(*[loop(todo, t0, records) for _ in range(concurrency)])
        return records, time.perf_counter() - t0


def wait_processes(url: str, processes: int, timeout_s: float) -> str | None:
    """Poll ``/v1/status`` over fresh connections until each of the gateway's ``processes`` processes
    has answered ready; None then, else why not."""
    seen = gateway_pids(url, processes, timeout_s)
    if len(seen) == processes:
        return None
    return f"only gateway processes {sorted(seen)} of {processes} ready after {timeout_s:g} s"


def gateway_pids(url: str, processes: int, timeout_s: float) -> dict[int, int]:
    """Poll ``/v1/status`` over fresh connections (``SO_REUSEPORT`` spreads them over the processes) until
    each of the gateway's ``processes`` processes has answered ready, or ``timeout_s`` seconds pass;
    returns process index -> pid of those that did."""
    seen: dict[int, int] = {}
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with contextlib.suppress(httpx.HTTPError), httpx.Client(timeout=2.0) as client:
            body = client.get(url + "/v1/status").json()
            if body["ready"]:
                seen[body["process"]["index"]] = body["process"]["pid"]
        if len(seen) == processes:
            break
        time.sleep(0.05)
    return seen


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
