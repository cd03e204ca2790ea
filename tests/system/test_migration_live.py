"""A decode worker killed mid-stream, through real processes (gateway, one prefill and two decode workers,
the embedded SmolLM2 on the CPU, KV over NIXL): every stream it served continues on the other decode
worker (the gateway re-sends prompt + streamed tokens, gateway/orchestrator.py), so each client gets
HTTP 200 and the same text as an unbroken run of its request on the surviving system, greedy and seeded
sampled alike, and no KV block stays used on the surviving workers. The suite owns its system (it kills
a child), so it is not one of the shared live system's suites (tests/live.py).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.live_system import LiveSystem, live_system, metric_samples, wait_all_free, worker_id

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "smollm2-135m"
MAX_TOKENS = 96
PROMPTS = ["Write a long story about a dragon.", "List the planets of the solar system and describe each.",
           "Explain how a bicycle works, step by step.", "Tell me about the history of Rome."]
# (prompt index, sampling): greedy streams, and seeded sampled ones (their draws hash seed and position)
REQUESTS: list[tuple[int, dict[str, Any]]] = [
    *((i, {"temperature": 0}) for i in range(len(PROMPTS))),
    (0, {"temperature": 0.9, "seed": 11}), (2, {"temperature": 0.8, "top_p": 0.95, "seed": 5})]


@dataclass
class Stream:
    """One streaming completion run in a thread: its text pieces, finish reasons, errors, HTTP status."""

    body: dict[str, Any]
    pieces: list[str] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    status: int = 0

    def run(self, url: str) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=self.body, timeout=300) as resp:
                self.status = resp.status_code
                for line in resp.iter_lines():
                    data = line.removeprefix("data: ")
                    if not line.startswith("data: ") or data == "[DONE]":
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        self.errors.append(event["error"]["message"])
                    for choice in event.get("choices", []):
                        self.pieces.append(choice["text"])
                        if choice.get("finish_reason"):
                            self.finish.append(choice["finish_reason"])
        except Exception as exc:  # reported by the test
            self.errors.append(repr(exc))


def body(prompt: int, sampling: dict[str, Any], stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPTS[prompt], "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": stream, **sampling}


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveSystem]:
    with live_system("disagg", Path(tmp_path_factory.mktemp("migration")), num_blocks=256, num_decode=2,
                     heartbeat_timeout_s=4.0, gateway_flags=("--request-timeout", "600")) as s:
        yield s


def wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def test_decode_killed_mid_stream_streams_continue_unbroken(system: LiveSystem) -> None:
    streams = [Stream(body(p, s, stream=True)) for p, s in REQUESTS]
    threads = [threading.Thread(target=s.run, args=(system.url,), daemon=True) for s in streams]
    for t in threads:
        t.start()
    wait_for(lambda: all(len(s.pieces) >= 3 or s.errors for s in streams), 300, "every stream under way")
    assert not any(s.errors for s in streams), [s.errors for s in streams]
    assert not any(s.finish for s in streams), "a stream ended before the kill: raise MAX_TOKENS"
    os.kill(system.pids["decode"], signal.SIGKILL)
    for t in threads:
        t.join(timeout=400)
    assert not any(t.is_alive() for t in threads)
    samples = metric_samples(system.url)
    migrated = sum(v for (name, _), v in samples.items() if name == "pdserve_request_migrations_total")
    assert migrated >= 1, "the killed decode worker served no stream"
    for s in streams:
        assert (s.status, s.errors, s.finish) == (200, [], ["length"]), s.body
    # the same requests, unbroken, on the surviving system (one prefill, one decode worker)
    whole = [httpx.post(f"{system.url}/v1/completions", json=body(p, s, stream=False), timeout=300).json()
             for p, s in REQUESTS]
    for s, w in zip(streams, whole, strict=True):
        assert w["usage"]["completion_tokens"] == MAX_TOKENS
        assert "".join(s.pieces) == w["choices"][0]["text"], s.body  # no gap, no repeat
    wait_all_free(system.url, {worker_id("prefill"), worker_id("decode-1")})
