"""Shared loaders for the deploy tests: compose interpolation, rendered overlays, the metric list, and a
check of one container's command + PDSERVE_* environment through ``pdserve.cli.build_parser``."""

from __future__ import annotations

import argparse
import functools
import re
import tempfile
from pathlib import Path
from typing import Any

import yaml

from deploy.kustomize_lite import render
from kvtransfer.curve import generate_keys
from pdserve.cli import build_parser
from protocol.settings import Settings, settings_from_args

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "gpu", "rdma")
K8S_VERSION = "1.35.0"  # Kubernetes schema version the manifests are validated against
# PDSERVE_* variables that are not CLI flags, and who reads them.
NON_FLAG_ENV = {"PDSERVE_CACHE_DIR": "engine.models.registry.cache_dir"}
_INTERP = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(text: str, given: dict[str, str] | None = None) -> str:
    """Compose-style ``${VAR:-default}`` / ``${VAR}`` → the value in ``given``, else the default (or ""),
    as with an environment holding just ``given``."""
    values = given or {}
    return _INTERP.sub(lambda m: values.get(m.group(1), m.group(2) or ""), text)


def load_compose(given: dict[str, str] | None = None) -> dict[str, Any]:
    """docker-compose.yml, its variables set from ``given`` (others at their defaults)."""
    data: dict[str, Any] = yaml.safe_load(interpolate((DEPLOY / "docker-compose.yml").read_text(), given))
    return data


@functools.cache
def stand_in_keys() -> Path:
    """A CURVE key directory for settings checks of deploy files (theirs are container paths)."""
    directory = Path(tempfile.mkdtemp(prefix="pdserve-deploy-keys-")) / "keys"
    generate_keys(directory)
    return directory


@functools.cache
def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    return tuple(render(DEPLOY / "k8s" / "overlays" / overlay))


def known_metrics() -> set[str]:
    spec = yaml.safe_load((DEPLOY / "metrics.yaml").read_text())
    names: set[str] = set()
    for m in spec["metrics"]:
        names.add(m["name"])
        if m["type"] == "histogram":
            names |= {m["name"] + s for s in ("_bucket", "_sum", "_count")}
    return names


def pdserve_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("PDSERVE_")}


def check_cli(args: list[str], env: dict[str, str], where: str) -> Settings:
    """Assert ``pdserve <args>`` with ``env`` parses and builds valid settings, and that every
    ``PDSERVE_X`` in ``env`` is a flag ``--x`` of that subcommand giving the same value as the env.
    Returns those settings."""
    env = {k: v for k, v in pdserve_env(env).items() if k not in NON_FLAG_ENV}
    ns = build_parser(env).parse_args(args)
    checked = argparse.Namespace(**vars(ns))
    if getattr(ns, "curve_keys", None):  # a path inside the container: a key pair of the test's stands in
        checked.curve_keys = str(stand_in_keys())
    settings = settings_from_args(checked)  # raises ValueError on out-of-range values
    for name, value in env.items():
        dest = name.removeprefix("PDSERVE_").lower()
        flag = "--" + dest.replace("_", "-")
        assert dest in vars(ns), f"{where}: {name} is not a flag of `pdserve {args[0]}`"
        by_flag = build_parser({}).parse_args([*args, flag, value])
        assert getattr(by_flag, dest) == getattr(ns, dest), f"{where}: {name}={value!r} not read from env"
    return settings
