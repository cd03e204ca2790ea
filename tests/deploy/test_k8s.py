"""The Kubernetes overlays: render, validate against the Kubernetes schemas, check the wiring."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from deploy.kustomize_lite import render
from pdserve.cli import build_parser
from protocol.settings import PLACEHOLDER_API_KEY, settings_from_args
from tests.deploy.common import DEPLOY, K8S_VERSION, OVERLAYS, check_cli, known_metrics, rendered

WORKERS = ("pdserve-prefill", "pdserve-decode")


def _get(resources: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    (hit,) = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    return hit


def _check_service_monitor(sm: dict[str, Any]) -> None:
    # ServiceMonitor is a Prometheus Operator CRD: kubernetes-validate has no schema for it, so its
    # structure is checked here against the fields of monitoring.coreos.com/v1 that we use.
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(sm["spec"]) == {"selector", "endpoints"}
    for ep in sm["spec"]["endpoints"]:
        assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels"}
        assert ep["path"] == "/metrics"
        assert ep["honorLabels"] is True  # keeps pdserve_requests_total's own `endpoint` label


def _check_pod_monitor(pm: dict[str, Any], resources: tuple[dict[str, Any], ...]) -> None:
    # PodMonitor (monitoring.coreos.com/v1) has no kubernetes-validate schema either: the fields we use,
    # and that it selects exactly the worker pods, on their port named `metrics`.
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(pm["spec"]) == {"selector", "podMetricsEndpoints"}
    for ep in pm["spec"]["podMetricsEndpoints"]:
        assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels"}
        assert (ep["port"], ep["path"]) == ("metrics", "/metrics")
    selected = {r["metadata"]["name"] for r in resources if r["kind"] == "Deployment"
                and _selects(pm["spec"]["selector"], r["spec"]["template"]["metadata"]["labels"])}
    assert selected == set(WORKERS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_manifest_validates(overlay: str) -> None:
    resources = rendered(overlay)
    kinds = {r["kind"] for r in resources}
    assert {"Deployment", "Service", "ConfigMap", "Secret", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "ServiceMonitor", "Namespace"} <= kinds
    assert "PodMonitor" in kinds
    for r in resources:
        if r["kind"] == "ServiceMonitor":
            _check_service_monitor(r)
            continue
        if r["kind"] == "PodMonitor":
            _check_pod_monitor(r, resources)
            continue
        kubernetes_validate.validate(r, K8S_VERSION, strict=True)
        if r["kind"] != "Namespace":
            assert r["metadata"]["namespace"] == "pdserve", r["metadata"]["name"]


def test_monitoring_adapter_rules_validate_and_name_known_metrics() -> None:
    (cm,) = render(DEPLOY / "k8s" / "monitoring")
    kubernetes_validate.validate(cm, K8S_VERSION, strict=True)
    rules = yaml.safe_load(cm["data"]["config.yaml"])["externalRules"]
    known = known_metrics()
    served = set()
    for rule in rules:
        for text in (rule["seriesQuery"], rule["metricsQuery"]):
            used = {w for w in text.replace("(", " ").replace("{", " ").split() if w.startswith("pdserve_")}
            assert used and used <= known, used - known
        served.add(rule["name"]["as"])
    for hpa in [r for r in rendered("gpu") if r["kind"] == "HorizontalPodAutoscaler"]:
        for metric in hpa["spec"]["metrics"]:
            assert metric["external"]["metric"]["name"] in served


def _pod(resources: tuple[dict[str, Any], ...], name: str) -> dict[str, Any]:
    spec: dict[str, Any] = _get(resources, "Deployment", name)["spec"]["template"]["spec"]
    return spec


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_wiring(overlay: str) -> None:
    resources = rendered(overlay)
    for name in (*WORKERS, "pdserve-gateway"):
        pod = _pod(resources, name)
        assert pod["enableServiceLinks"] is False  # keeps kubelet's *_PORT variables out of PDSERVE_*
        assert pod["securityContext"]["runAsNonRoot"] is True
        # a crashed worker or gateway is restarted by the kubelet (with its backoff): a Deployment's pods
        # may only have restartPolicy Always, the default
        assert pod.get("restartPolicy", "Always") == "Always", (overlay, name)
        (c,) = pod["containers"]
        assert {"readinessProbe", "livenessProbe", "startupProbe"} <= set(c)
        gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert gpus == ("1" if overlay != "cpu" and name in WORKERS else None), (overlay, name)
        assert c["resources"].get("requests", {}).get("nvidia.com/gpu") == gpus, (overlay, name)
        env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
        tp = env.get("PDSERVE_TENSOR_PARALLEL_SIZE")
        assert tp == gpus, (overlay, name)  # one GPU per tensor parallel rank
        if name in WORKERS:  # torch threads: the pod's CPU request, not one per core of the node
            threads = {e["name"]: e.get("valueFrom") for e in c["env"]}["PDSERVE_CPU_THREADS"]
            assert threads == {"resourceFieldRef": {"resource": "requests.cpu"}}, (overlay, name)
            assert int(c["resources"]["requests"]["cpu"]) >= 1, (overlay, name)
    worker_cfg = _get(resources, "ConfigMap", "pdserve-worker-config")["data"]
    # workers register through a Service that lists the gateway before it is ready (its readiness, /ready,
    # needs registered workers); the API Service lists only ready gateways
    assert worker_cfg["PDSERVE_GATEWAY_CONTROL"] == "tcp://pdserve-gateway-control:7100"
    service = _get(resources, "Service", "pdserve-gateway")
    assert {p["port"] for p in service["spec"]["ports"]} == {8000}
    assert not service["spec"].get("publishNotReadyAddresses", False)
    control = _get(resources, "Service", "pdserve-gateway-control")
    assert {p["port"] for p in control["spec"]["ports"]} == {7100}
    assert control["spec"]["publishNotReadyAddresses"] is True
    assert control["spec"]["selector"] == service["spec"]["selector"]
    # headless: the name resolves to every gateway pod (workers register with each), not one virtual IP
    assert control["spec"]["clusterIP"] == "None"
    for hpa_name in WORKERS:
        hpa = _get(resources, "HorizontalPodAutoscaler", hpa_name)
        assert hpa["spec"]["scaleTargetRef"]["name"] == hpa_name
        _get(resources, "PodDisruptionBudget", hpa_name)
    rdma = overlay == "rdma"
    for name in WORKERS:
        assert _pod(resources, name).get("hostNetwork", False) is rdma


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_replicas_roll_one_at_a_time_and_survive_drains(overlay: str, tmp_path: Path) -> None:
    """Two gateway pods or more, replaced one at a time (a new one ready before an old one goes), and
    a PodDisruptionBudget that keeps one serving through a node drain; each pod's control ports are
    one per gateway process (``PDSERVE_WORKERS``), as many as the container declares."""
    resources = rendered(overlay)
    deployment = _get(resources, "Deployment", "pdserve-gateway")
    assert deployment["spec"]["replicas"] >= 2
    strategy = deployment["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate" and strategy["rollingUpdate"]["maxUnavailable"] == 0
    pdb = _get(resources, "PodDisruptionBudget", "pdserve-gateway")
    assert pdb["spec"]["minAvailable"] == 1
    assert _selects(pdb["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    (c,) = _pod(resources, "pdserve-gateway")["containers"]
    env = _container_env(resources, c, tmp_path)
    processes = int(env["PDSERVE_WORKERS"])
    control_ports = sorted(p["containerPort"] for p in c["ports"] if p["name"].startswith("control"))
    assert control_ports == [7100 + i for i in range(processes)]
    assert env["PDSERVE_CONTROL_BIND"] == "tcp://0.0.0.0:7100"


def _container_env(resources: tuple[dict[str, Any], ...], c: dict[str, Any], tmp: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        env.update(_get(resources, "ConfigMap", src["configMapRef"]["name"])["data"])
    for e in c.get("env", []):
        ref = e.get("valueFrom", {}).get("resourceFieldRef")
        if ref is not None:  # the kubelet gives the container's own resource, rounded up to whole units
            kind, resource = ref["resource"].split(".", 1)
            quantity = c["resources"][kind][resource]
            cores = int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)
            env[e["name"]] = str(math.ceil(cores))
            continue
        # Other Downward-API values (pod IP, pod name) get a sample of the right shape.
        env[e["name"]] = e.get("value", "10.0.0.7" if "podIP" in str(e) else "pdserve-decode-abc12")
    assert env["PDSERVE_CURVE_KEYS"] == "/etc/pdserve/curve"  # the Secret's mount (test_curve_keys_...)
    if "PDSERVE_API_KEY_FILE" in env:  # the Secret's mount: its content, a test key for the placeholder
        keys = tmp / "api-keys"
        text = _get(resources, "Secret", "pdserve-api-keys")["stringData"]["api-keys"]
        keys.write_text(text.replace(PLACEHOLDER_API_KEY, "stand-in-key"))
        env["PDSERVE_API_KEY_FILE"] = str(keys)
    return env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_api_keys_secret_placeholder_is_refused_by_the_gateway(overlay: str, tmp_path: Path) -> None:
    """The shipped pdserve-api-keys Secret holds a placeholder key, known to anyone: the gateway reading it
    (PDSERVE_API_KEY_FILE, the Secret's mount) refuses to start, naming the file, as a pod given the
    placeholder CURVE Secret does."""
    resources = rendered(overlay)
    (g,) = _pod(resources, "pdserve-gateway")["containers"]
    env = _container_env(resources, g, tmp_path)
    assert "stand-in-key" in Path(env["PDSERVE_API_KEY_FILE"]).read_text()
    shipped = tmp_path / "shipped-api-keys"
    text = _get(resources, "Secret", "pdserve-api-keys")["stringData"]["api-keys"]
    assert PLACEHOLDER_API_KEY in text.splitlines()
    shipped.write_text(text)
    args = build_parser({**env, "PDSERVE_API_KEY_FILE": str(shipped)}).parse_args(list(g["args"]))
    with pytest.raises(ValueError, match=f"--api-key-file: {shipped} holds the placeholder key "
                                         f"{PLACEHOLDER_API_KEY} .*replace it"):
        settings_from_args(args)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_commands_and_env_accepted_by_cli(overlay: str, tmp_path: Path) -> None:
    resources = rendered(overlay)
    for name in (*WORKERS, "pdserve-gateway"):
        (c,) = _pod(resources, name)["containers"]
        check_cli(list(c["args"]), _container_env(resources, c, tmp_path), f"{overlay}/{name}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_check_the_engine_loop_and_the_gateway_readiness(overlay: str, tmp_path: Path) -> None:
    """Worker probes are HTTP on the worker's own --metrics-port (not a TCP connect): liveness and
    startup /live (the engine loop ticks), readiness /health (ticks and registered). The gateway's
    readiness is /ready (workers registered), its liveness /health."""
    resources = rendered(overlay)
    metrics_ports = set()
    for name in WORKERS:
        (c,) = _pod(resources, name)["containers"]
        env = _container_env(resources, c, tmp_path)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["control"] == int(env["PDSERVE_PORT"])
        assert ports["metrics"] == int(env["PDSERVE_METRICS_PORT"]) != ports["control"]
        metrics_ports.add(ports["metrics"])
        for probe, path in (("livenessProbe", "/live"), ("startupProbe", "/live"),
                            ("readinessProbe", "/health")):
            assert c[probe]["httpGet"] == {"path": path, "port": "metrics"}, (name, probe)
    assert len(metrics_ports) == len(WORKERS)  # distinct: the rdma overlay's pods share the node's ports
    (g,) = _pod(resources, "pdserve-gateway")["containers"]
    assert g["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert g["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # on its empty cache the gateway converts its --tokenizer alias before it serves /health: the startup
    # probe gives it longer than the conversion's deadline
    from gateway.text import PREPARE_TIMEOUT_S

    startup = g["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > PREPARE_TIMEOUT_S


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_curve_keys_secret_is_mounted_in_every_pod(overlay: str) -> None:
    """Every pod mounts the Secret pdserve-curve-keys (read-only, 0400) where PDSERVE_CURVE_KEYS points;
    the shipped Secret is a placeholder, not a key pair, so no two clusters share a key by default."""
    resources = rendered(overlay)
    secret = _get(resources, "Secret", "pdserve-curve-keys")
    assert "REPLACE ME" in secret["stringData"]["fleet.key_secret"]
    for name in (*WORKERS, "pdserve-gateway"):
        pod = _pod(resources, name)
        (vol,) = [v for v in pod["volumes"] if v["name"] == "curve-keys"]
        assert vol["secret"] == {"secretName": "pdserve-curve-keys", "defaultMode": 0o400}
        (c,) = pod["containers"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "curve-keys"]
        assert mount == {"name": "curve-keys", "mountPath": "/etc/pdserve/curve", "readOnly": True}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions with In) selects ``labels``."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In", e
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_fence_control_and_transfer_ports(overlay: str) -> None:
    """Rendered and validated with the other manifests (test_every_manifest_validates); here what they
    allow: the gateway's HTTP port from anywhere, its control port (from anywhere in the rdma overlay,
    whose workers are on the host network) and every worker port only from prefill and decode pods, and
    nothing from a pod of another kind (e.g. the gateway to a worker)."""
    resources = rendered(overlay)
    policies = [r for r in resources if r["kind"] == "NetworkPolicy"]
    assert {p["metadata"]["name"] for p in policies} == {"pdserve-gateway", "pdserve-workers"} | (
        {"pdserve-gateway-control-rdma"} if overlay == "rdma" else set())
    for p in policies:
        kubernetes_validate.validate(p, K8S_VERSION, strict=True)
        assert p["spec"]["policyTypes"] == ["Ingress"]
    labels = {name: _get(resources, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
              for name in (*WORKERS, "pdserve-gateway")}
    stranger = {"app.kubernetes.io/name": "something-else"}

    def allowed(to: str, source: dict[str, str], port: int) -> bool:
        mine = [p for p in policies if _selects(p["spec"]["podSelector"], labels[to])]
        assert mine, f"no NetworkPolicy selects {to}: it would accept anything"
        for p in mine:
            for rule in p["spec"]["ingress"]:
                ranges = [(x["port"], x.get("endPort", x["port"])) for x in rule.get("ports", [])]
                sources = rule.get("from")
                if (not ranges or any(lo <= port <= hi for lo, hi in ranges)) and (
                        sources is None or any(_selects(s["podSelector"], source) for s in sources)):
                    return True
        return False

    worker_ports = (7200, 45_000)  # the KV control port and a transfer port NIXL/UCX picked
    gateway_controls = (7100, 7101, 7163)  # one control port per gateway process (`--workers` up to 64)
    for source in (stranger, labels["pdserve-gateway"]):
        # the rdma overlay's workers are on the host network: they register from node addresses, which no
        # pod selector matches, so its gateway takes control connections from anywhere (CURVE still
        # refuses a process without the fleet's key)
        opened = [allowed("pdserve-gateway", source, port) for port in gateway_controls]
        assert opened == [overlay == "rdma"] * len(gateway_controls), (source, opened)
        for w in WORKERS:
            assert not any(allowed(w, source, port) for port in worker_ports), (w, source)
    assert allowed("pdserve-gateway", stranger, 8000)
    for w in WORKERS:  # Prometheus scrapes each worker's own /metrics
        (c,) = _pod(resources, w)["containers"]
        metrics_port = {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"]
        assert allowed(w, stranger, metrics_port), w
    assert not allowed("pdserve-gateway", labels["pdserve-prefill"], 7164)
    for src in WORKERS:
        assert all(allowed("pdserve-gateway", labels[src], port) for port in gateway_controls)
        for w in WORKERS:
            assert all(allowed(w, labels[src], port) for port in worker_ports), (src, w)


def test_gpu_overlay_tensor_parallel_size_is_set_with_its_gpu_count(tmp_path: Path) -> None:
    """An overlay of ../gpu (as docs/deploy.md describes) that patches the prefill pods to
    tensor-parallel size 4 renders pods asking for 4 GPUs whose command line the CLI accepts, and leaves
    the decode pods at 1."""
    patch = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "pdserve-prefill"},
             "spec": {"template": {"spec": {"containers": [{
                 "name": "worker", "env": [{"name": "PDSERVE_TENSOR_PARALLEL_SIZE", "value": "4"}],
                 "resources": {"requests": {"nvidia.com/gpu": "4"}, "limits": {"nvidia.com/gpu": "4"}}}]}}}}
    (tmp_path / "tp4.yaml").write_text(yaml.safe_dump(patch))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [str(DEPLOY / "k8s" / "overlays" / "gpu")], "patches": [{"path": "tp4.yaml"}]}))
    resources = tuple(render(tmp_path))
    for name, n in (("pdserve-prefill", "4"), ("pdserve-decode", "1")):
        (c,) = _pod(resources, name)["containers"]
        assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == n
        env = _container_env(resources, c, tmp_path)
        assert env["PDSERVE_TENSOR_PARALLEL_SIZE"] == n, name
        check_cli(list(c["args"]), env, name)
        kubernetes_validate.validate(_get(resources, "Deployment", name), K8S_VERSION, strict=True)
