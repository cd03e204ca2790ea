"""bench/serving/inference_perf.py without a live system: a worker's deltas between two readings of its
/metrics, the checks on inference-perf's summaries (each failing when its figure is off), the Prometheus
config's targets and labels, and the one-line refusal of a missing binary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.serving import inference_perf as ip
from pdserve.live_system import MODEL, LiveSystem, Samples
from pdserve.supervisor import Supervisor

LOAD = ip.Load(rate=2, duration_s=20, output_len=16, groups=2, prompts_per_group=10, system_prompt_len=64,
               question_len=16)
M = (("engine", "0"), ("model_name", MODEL))


def reading(prompt: float, generated: float, finished: dict[str, float], hits: float,
            ttft: tuple[float, float], e2e: tuple[float, float]) -> Samples:
    """One worker's /metrics samples: counters, request_success by finished_reason, and the (sum, count)
    of the TTFT and e2e histograms."""
    out: Samples = {("vllm:prompt_tokens_total", M): prompt, ("vllm:generation_tokens_total", M): generated,
                    ("vllm:prefix_cache_queries_total", M): prompt, ("vllm:prefix_cache_hits_total", M): hits,
                    ("vllm:prompt_tokens_cached_total", M): hits}
    for reason, n in finished.items():
        out[("vllm:request_success_total", (("engine", "0"), ("finished_reason", reason),
                                            ("model_name", MODEL)))] = n
    for name, (s, n) in (("vllm:time_to_first_token_seconds", ttft),
                         ("vllm:e2e_request_latency_seconds", e2e)):
        out[(name + "_sum", M)] = s
        out[(name + "_count", M)] = n
    return out


def test_worker_delta_sums_label_sets_and_takes_histogram_means_over_the_run() -> None:
    before = reading(100, 10, {"stop": 1, "length": 2}, 16, (0.5, 3), (2.0, 3))
    after = reading(420, 30, {"stop": 1, "length": 6}, 48, (1.7, 7), (12.0, 7))
    d = ip.worker_delta(before, after)
    assert d.counters["vllm:prompt_tokens_total"] == 320
    assert d.counters["vllm:generation_tokens_total"] == 20
    assert d.counters["vllm:request_success_total"] == 4
    assert d.counters["vllm:prefix_cache_hits_total"] == 32
    assert d.counts["vllm:time_to_first_token_seconds"] == 4
    assert d.means_s["vllm:time_to_first_token_seconds"] == pytest.approx(0.3)
    assert d.means_s["vllm:e2e_request_latency_seconds"] == pytest.approx(2.5)
    assert d.means_s["vllm:inter_token_latency_seconds"] is None  # nothing observed


def summaries() -> tuple[dict[str, Any], dict[str, Any], dict[str, ip.WorkerDelta]]:
    """A consistent disaggregated run of 2 requests: 160 prompt tokens of which 64 cached, 16 tokens
    each, the prefill worker's first-token span inside the client's."""
    hist = {"mean": 0.5, "median": 0.4, "p90": 0.9, "p99": 1.0}
    collector: dict[str, Any] = {f: hist for f in ip.SERVED_FIELDS}
    collector.update(count=4.1, request_success_count=4.1, prompt_tokens_cached=65.0,
                     prefix_cache_hit_percent={"mean": 40.0}, num_requests_running={"mean": 1.5})
    collector.update({f: {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0} for f in ip.UNSERVED_FIELDS})
    collector.update(corrupted_requests=0.0, external_prefix_cache_hit_percent={"mean": 0.0},
                     mm_cache_hit_percent={"mean": 0.0})
    client = {"count": 2, "prompt_tokens": {"total": 160.0, "cached": 64.0}, "output_tokens": {"total": 32.0},
              "latency": {"time_to_first_token": {"mean": 0.6}, "request_latency": {"mean": 3.0}}}
    prefill = ip.WorkerDelta(
        {c: 0.0 for c in ip.COUNTERS} | {"vllm:prompt_tokens_total": 160, "vllm:generation_tokens_total": 2,
                                         "vllm:request_success_total": 2, "vllm:prefix_cache_hits_total": 64},
        {h: None for h in ip.HISTOGRAMS} | {"vllm:time_to_first_token_seconds": 0.4,
                                            "vllm:e2e_request_latency_seconds": 0.4},
        {h: 2.0 for h in ip.HISTOGRAMS})
    decode = ip.WorkerDelta(
        {c: 0.0 for c in ip.COUNTERS} | {"vllm:generation_tokens_total": 30, "vllm:request_success_total": 2},
        # the decode worker's TTFT ends after the client's first token: not checked
        {h: None for h in ip.HISTOGRAMS} | {"vllm:time_to_first_token_seconds": 0.7,
                                            "vllm:e2e_request_latency_seconds": 2.9},
        {h: 2.0 for h in ip.HISTOGRAMS})
    return collector, client, {"decode": decode, "prefill": prefill}


def failing(results: list[ip.Check]) -> list[str]:
    return [c.name for c in results if not c.ok]


def test_checks_pass_on_a_consistent_run() -> None:
    collector, client, workers = summaries()
    results = ip.checks(collector, client, workers, LOAD)
    assert failing(results) == []
    names = {c.name for c in results}
    assert "prefill mean time_to_first_token <= client's" in names
    assert "decode mean time_to_first_token <= client's" not in names
    assert "decode mean request_latency <= client's" in names


@pytest.mark.parametrize(("change", "fails"), [
    (lambda col, cli, w: col.update(kv_cache_usage_percentage={"mean": 0.0, "median": 0.0, "p90": 0.0,
                                                               "p99": 0.0}),
     "collector read kv_cache_usage_percentage"),
    (lambda col, cli, w: col.update(mm_cache_hit_percent={"mean": 3.0}),
     "collector read mm_cache_hit_percent as 0 (not served)"),
    (lambda col, cli, w: cli["prompt_tokens"].update(total=161.0), "workers' prompt tokens = client's"),
    (lambda col, cli, w: cli.update(count=3), "workers' generated tokens = client's"),
    (lambda col, cli, w: cli["prompt_tokens"].update(cached=48.0),
     "workers' prefix-cache hits vs usage cached tokens = client's"),
    (lambda col, cli, w: cli["latency"]["time_to_first_token"].update(mean=0.3),
     "prefill mean time_to_first_token <= client's"),
    (lambda col, cli, w: cli["latency"]["request_latency"].update(mean=2.0),
     "decode mean request_latency <= client's"),
])
def test_each_check_fails_when_its_figure_is_off(change: Any, fails: str) -> None:
    collector, client, workers = summaries()
    change(collector, client, workers)
    assert fails in failing(ip.checks(collector, client, workers, LOAD))


def test_requests_are_counted_on_the_worker_that_returns_tokens() -> None:
    collector, client, workers = summaries()
    # the prefill worker's own count does not stand in for the decode worker's
    workers["decode"] = ip.WorkerDelta(workers["decode"].counters | {"vllm:request_success_total": 1},
                                       workers["decode"].means_s, workers["decode"].counts)
    assert "workers' requests finished by decode = client's" in failing(
        ip.checks(collector, client, workers, LOAD))


def test_prometheus_config_labels_each_worker_by_name(tmp_path: Path) -> None:
    system = LiveSystem("http://127.0.0.1:1", Supervisor(), tmp_path,
                        metrics_urls={"prefill": "http://127.0.0.1:5001", "decode": "http://127.0.0.1:5002"})
    cfg = json.loads(ip.prometheus_config(system, 2))
    assert cfg["global"]["scrape_interval"] == "2s"
    (job,) = cfg["scrape_configs"]
    assert job["static_configs"] == [
        {"targets": ["127.0.0.1:5002"], "labels": {"role": "decode", "instance": "decode"}},
        {"targets": ["127.0.0.1:5001"], "labels": {"role": "prefill", "instance": "prefill"}}]


def test_inference_perf_config_points_the_vllm_collector_at_prometheus(tmp_path: Path) -> None:
    cfg = ip.inference_perf_config("http://127.0.0.1:8000", "http://127.0.0.1:9090", 1, tmp_path / "tok",
                                   LOAD, tmp_path / "out")
    assert cfg["server"] == {"type": "vllm", "model_name": MODEL, "base_url": "http://127.0.0.1:8000",
                             "ignore_eos": True}
    assert cfg["metrics"] == {"type": "prometheus",
                              "prometheus": {"url": "http://127.0.0.1:9090", "scrape_interval": 1}}
    assert cfg["load"]["stages"] == [{"rate": 2, "duration": 20}]
    assert cfg["data"]["shared_prefix"]["output_len"] == 16


def test_missing_binary_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    absent = str(tmp_path / "prometheus")
    assert ip.main(["--prometheus", absent, "--inference-perf", absent]) == 2
    err = capsys.readouterr().err
    assert err == f"inference_perf: --prometheus {absent} is not an executable file\n"
