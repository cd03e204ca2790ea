"""The metric names of the deploy files are the names the gateway serves.

``deploy/metrics.yaml`` must list exactly what ``GatewayMetrics`` exposes (name, type, labels), and the
Grafana dashboard, the prometheus-adapter rules, the HPAs and docs/deploy.md may only use names (and
labels) from it. Parsed, not grepped: the exposition through prometheus-client's parser, the deploy files
as JSON/YAML, PromQL through tests/deploy/promql.py. Plus the KV transfer counters, fed by heartbeats
through the gateway's control-plane dispatch.
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from deploy.kustomize_lite import render
from gateway.metrics import GatewayMetrics
from gateway.service import GatewayService
from kvtransfer.compat import KVCompat
from protocol.messages import Heartbeat, Message, RegisterWorker, WorkerLoad, WorkerShutdown
from protocol.settings import GatewaySettings
from tests.deploy.common import DEPLOY, ROOT
from tests.deploy.promql import legend_labels, names

TARGET_LABELS = {"namespace"}  # added by Prometheus at scrape time (ServiceMonitor), used by adapter rules
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("",), "gauge": ("",)}


def _listed() -> dict[str, dict[str, Any]]:
    spec = yaml.safe_load((DEPLOY / "metrics.yaml").read_text())
    return {m["name"]: m for m in spec["metrics"]}


def _derived() -> dict[str, dict[str, Any]]:
    spec = yaml.safe_load((DEPLOY / "metrics.yaml").read_text())
    return {m["name"]: m for m in spec.get("derived", [])}


def _fed_metrics() -> GatewayMetrics:
    """GatewayMetrics with every labelled family given a series (fake worker loads, one request)."""
    m = GatewayMetrics()
    m.set_worker_load("p0", "prefill", WorkerLoad(num_waiting=2, num_free_blocks=7, num_total_blocks=10,
                                                  kv_transfer_bytes=4096, kv_transfer_seconds=0.25))
    m.set_worker_load("d0", "decode", WorkerLoad(num_running=3, num_free_blocks=5, num_total_blocks=10))
    m.requests.labels("/v1/completions", "200").inc()
    m.routes.labels("disaggregated").inc()
    m.admission_refused.labels("prefill_queue").inc()
    m.workers.labels("prefill").set(1)
    m.kv_path_gbps.labels("p0", "d0", "loopback").set(1.5)
    m.kv_path_slow.labels("p0", "d0").set(0)
    m.prefix_index_blocks.labels("p0", "prefill").set(3)
    m.observe_tokens(0.0, [0.1, 0.15, 0.2])
    return m


def _served(m: GatewayMetrics) -> dict[str, tuple[str, set[str]]]:
    """Exposed name (counters with ``_total``, histograms by base name) → (type, label names)."""
    fams = list(text_string_to_metric_families(m.render().decode()))
    out: dict[str, tuple[str, set[str]]] = {}
    for f in fams:
        assert not f.name.endswith("_created"), f.name  # prometheus-client's _created series are off
        labels = {k for s in f.samples for k in s.labels} - {"le"}
        out[f.name + ("_total" if f.type == "counter" else "")] = (f.type, labels)
        assert f.samples, f"{f.name} has no series although every family was fed"
    return out


def _sample_names() -> dict[str, str]:
    """Every sample name a query may use → its listed metric."""
    return {name + sfx: name for name, m in _listed().items() for sfx in _SUFFIXES[m["type"]]}


def _check_query(expr: str, where: str, extra_labels: set[str] = frozenset()) -> set[str]:  # type: ignore[assignment]
    """Assert ``expr`` names only listed metrics and their labels; returns those metrics' labels."""
    samples, listed = _sample_names(), _listed()
    used = names(expr)
    assert used.metrics, f"{where}: no metric in {expr!r}"
    unknown = used.metrics - samples.keys()
    assert not unknown, f"{where}: {sorted(unknown)} not in deploy/metrics.yaml ({expr!r})"
    labels = {lab for m in used.metrics for lab in listed[samples[m]]["labels"]} | extra_labels
    if any(m.endswith("_bucket") for m in used.metrics):
        labels.add("le")
    assert used.labels <= labels, f"{where}: labels {sorted(used.labels - labels)} not on {used.metrics}"
    return labels


def test_metrics_yaml_lists_exactly_what_the_gateway_serves() -> None:
    served = _served(_fed_metrics())
    listed = {n: (m["type"], set(m["labels"])) for n, m in _listed().items()}
    assert listed.keys() == served.keys(), (sorted(listed.keys() - served.keys()),
                                            sorted(served.keys() - listed.keys()))
    for name, (kind, labels) in served.items():
        assert listed[name] == (kind, labels), name
    assert not _derived().keys() & served.keys()


def test_names_follow_prometheus_conventions() -> None:
    for name, m in _listed().items():
        assert re.fullmatch(r"pdserve_[a-z0-9_]+", name), name
        assert name.endswith("_total") == (m["type"] == "counter"), name
        if m["type"] == "histogram":
            assert name.endswith("_seconds"), name
        assert "worker" not in m["labels"], f"{name}: the per-worker label is worker_id"


def test_dashboard_queries_and_legends_use_served_names_and_labels() -> None:
    dash = json.loads((DEPLOY / "grafana" / "pdserve.json").read_text())
    used: set[str] = set()
    targets = [(p["title"], t) for p in dash["panels"] for t in p["targets"]]
    assert len(targets) >= 20
    for title, t in targets:
        labels = _check_query(t["expr"], f"panel {title!r}")
        assert legend_labels(t.get("legendFormat", "")) <= labels, (title, t["legendFormat"])
        used |= names(t["expr"]).metrics
    for needed in ("pdserve_kv_blocks_capacity", "pdserve_kv_transfer_bytes_total",
                   "pdserve_kv_transfer_seconds_total", "pdserve_requests_in_flight", "pdserve_workers_live"):
        assert needed in used, needed


def _adapter_rules() -> list[dict[str, Any]]:
    (cm,) = render(DEPLOY / "k8s" / "monitoring")
    rules: list[dict[str, Any]] = yaml.safe_load(cm["data"]["config.yaml"])["externalRules"]
    return rules


def test_adapter_rules_read_served_metrics_and_expose_listed_names() -> None:
    listed, derived = _listed(), _derived()
    for rule in _adapter_rules():
        exposed = rule["name"]["as"]
        _check_query(rule["seriesQuery"], f"seriesQuery of {exposed}", TARGET_LABELS)
        _check_query(rule["metricsQuery"], f"metricsQuery of {exposed}", TARGET_LABELS)
        (series,) = names(rule["seriesQuery"]).metrics
        assert re.fullmatch(rule["name"]["matches"], series), rule["name"]
        reads = names(rule["metricsQuery"]).metrics
        if exposed in derived:
            assert reads == set(derived[exposed]["from"]), exposed
        else:
            assert exposed in listed and reads == {exposed}, exposed
    assert {r["name"]["as"] for r in _adapter_rules()} >= derived.keys()


def test_hpas_use_adapter_metrics_with_existing_labels() -> None:
    rules = {r["name"]["as"]: r for r in _adapter_rules()}
    listed = _listed()
    hpas = [r for r in render(DEPLOY / "k8s" / "base") if r["kind"] == "HorizontalPodAutoscaler"]
    assert {h["metadata"]["name"] for h in hpas} == {"pdserve-prefill", "pdserve-decode"}
    for hpa in hpas:
        for metric in hpa["spec"]["metrics"]:
            ext = metric["external"]["metric"]
            assert ext["name"] in listed.keys() | _derived().keys(), ext["name"]
            assert ext["name"] in rules, f"no adapter rule exposes {ext['name']}"
            reads = names(rules[ext["name"]]["metricsQuery"]).metrics
            labels = {lab for m in reads for lab in listed[m]["labels"]}
            assert set(ext.get("selector", {}).get("matchLabels", {})) <= labels, ext


def test_deploy_doc_names_only_listed_metrics() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    known = _sample_names().keys() | _derived().keys()
    used = set(re.findall(r"\bpdserve_[a-z0-9_]+", text)) - {"pdserve_env"}
    assert used and used <= known, sorted(used - known)


class _FakeControl:
    """Stands in for the gateway's ROUTER socket: records what the gateway sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Message]] = []

    async def send(self, identity: bytes, msg: Message) -> None:
        self.sent.append((identity, msg))


def _value(m: GatewayMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


async def test_transfer_counters_follow_heartbeats_and_vanish_with_the_worker() -> None:
    metrics = GatewayMetrics()
    svc = GatewayService(GatewaySettings(insecure_control_plane=True), metrics, text=object())  # type: ignore[arg-type]
    svc.control = _FakeControl()  # type: ignore[assignment]
    compat = KVCompat(dtype="float32", block_size=16, transfer_backend="loopback")
    register = RegisterWorker(role="prefill", worker_id="p0", epoch=1, model="m", model_path="",
                              compat=compat,
                              load=WorkerLoad(num_total_blocks=64))
    await svc.on_control_message(b"p0", register)
    assert _value(metrics, "pdserve_kv_transfer_bytes_total", worker_id="p0") == 0
    assert _value(metrics, "pdserve_kv_blocks_capacity", worker_id="p0", role="prefill") == 64
    seen = []
    for num_bytes, seconds in ((4096, 0.5), (12288, 1.25), (12288, 1.25)):
        load = WorkerLoad(num_total_blocks=64, num_free_blocks=64, kv_transfer_bytes=num_bytes,
                          kv_transfer_seconds=seconds)
        await svc.on_control_message(b"p0", Heartbeat(worker_id="p0", epoch=1, load=load))
        seen.append((_value(metrics, "pdserve_kv_transfer_bytes_total", worker_id="p0"),
                     _value(metrics, "pdserve_kv_transfer_seconds_total", worker_id="p0")))
    assert seen == [(4096, 0.5), (12288, 1.25), (12288, 1.25)]
    await svc.on_control_message(b"p0", WorkerShutdown(worker_id="p0", epoch=1))
    assert _value(metrics, "pdserve_kv_transfer_bytes_total", worker_id="p0") is None
    assert _value(metrics, "pdserve_kv_transfer_seconds_total", worker_id="p0") is None
    assert _value(metrics, "pdserve_kv_blocks_capacity", worker_id="p0", role="prefill") is None
    assert not svc.orchestrator.requests  # leak check: the gateway holds no request

