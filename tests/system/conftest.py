"""One pdserve system per test session, as real processes on 127.0.0.1 (the embedded SmolLM2, NIXL).

* gateway ``disagg`` (``--disagg-threshold 0``): one prefill and one decode worker, KV over NIXL;
* gateway ``colo``: one colocated worker — the baseline. Two gateways route each test request
  deterministically (disaggregated vs colocated) without a routing override inside the gateway.
The model is converted once into the pdserve cache (``engine.models.registry.cache_dir``) and reused.
Worker logs (decode at debug level, so its received messages are visible) live in a session tmp dir.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdserve.launcher import Supervisor, free_port

WORKER_FLAGS = ["--model", "smollm2-135m", "--num-blocks", "256", "--host", "127.0.0.1"]


@dataclass
class System:
    """URLs of both gateways, the supervisor holding every child, and the log directory."""

    disagg_url: str
    colo_url: str
    sup: Supervisor
    logs: Path

    def log(self, name: str) -> str:
        """The text logged so far by child ``name``."""
        return (self.logs / f"{name}.log").read_text(errors="replace")


def _wait_ready(sys_: System, timeout: float) -> None:
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


@pytest.fixture(scope="session")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    """Start both gateways and the three workers; stop them all at the end of the session."""
    from engine.models.registry import resolve_model

    resolve_model("smollm2-135m")  # convert once, before three workers race for the cache
    logs = tmp_path_factory.mktemp("system_logs")
    sup = Supervisor(grace=10.0)
    ports = {name: free_port() for name in ("dh", "dc", "ch", "cc")}
    dctl, cctl = f"tcp://127.0.0.1:{ports['dc']}", f"tcp://127.0.0.1:{ports['cc']}"
    gw = ["--heartbeat-timeout", "5", "--request-timeout", "120", "--log-level", "info"]
    children = [
        ("gateway-disagg", ["gateway", "--port", str(ports["dh"]), "--control-bind", dctl, *gw]),
        ("gateway-colo", ["gateway", "--port", str(ports["ch"]), "--control-bind", cctl, *gw]),
        ("prefill", ["prefill", "--gateway-control", dctl, "--worker-id", "sys-prefill", *WORKER_FLAGS]),
        ("decode", ["decode", "--gateway-control", dctl, "--worker-id", "sys-decode", "--log-level", "debug",
                    *WORKER_FLAGS]),
        ("colocated", ["colocated", "--gateway-control", cctl, "--worker-id", "sys-colo", *WORKER_FLAGS]),
    ]
    sys_ = System(f"http://127.0.0.1:{ports['dh']}", f"http://127.0.0.1:{ports['ch']}", sup, logs)
    try:
        for name, args in children:
            sup.start(name, args, str(logs / f"{name}.log"))
        _wait_ready(sys_, timeout=240)
        yield sys_
    finally:
        sup.stop_all()
