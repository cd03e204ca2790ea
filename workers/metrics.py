"""A worker's own Prometheus metrics, under vLLM's names, and the numbers they are made of.

Each worker process is one scrape target (``--metrics-port``, served by ``workers.health_server``). The
series carry vLLM's names, types, units and labels (``model_name``: the worker's ``--model``, ``engine``:
"0"), so tools written against a vLLM pod read a pdserve worker unmodified; the names, bucket boundaries
and meanings follow vLLM's v1 Prometheus logger (``vllm/v1/metrics/loggers.py`` and ``stats.py`` in
github.com/vllm-project/vllm). pdserve's own series beside them start with ``pdserve_worker_``.

What a worker counts is what it computed, so a sum over the fleet counts each token once:

* prefill and colocated workers count a request's prompt (``vllm:prompt_tokens``, prefix-cache
  queries and hits and ``vllm:prompt_tokens_cached``, in tokens; ``vllm:request_prefill_kv_computed_tokens``
  per request) when its first token is sampled; a decode worker counts none (the KV arrived from a
  prefill worker);
* ``vllm:generation_tokens`` counts the tokens this worker sampled (a prefill worker: the first token;
  a decode worker: the second on);
* a decode worker counts the prompt KV blocks it received (``pdserve_worker_kv_received_blocks`` and
  ``_bytes``) and those it found in its own prefix cache instead (``pdserve_worker_kv_reused_blocks``)
  when a request's KV has landed;
* per-request times (seconds, ``time.monotonic()``) run from the request's arrival at this worker
  (``Sequence.arrival_time``): queue = arrival → first scheduled; prefill = first scheduled → first
  token; decode = first token → last token; inference = prefill + decode; e2e = arrival → finished.
  On a decode worker the request is "scheduled" and has its first token when its KV has landed and the
  prefill's first token is known (it joins the running batch): its TTFT and queue time then span the
  prefill on the other worker and the KV transfer, and its prefill time is 0. A prefill worker's part of
  a request ends with the first token: it observes e2e there and counts the request as finished with
  ``finished_reason`` "length" when its KV went on to a decode worker (as a vLLM prefill instance run
  with ``max_tokens=1`` does), else with the first token's own reason.
* inter-token latency (``vllm:inter_token_latency_seconds`` and its older name
  ``vllm:time_per_output_token_seconds``, the same numbers) is observed once per engine step with a
  weight: every token of the step that was not its request's first gets the time since the previous
  step that produced tokens (or, on an idle decode worker, since a request joined). In continuous
  batching every running request gets one token per step, so this is each token's own interval, at one
  histogram update per step instead of one per token. A request resumed after preemption is the
  exception: its first token after the recompute is counted with the step interval, not its stall.
* the host KV tier (``--kv-host-cache-gib``, engine/kv_host_tier.py), read at scrape time from its
  counters, zero without a tier: ``pdserve_worker_kv_host_hit_blocks`` (blocks a prefix lookup took from
  the tier; their tokens also count in ``vllm:prefix_cache_hits``), ``pdserve_worker_kv_host_bytes``
  with ``direction`` ``to_host`` (evicted blocks saved) and ``to_device`` (hits copied back),
  ``pdserve_worker_kv_host_evictions`` (blocks the full tier dropped), and the gauges
  ``pdserve_worker_kv_host_blocks`` / ``pdserve_worker_kv_host_capacity_blocks``;
* ``vllm:num_requests_running`` / ``_waiting`` and ``vllm:kv_cache_usage_perc`` (a fraction, 1 = all
  blocks in use) are read from the worker's load at scrape time; ``vllm:num_preemptions`` from the
  scheduler's counter. A request the gateway aborts while this worker holds it counts in
  ``vllm:request_success{finished_reason="abort"}`` (not in the latency histograms), except one the
  gateway ended at a stop string it matched (``AbortRequest.stop_string``): that one finished, with
  reason ``stop`` and its latencies, as in vLLM, which matches stop strings in the engine; a failed
  request (``RequestFailed``) is not counted.

* ``vllm:iteration_tokens_total`` (vLLM's name, type, buckets and count: "tokens per engine step") is
  observed once per engine step that sampled a token, as vLLM's ``IterationStats`` counts it
  (``num_prompt_tokens + num_generation_tokens``): the prompt tokens of the requests whose first token
  this worker sampled in the step (their whole prompts, cached tokens included; a decode worker samples
  no first token) plus the tokens the step sampled. A step that only ran prompt chunks is not observed.
* ``pdserve_worker_prefill_tokens_per_second`` (prefill and colocated workers; 0 on decode workers): the
  prefill rate this worker reports in its heartbeats (``prefill_rate``, protocol/prefill_rate.py: prompt
  tokens computed per busy second from each request's arrival to its first token, over the first tokens
  sampled while other requests waited, seeded by the start-up probe), read at scrape time.
* ``pdserve_worker_kv_sent_bytes`` (prefill workers) counts the KV of each transfer that completed, as
  blocks x ``KVCachePool.bytes_per_block`` (whole blocks: a prompt's last block counts in full; only the
  blocks sent, not those the decode worker had cached). Canary transfers are not counted.

The engine loop pays one ``time.monotonic()`` and a few counter updates per step, and a few histogram
updates per request at its first token and at its end.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol.prefill_rate import PrefillRate

# no ``<name>_created`` series beside each counter and histogram (as vLLM's server turns them off): they
# would double the series count, and no dashboard or scheduler reads them
disable_created_metrics()

if TYPE_CHECKING:
    from engine.kv_host_tier import HostTierStats
    from engine.sequence import Sequence
    from protocol.messages import WorkerLoad

LABELS = ("model_name", "engine")
# vLLM's bucket boundaries (seconds), so histogram_quantile over a mixed vLLM/pdserve fleet agrees
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_INTERVAL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                          10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's ITERATION_TOKENS_BUCKETS (tokens per engine step: powers of two up to a large step budget)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISHED_REASONS = ("stop", "length", "abort")


def token_count_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (tokens; vLLM's buckets of per-request token counts)."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


class WeightedHistogram(Collector):
    """A Prometheus histogram whose ``observe`` takes a count: ``n`` observations of one value cost one
    update (``Histogram.observe`` would cost ``n``). Thread-safe; exposed by ``collect``.

    Args:
        name / documentation: as for ``prometheus_client.Histogram`` (``name`` without ``_bucket``).
        label_values: the values of ``LABELS``.
        buckets: the finite upper bounds, increasing (``+Inf`` is added).
    """

    def __init__(self, name: str, documentation: str, label_values: tuple[str, ...],
                 buckets: tuple[float, ...]) -> None:
        self.name, self.documentation, self.label_values = name, documentation, label_values
        self.bounds = tuple(buckets)
        self._counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; last: above every bound
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, n: int = 1) -> None:
        """Record ``n`` (>= 0) observations of ``value``."""
        if n <= 0:
            return
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[i] += n
            self._sum += value * n

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, float("inf")), counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        family = HistogramMetricFamily(self.name, self.documentation, labels=LABELS)
        family.add_metric(list(self.label_values), buckets, total)
        yield family


@dataclass(frozen=True)
class _Timeline:
    """Where a request is on this worker: ``scheduled`` and ``first_token`` in ``time.monotonic()`` s."""

    scheduled: float
    first_token: float


class _ScrapeTime(Collector):
    """Series read from the worker when scraped (no cost in the engine loop)."""

    def __init__(self, label_values: tuple[str, ...], load: Callable[[], WorkerLoad],
                 preemptions: Callable[[], int], loop_age: Callable[[], float | None],
                 registered: Callable[[], bool]) -> None:
        self.label_values, self.load, self.preemptions = label_values, load, preemptions
        self.loop_age, self.registered = loop_age, registered

    def collect(self) -> Iterator[Metric]:
        load, labels = self.load(), list(self.label_values)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(labels, value)
            return family

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    load.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed (for KV blocks, "
                    "for their KV to land, or to be scheduled).", load.num_waiting)
        used = (1.0 - load.num_free_blocks / load.num_total_blocks) if load.num_total_blocks else 0.0
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", used)
        preempted = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemption from the "
                                        "engine.", labels=LABELS)
        preempted.add_metric(labels, self.preemptions())
        yield preempted
        age = self.loop_age()
        yield gauge("pdserve_worker_engine_loop_age_seconds", "Seconds since the engine loop last ticked "
                    "(-1 before it started).", -1.0 if age is None else age)
        yield gauge("pdserve_worker_prefill_tokens_per_second", "Prefill rate this worker reports to "
                    "gateways: prompt tokens computed per busy second (0: not measured).",
                    load.prefill_tokens_per_s)
        yield gauge("pdserve_worker_registered", "1 while some gateway accepts this worker.",
                    float(self.registered()))


class _HostTierSeries(Collector):
    """The host KV tier's counters and size, read when scraped (zero without a tier)."""

    def __init__(self, label_values: tuple[str, ...], stats: Callable[[], HostTierStats | None]) -> None:
        self.label_values, self.stats = label_values, stats

    def collect(self) -> Iterator[Metric]:
        stats, labels = self.stats(), list(self.label_values)
        hits = saved = loaded = evictions = used = capacity = 0
        if stats is not None:
            hits, evictions = stats.hits, stats.evictions
            saved, loaded = stats.saved_bytes, stats.loaded_bytes
            used, capacity = stats.used_blocks, stats.capacity_blocks
        family = CounterMetricFamily("pdserve_worker_kv_host_hit_blocks", "KV blocks a prefix lookup took "
                                     "from the host KV tier (copied back instead of recomputed).",
                                     labels=LABELS)
        family.add_metric(labels, hits)
        yield family
        moved = CounterMetricFamily("pdserve_worker_kv_host_bytes", "Bytes copied between the KV cache and "
                                    "the host KV tier, by direction (to_host: evicted blocks saved; "
                                    "to_device: hits copied back).", labels=(*LABELS, "direction"))
        moved.add_metric([*labels, "to_host"], saved)
        moved.add_metric([*labels, "to_device"], loaded)
        yield moved
        dropped = CounterMetricFamily("pdserve_worker_kv_host_evictions", "KV blocks the full host KV tier "
                                      "dropped (least recently used) to make room.", labels=LABELS)
        dropped.add_metric(labels, evictions)
        yield dropped
        for name, doc, value in (
                ("pdserve_worker_kv_host_blocks", "KV blocks the host KV tier holds.", used),
                ("pdserve_worker_kv_host_capacity_blocks",
                 "KV blocks the host KV tier can hold (0: no tier).", capacity)):
            gauge = GaugeMetricFamily(name, doc, labels=LABELS)
            gauge.add_metric(labels, value)
            yield gauge


class WorkerMetrics:
    """The worker's metrics in its own registry (``registry``; serve it with
    ``prometheus_client.generate_latest``). Event methods are called from the worker's loop thread with
    ``now`` = ``time.monotonic()`` seconds.

    Args:
        model_name: the ``model_name`` label (the worker's ``--model``).
        max_model_len: tokens; bounds the per-request token-count buckets.
    """

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.label_values = (model_name, "0")
        self._timelines: weakref.WeakKeyDictionary[Sequence, _Timeline] = weakref.WeakKeyDictionary()
        self._last_token_at: float | None = None
        self._firsts_in_step = 0  # first tokens sampled in the step being reported (see ``step``)
        self._prompts_in_step = 0  # their prompt tokens (``vllm:iteration_tokens_total``)
        self.prefill_rate = PrefillRate()  # over the prompts computed here (first_token, then step)
        self._computed_in_step: list[tuple[int, float]] = []  # (computed prompt tokens, arrival) this step
        self._queue_waiting: Callable[[], bool] = lambda: True  # watch_queue
        reg, lv = self.registry, self.label_values

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=reg).labels(*lv)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=reg, buckets=tuple(buckets)).labels(*lv)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          (*LABELS, "finished_reason"), registry=reg)
        self.request_success = {r: success.labels(*lv, r) for r in FINISHED_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in "
                              "seconds.", TTFT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in "
                             "seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase "
                               "for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL "
                                 "phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase "
                                "for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds", "Histogram of time spent in "
                                   "RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds", "Histogram of "
                                      "time_per_output_token_seconds per request.", TOKEN_INTERVAL_BUCKETS)
        counts = token_count_buckets(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens "
                                               "processed.", counts)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens", "Number of generation "
                                                   "tokens processed.", counts)
        self.request_computed_tokens = histogram("vllm:request_prefill_kv_computed_tokens", "Prompt tokens "
                                                 "whose KV this worker computed per request (not cached).",
                                                 counts)
        self.kv_received_blocks = counter("pdserve_worker_kv_received_blocks", "Decode worker: prompt KV "
                                          "blocks received from prefill workers (requests whose KV landed).")
        self.kv_received_bytes = counter("pdserve_worker_kv_received_bytes", "Decode worker: bytes of the "
                                         "prompt KV blocks received from prefill workers (all layers, K and "
                                         "V).")
        self.kv_reused_blocks = counter("pdserve_worker_kv_reused_blocks", "Decode worker: prompt KV blocks "
                                        "found in its own prefix cache, so not received.")
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per "
                                          "engine_step.", ITERATION_TOKENS_BUCKETS)
        self.request_max_tokens = histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens "
                                            "request parameter.", counts)
        self.request_max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", counts)
        self.itl = WeightedHistogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency "
                                     "in seconds.", lv, TOKEN_INTERVAL_BUCKETS)
        self.tpot = WeightedHistogram("vllm:time_per_output_token_seconds", "Histogram of time per output "
                                      "token in seconds (the same as vllm:inter_token_latency_seconds).", lv,
                                      TOKEN_INTERVAL_BUCKETS)
        reg.register(self.itl)
        reg.register(self.tpot)
        self.kv_sent_bytes = counter("pdserve_worker_kv_sent_bytes", "KV bytes this worker sent to decode "
                                     "workers (transfers that completed; blocks x bytes per block).")

    def watch(self, load: Callable[[], WorkerLoad], preemptions: Callable[[], int],
              loop_age: Callable[[], float | None], registered: Callable[[], bool]) -> None:
        """Register the series read at scrape time: the worker's load (running, waiting, KV blocks), the
        scheduler's preemption count, the engine loop's age (seconds) and whether the gateway accepted
        the worker. Call once."""
        self.registry.register(_ScrapeTime(self.label_values, load, preemptions, loop_age, registered))

    def watch_queue(self, waiting: Callable[[], bool]) -> None:
        """``waiting()``: whether requests wait to be scheduled now (read after a step); ``prefill_rate``
        counts the first tokens of a step that batched several prompts or after which some waited
        (protocol/prefill_rate.py). Unwatched: every first token."""
        self._queue_waiting = waiting

    def watch_host_tier(self, stats: Callable[[], HostTierStats | None]) -> None:
        """Register the host KV tier's series, read from ``stats`` at scrape time (None: no tier, zeros).
        Call once."""
        self.registry.register(_HostTierSeries(self.label_values, stats))

    def first_token(self, seq: Sequence, now: float, *, computed_prompt: bool = True) -> None:
        """``seq`` got its first token on this worker at ``now``: TTFT; with ``computed_prompt`` (a prefill
        or colocated worker: the token was sampled here, in the step ``step`` reports next) its prompt
        tokens and prefix-cache queries / hits (in tokens)."""
        scheduled = seq.first_scheduled_time if seq.first_scheduled_time is not None else now
        self._timelines[seq] = _Timeline(scheduled, now)
        self.ttft.observe(max(now - seq.arrival_time, 0.0))
        if computed_prompt:
            self._computed_in_step.append((seq.num_prompt_tokens - seq.num_cached_tokens, seq.arrival_time))
            self._firsts_in_step += 1
            self._prompts_in_step += seq.num_prompt_tokens
            self.prompt_tokens.inc(seq.num_prompt_tokens)
            self.prefix_cache_queries.inc(seq.num_prompt_tokens)
            if seq.num_cached_tokens:
                self.prefix_cache_hits.inc(seq.num_cached_tokens)
                self.prompt_tokens_cached.inc(seq.num_cached_tokens)
            self.request_computed_tokens.observe(seq.num_prompt_tokens - seq.num_cached_tokens)

    def joined(self, seq: Sequence, now: float, *, batch_was_empty: bool) -> None:
        """Decode worker: ``seq``'s KV landed and its first token (sampled by the prefill worker) is known;
        it joins the running batch at ``now`` (its schedule and first-token time here). With
        ``batch_was_empty`` the next step's inter-token latency counts from ``now``."""
        self.first_token(seq, now, computed_prompt=False)
        if batch_was_empty:
            self._last_token_at = now

    def kv_received(self, num_received: int, num_reused: int, bytes_per_block: int) -> None:
        """Decode worker: a request's prompt KV is complete here, ``num_received`` blocks of it sent by its
        prefill worker and ``num_reused`` found in this worker's prefix cache; ``bytes_per_block``: bytes of
        one block over every layer, K and V."""
        self.kv_received_blocks.inc(num_received)
        self.kv_received_bytes.inc(num_received * bytes_per_block)
        self.kv_reused_blocks.inc(num_reused)

    def step(self, num_sampled: int, now: float) -> None:
        """One engine step sampled ``num_sampled`` tokens at ``now`` (reported after its requests'
        ``first_token`` / ``finished``): generation tokens, and each token that was not its request's first
        gets the time since the previous step that sampled (one weighted update); the step's tokens as vLLM
        counts them (``vllm:iteration_tokens_total``: its first tokens' prompts + the tokens sampled)."""
        num_later, self._firsts_in_step = num_sampled - self._firsts_in_step, 0
        prompts, self._prompts_in_step = self._prompts_in_step, 0
        computed, self._computed_in_step = self._computed_in_step, []
        if computed:  # one verdict for the step: others waited, or it batched several prompts
            count = len(computed) > 1 or self._queue_waiting()
            for tokens, arrival in computed:
                self.prefill_rate.observe(tokens, arrival, now, count=count)
        if num_sampled <= 0:
            return
        self.iteration_tokens.observe(prompts + num_sampled)
        self.generation_tokens.inc(num_sampled)
        if num_later > 0 and self._last_token_at is not None:
            interval = max(now - self._last_token_at, 0.0)
            self.itl.observe(interval, num_later)
            self.tpot.observe(interval, num_later)
        self._last_token_at = now

    def aborted(self) -> None:
        """The gateway aborted a request this worker held (before its part here ended)."""
        self.request_success["abort"].inc()

    def ended_by_gateway(self, seq: Sequence | None, stop_string: bool, now: float) -> None:
        """The gateway ended a request this worker held (``AbortRequest``): at a stop string it matched
        (``stop_string``, ``seq`` running here) it finished with reason ``stop`` at ``now`` (``finished``),
        otherwise it was aborted (``aborted``)."""
        if stop_string and seq is not None:
            self.finished(seq, "stop", now)
        else:
            self.aborted()

    def finished(self, seq: Sequence, reason: str, now: float) -> None:
        """``seq``'s part on this worker ended at ``now`` with ``reason`` (stop, length): request_success and
        the per-request histograms."""
        timeline = self._timelines.pop(seq, None)
        if timeline is None:  # ended without a first token here (never seen by first_token / joined)
            timeline = _Timeline(seq.first_scheduled_time or now, now)
        counter = self.request_success.get(reason)
        if counter is not None:
            counter.inc()
        self.e2e.observe(max(now - seq.arrival_time, 0.0))
        self.queue.observe(max(timeline.scheduled - seq.arrival_time, 0.0))
        self.prefill.observe(max(timeline.first_token - timeline.scheduled, 0.0))
        decode = max(now - timeline.first_token, 0.0)
        self.decode.observe(decode)
        self.inference.observe(max(now - timeline.scheduled, 0.0))
        if seq.num_output_tokens > 1:
            self.request_tpot.observe(decode / (seq.num_output_tokens - 1))
        self.request_prompt_tokens.observe(seq.num_prompt_tokens)
        self.request_generation_tokens.observe(seq.num_output_tokens)
        # one choice per worker request: the largest max_tokens of its group is its own
        self.request_max_tokens.observe(seq.sampling_params.max_tokens)
        self.request_max_generation_tokens.observe(seq.sampling_params.max_tokens)
