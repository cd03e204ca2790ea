"""bench/serving/inference_perf.py without a live system: a worker's deltas between two readings of its
/metrics, inference-perf's summaries read into their types (a missing or mistyped field refused by name), the
checks on them (each failing when its figure is off), the Prometheus config's targets and labels, and the
one-line refusal of a missing binary."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from bench.serving import inference_perf as ip
from bench.serving import inference_perf_formats as fmt
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


def dist(mean: float) -> dict[str, float]:
    """A latency as inference-perf's ``summarize`` writes it, every sample equal to ``mean``."""
    return {"mean": mean, "min": mean, "max": mean}


def collector_literal() -> dict[str, object]:
    """The collector's ``successes`` of a consistent disaggregated run of 2 requests (its counts twice the
    client's), every served field non-zero and every unserved one 0."""
    hist = {"mean": 0.5, "median": 0.4, "p90": 0.9, "p99": 1.0}
    collector: dict[str, object] = {f: hist for f in ip.SERVED_FIELDS}
    collector.update(count=4.1, request_success_count=4.1, prompt_tokens_cached=65.0,
                     prefix_cache_hit_percent={"mean": 40.0}, num_requests_running={"mean": 1.5})
    collector.update({f: {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0} for f in ip.UNSERVED_FIELDS})
    collector.update(corrupted_requests=0.0, external_prefix_cache_hit_percent={"mean": 0.0},
                     mm_cache_hit_percent={"mean": 0.0})
    return collector


def client_literal() -> dict[str, object]:
    """The client's ``successes`` of that run: 160 prompt tokens of which 64 cached, 16 tokens each."""
    return {"count": 2,
            "latency": {"request_latency": dist(3.0), "normalized_time_per_output_token": dist(0.19),
                        "time_per_output_token": dist(0.16), "time_to_first_token": dist(0.6),
                        "inter_token_latency": dist(0.16)},
            "throughput": {"input_tokens_per_sec": 53.3, "output_tokens_per_sec": 10.7,
                           "total_tokens_per_sec": 64.0, "requests_per_sec": 0.67, "images_per_sec": 0.0,
                           "videos_per_sec": 0.0, "audios_per_sec": 0.0},
            "prompt_tokens": {"total": 160.0, "cached": 64.0, "uncached": 96.0, "mean": 80.0, "min": 80.0,
                              "max": 80.0},
            "output_tokens": {"total": 32.0, "mean": 16.0, "min": 16.0, "max": 16.0}}


def summaries() -> tuple[fmt.CollectorSuccesses, fmt.ClientSuccesses, dict[str, ip.WorkerDelta]]:
    """That run's summaries through their types, and the workers' deltas: the prefill worker's
    first-token span inside the client's."""
    collector = msgspec.convert(collector_literal(), fmt.CollectorSuccesses)
    client = msgspec.convert(client_literal(), fmt.ClientSuccesses)
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


Change = Callable[[fmt.CollectorSuccesses, fmt.ClientSuccesses],
                  tuple[fmt.CollectorSuccesses, fmt.ClientSuccesses]]
replace = msgspec.structs.replace


@pytest.mark.parametrize(("change", "fails"), [
    (lambda col, cli: (col | {"kv_cache_usage_percentage": fmt.CollectorStats(0.0, 0.0, 0.0, 0.0)}, cli),
     "collector read kv_cache_usage_percentage"),
    (lambda col, cli: (col | {"mm_cache_hit_percent": fmt.CollectorStats(3.0)}, cli),
     "collector read mm_cache_hit_percent as 0 (not served)"),
    (lambda col, cli: (col, replace(cli, prompt_tokens=replace(cli.prompt_tokens, total=161.0))),
     "workers' prompt tokens = client's"),
    (lambda col, cli: (col, replace(cli, count=3)), "workers' generated tokens = client's"),
    (lambda col, cli: (col, replace(cli, prompt_tokens=replace(cli.prompt_tokens, cached=48.0))),
     "workers' prefix-cache hits vs usage cached tokens = client's"),
    (lambda col, cli: (col, replace(cli, latency=replace(cli.latency, time_to_first_token=fmt.Distribution(
        0.3, 0.3, 0.3)))),
     "prefill mean time_to_first_token <= client's"),
    (lambda col, cli: (col, replace(cli, latency=replace(cli.latency, request_latency=fmt.Distribution(
        2.0, 2.0, 2.0)))),
     "decode mean request_latency <= client's"),
    (lambda col, cli: (col, replace(cli, latency=replace(cli.latency, time_to_first_token=None))),
     "prefill mean time_to_first_token <= client's"),
])
def test_each_check_fails_when_its_figure_is_off(change: Change, fails: str) -> None:
    collector, client, workers = summaries()
    collector, client = change(collector, client)
    assert fails in failing(ip.checks(collector, client, workers, LOAD))


def test_requests_are_counted_on_the_worker_that_returns_tokens() -> None:
    collector, client, workers = summaries()
    # the prefill worker's own count does not stand in for the decode worker's
    workers["decode"] = ip.WorkerDelta(workers["decode"].counters | {"vllm:request_success_total": 1},
                                       workers["decode"].means_s, workers["decode"].counts)
    assert "workers' requests finished by decode = client's" in failing(
        ip.checks(collector, client, workers, LOAD))


def write_summaries(tmp_path: Path, collector: dict[str, object],
                    client: dict[str, object]) -> tuple[Path, Path]:
    """Both summaries as inference-perf writes them (``json.dumps``; ``failures`` and the keys this module
    does not read included), in ``tmp_path``."""
    prom = tmp_path / "summary_prometheus_metrics.json"
    life = tmp_path / "summary_lifecycle_metrics.json"
    prom.write_text(json.dumps({"benchmark_time_seconds": 0.0, "load_summary": {}, "successes": collector,
                                "failures": {}}, indent=2))
    life.write_text(json.dumps({"benchmark_time_seconds": 30.0, "load_summary": {"count": 2},
                                "successes": client | {"request_size_bytes": dist(700.0),
                                                       "token_count_mismatches": 0},
                                "failures": {"count": 0}}, indent=2))
    return prom, life


def test_summaries_read_back_as_written_for_the_json_document(tmp_path: Path) -> None:
    collector = collector_literal()
    # a histogram quantile in Prometheus' +Inf bucket: json.dumps writes Infinity
    collector["iteration_tokens"] = {"mean": 40.0, "median": 32.0, "p90": 64.0, "p99": float("inf")}
    client = client_literal()
    full = {"mean": 3.0, "min": 2.5, "max": 3.5, "p0.1": 2.5, "p1": 2.5, "p5": 2.6, "p10": 2.6, "p25": 2.8,
            "median": 3.0, "p75": 3.2, "p90": 3.4, "p95": 3.4, "p99": 3.5, "p99.9": 3.5}
    client["latency"] = {"request_latency": full, "normalized_time_per_output_token": dist(0.19),
                         "time_per_output_token": None, "time_to_first_token": None,
                         "inter_token_latency": None}
    prom, life = write_summaries(tmp_path, collector, client)
    read_collector = ip.read_collector(prom)
    assert read_collector["count"] == 4.1
    assert read_collector["iteration_tokens"] == fmt.CollectorStats(40.0, 32.0, 64.0, float("inf"))
    assert json.dumps(msgspec.to_builtins(read_collector)) == json.dumps(collector)
    read_client = ip.read_client(life)
    assert read_client.latency.request_latency is not None
    assert read_client.latency.request_latency.p99_9 == 3.5
    assert json.dumps(msgspec.to_builtins(read_client)) == json.dumps(client)


def without(literal: dict[str, object], dotted: str) -> dict[str, object]:
    """A copy of ``literal`` less the key at the ``dotted`` path."""
    head, _, rest = dotted.partition(".")
    if not rest:
        return {k: v for k, v in literal.items() if k != head}
    inner = literal[head]
    assert isinstance(inner, dict)
    return literal | {head: without(inner, rest)}


@pytest.mark.parametrize(("which", "drop", "error"), [
    ("client", "count", "Object missing required field `count` - at `$.successes`"),
    ("client", "prompt_tokens.cached",
     "Object missing required field `cached` - at `$.successes.prompt_tokens`"),
    ("client", "latency.time_to_first_token.mean",
     "Object missing required field `mean` - at `$.successes.latency.time_to_first_token`"),
    ("client", "latency.inter_token_latency",
     "Object missing required field `inter_token_latency` - at `$.successes.latency`"),
    ("collector", "kv_cache_usage_percentage", "successes lacks `kv_cache_usage_percentage`"),
    ("collector", "request_latency.mean",
     "Object missing required field `mean` (in `$.successes.request_latency`)"),
])
def test_a_summary_missing_a_required_field_is_refused_naming_it(tmp_path: Path, which: str, drop: str,
                                                                 error: str) -> None:
    collector, client = collector_literal(), client_literal()
    if which == "collector":
        collector = without(collector, drop)
    else:
        client = without(client, drop)
    prom, life = write_summaries(tmp_path, collector, client)
    path = prom if which == "collector" else life
    with pytest.raises(ValueError) as e:
        ip.read_collector(path) if which == "collector" else ip.read_client(path)
    assert str(e.value) == f"{path}: {error}"


def test_a_mistyped_field_is_refused_naming_it(tmp_path: Path) -> None:
    client = client_literal()
    client["prompt_tokens"] = {"total": "160", "cached": 64.0, "uncached": 96.0}
    prom, life = write_summaries(tmp_path, collector_literal() | {"count": "4.1"}, client)
    with pytest.raises(ValueError) as e:
        ip.read_client(life)
    assert str(e.value) == f"{life}: Expected `float`, got `str` - at `$.successes.prompt_tokens.total`"
    with pytest.raises(ValueError) as e:
        ip.read_collector(prom)
    assert str(e.value) == f"{prom}: Expected `float | object`, got `str` (in `$.successes.count`)"


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


@pytest.mark.parametrize(("flag", "value"), [("--rate", "0"), ("--duration", "0"), ("--groups", "-2"),
                                             ("--scrape-interval", "x"), ("--num-blocks", "0")])
def test_bad_number_is_refused_by_name_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str,
) -> None:
    absent = str(tmp_path / "prometheus")
    with pytest.raises(SystemExit) as exc:
        ip.main(["--prometheus", absent, "--inference-perf", absent, flag, value])
    assert exc.value.code == 2
    assert f"argument {flag}: " in capsys.readouterr().err
