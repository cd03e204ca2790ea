"""Prometheus metrics of the gateway (prefix ``pdserve_``), in a registry of their own per app.

Latencies in seconds: TTFT (arrival → first token), TPOT (mean gap after the first token), ITL (each
gap), E2E (arrival → last token). Per-worker gauges come from heartbeats and vanish with the worker.
"""

from __future__ import annotations

import contextlib
import itertools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.messages import WorkerLoad

_LAT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class GatewayMetrics:
    """All gateway metrics; ``render()`` gives the Prometheus text exposition."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdserve_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("pdserve_ttft_seconds", "time to first token", buckets=_LAT_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_tpot_seconds", "mean time per output token after the first",
                              buckets=_GAP_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_itl_seconds", "inter-token latency", buckets=_GAP_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_seconds", "request latency", buckets=_LAT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "generated tokens", registry=r)
        self.routes = Counter("pdserve_routed_requests", "requests by route kind "
                              "(disaggregated, prefill_only, colocated)", ["kind"], registry=r)
        self.fallbacks = Counter("pdserve_local_prefill_fallbacks", "requests served colocated because "
                                 "prefill/decode workers were missing", registry=r)
        self.running = Gauge("pdserve_worker_running", "running sequences", ["worker_id", "role"], registry=r)
        self.waiting = Gauge("pdserve_worker_waiting", "waiting sequences", ["worker_id", "role"], registry=r)
        self.kv_used = Gauge("pdserve_kv_blocks_used", "KV blocks in use", ["worker_id", "role"], registry=r)
        self.kv_free = Gauge("pdserve_kv_blocks_free", "KV blocks free", ["worker_id", "role"], registry=r)
        self.workers = Gauge("pdserve_workers_live", "live workers", ["role"], registry=r)
        self.worker_deaths = Counter("pdserve_worker_deaths", "workers declared dead or replaced", registry=r)
        self.in_flight = Gauge("pdserve_requests_in_flight", "requests being served", registry=r)

    def set_worker_load(self, worker_id: str, role: str, load: WorkerLoad) -> None:
        """Update one worker's gauges from a heartbeat."""
        self.running.labels(worker_id, role).set(load.num_running)
        self.waiting.labels(worker_id, role).set(load.num_waiting)
        self.kv_used.labels(worker_id, role).set(load.num_total_blocks - load.num_free_blocks)
        self.kv_free.labels(worker_id, role).set(load.num_free_blocks)

    def drop_worker(self, worker_id: str, role: str) -> None:
        """Remove a gone worker's gauges."""
        for gauge in (self.running, self.waiting, self.kv_used, self.kv_free):
            with contextlib.suppress(KeyError):
                gauge.remove(worker_id, role)

    def observe_tokens(self, arrival: float, token_times: list[float]) -> None:
        """Record TTFT/ITL/TPOT/E2E of a finished request from its token arrival times (seconds)."""
        if not token_times:
            return
        self.ttft.observe(token_times[0] - arrival)
        self.e2e.observe(token_times[-1] - arrival)
        gaps = [b - a for a, b in itertools.pairwise(token_times)]
        for gap in gaps:
            self.itl.observe(gap)
        if gaps:
            self.tpot.observe(sum(gaps) / len(gaps))

    def render(self) -> bytes:
        """Prometheus text format."""
        return generate_latest(self.registry)
