"""Prometheus metrics of the gateway (prefix ``pdserve_``), in a registry of their own per app.

Latencies in seconds: TTFT (arrival → first token), TPOT (mean gap after the first token), ITL (each
gap), E2E (arrival → last token). Per-worker series (label ``worker_id``) come from heartbeats and vanish
with the worker. Names follow https://prometheus.io/docs/practices/naming/ (unit suffixes, ``_total`` on
counters); ``deploy/metrics.yaml`` lists every served name and tests/gateway/test_metric_names.py keeps
the two in step.

Several gateway processes (``pdserve gateway --workers N``, gateway/process.py) answer ``/metrics`` on one
port, so any of them must give the same account. Two kinds of series:

- *per process* (requests, tokens, latencies, routing, retries, refusals, in-flight requests, worker
  deaths declared): each process counts its own; with N > 1 they live in prometheus-client's
  multiprocess files (``PROMETHEUS_MULTIPROC_DIR``, a directory the parent owns) and every process serves
  their sum (prometheus-client docs, "Multiprocess Mode"; ``pdserve_requests_in_flight`` as ``livesum``:
  a dead process's share leaves with it). A worker death is declared by each process that sees it, so
  with N processes one death counts up to N times.
- *fleet view* (per-worker load and KV blocks, live workers, KV transfer totals, KV path speed): every
  process learns the same from the workers' heartbeats and canaries, so the answering process serves its
  own view (``FleetGauge`` and the collectors below, never written to the multiprocess files).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import itertools
import os
from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    values,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from kvtransfer.curve import REFUSAL_KINDS
from protocol.messages import WorkerLoad

disable_created_metrics()  # no ``<name>_created`` series (as in workers/metrics.py)

_LAT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FAILURE_CAUSES = ("failed", "lost", "unreachable")  # the ``cause`` label of retries and migrations
_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class FleetGauge(Collector):
    """A labelled gauge kept in this process's memory whatever prometheus-client's mode (a custom
    collector): a fleet-view series every gateway process holds alike, served by whichever answers.
    ``labels(*values).set(v)`` and ``remove(*values)`` as on a ``Gauge``."""

    def __init__(self, name: str, documentation: str, labelnames: list[str]) -> None:
        self._name, self._doc, self._labelnames = name, documentation, labelnames
        self._values: dict[tuple[str, ...], float] = {}

    def labels(self, *labelvalues: str) -> _FleetGaugeChild:
        """The series of these label values (created at 0 when new).

        Raises:
            ValueError: not one value per label name.
        """
        if len(labelvalues) != len(self._labelnames):
            raise ValueError(f"{self._name}: expected {len(self._labelnames)} label values, got "
                             f"{len(labelvalues)}")
        key = tuple(str(v) for v in labelvalues)
        self._values.setdefault(key, 0.0)
        return _FleetGaugeChild(self._values, key)

    def remove(self, *labelvalues: str) -> None:
        """Drop a series. Raises KeyError when it does not exist, as ``Gauge.remove`` does."""
        del self._values[tuple(str(v) for v in labelvalues)]

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """The family without samples."""
        yield GaugeMetricFamily(self._name, self._doc, labels=self._labelnames)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """The family with one sample per series."""
        family = GaugeMetricFamily(self._name, self._doc, labels=self._labelnames)
        for key, value in sorted(self._values.items()):
            family.add_metric(list(key), value)
        yield family


class _FleetGaugeChild:
    """One series of a ``FleetGauge``."""

    def __init__(self, store: dict[tuple[str, ...], float], key: tuple[str, ...]) -> None:
        self._store, self._key = store, key

    def set(self, value: float) -> None:
        """Set the series' value."""
        self._store[self._key] = float(value)

    def get(self) -> float:
        """The series' value (0 until set)."""
        return self._store.get(self._key, 0.0)


class KVTransferCollector(Collector):
    """``pdserve_kv_transfer_bytes_total`` / ``pdserve_kv_transfer_seconds_total`` by ``worker_id``.

    The prefill workers count their DONE transfers themselves and report the cumulative bytes and
    seconds in every heartbeat (``WorkerLoad.kv_transfer_bytes`` / ``kv_transfer_seconds``); this
    collector re-exposes the last reported values as counters (a custom collector, as in the
    prometheus-client docs, "Custom Collectors"). A restarted worker starts again from 0, which
    Prometheus' ``rate()`` treats as a counter reset.
    """

    def __init__(self) -> None:
        self._totals: dict[str, tuple[int, float]] = {}

    def set(self, worker_id: str, num_bytes: int, seconds: float) -> None:
        """Record a worker's cumulative totals (bytes, seconds)."""
        self._totals[worker_id] = (num_bytes, seconds)

    def drop(self, worker_id: str) -> None:
        """Forget a gone worker (its series disappear)."""
        self._totals.pop(worker_id, None)

    def _families(self) -> tuple[CounterMetricFamily, CounterMetricFamily]:
        return (CounterMetricFamily("pdserve_kv_transfer_bytes", "KV bytes sent prefill -> decode by "
                                    "completed transfers", labels=["worker_id"]),
                CounterMetricFamily("pdserve_kv_transfer_seconds", "seconds from a transfer's first layer "
                                    "handed to the sender to DONE, summed", labels=["worker_id"]))

    def describe(self) -> Iterator[CounterMetricFamily]:
        """The two families without samples (lets the registry check for name clashes)."""
        yield from self._families()

    def collect(self) -> Iterator[CounterMetricFamily]:
        """The two families with one sample per worker."""
        num_bytes, seconds = self._families()
        for worker_id, (b, s) in sorted(self._totals.items()):
            num_bytes.add_metric([worker_id], b)
            seconds.add_metric([worker_id], s)
        yield num_bytes
        yield seconds


class WorkerCountCollector(Collector):
    """A cumulative per-worker count that workers report in heartbeats, re-exposed as the counter
    ``<name>_total{worker_id}`` (as ``KVTransferCollector``): here the peers each worker's KV
    control socket refused (``WorkerLoad.kv_control_refused``)."""

    def __init__(self, name: str, documentation: str) -> None:
        self._name, self._doc = name, documentation
        self._counts: dict[str, int] = {}

    def set(self, worker_id: str, count: int) -> None:
        """Record a worker's cumulative count."""
        self._counts[worker_id] = count

    def drop(self, worker_id: str) -> None:
        """Forget a gone worker (its series disappears)."""
        self._counts.pop(worker_id, None)

    def describe(self) -> Iterator[CounterMetricFamily]:
        """The family without samples."""
        yield CounterMetricFamily(self._name, self._doc, labels=["worker_id"])

    def collect(self) -> Iterator[CounterMetricFamily]:
        """The family with one sample per worker."""
        family = CounterMetricFamily(self._name, self._doc, labels=["worker_id"])
        for worker_id, count in sorted(self._counts.items()):
            family.add_metric([worker_id], count)
        yield family


def observe_many(histogram: Histogram, amounts: list[float]) -> None:
    """``histogram.observe(a)`` for every ``a`` in ``amounts`` (seconds), as one increment per touched
    bucket and one of the sum: with N gateway processes each increment is a locked write to the
    process's multiprocess file, and a 128-token request has 127 ITL gaps. The buckets are
    prometheus-client's own (``_upper_bounds``, ``_buckets``, ``_sum`` of the pinned version; a test
    holds this equal to one ``observe`` per amount). An amount goes to the first bucket whose upper
    bound is ≥ it, as ``observe`` does.

    Raises:
        ValueError: ``histogram`` has labels and is not a labelled child (as ``observe`` raises).
    """
    histogram._raise_if_not_observable()
    bounds = histogram._upper_bounds
    # a NaN goes to the sum and no bucket, as ``observe`` does (it is ≤ no bound)
    counts = collections.Counter(bisect.bisect_left(bounds, a) for a in amounts if a == a)
    histogram._sum.inc(sum(amounts))
    for index, count in counts.items():
        histogram._buckets[index].inc(count)


class GatewayMetrics:
    """All gateway metrics; ``render()`` gives the Prometheus text exposition. ``registry`` holds this
    process's own series; with ``multiprocess_dir`` (N gateway processes) ``render`` serves the per-process
    series summed over the processes' files in that directory, and this process's fleet view.

    Raises:
        RuntimeError: ``multiprocess_dir`` is given but prometheus-client was imported without
            ``PROMETHEUS_MULTIPROC_DIR`` set to it (its series would stay in this process's memory).
    """

    def __init__(self, multiprocess_dir: str | None = None) -> None:
        if multiprocess_dir is not None and (
                not getattr(values.ValueClass, "_multiprocess", False)
                or os.environ.get("PROMETHEUS_MULTIPROC_DIR") != multiprocess_dir):
            raise RuntimeError(f"gateway metrics in {multiprocess_dir} need PROMETHEUS_MULTIPROC_DIR set "
                               "to it before prometheus_client is imported")
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdserve_requests", "HTTP requests by endpoint and status "
                                "(not /health, /ready or /metrics)",
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
        self.prefix_prompt_blocks = Counter("pdserve_prefix_prompt_blocks", "full prompt blocks of the "
                                            "requests routed to a prefill or colocated worker", registry=r)
        self.prefix_cached_blocks = Counter("pdserve_prefix_cached_blocks", "leading prompt blocks the "
                                            "chosen prefill or colocated worker had reported cached (KV "
                                            "events) when routed",
                                            registry=r)
        self.decode_prefix_cached_blocks = Counter("pdserve_decode_prefix_cached_blocks", "leading prompt "
                                                   "blocks the chosen decode worker had reported cached (KV "
                                                   "events) when routed: KV it need not receive",
                                                   registry=r)
        self.kv_events = Counter("pdserve_kv_events", "KVEvents applied to the prefix index by kind (delta, "
                                 "snapshot), and gaps (a missed delta: the worker's state unknown until "
                                 "a snapshot); every gateway process applies every worker's events, so "
                                 "with --workers N each event counts N times", ["kind"], registry=r)
        for kind in ("delta", "snapshot", "gap"):
            self.kv_events.labels(kind)
        self.fallbacks = Counter("pdserve_local_prefill_fallbacks", "requests served colocated because "
                                 "prefill/decode workers were missing", registry=r)
        labels = ["worker_id", "role"]
        self.running = FleetGauge("pdserve_worker_running_requests", "requests in the worker's running batch",
                                  labels)
        self.waiting = FleetGauge("pdserve_worker_waiting_requests", "requests waiting in the worker's queue",
                                  labels)
        self.kv_used = FleetGauge("pdserve_kv_blocks_used", "KV blocks in use", labels)
        self.kv_free = FleetGauge("pdserve_kv_blocks_free", "KV blocks free", labels)
        self.kv_total = FleetGauge("pdserve_kv_blocks_capacity", "KV blocks in the worker's pool", labels)
        self.prefix_index_blocks = FleetGauge("pdserve_prefix_index_blocks", "blocks the worker reported in "
                                              "its prefix cache (KV events), as this gateway's prefix index "
                                              "holds them", labels)
        self.kv_transfers = KVTransferCollector()
        self.workers = FleetGauge("pdserve_workers_live", "live workers", ["role"])
        self.worker_deaths = Counter("pdserve_worker_deaths", "workers declared dead or replaced", registry=r)
        self.retries = Counter("pdserve_request_retries", "requests routed again after a worker failed them "
                               "before their first output token, by cause (failed, lost, unreachable)",
                               ["cause"], registry=r)
        self.migrations = Counter("pdserve_request_migrations", "streams continued on another worker after "
                                  "theirs failed mid-stream, by cause (failed, lost, unreachable)",
                                  ["cause"], registry=r)
        for cause in FAILURE_CAUSES:  # series at 0 from the start, so rate() sees the first one
            self.retries.labels(cause)
            self.migrations.labels(cause)
        self.in_flight = Gauge("pdserve_requests_in_flight", "requests being served", registry=r,
                               multiprocess_mode="livesum")
        self.admission_refused = Counter("pdserve_admission_refused", "requests refused at admission by "
                                         "reason (prefill_queue, kv_blocks: 429; prompt_too_long: 400)",
                                         ["reason"], registry=r)
        self.control_auth_refused = Counter("pdserve_control_auth_refused", "handshakes refused by the "
                                            "gateway's CURVE control socket (unknown_key: a client key that "
                                            "is not the fleet's; handshake: no CURVE or a wrong server key; "
                                            "no_handshake: closed before any, e.g. a TCP probe)",
                                            ["kind"], registry=r)
        for kind in REFUSAL_KINDS:
            self.control_auth_refused.labels(kind)
        self.kv_control_refused = WorkerCountCollector(
            "pdserve_kv_control_refused", "peers a decode worker's KV control socket refused (no fleet "
            "CURVE keys, or a sender its gateway never named), as the worker reports them")
        self.kv_path_gbps = FleetGauge("pdserve_kv_path_gbps", "KV data path speed of a prefill/decode pair, "
                                       "GB/s, from its latest canary transfer",
                                       ["prefill", "decode", "transport"])
        self.kv_path_slow = FleetGauge("pdserve_kv_path_slow", "1 when a prefill/decode pair's latest canary "
                                       "was far below the speed of the path its placement allows, else 0",
                                       ["prefill", "decode"])
        fleet: tuple[Collector, ...] = (self.running, self.waiting, self.kv_used, self.kv_free, self.kv_total,
                                         self.prefix_index_blocks,
                                        self.kv_transfers, self.workers, self.kv_control_refused,
                                        self.kv_path_gbps, self.kv_path_slow)
        for collector in fleet:
            r.register(collector)
        self.exposed = r
        if multiprocess_dir is not None:
            self.exposed = CollectorRegistry()
            MultiProcessCollector(self.exposed, multiprocess_dir)
            for collector in fleet:
                self.exposed.register(collector)

    def set_worker_load(self, worker_id: str, role: str, load: WorkerLoad) -> None:
        """Update one worker's series from a heartbeat or registration (counts in requests / blocks;
        the transfer totals are cumulative bytes and seconds, exposed for prefill workers). This and
        ``render`` run on the event loop, so a scrape shows all of one heartbeat's values or none."""
        self.running.labels(worker_id, role).set(load.num_running)
        self.waiting.labels(worker_id, role).set(load.num_waiting)
        self.kv_used.labels(worker_id, role).set(load.num_total_blocks - load.num_free_blocks)
        self.kv_free.labels(worker_id, role).set(load.num_free_blocks)
        self.kv_total.labels(worker_id, role).set(load.num_total_blocks)
        if role == "prefill" or load.kv_transfer_bytes:
            self.kv_transfers.set(worker_id, load.kv_transfer_bytes, load.kv_transfer_seconds)
        if role == "decode" or load.kv_control_refused:
            self.kv_control_refused.set(worker_id, load.kv_control_refused)

    def drop_worker(self, worker_id: str, role: str) -> None:
        """Remove a gone worker's series."""
        for gauge in (self.running, self.waiting, self.kv_used, self.kv_free, self.kv_total,
                      self.prefix_index_blocks):
            with contextlib.suppress(KeyError):
                gauge.remove(worker_id, role)
        self.kv_transfers.drop(worker_id)
        self.kv_control_refused.drop(worker_id)

    def drop_kv_path(self, prefill: str, decode: str, transport: str) -> None:
        """Remove a pair's ``pdserve_kv_path_gbps`` and ``pdserve_kv_path_slow`` series (the pair is gone,
        or its transport changed)."""
        with contextlib.suppress(KeyError):
            self.kv_path_gbps.remove(prefill, decode, transport)
        with contextlib.suppress(KeyError):
            self.kv_path_slow.remove(prefill, decode)

    def observe_tokens(self, arrival: float, token_times: list[float]) -> None:
        """Record TTFT/ITL/TPOT/E2E of a finished request from its token arrival times (seconds)."""
        if not token_times:
            return
        self.ttft.observe(token_times[0] - arrival)
        self.e2e.observe(token_times[-1] - arrival)
        gaps = [b - a for a, b in itertools.pairwise(token_times)]
        if gaps:
            observe_many(self.itl, gaps)
            self.tpot.observe(sum(gaps) / len(gaps))

    def render(self) -> bytes:
        """Prometheus text format (with N gateway processes: the per-process series summed over all)."""
        return generate_latest(self.exposed)
