"""``pdserve up`` gives up on a worker that keeps dying: ``kill -9`` of each new decode worker (the only
one; embedded model, CPU) five times within 60 s. Once it is given up on no prefill/decode pair is left,
so the launcher stops every child with one line naming the worker and why, and exits 1, for a process
manager's restart policy to take over, rather than serving 503 "no live decode worker" forever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.ports import free_ports
from tests.system.test_up_restart import _child_pid, _until, stop_up

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MAX_EXITS = 5  # RestartPolicy().max_exits: its restarts wait 1 + 2 + 4 + 8 s


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


@pytest.mark.timeout(300)
def test_up_stops_everything_and_exits_1_once_its_only_decode_worker_is_given_up(tmp_path: Path) -> None:
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    err_path = tmp_path / "up.err"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_NUM_BLOCKS": "128"}
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), "--device", "cpu"]
    out_path = tmp_path / "up.out"
    with open(err_path, "wb") as err, open(out_path, "wb") as out:
        up = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
    try:
        # the launcher supervises once it printed its ready block; a kill before it (while /ready may
        # already answer 200) is a death during start-up
        def ready() -> bool:
            assert up.poll() is None, err_path.read_text()
            return "pdserve is ready at" in out_path.read_text()

        _until(ready, 240, "pdserve up ready")
        victim: int | None = None
        first_kill = time.monotonic()
        for _ in range(MAX_EXITS):  # each new decode-0 as soon as it runs: 1 + 2 + 4 + 8 s of backoff
            victim = _wait_new_pid(up, "up-decode-0", victim, 30)
            os.kill(victim, signal.SIGKILL)
        code = up.wait(60)
        took = time.monotonic() - first_kill
        text = err_path.read_text()
        assert code == 1, text
        assert text.count("pdserve up: decode-0 exited with code -9; restarting it in") == MAX_EXITS - 1
        given_up = [line for line in text.splitlines() if "given up" in line]
        assert given_up == [f"pdserve up: decode-0 given up (exited {MAX_EXITS} times within 60 s, last exit "
                            "code -9); no decode worker left: stopping everything"], text
        assert "pdserve up: stopped prefill-0 (pid" in text and "pdserve up: stopped gateway (pid" in text
        with pytest.raises(httpx.ConnectError):  # the gateway is gone too: nothing answers 503 forever
            httpx.get(f"{url}/ready", timeout=2, trust_env=False)
        print(f"given up and stopped {took:.1f} s after the first kill")
    finally:
        stop_up(up)
