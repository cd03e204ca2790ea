"""The end of a gateway's drain answers the requests still in flight (gateway/server.py ``DrainingServer``,
``Orchestrator.stop_requests``): a real gateway process with fake workers, ``--drain-timeout 1``, a long
stream and a long non-streaming request in flight at SIGTERM. One second later the stream gets an error
event naming why, then ``[DONE]`` (not a body cut off mid-way, which clients read as a broken
connection), the non-streaming request a 503 with ``Retry-After`` and the code ``gateway_stopping``, and
the workers are told to drop both."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import MSGS, read_record, wait_until


@pytest.mark.parametrize("how", ["deadline", "second signal"])
def test_the_end_of_a_drain_answers_the_requests_in_flight(make_cluster, how: str) -> None:
    """``deadline``: ``--drain-timeout 1``; ``second signal``: a 30 s drain ended by a second SIGTERM."""
    c = make_cluster(drain_timeout=1 if how == "deadline" else 30, log_level="info")
    c.start_worker("prefill", "p1", token_delay=0.05)
    record = c.start_worker("decode", "d1", token_delay=0.05)  # 200 tokens: 10 s, far past the drain
    body = {"model": "fake-model", "messages": MSGS, "max_tokens": 200}
    events: list[str] = []
    statuses: list[int] = []
    answer: list[httpx.Response] = []

    def stream() -> None:
        with httpx.stream("POST", f"{c.base}/v1/chat/completions", json={**body, "stream": True},
                          timeout=30, trust_env=False) as r:
            statuses.append(r.status_code)
            events.extend(line for line in r.iter_lines() if line)

    def whole() -> None:
        answer.append(httpx.post(f"{c.base}/v1/chat/completions", json=body, timeout=30, trust_env=False))

    threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
    for t in threads:
        t.start()
    wait_until(lambda: c.metric("pdserve_requests_in_flight") == 2, 10, "both in flight")
    time.sleep(0.3)  # the stream has begun
    signalled = time.monotonic()
    c.gateway.send_signal(signal.SIGTERM)
    if how == "second signal":
        time.sleep(0.5)
        c.gateway.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(20)
    took = time.monotonic() - signalled
    c.gateway.wait(20)
    log = (Path(c.tmp) / "gateway.log").read_text()

    why = "the drain's deadline" if how == "deadline" else "a second stop signal"
    assert statuses == [200] and events[-1] == "data: [DONE]", (statuses, events[-3:])
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "gateway_stopping", error
    assert error["message"] == f"the gateway is shutting down ({why})", error
    chunks = [e for e in events[:-2] if "choices" in e]
    assert 0 < len(chunks) < 200

    [resp] = answer
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "gateway_stopping"
    assert int(resp.headers["Retry-After"]) >= 1

    # at the deadline or the second signal, not at the stream's end nor uvicorn's backstop
    assert (0.9 if how == "deadline" else 0.4) < took < 5, took
    assert f"requests_cut requests=2 why={why}" in log, log
    assert "Traceback" not in log and "ERROR" not in log, log
    wait_until(lambda: sum(m["type"] == "AbortRequest" for m in read_record(record)) == 2, 10,
               "both requests aborted on the decode worker")
