"""``pdserve up`` (embedded model, CPU, two decode workers; one system for the module's tests, in order):

* it supervises its workers: ``kill -9`` of one decode worker no longer stops the whole server. The
  launcher restarts the worker after its backoff; it registers with a new epoch, the gateway replaces the
  old entry, and requests are answered throughout (the other decode worker serves them meanwhile).
* a stop drains: SIGTERM to the decode worker streaming a request takes it out of routing (other requests
  are answered meanwhile by the other one) and the stream runs to its end before the worker stops; SIGTERM
  to ``up`` closes the HTTP port to new connections while a stream in flight runs to its end, then
  everything stops (the gateway first), exit 143. Before, the stream got "worker lost: worker shut down".
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.ports import free_ports

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
REGISTERED = re.compile(r"worker_registered.*worker_id=up-decode-1\b.*epoch=(\d+)")


def _child_pid(parent: int, worker_id: str) -> int:
    """The pid of ``parent``'s child whose command line names ``worker_id``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and worker_id.encode() in cmdline:
            return int(entry.name)
    raise AssertionError(f"no child of {parent} runs {worker_id}")


def stop_up(up: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    """SIGTERM a ``pdserve up`` still running, as a terminal's user would stop it; its process group is
    killed if it has not exited within 60 s."""
    if up.poll() is None:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


def _until(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.2)


@dataclass
class UpSystem:
    up: subprocess.Popen[bytes]
    url: str
    err_path: Path


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpSystem]:
    """``pdserve up`` with two decode workers, ready (its stderr in ``err_path``); stopped at the end."""
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    err_path = tmp_path_factory.mktemp("up") / "up.err"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_NUM_BLOCKS": "128"}
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), "--device", "cpu",
           "--num-decode", "2"]
    with open(err_path, "wb") as err:
        up = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err,
                              start_new_session=True)
    try:
        def ready() -> bool:
            assert up.poll() is None, err_path.read_text()
            try:
                return httpx.get(f"{url}/ready", timeout=2, trust_env=False).status_code == 200
            except httpx.HTTPError:
                return False

        _until(ready, 300, "pdserve up ready")
        yield UpSystem(up, url, err_path)
    finally:
        stop_up(up)


@pytest.mark.timeout(420)
def test_kill_9_of_a_decode_worker_is_restarted_while_the_server_keeps_answering(system: UpSystem) -> None:
    up, url, err_path = system.up, system.url, system.err_path
    statuses: Counter[str] = Counter()
    sending = threading.Event()
    sending.set()

    def client() -> None:  # one request at a time while the worker is down and comes back
        with httpx.Client(timeout=60, trust_env=False) as http:
            while sending.is_set():
                try:
                    r = http.post(f"{url}/v1/completions", json={
                        "model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 4,
                        "temperature": 0})
                    statuses[str(r.status_code)] += 1
                except httpx.HTTPError as exc:
                    statuses[type(exc).__name__] += 1
                time.sleep(0.2)

    thread = threading.Thread(target=client)
    try:
        _until(lambda: len(REGISTERED.findall(err_path.read_text())) >= 1, 30, "decode-1 registered")
        # kill decode-1 once the gateway's KV canaries to it finished: a kill during a canary's transfer
        # can leave the prefill worker's KV sender unable to send to anyone (a known, separate bug)
        _until(lambda: "kv_path_measured prefill=up-prefill-0 decode=up-decode-1" in err_path.read_text(), 60,
               "decode-1's KV path measured")
        [epoch_before] = REGISTERED.findall(err_path.read_text())
        victim = _child_pid(up.pid, "up-decode-1")
        thread.start()
        _until(lambda: statuses["200"] >= 1, 60, "a first answer")
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _until(lambda: len(REGISTERED.findall(err_path.read_text())) >= 2, 180, "decode-1 back")
        back_s = time.monotonic() - killed_at
        ok_before_back = statuses["200"]
        _until(lambda: statuses["200"] >= ok_before_back + 3, 120, "answers after the restart")
        sending.clear()
        thread.join(90)
        text = err_path.read_text()
        epochs = REGISTERED.findall(text)
        assert up.poll() is None, text  # the launcher, and so the server, kept running
        assert int(epochs[-1]) > int(epoch_before), epochs  # a new incarnation
        assert "pdserve up: decode-1 exited with code -9; restarting it in 1 s" in text
        assert "stopping the rest" not in text
        assert _child_pid(up.pid, "up-decode-1") != victim
        # every request got an answer, and none an error: those on (or routed to) the killed worker were
        # retried on the other decode worker before their first token
        assert set(statuses) == {"200"}, statuses
        print(f"decode-1 back after {back_s:.1f} s; answers {dict(statuses)}")
    finally:
        sending.clear()
        if thread.is_alive():
            thread.join(90)


class Stream(threading.Thread):
    """One streamed completion of ``max_tokens`` tokens (``ignore_eos``): its text chunks, its finish
    reason, and the error that ended it, if one did."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__()
        self.url, self.max_tokens = url, max_tokens
        self.chunks: list[str] = []
        self.finish_reason: str | None = None
        self.error = ""
        self.done = False

    def run(self) -> None:
        body = {"model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": self.max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120,
                              trust_env=False) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.error = str(event["error"])
                            continue
                        choice = event["choices"][0]
                        self.chunks.append(choice["text"])
                        self.finish_reason = choice["finish_reason"] or self.finish_reason
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"


def _status(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/status", timeout=5, trust_env=False).json()  # type: ignore[no-any-return]


def _decodes(url: str, draining: bool = False) -> list[dict[str, Any]]:
    """The decode workers of ``/v1/status`` that are (``draining``) or are not draining."""
    return [w for w in _status(url)["workers"] if w["role"] == "decode" and w["draining"] == draining]


@pytest.mark.timeout(420)
def test_a_stopped_worker_and_a_stopped_up_let_the_streams_in_flight_finish(system: UpSystem) -> None:
    up, url, err_path = system.up, system.url, system.err_path
    # every worker back and taking requests (after the previous test's restart)
    _until(lambda: len(_decodes(url)) == 2, 180, "two decode workers")
    # 1. SIGTERM to the decode worker streaming a request
    stream = Stream(url, 60)
    stream.start()
    holder: list[str] = []

    def streaming_on_one() -> bool:
        holder[:] = [w["worker_id"] for w in _decodes(url) if w["requests"]]
        return len(holder) == 1 and len(stream.chunks) >= 2

    _until(streaming_on_one, 60, "the stream on a decode worker")
    worker_id = holder[0]
    os.kill(_child_pid(up.pid, worker_id), signal.SIGTERM)
    _until(lambda: any(w["worker_id"] == worker_id and w["draining"] for w in _status(url)["workers"])
           or stream.done, 10, f"{worker_id} draining")
    with httpx.Client(timeout=60, trust_env=False) as http:  # meanwhile the other decode worker answers
        for _ in range(3):
            r = http.post(f"{url}/v1/completions", json={"model": "smollm2-135m", "prompt": "Hello",
                                                         "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200, r.text
    stream.join(120)
    assert (stream.error, stream.done, len(stream.chunks), stream.finish_reason) == ("", True, 60, "length")
    name = worker_id.removeprefix("up-")
    _until(lambda: f"pdserve up: {name} exited with code 0; restarting it" in err_path.read_text(), 30,
           f"{worker_id} stopped after its drain")
    text = err_path.read_text()
    assert f"worker_drained worker_id={worker_id}" in text
    assert f"requests_dropped_at_stop worker_id={worker_id}" not in text

    # 2. SIGTERM to up while a stream is in flight (on the other decode worker: the restarted one, started
    # again, may still be loading; it is stopped either way)
    # the restart after this drain: an earlier test's kill -9 already left one "restarted" line of it
    after_drain = text.index(f"pdserve up: {name} exited with code 0; restarting it")
    _until(lambda: f"pdserve up: restarted {name} " in err_path.read_text()[after_drain:], 30,
           f"{name} started again")
    stream = Stream(url, 60)
    stream.start()
    _until(lambda: len(stream.chunks) >= 2, 60, "the second stream")
    up.send_signal(signal.SIGTERM)

    def refused() -> bool:
        try:
            httpx.get(f"{url}/health", timeout=2, trust_env=False)
        except httpx.ConnectError:
            return True
        return False

    _until(refused, 10, "new connections refused")
    assert not stream.done  # the port closed while the stream was still running
    stream.join(120)
    assert (stream.error, stream.done, len(stream.chunks), stream.finish_reason) == ("", True, 60, "length")
    up.wait(60)
    assert up.returncode == 128 + signal.SIGTERM
    text = err_path.read_text()
    # the stream is among the HTTP requests the drain waits for (the count is uvicorn's request tasks:
    # one CI run logged 2 with only the stream routed, not explained, so at least 1 is what is checked)
    draining = re.search(r"gateway_draining requests=(\d+)", text)
    assert draining is not None and int(draining.group(1)) >= 1, text
    stops = re.findall(r"pdserve up: stopped (\S+) ", text)
    assert stops[0] == "gateway" and sorted(stops[1:]) == ["decode-0", "decode-1", "prefill-0"], stops
    assert "gateway_lost" not in text.split("stopping: the gateway")[1]  # the workers saw it leave cleanly
