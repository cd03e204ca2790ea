"""docker-compose.yml against the compose-spec JSON schema; Dockerfiles; the Grafana dashboard."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from deploy.healthcheck import ProbeTarget, probe_target
from pdserve.cli import build_parser
from protocol.settings import GatewaySettings, UpSettings, WorkerSettings, settings_from_args
from tests.deploy.common import DEPLOY, NON_FLAG_ENV, check_cli, known_metrics, load_compose


def compose_schema() -> dict[str, Any]:
    # The Compose Specification JSON schema as shipped in PyPI's docker-compose 1.29.2 wheel
    # (compose/config/compose_spec.json, Apache-2.0). Located without importing the package.
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.submodule_search_locations, (
        "install docker-compose==1.29.2 with --no-deps (it ships the compose-spec JSON schema)")
    path = Path(next(iter(spec.submodule_search_locations))) / "config" / "compose_spec.json"
    schema: dict[str, Any] = json.loads(path.read_text())
    return schema


def test_compose_validates_against_compose_spec() -> None:
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    validator.validate(load_compose())
    broken = load_compose()
    broken["services"]["gateway"]["restart_policy"] = "always"  # not a compose key: must be refused
    assert not validator.is_valid(broken)


def _services(profile: str, given: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    services = load_compose(given)["services"]
    return {n: s for n, s in services.items() if profile in s.get("profiles", [profile])}


def _gpu_workers(given: dict[str, str] | None = None) -> dict[str, tuple[int, list[str]]]:
    """Each GPU worker's tensor parallel size and the GPU ids its container reserves."""
    out = {}
    for name, svc in _services("gpu", given).items():
        if name in ("gateway", "keys"):
            continue
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["capabilities"] == ["gpu"] and "count" not in dev, name
        # one entry "0,1" reaches the container as NVIDIA_VISIBLE_DEVICES=0,1
        ids = [i for entry in dev["device_ids"] for i in entry.split(",")]
        out[name] = (int(svc["environment"]["PDSERVE_TENSOR_PARALLEL_SIZE"]), ids)
        assert svc["ipc"] == "host" and svc["pid"] == "host"
        assert svc["environment"]["PDSERVE_DEVICE"] == "cuda"
        check_cli(list(svc["command"]), {k: str(v) for k, v in svc["environment"].items()}, name)
    return out


def test_gpu_profile_pins_each_worker_to_its_own_gpu() -> None:
    workers = {n: s for n, s in _services("gpu").items() if n not in ("gateway", "keys")}
    assert {s["command"][0] for s in workers.values()} == {"prefill", "decode"}
    assert _gpu_workers() == {"prefill-0": (1, ["0"]), "decode-0": (1, ["1"])}


def test_gpu_profile_tensor_parallel_variables_set_the_flag_and_the_gpus() -> None:
    given = {"PREFILL_TENSOR_PARALLEL_SIZE": "2", "PREFILL_GPUS": "0,1",
             "DECODE_TENSOR_PARALLEL_SIZE": "4", "DECODE_GPUS": "2,3,4,5"}
    workers = _gpu_workers(given)
    assert workers == {"prefill-0": (2, ["0", "1"]), "decode-0": (4, ["2", "3", "4", "5"])}
    seen = [i for _, ids in workers.values() for i in ids]
    assert len(seen) == len(set(seen)), f"two workers share a GPU: {seen}"
    schema = compose_schema()
    jsonschema.validators.validator_for(schema)(schema).validate(load_compose(given))


def test_cpu_profile_runs_the_embedded_model_without_gpus() -> None:
    workers = {n: s for n, s in _services("cpu").items() if n not in ("gateway", "keys")}
    assert {s["command"][0] for s in workers.values()} == {"prefill", "decode"}
    for svc in workers.values():
        assert "deploy" not in svc
        assert svc["environment"]["PDSERVE_DEVICE"] == "cpu"
        assert svc["environment"]["PDSERVE_MODEL"] == "smollm2-135m"
        assert svc["image"] == "pdserve:cpu"


def test_cpu_profile_workers_share_the_host_cores_instead_of_a_thread_per_core_each() -> None:
    """Both CPU workers run on one host: each gets CPU_THREADS torch threads (default 1), which the
    worker's settings parse as --cpu-threads."""
    for given, want in ((None, 1), ({"CPU_THREADS": "4"}, 4)):
        for name, svc in _services("cpu", given).items():
            if name in ("gateway", "keys"):
                continue
            env = {k: str(v) for k, v in svc["environment"].items()}
            settings = check_cli(list(svc["command"]), env, name)
            assert isinstance(settings, WorkerSettings) and settings.cpu_threads == want, (name, given)


def test_every_service_health_checked_restarted_and_accepted_by_cli() -> None:
    for name, svc in load_compose()["services"].items():
        if name == "keys":  # the one-shot key maker (test_every_service_gets_the_fleet_keys)
            continue
        assert svc["restart"] == "unless-stopped"
        test = svc["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "/app/deploy/healthcheck.py"] and test[3] == svc["command"][0]
        env = {k: str(v) for k, v in svc["environment"].items()}
        check_cli(list(svc["command"]), env, f"compose service {name}")
        if name != "gateway":
            assert env["PDSERVE_GATEWAY_CONTROL"] == "tcp://gateway:7100"
            assert env["PDSERVE_ADVERTISE_HOST"] == name
            assert svc["depends_on"]["gateway"]["condition"] == "service_healthy"
            # a worker's health is its engine loop (HTTP /health on its metrics port), not a TCP connect
            assert probe_target(["pdserve", *test[3:]], env) == ProbeTarget(
                "http", "127.0.0.1", int(env["PDSERVE_METRICS_PORT"]), "/health")


def test_worker_ports_are_the_kubernetes_ones_by_role() -> None:
    """Prefill workers use 7200 (KV control) and 7210 (HTTP), decode workers 7201 and 7211, as the
    Kubernetes manifests and docs/deploy.md ("Ports") say; the compose file once gave every worker
    7200/7210."""
    from tests.deploy.common import rendered

    k8s = {}
    for res in rendered("cpu"):
        if res["kind"] == "Deployment" and res["metadata"]["name"] in ("pdserve-prefill", "pdserve-decode"):
            (c,) = res["spec"]["template"]["spec"]["containers"]
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            k8s[res["metadata"]["name"].removeprefix("pdserve-")] = (env["PDSERVE_PORT"],
                                                                     env["PDSERVE_METRICS_PORT"])
    assert k8s == {"prefill": ("7200", "7210"), "decode": ("7201", "7211")}
    for name, svc in load_compose()["services"].items():
        role = svc["command"][0]
        if role in k8s:
            env = {k: str(v) for k, v in svc["environment"].items()}
            assert (env["PDSERVE_PORT"], env["PDSERVE_METRICS_PORT"]) == k8s[role], name
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.gpu"):
        exposed = set(dict(_instructions(dockerfile))["EXPOSE"].split())
        assert {"8000", "7100", "7200", "7201", "7210", "7211"} <= exposed, dockerfile


def test_gateway_health_start_period_covers_the_tokenizer_preparation() -> None:
    """On an empty /cache the gateway converts its --tokenizer alias before /health answers; compose
    must not mark it unhealthy (the workers wait for a healthy gateway) before the conversion's deadline,
    nor must the image's own HEALTHCHECK."""
    from gateway.text import PREPARE_TIMEOUT_S

    check = load_compose()["services"]["gateway"]["healthcheck"]
    assert int(check["start_period"].removesuffix("s")) > PREPARE_TIMEOUT_S
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.gpu"):
        period = re.search(r"--start-period=(\d+)s", dict(_instructions(dockerfile))["HEALTHCHECK"])
        assert period is not None and int(period.group(1)) > PREPARE_TIMEOUT_S, dockerfile


def test_gateway_processes_and_worker_control_list_agree() -> None:
    """``GATEWAY_WORKERS=N`` runs N gateway processes (control ports 7100..7100+N-1) and
    ``GATEWAY_CONTROL`` gives the workers that list: the gateway's settings name the same endpoints
    the workers get, with the hosts as the workers reach them."""
    text = (DEPLOY / "docker-compose.yml").read_text()
    controls = "tcp://gateway:7100,tcp://gateway:7101,tcp://gateway:7102"
    given = {"GATEWAY_WORKERS": "3", "GATEWAY_CONTROL": controls}
    data = yaml.safe_load(re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}",
                                 lambda m: given.get(m.group(1), m.group(2) or ""), text))
    gateway = data["services"]["gateway"]
    env = {k: str(v) for k, v in gateway["environment"].items() if k != "PDSERVE_CURVE_KEYS"}
    settings = settings_from_args(build_parser({**env, **OPEN}).parse_args(gateway["command"]))
    assert isinstance(settings, GatewaySettings) and settings.workers == 3
    bound = [e.replace("0.0.0.0", "gateway") for e in settings.control_endpoints()]
    for name, svc in data["services"].items():
        if name not in ("gateway", "keys"):
            assert svc["environment"]["PDSERVE_GATEWAY_CONTROL"].split(",") == bound, name


def test_every_service_gets_the_fleet_keys() -> None:
    """The one-shot ``keys`` service makes the fleet's CURVE key pair once (kept on later ``up``s) in the
    pdserve-keys volume; every other service starts after it succeeded and mounts the volume read-only
    where PDSERVE_CURVE_KEYS points."""
    services = load_compose()["services"]
    keys = services.pop("keys")
    assert keys["command"] == ["keygen", "/keys", "--exist-ok"] and keys["volumes"] == ["pdserve-keys:/keys"]
    assert keys["restart"] == "no"
    assert "pdserve-keys" in load_compose()["volumes"]
    for name, svc in services.items():
        assert svc["environment"]["PDSERVE_CURVE_KEYS"] == "/keys", name
        assert "pdserve-keys:/keys:ro" in svc["volumes"], name
        assert svc["depends_on"]["keys"]["condition"] == "service_completed_successfully", name
        assert "PDSERVE_INSECURE_CONTROL_PLANE" not in svc["environment"], name


def _image_dirs(dockerfile: str) -> tuple[str, dict[str, str]]:
    """The image's user (its last ``USER``) and the directories its ``RUN`` lines make (``mkdir``), each
    with the user its ``chown`` gives it ("root" without one)."""
    ins = _instructions(dockerfile)
    made: dict[str, str] = {}
    for kind, arg in ins:
        if kind != "RUN":
            continue
        for command in re.split(r"&&|;", arg):
            words = shlex.split(command)
            if not words or words[0] not in ("mkdir", "chown"):
                continue
            operands = [w for w in words[1:] if not w.startswith("-")]
            if words[0] == "mkdir":
                made.update({path: made.get(path, "root") for path in operands})
            else:
                owner, *paths = operands
                made.update({path: owner.split(":")[0] for path in paths if path in made})
    users = [arg for kind, arg in ins if kind == "USER"]
    return (users[-1] if users else "root"), made


def test_every_named_volume_mount_point_is_owned_by_the_image_user() -> None:
    """A fresh named volume takes the ownership of the image's directory it is mounted on; with no such
    directory Docker makes the mount point root's, and a service running as the image's non-root user
    cannot write there (``keygen /keys`` fails with EACCES, and every service waits for ``keys``). So
    each path a service mounts from a named volume is made in the service's image and given to its
    user."""
    compose = load_compose()
    named = set(compose["volumes"])
    checked = set()
    for name, svc in compose["services"].items():
        dockerfile = Path(svc["build"]["dockerfile"]).name
        user, made = _image_dirs(dockerfile)
        assert user != "root", dockerfile
        for volume in svc.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source in named:
                assert made.get(target) == user, (
                    f"{name} mounts the volume {source} at {target}: {dockerfile} must make {target} "
                    f"owned by {user} (it is {made.get(target, 'not made')})")
                checked.add((dockerfile, target))
    assert {("Dockerfile.cpu", "/keys"), ("Dockerfile.gpu", "/keys"), ("Dockerfile.cpu", "/cache"),
            ("Dockerfile.gpu", "/cache")} <= checked


def test_keygen_exist_ok_keeps_the_pair(tmp_path: Path) -> None:
    from kvtransfer.curve import load_keys
    from pdserve.cli import main

    assert main(["keygen", str(tmp_path / "k"), "--exist-ok"]) == 0
    first = load_keys(tmp_path / "k")
    assert main(["keygen", str(tmp_path / "k"), "--exist-ok"]) == 0
    assert load_keys(tmp_path / "k") == first


OPEN = {"PDSERVE_INSECURE_CONTROL_PLANE": "1"}  # these settings need no key directory


def test_check_cli_rejects_unknown_and_misplaced_variables() -> None:
    with pytest.raises(AssertionError, match="PDSERVE_MODEL is not a flag"):
        check_cli(["gateway"], {"PDSERVE_MODEL": "x", **OPEN}, "t")  # gateway has --model-name, not --model
    with pytest.raises(AssertionError, match="PDSERVE_NUM_PREFILL is not a flag"):
        check_cli(["decode"], {"PDSERVE_NUM_PREFILL": "2", **OPEN}, "t")


def _instructions(name: str) -> list[tuple[str, str]]:
    text = (DEPLOY / name).read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


@pytest.mark.parametrize(("name", "base"), [("Dockerfile.cpu", "python:3.11-slim"),
                                            ("Dockerfile.gpu", "nvidia/cuda:13.")])
def test_dockerfile_installs_with_setup_sh_as_non_root(name: str, base: str) -> None:
    ins = _instructions(name)
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for k, a in ins if k == "ARG" and "=" in a}
    (from_,) = [a for k, a in ins if k == "FROM"]
    assert re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], from_).startswith(base)
    runs = [a for k, a in ins if k == "RUN"]
    installs = [r for r in runs if "pip install" in r or "setup.sh" in r]
    assert installs and all("bash scripts/setup.sh" in r for r in installs), installs
    kinds = [k for k, _ in ins]
    assert ("COPY", "--chown=pdserve:pdserve . /app") in ins
    assert kinds.index("USER") < kinds.index("RUN", kinds.index("COPY")), "setup.sh must not run as root"
    assert dict(ins)["USER"] == "pdserve"
    assert json.loads(dict(ins)["VOLUME"]) == ["/cache", "/models"]
    env = dict(kv.split("=", 1) for k, a in ins if k == "ENV" for kv in shlex.split(a))
    assert env["PDSERVE_CACHE_DIR"] == "/cache"
    assert "/app/deploy/healthcheck.py" in dict(ins)["HEALTHCHECK"]
    entry, cmd = json.loads(dict(ins)["ENTRYPOINT"]), json.loads(dict(ins)["CMD"])
    assert entry == ["pdserve"]
    image_env = {k: v for k, v in env.items() if k.startswith("PDSERVE_")}
    # the image's default command is the whole server on the embedded model, reachable from outside the
    # container, needing no keys (up makes a key pair for its internal planes); the deployments name a role
    assert cmd == ["up", "--host", "0.0.0.0"]
    assert isinstance(check_cli(cmd, image_env, f"{name} CMD"), UpSettings)
    # and the image's HEALTHCHECK asks that server's gateway
    assert probe_target(["/app/.venv/bin/python", "/app/.venv/bin/pdserve", *cmd], image_env) == ProbeTarget(
        "http", "127.0.0.1", 8000)


def test_cache_dir_variable_is_read_by_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.models.registry import cache_dir

    assert NON_FLAG_ENV == {"PDSERVE_CACHE_DIR": "engine.models.registry.cache_dir"}
    monkeypatch.setenv("PDSERVE_CACHE_DIR", "/cache")
    assert cache_dir() == Path("/cache")


def test_dashboard_queries_name_only_known_metrics() -> None:
    dash = json.loads((DEPLOY / "grafana" / "pdserve.json").read_text())
    known = known_metrics()
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bpdserve_\w+", e)}
    assert used <= known, used - known
    for needed in ("pdserve_ttft_seconds_bucket", "pdserve_tpot_seconds_bucket", "pdserve_itl_seconds_bucket",
                   "pdserve_kv_transfer_bytes_total", "pdserve_kv_transfer_seconds_total",
                   "pdserve_worker_waiting_requests", "pdserve_kv_blocks_used", "pdserve_requests_total"):
        assert needed in used, needed
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for e in exprs:
        assert e.count("(") == e.count(")"), e
        if "_bucket" in e:
            assert e.startswith("histogram_quantile(") and "by (le)" in e, e
