"""Two gateway processes share one fleet, through real processes: one prefill and one decode worker (the
embedded model, on the CPU, KV over NIXL) are each given both gateways' control addresses
(``--gateway-control tcp://…:A,tcp://…:B``) and register with, heartbeat to and stream to both.

Requests alternate between the two gateways through the ``openai`` client and all succeed; a prompt
computed for one gateway is a prefix hit for the other, which knows it only from the prefill worker's KV
events. Then one
gateway is killed with SIGKILL while it streams a long answer: the other serves a new request at once,
the workers drop the dead gateway's request (their log says ``gateway_lost`` with one request dropped)
and every KV block comes back (the surviving gateway's ``/metrics``, fed by the workers' heartbeats).
Gateway a then comes back at the same address and the workers register with it again; hung with
SIGSTOP mid-stream (no connection closes), it is lost through the ZMTP heartbeats, its request dropped
and its blocks freed the same way. The suite kills a child, so it owns its system.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtransfer.curve import generate_keys
from pdserve.live_system import MODEL, registered, wait_all_free
from pdserve.ports import free_ports
from pdserve.supervisor import Supervisor

pytestmark = pytest.mark.slow

WORKERS = {"prefill": "twogw-prefill", "decode": "twogw-decode"}


# the two ways a worker loses a gateway that stops reading (workers/gateway_sessions.py)
HANG_REASONS = ("its control connection dropped",
                "its control socket stopped taking messages (queue full or connection gone)")


def _events(log: Path, msg: str) -> list[dict]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("msg") == msg:
                out.append(event)
    return out


def _until(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.2)


def _metric(url: str, name: str, worker_id: str | None = None) -> float:
    """The value of ``name`` (with ``worker_id``'s label when given) in ``url``'s ``/metrics`` (0 if none)."""
    text = httpx.get(f"{url}/metrics", timeout=5, trust_env=False).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and (worker_id is None or sample.labels.get("worker_id") == worker_id))


def _ready(url: str) -> bool:
    try:
        return (httpx.get(f"{url}/ready", timeout=2, trust_env=False).status_code == 200
                and registered(url) >= set(WORKERS.values()))
    except httpx.HTTPError:
        return False


@pytest.mark.timeout(300)
def test_two_gateways_share_the_workers_and_survive_one_killed_mid_stream(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys)
    http_a, http_b, control_a, control_b = free_ports(4)
    controls = f"tcp://127.0.0.1:{control_a},tcp://127.0.0.1:{control_b}"
    secure = ["--curve-keys", str(keys), "--log-format", "json"]
    sup = Supervisor(grace=10.0)
    try:
        for name, http, control in (("gateway-a", http_a, control_a), ("gateway-b", http_b, control_b)):
            sup.start(name, ["gateway", "--host", "127.0.0.1", "--port", str(http), "--control-bind",
                             f"tcp://127.0.0.1:{control}", "--heartbeat-timeout", "10",
                             "--request-timeout", "120", *secure], str(tmp_path / f"{name}.log"))
        for role, wid in WORKERS.items():
            sup.start(role, [role, "--worker-id", wid, "--model", MODEL, "--host", "127.0.0.1",
                             "--gateway-control", controls, "--num-blocks", "128", "--device", "cpu",
                             "--transfer-backend", "nixl", *secure], str(tmp_path / f"{role}.log"))
        url_a, url_b = f"http://127.0.0.1:{http_a}", f"http://127.0.0.1:{http_b}"

        def both_ready() -> bool:
            assert not sup.dead(), f"child exited: {sup.dead()}; logs in {tmp_path}"
            return _ready(url_a) and _ready(url_b)

        _until(both_ready, 240, "both gateways ready with both workers")
        clients = [openai.OpenAI(base_url=f"{u}/v1", api_key="none", max_retries=0, timeout=60)
                   for u in (url_a, url_b)]
        for k in range(6):  # alternate: a, b, a, b, …
            reply = clients[k % 2].completions.create(model=MODEL, prompt=f"Count to {k + 3}:", max_tokens=4,
                                                      temperature=0)
            assert reply.choices[0].text and reply.usage is not None and reply.usage.completion_tokens >= 1

        # a prefix computed for gateway a is known to gateway b from the prefill worker's KV events: b
        # never routed it, yet it routes the same prompt as a prefix hit, and the worker serves it from cache
        prompt = "Here is a list of the planets of the solar system, in order from the sun: " * 4
        clients[0].completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        _until(lambda: _metric(url_b, "pdserve_prefix_index_blocks", WORKERS["prefill"]) >= 4, 15,
               "gateway b's prefix index holding the prefill worker's blocks")
        cached_before = _metric(url_b, "pdserve_prefix_cached_blocks_total")
        hit = clients[1].completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        assert _metric(url_b, "pdserve_prefix_cached_blocks_total") - cached_before >= 4
        assert hit.usage is not None and hit.usage.prompt_tokens_details is not None
        assert (hit.usage.prompt_tokens_details.cached_tokens or 0) >= 64

        # a long stream through gateway a; kill a once tokens flow
        stream = clients[0].completions.create(model=MODEL, prompt="Tell a very long story:", max_tokens=1500,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
        received = 0
        for chunk in stream:
            received += len(chunk.choices) and bool(chunk.choices[0].text)
            if received >= 3:
                break
        assert received >= 3
        killed_at = time.monotonic()
        os.kill(sup.children["gateway-a"].pid, signal.SIGKILL)

        reply = clients[1].completions.create(model=MODEL, prompt="Name a colour:", max_tokens=4,
                                              temperature=0)
        served_in = time.monotonic() - killed_at
        assert reply.choices[0].text
        assert served_in < 20, f"gateway b answered {served_in:.1f} s after gateway a died"

        def lost(role: str) -> list[dict]:
            return [e for e in _events(tmp_path / f"{role}.log", "gateway_lost")
                    if e.get("gateway") == f"tcp://127.0.0.1:{control_a}"]

        _until(lambda: lost("decode"), 15, "the decode worker dropping gateway a's requests")
        [killed] = lost("decode")
        assert killed["reason"] == "its control connection dropped"
        assert killed["dropped"] == 1  # the stream, decoding there; nothing of gateway b's
        wait_all_free(url_b, set(WORKERS.values()), timeout=30)  # every KV block back, both workers
        assert time.monotonic() - killed_at < 60  # long before 1500 tokens could have been decoded
        # gateway b still routes through both workers
        again = clients[1].completions.create(model=MODEL, prompt="Say hi:", max_tokens=3, temperature=0)
        assert again.choices[0].text
        wait_all_free(url_b, set(WORKERS.values()), timeout=30)

        # gateway a comes back at the same address: both workers register with it again
        sup.restart("gateway-a")
        _until(lambda: _ready(url_a), 60, "the workers registering with the restarted gateway a")
        assert len(lost("decode")) == 1  # the restart was known already: nothing more to drop
        back = clients[0].completions.create(model=MODEL, prompt="Say hello:", max_tokens=3, temperature=0)
        assert back.choices[0].text

        # a gateway that hangs (SIGSTOP: no FIN, no RST) is lost within seconds: by the ZMTP heartbeats, or
        # by the send queue its stream fills first when the decode worker outpaces the heartbeat timeout
        stream = clients[0].completions.create(model=MODEL, prompt="Tell another long story:",
                                               max_tokens=1500, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
        received = 0
        for chunk in stream:
            received += len(chunk.choices) and bool(chunk.choices[0].text)
            if received >= 3:
                break
        stopped_at = time.time()
        os.kill(sup.children["gateway-a"].pid, signal.SIGSTOP)

        def lost_since_stop() -> list[dict]:
            return [e for e in lost("decode") if e["ts"] > stopped_at]

        try:
            _until(lost_since_stop, 20, "the decode worker losing the hung gateway a")
            [hang] = lost_since_stop()
            assert hang["reason"] in HANG_REASONS and hang["dropped"] == 1, hang
            assert hang["ts"] - stopped_at < 10  # ZMTP heartbeats: 1 s apart, 3 s to answer
            wait_all_free(url_b, set(WORKERS.values()), timeout=30)
            hung = clients[1].completions.create(model=MODEL, prompt="Name a fruit:", max_tokens=3,
                                                 temperature=0)
            assert hung.choices[0].text
        finally:
            os.kill(sup.children["gateway-a"].pid, signal.SIGKILL)
    finally:
        sup.stop_all()
