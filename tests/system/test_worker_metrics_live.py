"""Each worker's own /metrics and /health on the shared live system (tests/live.py; each worker gets a
``--metrics-port`` from ``pdserve.live_system``).

A few requests with token-id prompts go through both gateways; every worker's /metrics, parsed with
prometheus-client's parser, must move by what was sent: prompt tokens (counted by the worker that
computed the prompt: prefill and colocated, not decode), tokens generated (by the worker that sampled
them), one TTFT and one finished request per request on every worker that served it, one inter-token
interval per token after a request's first on the workers that decode. A request streaming holds
``vllm:num_requests_running`` at 1 on the decode worker; a repeated prompt hits the prefix cache (in
tokens, full blocks). Counters are compared as differences: other suites share the system.
"""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from pdserve.live_system import SystemPair, metric_samples
from tests.live import API_KEY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "smollm2-135m"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
BLOCK_SIZE = 16  # the workers' default --block-size


def prompt(n: int) -> list[int]:
    """``n`` token ids no other test sends (so nothing of it is in a prefix cache yet)."""
    seed = uuid.uuid4().int
    return [1000 + (seed >> (3 * i)) % 20000 + i for i in range(n)]


def complete(url: str, token_ids: list[int], max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": token_ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    resp = httpx.post(f"{url}/v1/completions", json=body, headers=HEADERS, timeout=120, trust_env=False)
    resp.raise_for_status()
    out: dict = resp.json()
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


COUNTED = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
           "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
           "vllm:inter_token_latency_seconds_count", "vllm:request_queue_time_seconds_count")


def counts(url: str) -> dict[str, float]:
    found = metric_samples(url)
    out = {name: total(found, name) for name in COUNTED}
    out["length"] = total(found, "vllm:request_success_total", finished_reason="length")
    return out


def test_worker_metrics_count_what_was_sent(live: SystemPair) -> None:
    lengths, max_tokens = (7, 12, 20), 4
    urls = {**live.disagg.metrics_urls, **live.colo.metrics_urls}
    assert set(urls) == {"prefill", "decode", "colocated"}
    before = {name: counts(url) for name, url in urls.items()}
    for n in lengths:
        for gateway in (live.disagg_url, live.colo_url):
            reply = complete(gateway, prompt(n), max_tokens)
            assert reply["usage"]["completion_tokens"] == max_tokens
    after = {name: counts(url) for name, url in urls.items()}
    delta = {w: {k: after[w][k] - before[w][k] for k in after[w]} for w in urls}
    sent, requests = sum(lengths), len(lengths)
    later = requests * (max_tokens - 1)  # tokens after each request's first
    assert delta["prefill"] == {
        "vllm:prompt_tokens_total": sent, "vllm:generation_tokens_total": requests,
        "vllm:prefix_cache_queries_total": sent, "vllm:time_to_first_token_seconds_count": requests,
        "vllm:e2e_request_latency_seconds_count": requests, "vllm:inter_token_latency_seconds_count": 0,
        "vllm:request_queue_time_seconds_count": requests, "length": requests}
    assert delta["decode"] == {
        "vllm:prompt_tokens_total": 0, "vllm:generation_tokens_total": later,
        "vllm:prefix_cache_queries_total": 0, "vllm:time_to_first_token_seconds_count": requests,
        "vllm:e2e_request_latency_seconds_count": requests, "vllm:inter_token_latency_seconds_count": later,
        "vllm:request_queue_time_seconds_count": requests, "length": requests}
    assert delta["colocated"] == {
        "vllm:prompt_tokens_total": sent, "vllm:generation_tokens_total": requests * max_tokens,
        "vllm:prefix_cache_queries_total": sent, "vllm:time_to_first_token_seconds_count": requests,
        "vllm:e2e_request_latency_seconds_count": requests, "vllm:inter_token_latency_seconds_count": later,
        "vllm:request_queue_time_seconds_count": requests, "length": requests}
    for name, url in urls.items():
        assert httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200, name


def test_repeated_prompt_hits_the_prefix_cache_in_tokens(live: SystemPair) -> None:
    url = live.colo.metrics_urls["colocated"]
    ids = prompt(2 * BLOCK_SIZE + 8)
    hits = total(metric_samples(url), "vllm:prefix_cache_hits_total")
    complete(live.colo_url, ids, 1)
    assert total(metric_samples(url), "vllm:prefix_cache_hits_total") == hits  # a new prompt: a miss
    complete(live.colo_url, ids, 1)
    assert total(metric_samples(url), "vllm:prefix_cache_hits_total") == hits + 2 * BLOCK_SIZE


def test_running_request_shows_on_the_decode_worker(live: SystemPair) -> None:
    url = live.disagg.metrics_urls["decode"]
    body = {"model": MODEL, "prompt": prompt(8), "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "stream": True}
    running_seen = 0.0
    with httpx.stream("POST", f"{live.disagg_url}/v1/completions", json=body, headers=HEADERS, timeout=120,
                      trust_env=False) as resp:
        resp.raise_for_status()
        chunks = 0
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
                if chunks == 2:  # decoding on the decode worker now, 14 tokens to go
                    running_seen = total(metric_samples(url), "vllm:num_requests_running")
    assert running_seen == 1
    deadline = time.monotonic() + 10
    while total(metric_samples(url), "vllm:num_requests_running") != 0:  # the load refreshes per phase
        assert time.monotonic() < deadline, "decode worker still reports a running request"
        time.sleep(0.05)
    assert total(metric_samples(url), "vllm:num_requests_waiting") == 0


def _poll_total(url: str, name: str, want: float, timeout_s: float = 15.0) -> float:
    """``name``'s total at ``url`` once it equals ``want`` (a prefill worker counts a transfer when it sees
    it DONE, a moment after the stream may have ended), or the last reading after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (got := total(metric_samples(url), name)) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def test_iteration_tokens_and_kv_bytes_follow_requests(live: SystemPair) -> None:
    """``vllm:iteration_tokens_total`` sums, as vLLM counts them, the prompts of the first tokens a worker
    sampled and every token it sampled (prefill: prompts + first tokens; decode: the later tokens;
    colocated: both); the KV bytes counters move by the prompts' whole blocks x the model's KV bytes per
    block (config.json: 2 x layers x KV heads x head_dim x 4 bytes)."""
    from engine.models.registry import resolve_model
    from loadtest.kv_size import kv_bytes_per_token, load_model_config

    per_block = kv_bytes_per_token(load_model_config(resolve_model(MODEL)), "float32") * BLOCK_SIZE
    lengths, max_tokens = (7, 20, 33), 3  # 1 + 2 + 3 blocks; new prompts: no prefix-cache hit
    urls = {**live.disagg.metrics_urls, **live.colo.metrics_urls}
    names = ("vllm:iteration_tokens_total_sum", "vllm:iteration_tokens_total_count",
             "pdserve_worker_kv_sent_bytes_total", "pdserve_worker_kv_received_bytes_total")
    before = {w: {n: total(metric_samples(url), n) for n in names} for w, url in urls.items()}
    for n in lengths:
        for gateway in (live.disagg_url, live.colo_url):
            assert complete(gateway, prompt(n), max_tokens)["usage"]["completion_tokens"] == max_tokens
    blocks = sum(-(-n // BLOCK_SIZE) for n in lengths)
    sent, later = sum(lengths), len(lengths) * (max_tokens - 1)

    def moved(worker: str, name: str, want: float) -> float:
        return _poll_total(urls[worker], name, before[worker][name] + want) - before[worker][name]

    assert moved("prefill", "pdserve_worker_kv_sent_bytes_total", blocks * per_block) == blocks * per_block
    assert moved("decode", "pdserve_worker_kv_received_bytes_total", blocks * per_block) == blocks * per_block
    assert moved("colocated", "pdserve_worker_kv_sent_bytes_total", 0) == 0
    firsts = len(lengths)
    assert moved("prefill", "vllm:iteration_tokens_total_sum", sent + firsts) == sent + firsts
    assert moved("decode", "vllm:iteration_tokens_total_sum", later) == later
    both = sent + firsts + later
    assert moved("colocated", "vllm:iteration_tokens_total_sum", both) == both
    # one observation per step that sampled: one per prompt here (one at a time), one per decode round
    assert moved("prefill", "vllm:iteration_tokens_total_count", firsts) == firsts
    assert moved("decode", "vllm:iteration_tokens_total_count", later) == later
    buckets = {float(dict(ls)["le"]) for (n, ls) in metric_samples(urls["prefill"])
               if n == "vllm:iteration_tokens_total_bucket"}
    assert buckets == {1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, float("inf")}


def test_each_gateway_knows_the_prefill_rate_its_first_token_workers_report(live: SystemPair) -> None:
    """The prefill and colocated workers time a probe at start-up and report their prefill rate in every
    heartbeat (the rate a gateway judges its queue by before measuring the worker itself): the worker's
    gauge and the gateway's ``/v1/status`` show it; a decode worker reports none."""
    for system in (live.disagg, live.colo):
        status = httpx.get(f"{system.url}/v1/status", headers=HEADERS, timeout=10, trust_env=False).json()
        reported = {w["role"]: w["prefill_tokens_per_s"] for w in status["workers"]}
        for role, url in system.metrics_urls.items():
            gauge = total(metric_samples(url), "pdserve_worker_prefill_tokens_per_second")
            if role == "decode":
                assert gauge == 0 and reported[role] == 0
            else:  # the embedded model on a CPU: hundreds to thousands of prompt tokens per second
                assert 10 < gauge < 1e6 and 10 < reported[role] < 1e6, (role, gauge, reported)
