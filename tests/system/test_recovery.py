"""Recovery of the control plane, through real processes: a stalled worker and a restarted gateway.

Both used to leave a live worker unusable forever: the gateway dropped a worker whose heartbeats paused
longer than ``--heartbeat-timeout`` (a stall under load, not a death) and ignored its later heartbeats;
a restarted gateway ignored the heartbeats of workers registered with its previous incarnation. Now the
gateway answers a heartbeat from a worker it does not know with ``ReRegister``, the worker registers again
with the same epoch, and requests flow again. Requests that were in flight on a stalled worker are failed
to their clients and aborted on the worker, so its KV blocks come back.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtransfer.curve import generate_keys
from pdserve.ports import free_ports
from pdserve.supervisor import Supervisor

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT = 1.5


def _wait(url: str, status: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(f"{url}/ready", timeout=2).status_code
            if last == status:
                return
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise AssertionError(f"/ready never answered {status} within {timeout} s (last: {last})")


def _complete(url: str) -> str:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def _blocks_used(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve_kv_blocks_used{"))


class Mini:
    """A gateway and one colocated worker; the gateway can be restarted on the same ports."""

    def __init__(self, logs: Path) -> None:
        self.sup, self.logs = Supervisor(grace=10.0), logs
        self.http, self.ctl = free_ports(2)
        self.url = f"http://127.0.0.1:{self.http}"
        self.starts = 0
        self.keys = str(logs / "keys")  # the fleet's CURVE key pair, kept across the gateway's restart
        generate_keys(self.keys)

    def start_gateway(self) -> None:
        self.starts += 1
        self.sup.start(f"gateway-{self.starts}", [
            "gateway", "--port", str(self.http), "--control-bind", f"tcp://127.0.0.1:{self.ctl}",
            "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--curve-keys", self.keys],
            str(self.logs / f"gateway-{self.starts}.log"))

    def start_worker(self) -> None:
        self.sup.start("colocated", [
            "colocated", "--gateway-control", f"tcp://127.0.0.1:{self.ctl}", "--worker-id", "rec-colo",
            "--model", "smollm2-135m", "--num-blocks", "128", "--curve-keys", self.keys],
            str(self.logs / "colocated.log"))

    def pid(self, name: str) -> int:
        return self.sup.children[name].pid


@pytest.fixture(scope="module")
def mini(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mini]:
    from engine.models.registry import resolve_model

    resolve_model("smollm2-135m")
    m = Mini(tmp_path_factory.mktemp("recovery_logs"))
    try:
        m.start_gateway()
        m.start_worker()
        _wait(m.url, 200, 240)
        yield m
    finally:
        m.sup.stop_all()


def test_worker_stalled_past_heartbeat_timeout_registers_again(mini: Mini) -> None:
    expected = _complete(mini.url)
    worker = mini.pid("colocated")
    os.kill(worker, signal.SIGSTOP)
    try:
        _wait(mini.url, 503, HEARTBEAT_TIMEOUT + 10)  # declared lost while stopped
    finally:
        os.kill(worker, signal.SIGCONT)
    _wait(mini.url, 200, 30)  # heartbeat → ReRegister → registered again (same epoch)
    assert _complete(mini.url) == expected
    assert "reregistering" in (mini.logs / "colocated.log").read_text()


def test_restarted_gateway_gets_its_workers_back(mini: Mini) -> None:
    expected = _complete(mini.url)
    old = mini.sup.children[f"gateway-{mini.starts}"]
    old.send_signal(signal.SIGTERM)
    old.wait(15)
    mini.start_gateway()
    _wait(mini.url, 200, 60)
    assert _complete(mini.url) == expected
    deadline = time.monotonic() + 10
    while _blocks_used(mini.url) != 0 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _blocks_used(mini.url) == 0
