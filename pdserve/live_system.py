"""Live pdserve systems of real processes on 127.0.0.1, for the system tests and the benchmarks.

A system is a gateway plus either prefill and decode workers (``disagg``, one of each by default, KV
over NIXL by default) or one colocated worker per device (``colocated``; the gateway balances them by
in-flight requests). A worker placed on ``cuda:N`` gets ``--device cuda:N``, as ``pdserve up`` places
its workers (the engine makes that device current in every thread that runs a step); all GPUs stay
visible, so NIXL/UCX ``cuda_ipc`` over NVLink can map the peer's KV blocks. The environment (e.g.
``NCCL_NVLS_ENABLE=0``, ``PDSERVE_LOG_LEVEL``) is inherited.

* ``live_systems`` starts several systems at once and waits for all of them (their start-ups overlap:
  model load, CUDA graph capture, Triton JIT); ``live_system`` starts one.
* ``live_pair`` starts a disaggregated system and its colocated baseline, each behind its own gateway,
  so every request is routed deterministically without an override inside the gateway: what the system
  tests compare, and what ``bench.serving.disagg_vs_colocated`` measures.
* ``metric_samples``, ``kv_used``, ``registered`` and ``wait_all_free`` read a gateway's ``/metrics``
  (the KV-block leak check of every system-level suite).

It lives next to the launcher (``Supervisor``, ``free_ports``) because both ``bench/`` and ``tests/``
import it: ``tests/`` imports ``bench`` (plan and report tests), so a harness under ``tests/`` would make
``bench`` import ``tests`` back.
"""

from __future__ import annotations

import contextlib
import functools
import ssl
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvtransfer.curve import KEY_FILE, generate_keys
from pdserve.ports import free_ports
from pdserve.supervisor import Supervisor

Mode = Literal["disagg", "colocated"]
MODEL = "smollm2-135m"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass(frozen=True)
class SystemSpec:
    """What to start. ``devices``: one per worker (disagg: prefill then decode; colocated: one worker
    each), ``cpu``/``auto``/``cuda``/``cuda:N``; None = the workers' default device, one colocated worker.
    ``num_blocks``: KV blocks (of 16 tokens) per worker. ``worker_flags``/``gateway_flags``: extra flags.
    ``heartbeat_timeout_s``: the gateway declares a silent worker dead after this many seconds.
    ``api_key``: the gateway's ``--api-key`` (None: no key asked). ``num_prefill``/``num_decode``: workers
    of each role in a ``disagg`` system (children ``prefill``/``decode`` when one, else ``prefill-0``,
    ``prefill-1``, …), each on that role's device of ``devices``. ``prefill_flags``/``decode_flags``: extra
    flags of that role's workers only (e.g. each side's ``--tensor-parallel-size``)."""

    mode: Mode
    logs: Path
    model: str = MODEL
    devices: tuple[str, ...] | None = None
    num_blocks: int = 512
    worker_flags: tuple[str, ...] = ()
    gateway_flags: tuple[str, ...] = ()
    transfer_backend: str = "nixl"
    heartbeat_timeout_s: float = 5.0
    api_key: str | None = None
    num_prefill: int = 1
    num_decode: int = 1
    prefill_flags: tuple[str, ...] = ()
    decode_flags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in ("disagg", "colocated"):
            raise ValueError(f"mode must be 'disagg' or 'colocated', got {self.mode!r}")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(f"num_prefill and num_decode must be >= 1, got {self.num_prefill} and "
                             f"{self.num_decode}")
        if self.mode != "disagg" and ((self.num_prefill, self.num_decode) != (1, 1)
                                      or self.prefill_flags or self.decode_flags):
            raise ValueError("num_prefill, num_decode, prefill_flags and decode_flags apply to a disagg "
                             "system only")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.devices is not None and self.mode == "disagg" and len(self.devices) != 2:
            raise ValueError(f"disagg needs 2 devices (for its prefill workers, for its decode workers), "
                             f"got {self.devices!r}")
        if self.devices is not None and not self.devices:
            raise ValueError("devices must name at least one device")


@dataclass(frozen=True)
class LiveSystem:
    """A started system: the gateway ``url``, the ``sup``ervisor holding the children, their ``logs``
    directory, each child's pid by name (``gateway``, ``prefill``, ``decode``, ``colocated`` or
    ``colocated-<i>`` when there are several), the ``--worker-id`` of every worker, the gateway's API
    key (None when it asks for none), each child's ``pdserve`` argv (``restart`` starts it again) and
    each worker's own HTTP endpoint by child name (``metrics_urls``: ``/metrics``, ``/health``, ``/live``
    under it; ``workers.health_server``)."""

    url: str
    sup: Supervisor
    logs: Path
    pids: dict[str, int] = field(default_factory=dict)
    worker_ids: frozenset[str] = frozenset()
    api_key: str | None = None
    commands: dict[str, list[str]] = field(default_factory=dict)
    metrics_urls: dict[str, str] = field(default_factory=dict)

    def log(self, name: str) -> str:
        """The text child ``name`` has logged so far."""
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def restart(self, name: str) -> int:
        """Start child ``name`` again with its own argv (same worker id, same ports; a worker gets a new
        epoch), its output appended to its log; returns the new pid. The old process must have exited.

        Raises:
            KeyError: no child ``name``.
            RuntimeError: the old process is still running.
        """
        old = self.sup.children[name]
        if old.poll() is None:
            raise RuntimeError(f"{name} (pid {old.pid}) is still running")
        self.sup.start(name, self.commands[name], str(self.logs / f"{name}.log"))
        self.pids[name] = self.sup.children[name].pid
        return self.pids[name]


def worker_id(child: str) -> str:
    """The ``--worker-id`` of child ``child`` (``prefill`` → ``live-prefill``): the id the gateway's
    ``/metrics`` labels that worker's series with."""
    return f"live-{child}"


def num_workers(spec: SystemSpec) -> int:
    """Workers ``spec`` starts."""
    return spec.num_prefill + spec.num_decode if spec.mode == "disagg" else len(spec.devices or (None,))


def children(spec: SystemSpec, http_port: int, control: str, keys_dir: Path | None = None,
             metrics_ports: Sequence[int] = ()) -> list[tuple[str, list[str]]]:
    """(name, ``pdserve`` argv) of every child of ``spec``, gateway first. ``keys_dir``: the CURVE key
    directory every child gets (None: the spec's flags must say ``--insecure-control-plane``).
    ``metrics_ports``: each worker's ``--metrics-port``, in start order (empty: none)."""
    secure = [] if keys_dir is None else ["--curve-keys", str(keys_dir)]
    gateway = ["gateway", "--host", "127.0.0.1", "--port", str(http_port), "--control-bind", control,
               "--heartbeat-timeout", f"{spec.heartbeat_timeout_s:g}", *secure, *spec.gateway_flags]
    if spec.api_key is not None:
        gateway += ["--api-key", spec.api_key]
    worker = ["--model", spec.model, "--host", "127.0.0.1", "--gateway-control", control,
              "--num-blocks", str(spec.num_blocks), *secure, *spec.worker_flags]
    out: list[tuple[str, list[str]]] = [("gateway", gateway)]
    ports = iter(metrics_ports)

    def metrics() -> list[str]:
        port = next(ports, None)
        return [] if port is None else ["--metrics-port", str(port)]

    if spec.mode == "disagg":
        devices: Sequence[str | None] = spec.devices or (None, None)
        for role, device, count, own in zip(("prefill", "decode"), devices,
                                            (spec.num_prefill, spec.num_decode),
                                            (spec.prefill_flags, spec.decode_flags), strict=True):
            place = [] if device is None else ["--device", device]
            for i in range(count):
                name = role if count == 1 else f"{role}-{i}"
                out.append((name, [role, "--worker-id", worker_id(name), *worker, *own, *place, *metrics(),
                                   "--transfer-backend", spec.transfer_backend]))
        return out
    devices = spec.devices or (None,)
    for i, device in enumerate(devices):
        name = "colocated" if len(devices) == 1 else f"colocated-{i}"
        place = [] if device is None else ["--device", device]
        out.append((name, ["colocated", "--worker-id", worker_id(name), *worker, *place, *metrics()]))
    return out


def launch(spec: SystemSpec) -> LiveSystem:
    """Start every child of ``spec`` on free 127.0.0.1 ports without waiting; the caller stops them
    (``system.sup.stop_all()``), also when a later step fails. The control plane is CURVE with a key
    pair in ``spec.logs / "keys"`` (made once, 0700), unless the spec's flags say
    ``--insecure-control-plane``."""
    from engine.models.registry import resolve_model

    resolve_model(spec.model)  # convert/write the model dir once, before workers race for the cache
    http_port, control_port, *metrics_ports = free_ports(2 + num_workers(spec))
    spec.logs.mkdir(parents=True, exist_ok=True)
    keys_dir: Path | None = None
    if "--insecure-control-plane" not in (*spec.gateway_flags, *spec.worker_flags):
        keys_dir = spec.logs / "keys"
        if not (keys_dir / KEY_FILE).exists():
            generate_keys(keys_dir)
    sup = Supervisor(grace=10.0)
    plan = children(spec, http_port, f"tcp://127.0.0.1:{control_port}", keys_dir, metrics_ports)
    ids = frozenset(args[args.index("--worker-id") + 1] for _, args in plan if "--worker-id" in args)
    urls = {name: f"http://127.0.0.1:{args[args.index('--metrics-port') + 1]}"
            for name, args in plan if "--metrics-port" in args}
    system = LiveSystem(f"http://127.0.0.1:{http_port}", sup, spec.logs, worker_ids=ids, api_key=spec.api_key,
                        commands=dict(plan), metrics_urls=urls)
    try:
        for name, args in plan:
            sup.start(name, args, str(spec.logs / f"{name}.log"))
    except BaseException:
        sup.stop_all()
        raise
    system.pids.update({n: p.pid for n, p in sup.children.items()})
    return system


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every ``/metrics`` and ``/ready`` read: a new client would load the CA bundle
    each time (~20 ms of CPU; ``wait_all_free`` and ``wait_ready`` read several times a second)."""
    return httpx.create_ssl_context()


def metric_samples(url: str) -> Samples:
    """Every sample of the ``/metrics`` under ``url`` (a gateway's or a worker's): ``(name, sorted label
    pairs) → value`` (parsed with prometheus-client's text parser). Raises httpx.HTTPError when the
    server does not answer."""
    resp = httpx.get(f"{url}/metrics", timeout=5, trust_env=False, verify=_tls())
    resp.raise_for_status()
    out: Samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _by_worker(samples: Samples, name: str) -> dict[str, float]:
    return {dict(labels)["worker_id"]: v for (n, labels), v in samples.items() if n == name}


def kv_used(url: str) -> dict[str, float]:
    """worker_id → ``pdserve_kv_blocks_used`` (blocks) from the gateway's ``/metrics``."""
    return _by_worker(metric_samples(url), "pdserve_kv_blocks_used")


def registered(url: str) -> set[str]:
    """Worker ids the gateway at ``url`` reports a KV capacity for (registered and heartbeating).
    Raises httpx.HTTPError when /metrics cannot be read."""
    return set(_by_worker(metric_samples(url), "pdserve_kv_blocks_capacity"))


def wait_all_free(url: str, workers: frozenset[str] | set[str], timeout: float = 30.0) -> dict[str, float]:
    """Poll until every worker in ``workers`` reports 0 KV blocks used (heartbeats lag, hence the
    deadline of ``timeout`` s: on a loaded 2-core machine a colocated worker can take more than 15 s
    to report an aborted stream's block free) and nothing is in flight at the gateway; returns the
    last reading.

    Raises AssertionError naming the workers still holding blocks.
    """
    deadline = time.monotonic() + timeout
    used: dict[str, float] = {}
    in_flight = -1.0
    while time.monotonic() < deadline:
        samples = metric_samples(url)
        used = _by_worker(samples, "pdserve_kv_blocks_used")
        in_flight = samples.get(("pdserve_requests_in_flight", ()), 0.0)
        if set(used) >= set(workers) and all(used[w] == 0 for w in workers) and in_flight == 0:
            return used
        time.sleep(0.1)  # the workers heartbeat every 0.5 s: a coarser poll only adds to each wait
    raise AssertionError(f"after {timeout} s: KV blocks used {used}, requests in flight {in_flight}")


def _ready(system: LiveSystem) -> bool:
    """``/ready`` answers 200 and every worker of ``system`` has registered (``/ready`` alone turns
    200 with the first colocated worker; a sweep must not start before the second one is up)."""
    with contextlib.suppress(httpx.HTTPError):
        if httpx.get(f"{system.url}/ready", timeout=2, trust_env=False, verify=_tls()).status_code == 200:
            return registered(system.url) >= system.worker_ids
    return False


def _log_tail(path: str | None, lines: int = 25) -> str:
    """The last ``lines`` lines of a child's log file, as text to append to an error (a test run on CI
    keeps only what the error says: the log directory is gone with the machine); empty without a log."""
    if path is None:
        return ""
    try:
        tail = Path(path).read_text(errors="replace").splitlines()[-lines:]
    except OSError as exc:
        return f"\n--- {path}: unreadable ({exc})"
    return f"\n--- last {len(tail)} lines of {path}:\n" + "\n".join(tail)


def wait_ready(systems: Sequence[LiveSystem], timeout_s: float) -> None:
    """Wait until each system is ready (``_ready``). Raises RuntimeError naming the system, with the end
    of each exited child's log, if a child exits or ``timeout_s`` seconds pass."""
    deadline = time.monotonic() + timeout_s
    pending = list(systems)
    while pending:
        for system in list(pending):
            if dead := system.sup.dead():
                raise RuntimeError(f"child exited during start-up: {dead}; logs in {system.logs}"
                                   + "".join(_log_tail(system.sup.log_paths.get(name)) for name, _ in dead))
            if _ready(system):
                pending.remove(system)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"not ready after {timeout_s:.0f} s; logs in {[str(s.logs) for s in pending]}")
        time.sleep(0.5 if pending else 0)


@contextlib.contextmanager
def live_systems(specs: Sequence[SystemSpec], ready_timeout_s: float = 240.0) -> Iterator[list[LiveSystem]]:
    """Start every system of ``specs`` at once, wait until all are ready, yield them (in order); stop
    everything on exit, also when start-up fails (the systems stop at once, each in its own thread, so
    one that is slow to stop does not delay the others). Raises RuntimeError (see ``wait_ready``),
    ValueError (bad spec, before anything starts), FileNotFoundError (unknown model)."""
    systems: list[LiveSystem] = []
    try:
        for spec in specs:
            systems.append(launch(spec))
        wait_ready(systems, ready_timeout_s)
        yield systems
    finally:
        with ThreadPoolExecutor(max_workers=max(1, len(systems))) as pool:
            for stopping in [pool.submit(system.sup.stop_all) for system in systems]:
                stopping.result()


@contextlib.contextmanager
def live_system(mode: Mode, logs: Path, *, num_blocks: int = 512, transfer_backend: str = "nixl",
                gateway_flags: Sequence[str] = (), heartbeat_timeout_s: float = 5.0,
                ready_timeout_s: float = 240.0, model: str = MODEL, devices: Sequence[str] | None = None,
                worker_flags: Sequence[str] = (), num_prefill: int = 1, num_decode: int = 1
                ) -> Iterator[LiveSystem]:
    """Start one ``mode`` system (see ``SystemSpec`` for the arguments), wait for ``/ready`` (at most
    ``ready_timeout_s`` seconds), yield it, stop it on exit.

    Raises ValueError (unknown mode, ``num_blocks`` < 1, wrong device count) before starting anything,
    RuntimeError when a child dies during start-up or the gateway is not ready in time.
    """
    spec = SystemSpec(mode, logs, model, None if devices is None else tuple(devices), num_blocks,
                      tuple(worker_flags), tuple(gateway_flags), transfer_backend, heartbeat_timeout_s,
                      num_prefill=num_prefill, num_decode=num_decode)
    with live_systems([spec], ready_timeout_s) as systems:
        yield systems[0]


@dataclass(frozen=True)
class SystemPair:
    """A disaggregated system (``disagg``: gateway, prefill, decode) and its colocated baseline
    (``colo``: gateway, one colocated worker), started with the same model, flags and API key."""

    disagg: LiveSystem
    colo: LiveSystem

    @property
    def disagg_url(self) -> str:
        return self.disagg.url

    @property
    def colo_url(self) -> str:
        return self.colo.url

    @property
    def api_key(self) -> str | None:
        return self.disagg.api_key

    def pairs(self) -> tuple[tuple[str, frozenset[str]], ...]:
        """``(gateway url, its worker ids)`` for both gateways."""
        return ((self.disagg.url, self.disagg.worker_ids), (self.colo.url, self.colo.worker_ids))

    def dead(self) -> list[tuple[str, int]]:
        """``(system/child, exit code)`` of every child of either system that has exited."""
        return [(f"{mode}/{name}", code) for mode, system in (("disagg", self.disagg), ("colo", self.colo))
                for name, code in system.sup.dead()]


@contextlib.contextmanager
def live_pair(logs: Path, *, model: str = MODEL, num_blocks: int = 512, worker_flags: Sequence[str] = (),
              gateway_flags: Sequence[str] = (), heartbeat_timeout_s: float = 5.0, api_key: str | None = None,
              ready_timeout_s: float = 240.0) -> Iterator[SystemPair]:
    """Start a disaggregated system (logs in ``logs/disagg``) and a colocated one (``logs/colo``) at
    once, wait until both are ready, yield them, stop both on exit (see ``live_systems`` for errors)."""
    modes: tuple[tuple[Mode, str], ...] = (("disagg", "disagg"), ("colocated", "colo"))
    specs = [SystemSpec(mode, logs / name, model, None, num_blocks, tuple(worker_flags), tuple(gateway_flags),
                        heartbeat_timeout_s=heartbeat_timeout_s, api_key=api_key) for mode, name in modes]
    with live_systems(specs, ready_timeout_s) as (disagg, colo):
        yield SystemPair(disagg, colo)
