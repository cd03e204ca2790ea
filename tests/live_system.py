"""A live pdserve system as real processes on 127.0.0.1 (the embedded SmolLM2 on CPU, KV over NIXL), and
the probes the system-level suites share: readiness, ``/metrics`` samples, KV-block leak checks.

Two gateways route every request deterministically without any override inside the gateway:

* ``disagg`` (``--disagg-threshold 0``): one prefill and one decode worker;
* ``colo``: one colocated worker — the baseline the disaggregated answers are compared with.

``start_system`` is a context manager (one system per test session: the suites wrap it in a session
fixture). Extra gateway flags (API key, caps) go to both gateways. Worker logs live in ``logs``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.launcher import Supervisor, free_ports

MODEL = "smollm2-135m"
WORKER_FLAGS = ("--model", MODEL, "--num-blocks", "256", "--host", "127.0.0.1")
DISAGG_WORKERS = frozenset({"sys-prefill", "sys-decode"})
COLO_WORKERS = frozenset({"sys-colo"})


@dataclass
class System:
    """URLs of both gateways, the supervisor holding every child, the log directory and the API key
    (None when the gateways take none)."""

    disagg_url: str
    colo_url: str
    sup: Supervisor
    logs: Path
    api_key: str | None = None

    def log(self, name: str) -> str:
        """The text logged so far by child ``name`` (``gateway-disagg``, ``prefill``, ``decode`` …)."""
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def pairs(self) -> tuple[tuple[str, frozenset[str]], ...]:
        """``(gateway url, its worker ids)`` for both gateways."""
        return ((self.disagg_url, DISAGG_WORKERS), (self.colo_url, COLO_WORKERS))


def _wait_ready(sys_: System, timeout: float) -> None:
    """Poll both gateways' ``/ready`` until 200. Raises RuntimeError (child died, or ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    pending = {sys_.disagg_url, sys_.colo_url}
    while pending and time.monotonic() < deadline:
        dead = sys_.sup.dead()
        if dead:
            raise RuntimeError(f"child exited during start-up: {dead}; logs in {sys_.logs}")
        for url in list(pending):
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    pending.discard(url)
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    if pending:
        raise RuntimeError(f"not ready after {timeout} s: {pending}; logs in {sys_.logs}")


@contextmanager
def start_system(logs: Path, gateway_flags: Sequence[str] = (), api_key: str | None = None,
                 ready_timeout: float = 240.0) -> Iterator[System]:
    """Start two gateways and three workers; stop them all on exit (also when start-up fails).

    ``gateway_flags`` are extra ``pdserve gateway`` flags for both gateways; ``api_key`` is added as
    ``--api-key``. Raises RuntimeError when a child dies during start-up or ``ready_timeout`` s pass.
    """
    from engine.models.registry import resolve_model

    resolve_model(MODEL)  # convert once, before three workers race for the cache
    sup = Supervisor(grace=10.0)
    ports = dict(zip(("dh", "dc", "ch", "cc"), free_ports(4), strict=True))
    dctl, cctl = f"tcp://127.0.0.1:{ports['dc']}", f"tcp://127.0.0.1:{ports['cc']}"
    gw = ["--heartbeat-timeout", "5", "--request-timeout", "120", "--log-level", "info", *gateway_flags]
    if api_key is not None:
        gw += ["--api-key", api_key]
    children = [
        ("gateway-disagg", ["gateway", "--port", str(ports["dh"]), "--control-bind", dctl, *gw]),
        ("gateway-colo", ["gateway", "--port", str(ports["ch"]), "--control-bind", cctl, *gw]),
        ("prefill", ["prefill", "--gateway-control", dctl, "--worker-id", "sys-prefill", *WORKER_FLAGS]),
        ("decode", ["decode", "--gateway-control", dctl, "--worker-id", "sys-decode", "--log-level", "debug",
                    *WORKER_FLAGS]),
        ("colocated", ["colocated", "--gateway-control", cctl, "--worker-id", "sys-colo", *WORKER_FLAGS]),
    ]
    sys_ = System(f"http://127.0.0.1:{ports['dh']}", f"http://127.0.0.1:{ports['ch']}", sup, logs, api_key)
    try:
        for name, args in children:
            sup.start(name, args, str(logs / f"{name}.log"))
        _wait_ready(sys_, ready_timeout)
        yield sys_
    finally:
        sup.stop_all()


def metric_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the gateway's ``/metrics``: ``(name, sorted label pairs) → value`` (parsed with
    prometheus-client's text parser). Raises httpx.HTTPError when the gateway does not answer."""
    resp = httpx.get(f"{url}/metrics", timeout=5)
    resp.raise_for_status()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def kv_used(url: str) -> dict[str, float]:
    """worker_id → ``pdserve_kv_blocks_used`` (blocks) from the gateway's ``/metrics``."""
    return {dict(labels)["worker_id"]: v for (name, labels), v in metric_samples(url).items()
            if name == "pdserve_kv_blocks_used"}


def wait_all_free(url: str, workers: frozenset[str] | set[str], timeout: float = 15.0) -> dict[str, float]:
    """Poll until every worker in ``workers`` reports 0 KV blocks used (heartbeats lag, hence the
    deadline of ``timeout`` s) and nothing is in flight at the gateway; returns the last reading.

    Raises AssertionError naming the workers still holding blocks.
    """
    deadline = time.monotonic() + timeout
    used: dict[str, float] = {}
    in_flight = -1.0
    while time.monotonic() < deadline:
        samples = metric_samples(url)
        used = {dict(lb)["worker_id"]: v for (n, lb), v in samples.items() if n == "pdserve_kv_blocks_used"}
        in_flight = samples.get(("pdserve_requests_in_flight", ()), 0.0)
        if set(used) >= set(workers) and all(used[w] == 0 for w in workers) and in_flight == 0:
            return used
        time.sleep(0.25)
    raise AssertionError(f"after {timeout} s: KV blocks used {used}, requests in flight {in_flight}")
