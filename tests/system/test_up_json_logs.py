"""``pdserve up --log-format json`` (the Kubernetes and docker-compose default, ``PDSERVE_LOG_FORMAT=json``)
writes nothing but JSON objects, one per line, on stdout and stderr: through start-up (the workers load
the embedded model with transformers and make NIXL agents on the CPU), a request, and a SIGTERM stop.
Found by a user trial: 8 of 34 lines were not JSON (NIXL's own log lines on stdout, transformers'
"Loading weights" progress bar, the launcher's ready block and its ``pdserve up: stopped ...`` lines).
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
from tests.system.test_up_restart import stop_up

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.timeout(300)
def test_every_line_of_up_with_json_logs_is_a_json_object(tmp_path: Path) -> None:
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
    finally:
        stop_up(up)
    assert up.returncode == 128 + signal.SIGTERM
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
    stopped = [m.split()[1] for logger, m in msgs if logger == "pdserve.up" and m.startswith("stopped ")]
    assert sorted(stopped) == ["decode-0", "gateway", "prefill-0"]
    if importlib.util.find_spec("nixl_cu13") is not None:  # the KV transport on the CPU: NIXL's lines too
        assert any(logger.startswith("nixl.") for logger, _ in msgs), sorted(msgs)
