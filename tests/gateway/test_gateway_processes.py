"""``pdserve gateway --workers N``: N processes behind one HTTP port, supervised by a parent.

Real processes: the gateway pool (``python -m pdserve.cli gateway --workers 2``) and fake prefill/decode
workers (tests/fakes/fake_worker.py) given both control addresses. Requests over the one port all
succeed and both processes take some (the fake workers record which control socket each request came
through); ``/metrics`` from either process counts every request; ``kill -9`` of one process: the parent
restarts it (a new pid in ``/v1/status``), requests over new connections keep succeeding all through the
restart (the new process listens only once the workers have registered with it; one whose workers never
come listens after the hold, two heartbeat timeouts), the workers register with the new one and no KV
block leaks; SIGTERM stops the parent and every process. A process that cannot
start stops the pool with one line; a bad ``--workers`` is refused up front (a busy control port and a
bad ``--tokenizer`` too: test_gateway_refusals.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import Gauge

from gateway.metrics import GatewayMetrics
from gateway.server import _reporting_lifespan
from pdserve.cli import main
from pdserve.gateway_pool import GatewayPool, PoolFailed
from pdserve.ports import free_port_range, free_ports
from pdserve.supervisor import RestartPolicy
from protocol.settings import GatewaySettings
from tests.gateway.conftest import MSGS, REPLY, ROOT, read_record, wait_until

START_S = 60.0  # a gateway process imports FastAPI and loads the tokenizer: seconds on a busy 2-core box
LONG = 20_000  # tokens of the stream cut by the kill: at the fake's 5 ms a step it would run 100 s


class Pool:
    """The gateway pool process (its output in ``gateway.log``) and fake workers given every control
    endpoint; ``close`` stops them all."""

    def __init__(self, tmp: Path, tokenizer: Path, workers: int = 2, heartbeat_timeout: float = 1.5) -> None:
        self.tmp = tmp
        [self.port] = free_ports(1)
        first = free_port_range(workers, exclude=(self.port,))
        self.controls = [f"tcp://127.0.0.1:{first + i}" for i in range(workers)]
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "gateway.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115
        argv = [sys.executable, "-m", "pdserve.cli", "gateway", "--workers", str(workers), "--port",
                str(self.port), "--control-bind", self.controls[0], "--tokenizer", str(tokenizer),
                "--insecure-control-plane", "--heartbeat-timeout", str(heartbeat_timeout), "--log-level",
                "info"]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.tmpdir = tmp / "pool-tmp"  # the pool's TMPDIR: where its metrics directory goes
        self.tmpdir.mkdir()
        self.gateway = self._spawn(argv, self.log, {"TMPDIR": str(self.tmpdir)})

    def _spawn(self, argv: list[str], out: object,
               env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                                stdout=out, stderr=subprocess.STDOUT)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        assert self.gateway.poll() is None, f"gateway pool exited:\n{self.text()[-3000:]}"
        return True

    def start_worker(self, role: str, worker_id: str, output_ids: list[int],
                     controls: list[str] | None = None) -> Path:
        """A fake worker given ``controls`` (default: every process's control endpoint)."""
        record = self.tmp / f"{worker_id}.jsonl"
        self._spawn([sys.executable, "-m", "tests.fakes.fake_worker", "--role", role, "--worker-id",
                     worker_id, "--gateway-control", ",".join(controls or self.controls), "--record",
                     str(record),
                     "--output-ids", ",".join(map(str, output_ids)), "--max-model-len", str(LONG * 2)],
                    subprocess.DEVNULL)
        return record

    def status(self) -> dict:
        """``/v1/status`` over a fresh connection (so any process may answer)."""
        with httpx.Client(timeout=5) as client:
            return client.get(self.base + "/v1/status").json()

    def pids_serving(self, want: int) -> dict[int, int]:
        """Process index → pid, from ``/v1/status`` answers of processes that see both workers live;
        polls (fresh connections) until ``want`` processes answered so."""
        seen: dict[int, int] = {}

        def enough() -> bool:
            self.alive()
            try:
                body = self.status()
            except httpx.HTTPError:
                return False
            if body["ready"] and len(body["workers"]) == 2:
                seen[body["process"]["index"]] = body["process"]["pid"]
            return len(seen) == want

        wait_until(enough, START_S, f"{want} gateway processes ready with both workers")
        return seen

    @contextlib.contextmanager
    def connection_to(self, index: int) -> Iterator[httpx.Client]:
        """A client whose one keep-alive connection a given gateway process took (new connections until
        ``/v1/status`` on one names that process)."""
        for _ in range(100):
            client = httpx.Client(base_url=self.base, timeout=20,
                                  limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
            if client.get("/v1/status").json()["process"]["index"] == index:
                try:
                    yield client
                finally:
                    client.close()
                return
            client.close()
        raise AssertionError(f"no connection reached gateway process {index} in 100 tries")

    def chat(self, n: int, max_tokens: int) -> list[str]:
        """``n`` chat completions, each over a new connection (the kernel spreads them over the
        processes); returns their texts (asserting 200)."""
        texts = []
        for _ in range(n):
            with httpx.Client(timeout=20) as client:
                resp = client.post(self.base + "/v1/chat/completions",
                                   json={"model": "fake-model", "messages": MSGS, "max_tokens": max_tokens})
            assert resp.status_code == 200, resp.text
            texts.append(resp.json()["choices"][0]["message"]["content"])
        return texts

    def chat_through_restart(self, index: int, old_pid: int, max_tokens: int,
                             served: int = 4) -> tuple[int, int]:
        """Chat completions, each over a new connection, until a new pid of process ``index`` has
        answered ``served`` of them; asserts every one got 200 with the fake's reply. Returns the new pid
        and the number of requests sent."""
        by_new: list[int] = []
        sent = 0
        deadline = time.monotonic() + START_S
        while len(by_new) < served:
            assert time.monotonic() < deadline, f"process {index} not serving again within {START_S:g} s"
            self.alive()
            with httpx.Client(base_url=self.base, timeout=20,
                              limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)) as client:
                resp = client.post("/v1/chat/completions", json={"model": "fake-model", "messages": MSGS,
                                                                 "max_tokens": max_tokens})
                answered = client.get("/v1/status").json()["process"]  # the same connection's process
            sent += 1
            assert resp.status_code == 200, (answered, resp.text)
            assert resp.json()["choices"][0]["message"]["content"] == REPLY
            if answered["index"] == index and answered["pid"] != old_pid:
                by_new.append(answered["pid"])
        assert len(set(by_new)) == 1, by_new
        return by_new[0], sent

    def metric(self, name: str, labels: str) -> float:
        with httpx.Client(timeout=5) as client:
            body = client.get(self.base + "/metrics").text
        prefix = f"{name}{{{labels}}} " if labels else f"{name} "
        for line in body.splitlines():
            if line.startswith(prefix):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.log.close()


@pytest.fixture
def pool(tmp_path: Path, tokenizer_dir: Path) -> Iterator[Pool]:
    p = Pool(tmp_path, tokenizer_dir)
    yield p
    p.close()


def gateways_used(record: Path) -> set[int]:
    """The control sockets (gateway indexes) a fake prefill worker got its requests through."""
    return {int(m["gateway"]) for m in read_record(record) if m["type"] == "PrefillRequest"}


def gone(pid: int) -> bool:
    """The process has exited (no such process, or a zombie its parent has not reaped yet). A process
    reaped between the open and the read of its stat file makes the read fail with ESRCH."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_gone_counts_a_process_reaped_while_its_stat_file_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """CI once failed here: the killed process was reaped between the open and the read of
    ``/proc/<pid>/stat``, and the read raised ProcessLookupError out of ``gone``."""
    def reaped(self: Path, *args: object, **kwargs: object) -> str:
        raise ProcessLookupError(3, "No such process")

    assert not gone(os.getpid())
    monkeypatch.setattr(Path, "read_text", reaped)
    assert gone(os.getpid())


OK = 'endpoint="/v1/chat/completions",status="200"'


@pytest.mark.slow
def test_two_processes_share_one_port_and_survive_a_kill(pool: Pool, reply_ids: list[int]) -> None:
    prefill = pool.start_worker("prefill", "p1", reply_ids)
    pool.start_worker("decode", "d1", reply_ids)
    pids = pool.pids_serving(2)
    assert f"--gateway-control {','.join(pool.controls)}" in pool.text()  # the line operators copy

    assert pool.chat(16, len(reply_ids)) == [REPLY] * 16
    assert gateways_used(prefill) == {0, 1}  # both processes took requests through the one port
    counts = {pool.metric("pdserve_requests_total", OK) for _ in range(6)}  # whichever process answers
    assert counts == {16.0}

    with pool.connection_to(1) as client, client.stream(
            "POST", "/v1/chat/completions", json={"model": "fake-model", "messages": MSGS, "stream": True,
                                                  "max_tokens": LONG}) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # streaming from process 1, holding KV blocks on d1
        wait_until(lambda: pool.metric("pdserve_kv_blocks_free", 'role="decode",worker_id="d1"') < 64, 5,
                   "d1 holding the stream's blocks")
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(httpx.HTTPError):
            for _ in lines:
                pass
    wait_until(lambda: gone(pids[1]), 10, "process 1 gone")
    assert pool.chat(4, len(reply_ids)) == [REPLY] * 4  # the other process serves at once
    # requests over new connections all through the restart: the new process 1 takes connections only
    # once the workers have registered with it, so none meets a process without workers (a 503)
    new_pid, sent = pool.chat_through_restart(1, pids[1], len(reply_ids))
    restarted = pool.pids_serving(2)  # the parent restarted process 1; the workers registered again
    assert restarted[0] == pids[0] and restarted[1] == new_pid != pids[1]
    assert "gateway process 1: workers registered; listening" in pool.text()
    assert "gateway process 1 (pid" in pool.text() and "restarting it in" in pool.text()
    # the killed process's stream (100 s of tokens left) is dropped by d1 once the new process 1 is
    # there: its blocks come back long before the stream would have ended
    wait_until(lambda: pool.metric("pdserve_kv_blocks_free", 'role="decode",worker_id="d1"') == 64.0, 10,
               "d1's blocks of the killed process's stream freed")

    before = len(read_record(prefill))
    assert pool.chat(16, len(reply_ids)) == [REPLY] * 16
    assert {m["gateway"] for m in read_record(prefill)[before:] if m["type"] == "PrefillRequest"} == {0, 1}
    # the killed process's counts stay in the sum (its files outlive it): 16 + 4 + sent + 16, any process
    total = 36.0 + sent
    wait_until(lambda: pool.metric("pdserve_requests_total", OK) == total, 5, f"{total} requests counted")
    assert pool.metric("pdserve_requests_in_flight", "") == 0.0  # the killed process's share left with it
    wait_until(lambda: pool.metric("pdserve_kv_blocks_free", 'role="decode",worker_id="d1"') == 64.0, 5,
               "every KV block of d1 free")

    [metrics_dir] = pool.tmpdir.glob("pdserve-gateway-metrics-*")  # the processes' shared files
    assert any(metrics_dir.glob("counter_*.db"))
    pool.gateway.send_signal(signal.SIGTERM)
    assert pool.gateway.wait(20) == 128 + signal.SIGTERM
    assert gone(restarted[0]) and gone(restarted[1])
    assert not metrics_dir.exists()  # removed by the parent on its way out


@pytest.mark.slow
def test_a_restarted_process_without_workers_listens_only_after_the_hold(tmp_path: Path, tokenizer_dir: Path,
                                                                        reply_ids: list[int]) -> None:
    hold = 8.0  # two heartbeat timeouts of 4 s: longer than a restart's start-up on a busy 2-core box
    pool = Pool(tmp_path, tokenizer_dir, heartbeat_timeout=hold / 2)
    try:
        pool.start_worker("prefill", "p1", reply_ids, controls=pool.controls[:1])  # process 0's only
        pool.start_worker("decode", "d1", reply_ids, controls=pool.controls[:1])
        first: dict = {}

        def answers(index: int) -> bool:
            pool.alive()
            try:
                body = pool.status()
            except httpx.HTTPError:
                return False
            first.update(body["process"])
            return first["index"] == index and (index == 1 or body["ready"])

        wait_until(lambda: answers(0), START_S, "process 0 serving")
        wait_until(lambda: answers(1), START_S, "process 1 answering")
        os.kill(first["pid"], signal.SIGKILL)
        wait_until(lambda: gone(first["pid"]), 10, "process 1 gone")
        started: float | None = None
        deadline = time.monotonic() + START_S + hold
        while True:  # new connections until the new process 1 answers; process 0 serves them meanwhile
            assert time.monotonic() < deadline, pool.text()[-2000:]
            if started is None and "gateway process 1 started (pid" in pool.text().rsplit(
                    "restarting it in", 1)[-1]:
                started = time.monotonic()
            with httpx.Client(base_url=pool.base, timeout=20,
                              limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)) as client:
                resp = client.post("/v1/chat/completions", json={"model": "fake-model", "messages": MSGS,
                                                                 "max_tokens": len(reply_ids)})
                answered = client.get("/v1/status").json()["process"]
            if answered["index"] == 1:
                break
            assert resp.status_code == 200, resp.text  # process 0 has the workers
        assert started is not None and time.monotonic() - started >= hold - 0.5
        assert f"gateway process 1: no usable worker after {hold:g} s; listening anyway" in pool.text()
        assert resp.status_code == 503 and answered["pid"] != first["pid"]  # honest: no worker here
    finally:
        pool.close()


def test_a_stop_signal_ends_a_restarted_process_hold_at_once(tmp_path: Path, tokenizer_dir: Path) -> None:
    """SIGTERM to the pool while its restarted process waits for workers (the hold, 10 s here): that
    process stops at once instead of finishing the hold first (that it never listens:
    test_a_process_stopped_during_its_hold_never_listens)."""
    pool = Pool(tmp_path, tokenizer_dir, heartbeat_timeout=5.0)  # hold: min(2 x 5, 10) = 10 s
    try:
        def pid_of(index: int) -> int | None:
            pool.alive()
            with contextlib.suppress(httpx.HTTPError):
                process = pool.status()["process"]
                if process["index"] == index:
                    return int(process["pid"])
            return None

        pids: list[int] = []

        def found() -> bool:
            pid = pid_of(1)
            if pid is not None:
                pids.append(pid)
            return bool(pids)

        wait_until(found, START_S, "process 1 answering")
        os.kill(pids[0], signal.SIGKILL)
        wait_until(lambda: "gateway process 1: restarted; waiting up to 10 s" in pool.text(), START_S,
                   "the new process 1 holding")
        stopped_at = time.monotonic()
        pool.gateway.send_signal(signal.SIGTERM)
        pool.gateway.wait(30)
        took = time.monotonic() - stopped_at
        text = pool.text()
        assert "gateway process 1: asked to stop while waiting for workers" in text, text[-2000:]
        assert "listening anyway" not in text
        restarted = text.rsplit("restarting it in", 1)[1]
        assert pool.gateway.returncode == 128 + signal.SIGTERM, restarted
        assert took < 8.0, f"the pool took {took:.1f} s to stop (the hold is 10 s)\n{text[-2000:]}"
    finally:
        pool.close()


async def test_a_process_stopped_during_its_hold_never_listens() -> None:
    """The lifespan wrapper of a gateway process (gateway/server.py): a stop during the listen hold ends
    the hold at once and empties the socket list uvicorn listens on afterwards, closing the socket, so
    the kernel hands no connection to a process that is going away."""
    stopping = asyncio.Event()

    async def wait_ready(timeout: float, stop: asyncio.Event | None = None) -> bool:
        assert stop is stopping
        await stop.wait()
        return False

    app = FastAPI()
    app.state.service = SimpleNamespace(process=SimpleNamespace(index=1), wait_ready=wait_ready)
    sock = socket.socket()
    sockets = [sock]
    reported: list[str] = []
    _reporting_lifespan(app, reported.append, 10.0, stopping, sockets)
    asyncio.get_running_loop().call_later(0.1, stopping.set)
    started = time.monotonic()
    async with app.router.lifespan_context(app):
        assert sockets == [] and sock.fileno() == -1  # closed
    assert time.monotonic() - started < 5 and reported == []


@pytest.mark.slow
@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_process_that_cannot_start_stops_the_pool_with_one_line(tmp_path: Path, log_format: str) -> None:
    """A process whose app cannot be built (here its tokenizer dir has no tokenizer.json: ``pdserve
    gateway`` refuses such a ``--tokenizer`` before any process starts, so the pool is run directly, as
    a dir emptied after that check would be) stops the pool with one line naming the process: with
    ``--log-format json`` one JSON event at level error."""
    first = free_port_range(2)
    [port] = free_ports(1, exclude=(first, first + 1))
    settings = (f"GatewaySettings(port={port}, control_bind='tcp://127.0.0.1:{first}', workers=2, "
                f"tokenizer={str(tmp_path)!r}, insecure_control_plane=True, log_level='warning')")
    code = ("import sys; from pdserve.gateway_pool import run_pool; from protocol.settings import "
            "GatewaySettings; from protocol.logging import configure_logging; "
            f"configure_logging('warning', {log_format!r}); sys.exit(run_pool({settings}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=START_S + 30)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    if log_format == "json":
        event = json.loads(last)
        assert (event["level"], event["logger"]) == ("error", "pdserve.gateway"), last
        last = "pdserve gateway: " + event["msg"]
    where = re.escape(str(tmp_path))
    assert re.fullmatch(rf"pdserve gateway: gateway process (0|1) \(tcp://127\.0\.0\.1:({first}|{first + 1})"
                        rf"\) could not start: --tokenizer {where}: directory {where} has no tokenizer\.json",
                        last), out.stderr


def test_a_port_in_use_is_refused_before_any_process_starts(capsys: pytest.CaptureFixture[str]) -> None:
    """Another listener on the HTTP port (here a plain socket; as well another pool's SO_REUSEPORT
    sockets, which the processes would otherwise join) stops the pool before it starts anything."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    try:
        assert main(["gateway", "--workers", "2", "--port", str(port), "--insecure-control-plane",
                     "--control-bind", f"tcp://127.0.0.1:{free_port_range(2)}"]) == 2
    finally:
        held.close()
    err = capsys.readouterr().err
    want = f"pdserve gateway: port {port} on 127.0.0.1 is in use; choose another with --port\n"
    assert err == want, err


def test_one_gateway_process_refuses_an_address_it_cannot_bind(capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``pdserve gateway`` (one process) on a busy port or a host that is not this machine's: one line
    and exit code 2 before the app starts (uvicorn logged the bind error after start-up, exit 3)."""
    import gateway.server

    monkeypatch.setattr(gateway.server, "serve", lambda settings: pytest.fail("the gateway started"))
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    try:
        assert main(["gateway", "--port", str(port), "--insecure-control-plane"]) == 2
    finally:
        held.close()
    assert capsys.readouterr().err == (f"pdserve gateway: port {port} on 127.0.0.1 is in use; choose another "
                                       "with --port\n")
    assert main(["gateway", "--host", "192.0.2.1", "--port", str(port), "--insecure-control-plane"]) == 2
    assert capsys.readouterr().err.startswith("pdserve gateway: --host 192.0.2.1 is not an address of this "
                                              "machine")


@pytest.mark.parametrize(("flags", "message"), [
    (["--workers", "0"], "--workers: must be in [1, 64] gateway processes, got 0"),
    (["--workers", "65"], "--workers: must be in [1, 64] gateway processes, got 65"),
    (["--workers", "2", "--port", "0"], "--port: must be a fixed port with --workers 2"),
    (["--workers", "2", "--control-bind", "ipc:///tmp/x"], "--control-bind: must be tcp://host:port"),
    (["--workers", "2", "--control-bind", "tcp://127.0.0.1:0"], "--control-bind: ports 0..1"),
    (["--workers", "3", "--control-bind", "tcp://127.0.0.1:65534"], "--control-bind: ports 65534..65536"),
])
def test_bad_workers_refused_in_one_line(flags: list[str], message: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gateway", "--insecure-control-plane", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve gateway: {message}") and err.count("\n") == 1, err


def test_control_endpoints_one_port_per_process() -> None:
    one = GatewaySettings(insecure_control_plane=True, control_bind="ipc:///tmp/gw")
    assert one.control_endpoints() == ("ipc:///tmp/gw",)
    three = GatewaySettings(insecure_control_plane=True, workers=3, control_bind="tcp://*:7100")
    assert three.control_endpoints() == ("tcp://*:7100", "tcp://*:7101", "tcp://*:7102")


def test_metrics_refuse_a_shared_dir_prometheus_client_was_not_set_up_for(tmp_path: Path) -> None:
    """A process told to share a metrics directory, whose prometheus-client was imported without
    PROMETHEUS_MULTIPROC_DIR (this one), would keep its counts to itself: refused."""
    with pytest.raises(RuntimeError, match="PROMETHEUS_MULTIPROC_DIR"):
        GatewayMetrics(str(tmp_path))


def test_every_gauge_is_a_fleet_view_or_summed_over_live_processes() -> None:
    """With several gateway processes a prometheus ``Gauge`` lives in multiprocess files, where a removed
    series stays and each process adds its own: only the in-flight count (summed over live processes) is
    one; a per-worker or per-pair series must be a ``FleetGauge`` (the answering process's view)."""
    metrics = GatewayMetrics()
    gauges = {name: g for name, g in vars(metrics).items() if isinstance(g, Gauge)}
    assert list(gauges) == ["in_flight"], f"make {sorted(set(gauges) - {'in_flight'})} FleetGauges"
    assert gauges["in_flight"]._multiprocess_mode == "livesum"


def test_fleet_gauge_series_come_and_go() -> None:
    metrics = GatewayMetrics()
    metrics.kv_path_gbps.labels("p1", "d1", "fake").set(2.5)
    assert metrics.registry.get_sample_value(
        "pdserve_kv_path_gbps", {"prefill": "p1", "decode": "d1", "transport": "fake"}) == 2.5
    metrics.drop_kv_path("p1", "d1", "fake")
    assert metrics.registry.get_sample_value(
        "pdserve_kv_path_gbps", {"prefill": "p1", "decode": "d1", "transport": "fake"}) is None
    metrics.drop_kv_path("p1", "d1", "fake")  # gone already: nothing to drop, no error
    with pytest.raises(ValueError, match="expected 3 label values, got 2"):
        metrics.kv_path_gbps.labels("p1", "d1")


def test_up_leaves_workers_to_the_launcher(capsys: pytest.CaptureFixture[str]) -> None:
    """``pdserve up`` has no ``--workers`` of its own (``--gateway-workers`` sets its gateway processes)."""
    assert main(["up", "--workers", "2"]) == 2
    assert capsys.readouterr().err.startswith("pdserve up: error: unrecognized arguments: --workers 2")


class _Exited:
    """Stands in for a child's ``multiprocessing`` process that has exited with ``exitcode``."""

    def __init__(self, pid: int, exitcode: int | None) -> None:
        self.pid, self.exitcode = pid, exitcode

    def join(self, timeout: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_crash_loop_is_restarted_with_backoff_then_stops_the_pool(tmp_path: Path) -> None:
    """A ready process that exits is restarted after 1, 2, 4, 8 s (RestartPolicy); its fifth exit within
    the minute stops the pool with a line naming it. Its live-gauge file is retired at each exit."""
    settings = GatewaySettings(insecure_control_plane=True, workers=2, control_bind="tcp://127.0.0.1:7100")
    pool = GatewayPool(settings, str(tmp_path), RestartPolicy(), start_timeout=5.0, grace=1.0)
    started: list[int] = []
    pool.start = lambda child: started.append(child.index)  # type: ignore[method-assign]
    child = pool.children[1]
    delays = []
    now = 1000.0
    for pid in range(4):
        (tmp_path / f"gauge_livesum_{pid}.db").write_bytes(b"")
        child.process, child.ready = _Exited(pid, -9), True  # type: ignore[assignment]
        pool.step(now)
        assert child.process is None and child.restart_at is not None
        assert not (tmp_path / f"gauge_livesum_{pid}.db").exists()
        delays.append(child.restart_at - now)
        pool.step(child.restart_at - 0.01)
        assert started == [1] * pid  # not before its time
        now = child.restart_at
        pool.step(now)
        assert started == [1] * (pid + 1)
    assert delays == [1.0, 2.0, 4.0, 8.0]
    child.process, child.ready = _Exited(4, 1), True  # type: ignore[assignment]
    with pytest.raises(PoolFailed, match=r"process 1 exited 5 times within 60 s \(last exit code 1\)"):
        pool.step(now)


def test_a_process_not_ready_in_time_stops_the_pool(tmp_path: Path) -> None:
    settings = GatewaySettings(insecure_control_plane=True, workers=2, control_bind="tcp://127.0.0.1:7100")
    pool = GatewayPool(settings, str(tmp_path), RestartPolicy(), start_timeout=5.0, grace=1.0)
    reader, writer = multiprocessing.Pipe(duplex=False)
    for child in pool.children:
        child.process, child.conn, child.started_at = _Exited(10 + child.index, None), reader, 0.0  # type: ignore[assignment]
    writer.send("ready")
    pool.step(4.0)  # process 0 reads "ready"; process 1 still has time
    assert pool.children[0].ready and not pool.children[1].ready
    with pytest.raises(PoolFailed, match=r"gateway process 1 \(tcp://127.0.0.1:7101\) not ready after 5 s"):
        pool.step(5.5)
    writer.close()
    reader.close()


def test_the_restart_hold_is_two_heartbeat_timeouts_at_most_ten_seconds() -> None:
    from gateway.process import GatewayProcess

    assert GatewayProcess(0, 2, "m").listen_hold_s(5.0) == 0.0  # a first start listens at once
    assert GatewayProcess(0, 2, "m", restarted=True).listen_hold_s(1.5) == 3.0
    assert GatewayProcess(0, 2, "m", restarted=True).listen_hold_s(60.0) == 10.0  # within the pool's 120 s


async def test_the_register_ack_names_the_other_processes_control_ports() -> None:
    """Process 1 of 3 answers a registration naming processes 0 and 2's control ports, so a worker given
    one address finds the pool (tests/workers/test_several_gateways.py); a lone gateway names none. The
    pool hands each process every port, by index."""
    from gateway.process import GatewayProcess
    from gateway.service import GatewayService
    from kvtransfer.compat import KVCompat
    from protocol.messages import RegisterAck, RegisterWorker, WorkerLoad
    from tests.gateway.test_metric_names import _FakeControl

    register = RegisterWorker(role="colocated", worker_id="c0", epoch=1, model="m", model_path="",
                              compat=KVCompat(dtype="float32", block_size=16, transfer_backend="loopback"),
                              load=WorkerLoad())
    acks = []
    for process in (GatewayProcess(1, 3, "m", control_ports=(46200, 46201, 46202)), None):
        svc = GatewayService(GatewaySettings(insecure_control_plane=True), GatewayMetrics(), text=object(),  # type: ignore[arg-type]
                             process=process)
        control = _FakeControl()
        svc.control = control  # type: ignore[assignment]
        await svc.on_control_message(b"c0", register)
        [ack] = [m for _, m in control.sent if isinstance(m, RegisterAck)]
        acks.append(ack)
    assert [(a.accepted, a.sibling_ports, a.control_port) for a in acks] == [(True, (46200, 46202), 46201),
                                                                             (True, (), 0)]
    with pytest.raises(ValueError, match="2 control ports for 3 gateway processes"):
        GatewayProcess(0, 3, "m", control_ports=(1, 2))
    settings = GatewaySettings(port=46203, control_bind="tcp://127.0.0.1:46204", workers=2,
                               insecure_control_plane=True)
    pool = GatewayPool(settings, "m", RestartPolicy(), 5.0, 1.0)
    assert pool.control_ports == (46204, 46205)


@pytest.mark.slow
def test_a_worker_given_one_process_serves_them_all(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A real colocated worker given only process 0's control address (as an operator who copied the first
    address would): process 0's ``RegisterAck`` names process 1's port, the worker registers with it too,
    ``/ready`` is 200 from both processes and every request over a fresh connection succeeds, whichever
    process takes it (a partial outage: every other one was a 503 "no live worker")."""
    from engine.models.registry import resolve_model

    resolve_model("smollm2-135m")
    # a real worker, one torch thread (as every process of the session): behind the fake workers' 1.5 s
    # heartbeat timeout, its heartbeats held up by a busy machine dropped it (a 503) mid-check
    pool = Pool(tmp_path, tokenizer_dir, heartbeat_timeout=10.0)
    try:
        taken = (pool.port, *(int(c.rpartition(":")[2]) for c in pool.controls))
        [worker_port] = free_ports(1, exclude=taken)
        worker_log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115
        pool._spawn([sys.executable, "-m", "pdserve.cli", "colocated", "--gateway-control", pool.controls[0],
                     "--worker-id", "solo", "--model", "smollm2-135m", "--num-blocks", "64", "--port",
                     str(worker_port), "--insecure-control-plane", "--cpu-threads", "1"], worker_log)
        ready: set[int] = set()

        def both_ready() -> bool:
            pool.alive()
            with httpx.Client(base_url=pool.base, timeout=5) as client:
                try:
                    resp = client.get("/ready")
                    index = client.get("/v1/status").json()["process"]["index"]  # the same connection
                except httpx.HTTPError:
                    return False
            if resp.status_code == 200:
                ready.add(index)
            return ready == {0, 1}

        wait_until(both_ready, 240, f"/ready 200 from both processes (worker log: {tmp_path / 'worker.log'})")
        for index in (0, 1):
            with pool.connection_to(index) as client:
                assert client.get("/ready").status_code == 200
                assert [w["worker_id"] for w in client.get("/v1/status").json()["workers"]] == ["solo"]
        answered: set[int] = set()
        for _ in range(16):  # until both processes took one (16 at most): every one must succeed
            with httpx.Client(base_url=pool.base, timeout=60,
                              limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)) as client:
                resp = client.post("/v1/completions", json={"model": "smollm2-135m", "prompt": "Paris is",
                                                            "max_tokens": 2, "temperature": 0})
                answered.add(client.get("/v1/status").json()["process"]["index"])
            assert resp.status_code == 200, resp.text
            if answered == {0, 1}:
                break
        assert answered == {0, 1}, answered  # both processes took some: each succeeded through both
        worker_log.close()
        assert "gateways_discovered" in (tmp_path / "worker.log").read_text()
    finally:
        pool.close()
