"""``pdserve up --log-format json`` (the Kubernetes and docker-compose default, ``PDSERVE_LOG_FORMAT=json``)
writes nothing but JSON objects, one per line, on stdout and stderr: through start-up (the workers load
the embedded model with transformers and make NIXL agents on the CPU), a request, four restarts and a
stop. Found by a user trial: 8 of 34 lines were not JSON (NIXL's own log lines on stdout, transformers'
"Loading weights" progress bar, the launcher's ready block and its ``pdserve up: stopped ...`` lines).

The stop is the launcher's own: ``kill -9`` of each new decode worker (the only one) five times within
60 s. Once it is given up on no prefill/decode pair is left, so the launcher stops every child with one
event naming the worker and why, and exits 1, for a process manager's restart policy to take over,
rather than serving 503 "no live decode worker" forever. (One ``pdserve up`` serves both checks: each
start loads the model in three processes.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.ports import free_ports
from tests.system.test_up_restart import _child_pid, stop_up

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MAX_EXITS = 5  # RestartPolicy().max_exits: its restarts wait 1 + 2 + 4 + 8 s


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _new_pid(parent: int, worker_id: str, old: int | None) -> int | None:
    """``parent``'s child running ``worker_id`` when it is not ``old``, else None."""
    try:
        pid = _child_pid(parent, worker_id)
    except AssertionError:
        return None
    return pid if pid != old else None


def _wait_new_pid(up: subprocess.Popen[bytes], worker_id: str, old: int | None, timeout: float) -> int:
    """The pid of ``up``'s child running ``worker_id`` once it is not ``old`` (``up`` still running)."""
    deadline = time.monotonic() + timeout
    while (pid := _new_pid(up.pid, worker_id, old)) is None:
        assert up.poll() is None and time.monotonic() < deadline, f"no new {worker_id} within {timeout:.0f} s"
        time.sleep(0.05)
    return pid


@pytest.mark.timeout(360)
def test_every_line_of_up_with_json_logs_is_a_json_object_until_it_gives_up(tmp_path: Path) -> None:
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    out_path, err_path = tmp_path / "up.out", tmp_path / "up.err"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                                        if p)}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)  # the launcher turns the bars off itself
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), "--device", "cpu",
           "--log-format", "json"]

    def said(text: str) -> bool:
        return text in out_path.read_text() + err_path.read_text()

    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        up = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not _ready(url):
            assert up.poll() is None, err_path.read_text()
            assert time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.5)
        r = httpx.post(f"{url}/v1/completions", timeout=60, trust_env=False, json={
            "model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        # the gateway logs request_done after the answer; the launcher says it is ready after its next poll
        while not (said('"request_done"') and (said('"msg": "ready"') or said("is ready at"))):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # the launcher supervises once it said it is ready: each new decode-0 killed as soon as it runs
        victim: int | None = None
        first_kill = time.monotonic()
        for _ in range(MAX_EXITS):
            victim = _wait_new_pid(up, "up-decode-0", victim, 30)
            os.kill(victim, signal.SIGKILL)
        code = up.wait(60)
        print(f"given up and stopped {time.monotonic() - first_kill:.1f} s after the first kill")
    finally:
        stop_up(up)
    assert code == 1, err_path.read_text()
    with pytest.raises(httpx.ConnectError):  # the gateway is gone too: nothing answers 503 forever
        httpx.get(f"{url}/ready", timeout=2, trust_env=False)
    lines = {"stdout": out_path.read_text().splitlines(), "stderr": err_path.read_text().splitlines()}
    objs = []
    for stream, text in lines.items():
        for line in text:
            try:
                obj = json.loads(line)
            except ValueError:
                pytest.fail(f"not JSON on {stream}: {line!r}")
            assert isinstance(obj, dict) and {"ts", "level", "logger", "msg"} <= obj.keys(), line
            objs.append(obj)
    msgs = {(o["logger"], o["msg"]) for o in objs}
    ready = next(o for o in objs if (o["logger"], o["msg"]) == ("pdserve.up", "ready"))
    assert ready["url"] == url and set(ready["worker_metrics"]) == {"prefill-0", "decode-0"}
    assert ("pdserve.gateway", "request_done") in msgs
    up_events = [o for o in objs if o["logger"] == "pdserve.up"]
    restarts = [o for o in up_events if o["msg"].startswith("decode-0 exited with code -9; restarting it in")]
    assert len(restarts) == MAX_EXITS - 1 and all(o["exit_code"] == -9 for o in restarts), up_events
    given_up = [o for o in up_events if "given up" in o["msg"]]
    assert [o["msg"] for o in given_up] == [
        f"decode-0 given up (exited {MAX_EXITS} times within 60 s, last exit code -9); no decode worker "
        "left: stopping everything"], up_events
    fields = (given_up[0]["child"], given_up[0]["exits"], given_up[0]["exit_code"])
    assert fields == ("decode-0", MAX_EXITS, -9)
    stopped = [o["msg"].split()[1] for o in up_events if o["msg"].startswith("stopped ")]
    assert sorted(stopped) == ["gateway", "prefill-0"]
    if importlib.util.find_spec("nixl_cu13") is not None:  # the KV transport on the CPU: NIXL's lines too
        assert any(logger.startswith("nixl.") for logger, _ in msgs), sorted(msgs)
