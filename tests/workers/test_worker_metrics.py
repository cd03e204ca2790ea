"""A worker's own metrics (workers/metrics.py) and probes (workers/health_server.py), in-process.

A colocated worker on the tiny random-weight model serves two requests; its registry, parsed as
Prometheus text, must count what was sent (prompt tokens, tokens generated, one TTFT and one e2e per
request, the inter-token intervals) and show the queue as it was. The weighted histogram matches
prometheus-client's own. ``/health`` and ``/live`` follow a fake clock: 503 once the engine loop has
not ticked for longer than the stall timeout, ``/health`` also before registration. Ends with the leak
check."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from protocol.messages import ColocatedRequest, RequestFinished
from tests.workers.helpers import assert_clean, close, colocated_worker, of_type, pump, run, wire
from workers.health_server import EngineHealth, HealthServer
from workers.metrics import TOKEN_INTERVAL_BUCKETS, WeightedHistogram, token_count_buckets

PROMPTS = (list(range(50, 63)), list(range(70, 80)))  # 13 and 10 tokens
MAX_TOKENS = 5


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``registry`` as exposed: (name, sorted labels) → value."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """The one sample ``name`` whose labels include ``labels`` (KeyError when not exactly one)."""
    hits = [v for (n, ls), v in found.items() if n == name and set(labels.items()) <= set(ls)]
    if len(hits) != 1:
        raise KeyError(f"{name}{labels}: {len(hits)} samples")
    return hits[0]


def test_colocated_worker_metrics_follow_its_requests(model_dir: Any) -> None:
    w = colocated_worker(model_dir, max_num_batched_tokens=8)  # one prompt chunk per step
    try:
        reqs = [ColocatedRequest(request_id=f"r{i}", prompt_token_ids=p,
                                 sampling=wire(MAX_TOKENS, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
        before = samples(w.metrics.registry)
        assert value(before, "vllm:num_requests_running") == 0
        assert value(before, "vllm:time_to_first_token_seconds_count") == 0
        msgs: list[Any] = run(w, *reqs)  # first step: r0's first 8 prompt tokens; r1 waits
        mid = samples(w.metrics.registry)
        assert value(mid, "vllm:num_requests_running") == 1
        assert value(mid, "vllm:num_requests_waiting") == 1
        assert 0 < value(mid, "vllm:kv_cache_usage_perc") < 1
        pump([w], lambda: len(of_type(msgs, RequestFinished)) == len(reqs), sink=msgs)
        after = samples(w.metrics.registry)
        n = len(reqs)
        assert value(after, "vllm:prompt_tokens_total") == sum(map(len, PROMPTS))
        assert value(after, "vllm:prefix_cache_queries_total") == sum(map(len, PROMPTS))
        assert value(after, "vllm:generation_tokens_total") == n * MAX_TOKENS
        assert value(after, "vllm:time_to_first_token_seconds_count") == n
        assert value(after, "vllm:e2e_request_latency_seconds_count") == n
        assert value(after, "vllm:request_queue_time_seconds_count") == n
        # r1 waited for r0's prompt chunks: a queue time above zero
        assert value(after, "vllm:request_queue_time_seconds_sum") > 0
        assert value(after, "vllm:request_success_total", finished_reason="length") == n
        assert value(after, "vllm:request_success_total", finished_reason="stop") == 0
        later = n * (MAX_TOKENS - 1)  # every token but each request's first has an inter-token interval
        assert value(after, "vllm:inter_token_latency_seconds_count") == later
        assert value(after, "vllm:time_per_output_token_seconds_count") == later
        assert value(after, "vllm:inter_token_latency_seconds_sum") > 0
        assert value(after, "vllm:request_generation_tokens_sum") == n * MAX_TOKENS
        assert value(after, "vllm:num_requests_running") == 0
        assert value(after, "vllm:num_requests_waiting") == 0
        assert value(after, "vllm:kv_cache_usage_perc") == 0
        assert value(after, "vllm:num_preemptions_total") == 0
        # tokens per engine step as vLLM counts them: each first token's whole prompt, then every token
        # sampled, observed once per step that sampled (MAX_TOKENS steps at least: one per decode round)
        assert value(after, "vllm:iteration_tokens_total_sum") == sum(map(len, PROMPTS)) + n * MAX_TOKENS
        steps = value(after, "vllm:iteration_tokens_total_count")
        assert MAX_TOKENS <= steps <= n * MAX_TOKENS
        # the steps with a first token carry its prompt (10 or 13 tokens + 1): above the 8 bucket
        assert value(after, "vllm:iteration_tokens_total_bucket", le="8.0") <= steps - 1
        assert value(after, "pdserve_worker_kv_sent_bytes_total") == 0  # colocated: no KV moves
        assert value(after, "pdserve_worker_kv_received_bytes_total") == 0
        # every latency histogram reaches past 60 s
        for name in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                     "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                     "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"):
            bounds = {float(dict(ls)["le"]) for (nm, ls), _ in after.items() if nm == name + "_bucket"}
            assert max(b for b in bounds if b != float("inf")) > 60, name
        assert {dict(ls)["model_name"] for (_, ls) in after if "model_name" in dict(ls)} == {str(model_dir)}
        assert_clean(w)
    finally:
        close(w)


def test_weighted_histogram_equals_one_observe_per_value() -> None:
    reference = CollectorRegistry()
    plain = Histogram("h", "doc", ("model_name", "engine"), registry=reference,
                      buckets=TOKEN_INTERVAL_BUCKETS).labels("m", "0")
    weighted_registry = CollectorRegistry()
    weighted = WeightedHistogram("h", "doc", ("m", "0"), TOKEN_INTERVAL_BUCKETS)
    weighted_registry.register(weighted)
    for v, n in ((0.01, 3), (0.02, 1), (0.5, 4), (100.0, 2), (0.0, 1), (7.5, 0)):
        weighted.observe(v, n)
        for _ in range(n):
            plain.observe(v)
    got, want = samples(weighted_registry), samples(reference)
    want = {k: v for k, v in want.items() if not k[0].endswith("_created")}
    assert got == want
    assert value(got, "h_count") == 11


def test_token_count_buckets() -> None:
    assert token_count_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_count_buckets(1) == (1,)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_health_follows_the_engine_loop_and_registration() -> None:
    clock = FakeClock()
    health = EngineHealth(stall_timeout_s=30.0, clock=clock)
    server = HealthServer("127.0.0.1", 0, CollectorRegistry(), health).start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        def status(path: str) -> int:
            return httpx.get(base + path, timeout=5, trust_env=False).status_code

        assert (status("/live"), status("/health")) == (503, 503)  # the engine loop has not started
        health.tick()
        assert (status("/live"), status("/health")) == (200, 503)  # ticking, not registered
        health.registered = True
        assert (status("/live"), status("/health")) == (200, 200)
        clock.now += 29.0
        assert status("/health") == 200
        clock.now += 2.0  # 31 s since the last tick: stalled
        assert (status("/live"), status("/health")) == (503, 503)
        assert "engine loop stalled" in httpx.get(base + "/health", timeout=5, trust_env=False).text
        health.tick()
        assert status("/health") == 200
        assert status("/metrics") == 200 and status("/other") == 404
    finally:
        server.stop()


def test_stall_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="engine-stall-timeout"):
        EngineHealth(0.0)


@pytest.mark.parametrize(("kw", "flag"), [({"metrics_port": 70000}, "--metrics-port"),
                                          ({"metrics_port": 7200, "port": 7200}, "--metrics-port"),
                                          ({"engine_stall_timeout": 0.0}, "--engine-stall-timeout")])
def test_bad_metrics_settings_name_their_flag(kw: dict[str, Any], flag: str) -> None:
    from protocol.settings import WorkerSettings

    with pytest.raises(ValueError, match=flag):
        WorkerSettings(role="decode", insecure_control_plane=True, **kw)


def test_worker_serves_exactly_the_listed_metrics(model_dir: Any) -> None:
    """``deploy/metrics.yaml`` ``worker_metrics`` lists exactly what a worker exposes: name (counters with
    ``_total``), type and label names."""
    import yaml

    from tests.deploy.common import DEPLOY

    listed = {m["name"]: (m["type"], set(m["labels"]))
              for m in yaml.safe_load((DEPLOY / "metrics.yaml").read_text())["worker_metrics"]}
    w = colocated_worker(model_dir)
    try:
        served = {}
        for family in text_string_to_metric_families(generate_latest(w.metrics.registry).decode()):
            assert not family.name.endswith("_created"), family.name  # off, as in vLLM: no extra series
            name = family.name + "_total" if family.type == "counter" else family.name
            labels = {k for s in family.samples for k in s.labels if k not in ("le", "quantile")}
            served[name] = (family.type, labels)
    finally:
        close(w)
    assert served == listed


# What inference-perf's vLLM collector reads (PyPI inference-perf 0.7.0,
# inference_perf/client/modelserver/vllm_client.py, get_prometheus_metric_metadata: each metric queried
# with the filter model_name='<model>'; counters as <name>_total or <name>, histograms through _sum, _count
# and _bucket, gauges as named: inference_perf/client/modelserver/metrics/{counter,histogram,gauge}/base.py).
# Run live (Python >= 3.12 venv with inference-perf, a Prometheus binary; not in CI):
# bench/serving/inference_perf.py, figures in docs/benchmarks/serving.md.
INFERENCE_PERF_VLLM = {
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:num_requests_waiting": "gauge",
    "vllm:request_time_per_output_token_seconds": "histogram", "vllm:num_requests_running": "gauge",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_hits": "counter", "vllm:prefix_cache_queries": "counter",
    "vllm:request_queue_time_seconds": "histogram", "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram", "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram", "vllm:iteration_tokens_total": "histogram",
    "vllm:prompt_tokens_cached": "counter", "vllm:external_prefix_cache_hits": "counter",
    "vllm:external_prefix_cache_queries": "counter", "vllm:mm_cache_hits": "counter",
    "vllm:mm_cache_queries": "counter", "vllm:corrupted_requests": "counter",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
    "vllm:kv_block_idle_before_evict_seconds": "histogram", "vllm:kv_block_lifetime_seconds": "histogram",
    "vllm:kv_block_reuse_gap_seconds": "histogram",
}
# read by inference-perf but not served by a pdserve worker, and why
NOT_SERVED = {
    "vllm:request_params_n": "a worker request is one choice; n is the gateway's",
    "vllm:external_prefix_cache_hits": "no external (connector) KV cache",
    "vllm:external_prefix_cache_queries": "no external (connector) KV cache",
    "vllm:mm_cache_hits": "no multimodal input", "vllm:mm_cache_queries": "no multimodal input",
    "vllm:corrupted_requests": "vLLM serves it only with VLLM_COMPUTE_NANS_IN_LOGITS=1",
    "vllm:kv_block_idle_before_evict_seconds": "vLLM serves it only with --kv-cache-metrics",
    "vllm:kv_block_lifetime_seconds": "vLLM serves it only with --kv-cache-metrics",
    "vllm:kv_block_reuse_gap_seconds": "vLLM serves it only with --kv-cache-metrics",
}


def test_worker_serves_what_inference_perf_vllm_collector_reads(model_dir: Any) -> None:
    """After one request, every metric inference-perf's vLLM collector queries has the series its
    queries select (model_name = the worker's model), except ``NOT_SERVED``, of which none is served."""
    w = colocated_worker(model_dir)
    try:
        msgs: list[Any] = run(w, ColocatedRequest(request_id="r", prompt_token_ids=PROMPTS[0],
                                                  sampling=wire(3, ignore_eos=True)))
        pump([w], lambda: bool(of_type(msgs, RequestFinished)), sink=msgs)
        found = samples(w.metrics.registry)
        assert_clean(w)
    finally:
        close(w)
    model = {"model_name": str(model_dir)}
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_sum", "_count", "_bucket")}
    names = {n for n, _ in found}
    for name, kind in INFERENCE_PERF_VLLM.items():
        if name in NOT_SERVED:
            assert not any(n.startswith(name) for n in names), f"{name} is served: drop it from NOT_SERVED"
            continue
        for suffix in suffixes[kind]:
            assert any(n == name + suffix and set(model.items()) <= set(ls) for n, ls in found), name + suffix
    assert value(found, "vllm:request_time_per_output_token_seconds_count") == 1


def test_abort_of_a_held_request_counts_once(model_dir: Any) -> None:
    from protocol.messages import AbortRequest, NextToken

    w = colocated_worker(model_dir)
    try:
        msgs: list[Any] = run(w, ColocatedRequest(request_id="r", prompt_token_ids=PROMPTS[1],
                                                  sampling=wire(50, ignore_eos=True)))
        pump([w], lambda: bool(of_type(msgs, NextToken)), sink=msgs)  # decoding now
        run(w, AbortRequest(request_id="r"))
        run(w, AbortRequest(request_id="r"))  # no longer held: not counted again
        found = samples(w.metrics.registry)
        assert value(found, "vllm:request_success_total", finished_reason="abort") == 1
        assert value(found, "vllm:e2e_request_latency_seconds_count") == 0
        assert_clean(w)
    finally:
        close(w)


def test_a_request_the_gateway_ended_at_a_stop_string_counts_as_stop(model_dir: Any) -> None:
    """The gateway matches stop strings and then aborts the request at the worker (``stop_string``): the
    worker counts it finished with reason stop, latencies included, as vLLM does; not as an abort."""
    from protocol.messages import AbortRequest, NextToken

    w = colocated_worker(model_dir)
    try:
        msgs: list[Any] = run(w, ColocatedRequest(request_id="r", prompt_token_ids=PROMPTS[1],
                                                  sampling=wire(50, ignore_eos=True)))
        pump([w], lambda: bool(of_type(msgs, NextToken)), sink=msgs)  # decoding now
        run(w, AbortRequest(request_id="r", stop_string=True))
        run(w, AbortRequest(request_id="r", stop_string=True))  # no longer held: not counted again
        found = samples(w.metrics.registry)
        assert value(found, "vllm:request_success_total", finished_reason="stop") == 1
        assert value(found, "vllm:request_success_total", finished_reason="abort") == 0
        assert value(found, "vllm:e2e_request_latency_seconds_count") == 1
        assert_clean(w)
    finally:
        close(w)


def test_the_prefill_rate_a_worker_reports_starts_at_its_probe_and_follows_prompts(model_dir: Any) -> None:
    """``probe_core`` times throw-away prompts on a prefill or colocated worker's engine (none on a decode
    worker's); the rate seeds the load its registration and heartbeats carry, and each prompt computed
    afterwards while others waited moves it, one that found no queue does not (protocol/prefill_rate.py);
    the gauge shows the reported value."""
    from tests.workers.helpers import decode_worker, settings
    from workers.boot import probe_core

    w = colocated_worker(model_dir, max_num_seqs=1)  # one request at a time: the others wait
    d = decode_worker(model_dir)
    try:
        assert w.registration().load.prefill_tokens_per_s == 0  # not measured yet
        assert probe_core(settings("decode", "d0", model_dir), d.core) is None
        assert d.load().prefill_tokens_per_s == 0
        probe = probe_core(settings("colocated", "c0", model_dir), w.core)
        assert probe is not None and probe.tokens > 0 and probe.seconds > 0
        w.core.check_no_leaks()
        w.seed_prefill_rate(probe.tokens, probe.seconds, probe.ended)
        seeded = w.registration().load
        assert seeded.prefill_tokens_per_s == pytest.approx(probe.tokens / probe.seconds)
        assert seeded.prefill_largest_tokens == probe.tokens
        assert value(samples(w.metrics.registry), "pdserve_worker_prefill_tokens_per_second") \
            == pytest.approx(seeded.prefill_tokens_per_s)
        rate = w.metrics.prefill_rate
        msgs: list[Any] = run(w, ColocatedRequest(request_id="alone", prompt_token_ids=list(range(50, 70)),
                                                  sampling=wire(2, ignore_eos=True)))
        pump([w], lambda: len(of_type(msgs, RequestFinished)) == 1, sink=msgs)
        assert rate.tokens == probe.tokens and rate.last_first_token > probe.ended  # no queue: not counted
        prompts = [list(range(start, start + n)) for start, n in ((10, 30), (40, 40), (80, 50))]  # no hits
        msgs = run(w, *(ColocatedRequest(request_id=f"q{i}", prompt_token_ids=p,
                                         sampling=wire(2, ignore_eos=True)) for i, p in enumerate(prompts)))
        pump([w], lambda: len(of_type(msgs, RequestFinished)) == 3, sink=msgs)
        # q0 and q1 got their first tokens while others waited; q2 found no queue
        assert rate.tokens == pytest.approx(probe.tokens * 0.95 ** 2 + 30 * 0.95 + 40)  # DECAY
        served = w.load()
        assert served.prefill_tokens_per_s == pytest.approx(rate.tokens / rate.seconds)
        assert served.prefill_largest_tokens == round(max(probe.tokens * 0.95 ** 2, 40))
        assert value(samples(w.metrics.registry), "pdserve_worker_prefill_tokens_per_second") \
            == pytest.approx(served.prefill_tokens_per_s)
        assert_clean(w)
    finally:
        close(w)
        close(d)


def test_the_backlog_a_worker_reports_is_the_prompt_tokens_it_still_has_to_compute(model_dir: Any) -> None:
    """``prefill_backlog`` (the heartbeat's ``prefill_backlog_tokens``): per request without a first
    token, its prompt minus the prefix its gateway expected cached until it is scheduled, then minus what
    is computed; 0 once every first token is out; a decode worker has none."""
    from protocol.messages import FirstToken, PrefillRequest
    from tests.workers.helpers import decode_worker, prefill_worker

    p = prefill_worker(model_dir, max_num_batched_tokens=8)  # one 8-token chunk per step
    c = colocated_worker(model_dir, max_num_batched_tokens=8)
    d = decode_worker(model_dir)
    try:
        assert p.prefill_backlog() == c.prefill_backlog() == d.prefill_backlog() == 0
        prompts = [list(range(50, 70)), list(range(80, 92))]  # 20 and 12 tokens
        for i, prompt in enumerate(prompts):  # applied as the loop applies them, no step yet
            p.on_message(PrefillRequest(request_id=f"p{i}", prompt_token_ids=prompt, sampling=wire(1),
                                        expected_cached_tokens=4 * i))
            c.on_message(ColocatedRequest(request_id=f"c{i}", prompt_token_ids=prompt,
                                          sampling=wire(3, ignore_eos=True), expected_cached_tokens=4 * i))
        assert p.prefill_backlog() == c.prefill_backlog() == 20 + (12 - 4)
        msgs: list[Any] = run(p)  # first step: p0's first 8 tokens (nothing cached: the hint was 0)
        assert p.prefill_backlog() == p.heartbeat_load().prefill_backlog_tokens == (20 - 8) + (12 - 4)
        pump([p], lambda: len(of_type(msgs, FirstToken)) == 2, sink=msgs)
        assert p.prefill_backlog() == p.heartbeat_load().prefill_backlog_tokens == 0
        out: list[Any] = []
        pump([c], lambda: len(of_type(out, FirstToken)) == 2, sink=out)
        assert c.prefill_backlog() == c.heartbeat_load().prefill_backlog_tokens == 0  # decoding: no backlog
        pump([c], lambda: len(of_type(out, RequestFinished)) == 2, sink=out)
        assert_clean(p, c)
    finally:
        for w in (p, c, d):
            close(w)


def test_a_heartbeat_counts_the_requests_received_during_a_step(model_dir: Any) -> None:
    """Requests that arrive while a step runs wait in the inbox until it ends; the heartbeat sent meanwhile
    counts their prompts (minus the prefix expected cached) in ``prefill_backlog_tokens``."""
    from protocol.messages import PrefillRequest
    from tests.workers.helpers import prefill_worker

    p = prefill_worker(model_dir)
    try:
        p.deliver(PrefillRequest(request_id="r0", prompt_token_ids=list(range(50, 70)), sampling=wire(1),
                                 expected_cached_tokens=8))
        assert p.load().prefill_backlog_tokens == 0 and p.heartbeat_load().prefill_backlog_tokens == 20 - 8
        p.run_once()
        p.take_outbox()
        assert p.heartbeat_load().prefill_backlog_tokens == 0  # r0 prefilled
    finally:
        close(p)


def test_a_step_that_batched_several_prompts_counts_in_the_rate(model_dir: Any) -> None:
    """Prompts batched in one step share its fixed cost: their first tokens count even when nothing waits
    after the step (a lone prompt's does not)."""
    w = colocated_worker(model_dir)
    try:
        reqs = [ColocatedRequest(request_id=f"b{i}", prompt_token_ids=list(range(s, s + 10)),
                                 sampling=wire(1)) for i, s in ((0, 10), (1, 40))]
        msgs: list[Any] = run(w, *reqs)
        pump([w], lambda: len(of_type(msgs, RequestFinished)) == 2, sink=msgs)
        rate = w.metrics.prefill_rate
        assert rate.tokens == pytest.approx(10 * 0.95 + 10) and rate.largest == 10  # both counted (DECAY)
        assert_clean(w)
    finally:
        close(w)
