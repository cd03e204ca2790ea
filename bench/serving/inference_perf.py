"""inference-perf's vLLM collector reads a live pdserve system's worker metrics through Prometheus (CPU,
the embedded model; not a test).

Starts a system (``pdserve.live_system``: ``--mode disagg``, one prefill and one decode worker with KV
over NIXL, as ``pdserve up`` starts it; or ``colocated``, one worker), each worker serving ``/metrics``
on its own port; a Prometheus server (the ``--prometheus`` binary, own config and a temporary storage
directory) scraping every worker each ``--scrape-interval`` s, each target labelled ``role`` and
``instance`` with the worker's child name (``prefill``, ``decode``, ``colocated``); and inference-perf
(the ``--inference-perf`` entry point of a Python >= 3.12 venv with ``inference-perf`` 0.7.0, e.g.
``python3.12 -m venv /work/ipvenv && /work/ipvenv/bin/pip install inference-perf==0.7.0``) against the
gateway's OpenAI API with server type ``vllm`` and its Prometheus metrics client pointed at that server.
The load: streaming ``/v1/completions`` at ``--rate`` requests/s for ``--duration`` s, ``ignore_eos``
with ``--output-len`` tokens each, prompts from inference-perf's ``shared_prefix`` generator
(``--groups`` system prompts of ``--system-prompt-len`` tokens, ``--prompts-per-group`` questions of
``--question-len`` tokens each, so the prefix cache has something to hit), tokenized with the model's own
tokenizer.

Printed (and saved with ``--json``): every value inference-perf's collector read (its
``summary_prometheus_metrics.json``) next to its client-side measurements
(``summary_lifecycle_metrics.json``), and each worker's counters and histogram means over the run, read
straight from its ``/metrics`` before and after the load (exact, without Prometheus' ``increase``
extrapolation). The two summaries are read into typed structures (``read_collector``,
``read_client``): a missing or mistyped field stops the run with a ValueError naming the file and the
field. Checked (exit 1 when one fails, each named):

* every metric pdserve serves was read non-zero by the collector, every one it does not serve (the
  ``NOT_SERVED`` list of ``tests/workers/test_worker_metrics.py``) read as 0;
* the workers' prompt tokens equal the client's prompt tokens; their generated tokens equal
  successes x ``--output-len``; the requests finished by the workers that return tokens (decode or
  colocated) equal the client's successes; the workers' prefix-cache hits equal the cached prompt tokens
  the client saw in the responses' ``usage``;
* per worker, the mean end-to-end latency is at most the client's, and so is the mean TTFT of the
  worker that samples the first token (prefill or colocated): such a span lies inside the client's, from
  the request's arrival at that worker to its last or first token. A decode worker's TTFT ends when the
  prompt's KV and the first token have landed there, after the gateway has streamed that token to the
  client, so it can exceed the client's by the tail of the KV transfer: printed, not checked.

In a disaggregated system each request is counted by both workers in ``vllm:request_success``, the
latency histograms and ``vllm:request_max_num_generation_tokens`` (the prefill worker's part ends with
the first token, ``finished_reason="length"``), as vLLM's prefill and decode instances count it; the
collector sums all series of a histogram or counter, so its request count is twice the client's and its
TTFT/latency means mix both workers' spans. inference-perf reads a gauge (``vllm:kv_cache_usage_perc``,
``vllm:num_requests_running``/``_waiting``) from the first series Prometheus returns, i.e. one worker:
the decode worker here (``prometheus_config``).

    python -m bench.serving.inference_perf --prometheus /usr/bin/prometheus \\
        --inference-perf /work/ipvenv/bin/inference-perf [--mode disagg|colocated] [--rate 2] \\
        [--duration 20] [--json out.json]

Exit 0 when every check holds, 1 when one fails, 2 on bad arguments or a missing binary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import msgspec

from bench.argtypes import positive_float, positive_int
from bench.serving.inference_perf_formats import (
    ClientSuccesses,
    CollectorStats,
    CollectorSuccesses,
    CollectorValue,
    InferencePerfConfig,
    LifecycleSummary,
    PrometheusSummary,
    TargetsAnswer,
    read_summary,
)
from pdserve.live_system import MODEL, LiveSystem, Samples, live_system, metric_samples
from pdserve.ports import free_ports

# collector fields (summary_prometheus_metrics.json, "successes") read from series a pdserve worker
# serves: each must be non-zero after a load that hits the prefix cache (queue_len, the waiting
# requests' gauge, may stay 0 at this load)
SERVED_FIELDS = ("count", "num_requests_running", "request_latency", "time_to_first_token",
                 "time_per_output_token", "inter_token_latency", "kv_cache_usage_percentage",
                 "prefix_cache_hit_percent",
                 "request_queue_time", "request_inference_time", "request_prefill_time",
                 "request_decode_time", "request_prompt_tokens", "request_generation_tokens",
                 "request_max_num_generation_tokens", "request_params_max_tokens", "request_success_count",
                 "iteration_tokens", "prompt_tokens_cached", "request_prefill_kv_computed_tokens")
# fields read from series no pdserve worker serves (tests/workers/test_worker_metrics.py, NOT_SERVED)
UNSERVED_FIELDS = ("request_params_n", "external_prefix_cache_hit_percent", "mm_cache_hit_percent",
                   "corrupted_requests", "kv_block_idle_before_evict", "kv_block_lifetime",
                   "kv_block_reuse_gap")
COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
            "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:prompt_tokens_cached_total", "vllm:num_preemptions_total")
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds",
              "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
              "vllm:request_decode_time_seconds")
TOLERANCE_S = 1e-3  # clock reading granularity between a worker's and the client's timestamps


def read_collector(path: Path) -> CollectorSuccesses:
    """The ``successes`` of inference-perf's ``summary_prometheus_metrics.json`` at ``path``. Raises
    ValueError naming ``path`` and the field when one is mistyped, or when a field of ``SERVED_FIELDS``
    or ``UNSERVED_FIELDS`` is absent."""
    raw = read_summary(path, PrometheusSummary).successes
    missing = [f for f in (*SERVED_FIELDS, *UNSERVED_FIELDS) if f not in raw]
    if missing:
        raise ValueError(f"{path}: successes lacks {', '.join(f'`{f}`' for f in missing)}")
    successes: CollectorSuccesses = {}
    for name, value in raw.items():
        try:
            successes[name] = msgspec.convert(value, type=CollectorValue)
        except msgspec.ValidationError as e:
            raise ValueError(f"{path}: {e} (in `$.successes.{name}`)") from e
    return successes


def read_client(path: Path) -> ClientSuccesses:
    """The ``successes`` of inference-perf's ``summary_lifecycle_metrics.json`` at ``path``. Raises
    ValueError naming ``path`` and the field when one is missing or mistyped."""
    return read_summary(path, LifecycleSummary).successes


@dataclass(frozen=True)
class Load:
    """The load inference-perf sends: ``rate`` requests/s for ``duration_s`` s, ``output_len`` tokens
    each (ignore_eos), shared-prefix prompts (``groups`` x ``prompts_per_group`` distinct prompts, a
    ``system_prompt_len``-token prefix per group plus a ``question_len``-token question)."""

    rate: float
    duration_s: int
    output_len: int
    groups: int
    prompts_per_group: int
    system_prompt_len: int
    question_len: int


@dataclass(frozen=True)
class WorkerDelta:
    """One worker's counters (``COUNTERS``, summed over their label sets) and histogram means
    (``HISTOGRAMS``, seconds; None when nothing was observed) over the run, with the observation
    counts."""

    counters: dict[str, float]
    means_s: dict[str, float | None]
    counts: dict[str, float]


@dataclass(frozen=True)
class Check:
    """One consistency check: ``name``, whether it ``ok``, and what was compared (``detail``)."""

    name: str
    ok: bool
    detail: str


def _total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def worker_delta(before: Samples, after: Samples) -> WorkerDelta:
    """Counters and histogram means of one worker between two readings of its ``/metrics``."""
    counters = {c: _total(after, c) - _total(before, c) for c in COUNTERS}
    means: dict[str, float | None] = {}
    counts: dict[str, float] = {}
    for h in HISTOGRAMS:
        n = _total(after, h + "_count") - _total(before, h + "_count")
        s = _total(after, h + "_sum") - _total(before, h + "_sum")
        counts[h] = n
        means[h] = s / n if n else None
    return WorkerDelta(counters, means, counts)


def prometheus_config(system: LiveSystem, scrape_interval_s: int) -> str:
    """Prometheus' config (JSON, which is YAML): one static target per worker of ``system``, labelled
    ``role`` and ``instance`` = its child name. inference-perf reads a gauge from the first series of
    the answer, which Prometheus orders by label set: ``instance="decode"`` sorts before ``"prefill"``, so
    a disaggregated system's gauges are read from the decode worker, the one that holds each request
    from its KV's arrival to its last token (an address would order the workers by their random
    ports)."""
    targets = [{"targets": [url.removeprefix("http://")], "labels": {"role": child, "instance": child}}
               for child, url in sorted(system.metrics_urls.items())]
    return json.dumps({"global": {"scrape_interval": f"{scrape_interval_s}s",
                                  "evaluation_interval": f"{scrape_interval_s}s"},
                       "scrape_configs": [{"job_name": "pdserve-workers", "static_configs": targets}]})


def inference_perf_config(gateway: str, prometheus: str, scrape_interval_s: int, tokenizer: Path,
                          load: Load, out: Path) -> InferencePerfConfig:
    """inference-perf 0.7.0's config (``inference_perf/config/config.py``): streaming completions, the
    shared-prefix generator, a constant-rate stage, server type ``vllm`` with the served model name
    (the workers' ``model_name`` label), the Prometheus metrics client, reports to ``out``."""
    return {
        "api": {"type": "completion", "streaming": True},
        "data": {"type": "shared_prefix", "shared_prefix": {
            "num_groups": load.groups, "num_prompts_per_group": load.prompts_per_group,
            "system_prompt_len": load.system_prompt_len, "question_len": load.question_len,
            "output_len": load.output_len, "seed": 0}},
        "load": {"type": "constant", "stages": [{"rate": load.rate, "duration": load.duration_s}]},
        "metrics": {"type": "prometheus",
                    "prometheus": {"url": prometheus, "scrape_interval": scrape_interval_s}},
        "server": {"type": "vllm", "model_name": MODEL, "base_url": gateway, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer)},
        "storage": {"local_storage": {"path": str(out)}},
        "report": {"request_lifecycle": {"summary": True, "per_stage": False},
                   "prometheus": {"summary": True, "per_stage": False}},
    }


def wait_targets_up(prometheus: str, want: int, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    """Wait until Prometheus at ``prometheus`` reports ``want`` targets, all up. Raises RuntimeError when
    it exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    health: list[str] = []
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {proc.returncode}")
        try:
            resp = httpx.get(f"{prometheus}/api/v1/targets", timeout=2, trust_env=False)
            answer = msgspec.json.decode(resp.content, type=TargetsAnswer)
            health = [t.health for t in answer.data.active_targets]
            if len(health) == want and all(h == "up" for h in health):
                return
        except (httpx.HTTPError, msgspec.DecodeError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"prometheus targets not all up after {timeout_s:.0f} s: {health}")


def _field_value(v: CollectorValue) -> float:
    """A collector summary field as one number: a plain value, else its ``mean``."""
    return v.mean if isinstance(v, CollectorStats) else v


def _shown(v: CollectorValue) -> str:
    """A collector summary field as inference-perf wrote it: the number, or its object's keys."""
    return str(msgspec.to_builtins(v))


def checks(collector: CollectorSuccesses, client: ClientSuccesses, workers: dict[str, WorkerDelta],
           load: Load) -> list[Check]:
    """The checks of the module docstring. ``collector``/``client``: the ``successes`` of inference-perf's
    Prometheus and lifecycle summaries (``read_collector``, ``read_client``); ``workers``: child name →
    its deltas. A latency span the client did not measure (None) fails its check. Raises KeyError when
    ``collector`` lacks a field of ``SERVED_FIELDS`` or ``UNSERVED_FIELDS``."""
    out = [Check(f"collector read {f}", _field_value(collector[f]) > 0, _shown(collector[f]))
           for f in SERVED_FIELDS]
    out += [Check(f"collector read {f} as 0 (not served)", _field_value(collector[f]) == 0,
                  _shown(collector[f]))
            for f in UNSERVED_FIELDS]
    successes = client.count
    fleet = {c: sum(w.counters[c] for w in workers.values()) for c in COUNTERS}
    finishing = [name for name in workers if name.startswith(("decode", "colocated"))]
    finished = sum(workers[n].counters["vllm:request_success_total"] for n in finishing)
    pairs = (("prompt tokens", fleet["vllm:prompt_tokens_total"], client.prompt_tokens.total),
             ("generated tokens", fleet["vllm:generation_tokens_total"], successes * load.output_len),
             (f"requests finished by {'+'.join(finishing)}", finished, successes),
             ("prefix-cache hits vs usage cached tokens", fleet["vllm:prefix_cache_hits_total"],
              client.prompt_tokens.cached))
    out += [Check(f"workers' {what} = client's", w == c, f"workers {w:g}, client {c:g}")
            for what, w, c in pairs]
    client_lat = client.latency
    for name, d in workers.items():
        spans = [("vllm:e2e_request_latency_seconds", "request_latency", client_lat.request_latency)]
        if not name.startswith("decode"):
            spans.append(("vllm:time_to_first_token_seconds", "time_to_first_token",
                          client_lat.time_to_first_token))
        for metric, key, dist in spans:
            mean = d.means_s[metric]
            check = f"{name} mean {key} <= client's"
            if dist is None:
                out.append(Check(check, False, f"{name} {mean}, client -"))
                continue
            c = dist.mean
            out.append(Check(check, mean is not None and mean <= c + TOLERANCE_S,
                             f"{name} {mean}, client {c:.4f}"))
    return out


def report(collector: CollectorSuccesses, client: ClientSuccesses, workers: dict[str, WorkerDelta]) -> str:
    """The printed tables: the collector's reading, the client's, each worker's."""
    lines = ["inference-perf vLLM collector (Prometheus; histograms: mean / median / p90 / p99):"]
    for k, v in collector.items():
        if isinstance(v, CollectorStats) and v.median is not None and v.p90 is not None and v.p99 is not None:
            lines.append(f"  {k:38s} {v.mean:10.4f} {v.median:10.4f} {v.p90:10.4f} {v.p99:10.4f}")
        elif isinstance(v, CollectorStats):
            lines.append(f"  {k:38s} " + "  ".join(f"{kk}={vv:.4f}" for kk, vv in v.present()))
        else:
            lines.append(f"  {k:38s} {v:10.4f}")
    lat = client.latency
    prompt = client.prompt_tokens
    means = (("time_to_first_token", lat.time_to_first_token),
             ("inter_token_latency", lat.inter_token_latency),
             ("time_per_output_token", lat.time_per_output_token),
             ("request_latency", lat.request_latency))
    lines.append(f"inference-perf client: {client.count} successes, prompt tokens "
                 f"{prompt.total:g} (cached {prompt.cached:g}), "
                 f"output tokens {client.output_tokens.total:g}; means (s): "
                 + ", ".join(f"{k} {'-' if m is None else f'{m.mean:.4f}'}" for k, m in means))
    for name, d in workers.items():
        lines.append(f"worker {name} over the run: "
                     + ", ".join(f"{c.removeprefix('vllm:')} {v:g}" for c, v in d.counters.items()))
        lines.append("  means (s, observations): " + ", ".join(
            f"{h.removeprefix('vllm:')} {'-' if m is None else f'{m:.4f}'} ({d.counts[h]:g})"
            for h, m in d.means_s.items()))
    return "\n".join(lines)


def run(args: argparse.Namespace, load: Load) -> int:
    """Start everything, run the load, print and check (module docstring); returns the exit code."""
    from engine.models.registry import resolve_model

    tokenizer = resolve_model(MODEL)
    devices = ["cpu", "cpu"] if args.mode == "disagg" else ["cpu"]
    with tempfile.TemporaryDirectory(prefix="pdserve-iperf-") as tmp_s:
        tmp = Path(tmp_s)
        with live_system(args.mode, tmp / "logs", num_blocks=args.num_blocks, devices=devices,
                         ready_timeout_s=600) as system:
            (port,) = free_ports(1)
            prom_url = f"http://127.0.0.1:{port}"
            (tmp / "prometheus.yml").write_text(prometheus_config(system, args.scrape_interval))
            with open(tmp / "prometheus.log", "wb") as prom_log:
                prom = subprocess.Popen([args.prometheus, f"--config.file={tmp / 'prometheus.yml'}",
                                         f"--storage.tsdb.path={tmp / 'tsdb'}",
                                         f"--web.listen-address=127.0.0.1:{port}"],
                                        stdout=prom_log, stderr=subprocess.STDOUT)
            try:
                wait_targets_up(prom_url, len(system.metrics_urls), 60, prom)
                before = {n: metric_samples(u) for n, u in system.metrics_urls.items()}
                out_dir = tmp / "inference-perf"
                cfg = inference_perf_config(system.url, prom_url, args.scrape_interval, tokenizer, load,
                                            out_dir)
                (tmp / "inference-perf.yml").write_text(json.dumps(cfg))
                env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_PROXY": "127.0.0.1,localhost",
                       "no_proxy": "127.0.0.1,localhost"}
                print(f"inference-perf: {load.rate:g} req/s for {load.duration_s} s against {system.url}, "
                      f"collector on {prom_url} ({args.mode}: {', '.join(sorted(system.metrics_urls))})",
                      flush=True)
                with open(tmp / "inference-perf.log", "wb") as ip_log:
                    rc = subprocess.run([args.inference_perf, "-c", str(tmp / "inference-perf.yml")], env=env,
                                        stdout=ip_log, stderr=subprocess.STDOUT,
                                        timeout=load.duration_s + 600).returncode
                if rc != 0:
                    tail = (tmp / "inference-perf.log").read_text(errors="replace")[-3000:]
                    print(f"inference-perf exited with {rc}:\n{tail}", file=sys.stderr)
                    return 1
                after = {n: metric_samples(u) for n, u in system.metrics_urls.items()}
            finally:
                prom.terminate()
                prom.wait(timeout=30)
            collector = read_collector(out_dir / "summary_prometheus_metrics.json")
            client = read_client(out_dir / "summary_lifecycle_metrics.json")
    workers = {n: worker_delta(before[n], after[n]) for n in sorted(before)}
    print(report(collector, client, workers))
    results = checks(collector, client, workers, load)
    for c in results:
        print(f"{'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}")
    if args.json:
        doc = {"mode": args.mode, "load": asdict(load), "scrape_interval_s": args.scrape_interval,
               "collector": msgspec.to_builtins(collector), "client": msgspec.to_builtins(client),
               "workers": {n: asdict(w) for n, w in workers.items()}, "checks": [asdict(c) for c in results]}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0 if all(c.ok for c in results) else 1


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments and run (module docstring); returns 0, 1 (a check failed or inference-perf
    failed) or 2 (bad arguments, a binary absent)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prometheus", required=True, help="the prometheus server binary")
    p.add_argument("--inference-perf", required=True,
                   help="the inference-perf entry point of a Python >= 3.12 venv with inference-perf 0.7.0")
    p.add_argument("--mode", choices=("disagg", "colocated"), default="disagg")
    p.add_argument("--num-blocks", type=positive_int, default=1310,
                   help="KV blocks per worker (1310: what `pdserve up` gives the embedded model on a CPU)")
    p.add_argument("--scrape-interval", type=positive_int, default=1,
                   help="Prometheus scrape interval, seconds")
    p.add_argument("--rate", type=positive_float, default=2.0, help="requests per second")
    p.add_argument("--duration", type=positive_int, default=20, help="seconds of load")
    p.add_argument("--output-len", type=positive_int, default=16, help="tokens generated per request")
    p.add_argument("--groups", type=positive_int, default=2, help="shared system prompts")
    p.add_argument("--prompts-per-group", type=positive_int, default=10)
    p.add_argument("--system-prompt-len", type=positive_int, default=64, help="tokens")
    p.add_argument("--question-len", type=positive_int, default=16, help="tokens")
    p.add_argument("--json", default=None, help="write the summaries and checks to this file")
    args = p.parse_args(argv)
    for flag, path in (("--prometheus", args.prometheus), ("--inference-perf", args.inference_perf)):
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            print(f"inference_perf: {flag} {path} is not an executable file", file=sys.stderr)
            return 2
    load = Load(args.rate, args.duration, args.output_len, args.groups, args.prompts_per_group,
                args.system_prompt_len, args.question_len)
    return run(args, load)


if __name__ == "__main__":
    raise SystemExit(main())
