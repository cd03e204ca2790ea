"""A prefill worker killed with SIGKILL leaves routing at once, through real processes.

Two prefill workers and one decode worker (the embedded model, on the CPU). A prompt prefix is warmed on
one prefill worker, which is then killed; 20 requests sharing that prefix follow at once. The gateway's
heartbeat timeout is 30 s, so only the control socket can tell: its connection drops, the gateway's
probe (or a send) fails, and from that moment no request is routed to the dead worker; ``/ready`` and
``/v1/status`` name it, with the reason and when; a request routed to it before that is retried on the
other prefill worker, so every client gets its answer. The suite kills a child, so it owns its system.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pdserve.live_system import live_system, wait_all_free, worker_id

pytestmark = pytest.mark.slow

PREFIX = ("You are a careful assistant. Read the following notes about the history of the city and answer "
          "briefly. The city was founded on a river crossing, grew as a market town, built walls, lost "
          "them, and became known for its bridges, its university and its long winters. ") * 3


def _events(log: str) -> list[dict]:
    out = []
    for line in log.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _complete(url: str, prompt: str, rid: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, headers={"X-Request-Id": rid}, json={
        "model": "smollm2-135m", "prompt": prompt, "max_tokens": 4, "temperature": 0})


def test_killed_prefill_worker_is_never_routed_to_after_its_first_failed_send(tmp_path: Path) -> None:
    with live_system("disagg", tmp_path, num_prefill=2, num_blocks=256, heartbeat_timeout_s=30,
                     gateway_flags=("--log-format", "json", "--request-timeout", "120")) as system:
        url = system.url
        warm = _complete(url, PREFIX + "Question 0?", "warm")
        assert warm.status_code == 200, warm.text
        [routed] = [e for e in _events(system.log("gateway"))
                    if e.get("msg") == "request_routed" and e.get("request_id") == "warm"]
        dead = next(w for w in routed["workers"].split(",") if "prefill" in w)
        child = dead[len(worker_id("")):]
        killed_at = time.time()
        os.kill(system.pids[child], signal.SIGKILL)
        with ThreadPoolExecutor(5) as pool:
            replies = list(pool.map(lambda k: _complete(url, PREFIX + f"Question {k}?", f"q{k}"),
                                    range(1, 21)))

        deadline = time.monotonic() + 10
        while True:
            events = _events(system.log("gateway"))
            first_failure = next((i for i, e in enumerate(events)
                                  if (e.get("msg") == "worker_lost" and e.get("worker_id") == dead)
                                  or "Host unreachable" in str(e.get("msg"))), None)
            if first_failure is not None or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert first_failure is not None, "the gateway never noticed the dead worker"
        print(f"killed at {killed_at:.3f}; detected {events[first_failure]['ts'] - killed_at:.3f} s later")
        lost = [e for e in events if e.get("msg") == "worker_lost" and e.get("worker_id") == dead]
        assert lost and "unreachable" in lost[0]["reason"], lost
        assert lost[0]["ts"] - killed_at < 10  # the control socket, not the 30 s heartbeat timeout
        routes = {e["request_id"]: e["workers"] for e in events if e.get("msg") == "request_routed"}
        late = [e["request_id"] for e in events[first_failure:]
                if e.get("msg") == "request_routed" and dead in e["workers"].split(",")]
        assert late == [], f"routed to the dead {dead} after its first failed send: {late}"
        for k, reply in enumerate(replies, 1):
            # routed ones answer 200 (those first routed to the dead worker were retried on the other);
            # admission may refuse some at once on a slow machine: a 429 with Retry-After, never routed
            if f"q{k}" in routes:
                assert reply.status_code == 200, reply.text
            else:
                assert reply.status_code == 429 and reply.headers.get("retry-after"), reply.text

        ready = httpx.get(f"{url}/ready", timeout=5)
        assert ready.status_code == 200  # the other prefill worker and the decode worker still pair
        assert dead in ready.json()["reason"]
        status = httpx.get(f"{url}/v1/status", timeout=5).json()
        [dropped] = status["dropped"]
        assert (dropped["worker_id"], dropped["role"]) == (dead, "prefill")
        assert "unreachable" in dropped["reason"]
        assert abs(dropped["at"] - lost[0]["ts"]) < 1
        assert dead not in {w["worker_id"] for w in status["workers"]}
        [pair] = status["pairs"]
        assert pair["usable"] and pair["path"] is not None  # the pairing canary measured the data path
        assert pair["path"]["transport"] == "nixl" and pair["path"]["gbps"] > 0
        print(f"KV path {pair['prefill']} → {pair['decode']}: {pair['path']}")
        wait_all_free(url, system.worker_ids - {dead})
