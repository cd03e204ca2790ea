"""Live pdserve systems of real processes on 127.0.0.1 for benchmarks and system tests.

A system is a gateway plus either one prefill and one decode worker (``disagg``, KV over NIXL by
default) or one colocated worker per device (``colocated``; the gateway balances them by in-flight
requests). A worker placed on ``cuda:N`` gets ``--device cuda:N``, as ``pdserve up`` places its workers
(the engine makes that device current in every thread that runs a step); all GPUs stay visible, so
NIXL/UCX ``cuda_ipc`` over NVLink can map the peer's KV blocks. The rest of the environment (e.g.
``NCCL_NVLS_ENABLE=0``) is inherited. ``live_systems`` starts several systems at once and waits for all
of them (their start-ups overlap: CUDA graph capture, Triton JIT). ``live_system`` (one system) is what
``tests/loadtest/test_live.py`` and the bench start systems with.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.launcher import Supervisor, free_port

Mode = Literal["disagg", "colocated"]
MODEL = "smollm2-135m"


@dataclass(frozen=True)
class SystemSpec:
    """What to start. ``devices``: one per worker (disagg: prefill then decode; colocated: one worker
    each), ``cpu``/``auto``/``cuda``/``cuda:N``; None = the workers' default device, one colocated worker.
    ``num_blocks``: KV blocks (of 16 tokens) per worker. ``worker_flags``/``gateway_flags``: extra flags.
    ``heartbeat_timeout_s``: the gateway declares a silent worker dead after this many seconds."""

    mode: Mode
    logs: Path
    model: str = MODEL
    devices: tuple[str, ...] | None = None
    num_blocks: int = 512
    worker_flags: tuple[str, ...] = ()
    gateway_flags: tuple[str, ...] = ()
    transfer_backend: str = "nixl"
    heartbeat_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.mode not in ("disagg", "colocated"):
            raise ValueError(f"mode must be 'disagg' or 'colocated', got {self.mode!r}")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.devices is not None and self.mode == "disagg" and len(self.devices) != 2:
            raise ValueError(f"disagg needs 2 devices (prefill, decode), got {self.devices!r}")
        if self.devices is not None and not self.devices:
            raise ValueError("devices must name at least one device")


@dataclass(frozen=True)
class LiveSystem:
    """A started system: the gateway ``url``, the ``sup``ervisor holding the children, their ``logs``
    directory, each child's pid by name (``gateway``, ``prefill``, ``decode``, ``colocated`` or
    ``colocated-<i>`` when there are several) and the ``--worker-id`` of every worker."""

    url: str
    sup: Supervisor
    logs: Path
    pids: dict[str, int] = field(default_factory=dict)
    worker_ids: frozenset[str] = frozenset()

    def log(self, name: str) -> str:
        """The text child ``name`` has logged so far."""
        return (self.logs / f"{name}.log").read_text(errors="replace")


def _placement(device: str | None) -> tuple[list[str], dict[str, str]]:
    """(``--device`` flags, extra env) of one worker placed on ``device`` (None: the worker's default)."""
    if device is None:
        return [], {}
    return ["--device", device], {}


def children(spec: SystemSpec, http_port: int, control: str) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, ``pdserve`` argv, extra env) of every child of ``spec``, gateway first."""
    gateway = ["gateway", "--host", "127.0.0.1", "--port", str(http_port), "--control-bind", control,
               "--heartbeat-timeout", f"{spec.heartbeat_timeout_s:g}", *spec.gateway_flags]
    worker = ["--model", spec.model, "--host", "127.0.0.1", "--gateway-control", control,
              "--num-blocks", str(spec.num_blocks), *spec.worker_flags]
    out: list[tuple[str, list[str], dict[str, str]]] = [("gateway", gateway, {})]
    if spec.mode == "disagg":
        devices: Sequence[str | None] = spec.devices or (None, None)
        for (role, wid), device in zip((("prefill", "bench-prefill"), ("decode", "bench-decode")), devices,
                                       strict=True):
            flags, env = _placement(device)
            out.append((role, [role, "--worker-id", wid, *worker, *flags,
                               "--transfer-backend", spec.transfer_backend], env))
        return out
    devices = spec.devices or (None,)
    for i, device in enumerate(devices):
        one = len(devices) == 1
        name, wid = ("colocated", "bench-colo") if one else (f"colocated-{i}", f"bench-colo-{i}")
        flags, env = _placement(device)
        out.append((name, ["colocated", "--worker-id", wid, *worker, *flags], env))
    return out


def _start_child(sup: Supervisor, name: str, args: list[str], log_path: Path, env: dict[str, str]) -> None:
    """Like ``Supervisor.start`` (``python -m pdserve.cli *args``, output appended to ``log_path``) with
    ``env`` added to the inherited environment; the child joins ``sup.children``."""
    with open(log_path, "ab") as out:
        sup.children[name] = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *args],
                                              env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)


def launch(spec: SystemSpec) -> LiveSystem:
    """Start every child of ``spec`` on free 127.0.0.1 ports without waiting; the caller stops them
    (``system.sup.stop_all()``), also when a later step fails."""
    from engine.models.registry import resolve_model

    resolve_model(spec.model)  # convert/write the model dir once, before workers race for the cache
    http_port, control = free_port(), f"tcp://127.0.0.1:{free_port()}"
    spec.logs.mkdir(parents=True, exist_ok=True)
    sup = Supervisor(grace=10.0)
    plan = children(spec, http_port, control)
    ids = frozenset(args[args.index("--worker-id") + 1] for _, args, _ in plan if "--worker-id" in args)
    system = LiveSystem(f"http://127.0.0.1:{http_port}", sup, spec.logs, worker_ids=ids)
    try:
        for name, args, env in plan:
            _start_child(sup, name, args, spec.logs / f"{name}.log", env)
    except BaseException:
        sup.stop_all()
        raise
    system.pids.update({n: p.pid for n, p in sup.children.items()})
    return system


def registered(url: str) -> set[str]:
    """Worker ids the gateway at ``url`` reports a KV capacity for (registered and heartbeating).
    Raises httpx.HTTPError when /metrics cannot be read."""
    text = httpx.get(f"{url}/metrics", timeout=2, trust_env=False).text
    return {s.labels["worker_id"] for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "pdserve_kv_blocks_capacity"}


def _ready(system: LiveSystem) -> bool:
    """``/ready`` answers 200 and every worker of ``system`` has registered (``/ready`` alone turns
    200 with the first colocated worker; a sweep must not start before the second one is up)."""
    with contextlib.suppress(httpx.HTTPError):
        if httpx.get(f"{system.url}/ready", timeout=2, trust_env=False).status_code == 200:
            return registered(system.url) >= system.worker_ids
    return False


def wait_ready(systems: Sequence[LiveSystem], timeout_s: float) -> None:
    """Wait until each system is ready (``_ready``). Raises RuntimeError naming the system if a child
    exits or ``timeout_s`` seconds pass."""
    deadline = time.monotonic() + timeout_s
    pending = list(systems)
    while pending:
        for system in list(pending):
            if dead := system.sup.dead():
                raise RuntimeError(f"child exited during start-up: {dead}; logs in {system.logs}")
            if _ready(system):
                pending.remove(system)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"not ready after {timeout_s:.0f} s; logs in {[str(s.logs) for s in pending]}")
        time.sleep(0.5 if pending else 0)


@contextlib.contextmanager
def live_systems(specs: Sequence[SystemSpec], ready_timeout_s: float = 240.0) -> Iterator[list[LiveSystem]]:
    """Start every system of ``specs`` at once, wait until all are ready, yield them (in order); stop
    everything on exit, also when start-up fails. Raises RuntimeError (see ``wait_ready``), ValueError
    (bad spec, before anything starts), FileNotFoundError (unknown model)."""
    systems: list[LiveSystem] = []
    try:
        for spec in specs:
            systems.append(launch(spec))
        wait_ready(systems, ready_timeout_s)
        yield systems
    finally:
        for system in systems:
            system.sup.stop_all()


@contextlib.contextmanager
def live_system(mode: Mode, logs: Path, *, num_blocks: int = 512, transfer_backend: str = "nixl",
                gateway_flags: Sequence[str] = (), heartbeat_timeout_s: float = 5.0,
                ready_timeout_s: float = 240.0, model: str = MODEL, devices: Sequence[str] | None = None,
                worker_flags: Sequence[str] = ()) -> Iterator[LiveSystem]:
    """Start one ``mode`` system (see ``SystemSpec`` for the arguments), wait for ``/ready`` (at most
    ``ready_timeout_s`` seconds), yield it, stop it on exit.

    Raises ValueError (unknown mode, ``num_blocks`` < 1, wrong device count) before starting anything,
    RuntimeError when a child dies during start-up or the gateway is not ready in time.
    """
    spec = SystemSpec(mode, logs, model, None if devices is None else tuple(devices), num_blocks,
                      tuple(worker_flags), tuple(gateway_flags), transfer_backend, heartbeat_timeout_s)
    with live_systems([spec], ready_timeout_s) as systems:
        yield systems[0]
