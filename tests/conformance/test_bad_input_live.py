"""Bad and hostile requests against the LIVE gateways (real workers, the embedded model): the 75 cases of
the fake-worker suite (tests/gateway/test_bad_input.py, reused as data: its model name swapped for the
served one, and the two context-length cases rescaled from its 128-token fake context to the real one),
each on both gateways. Each gets its documented 4xx with the OpenAI error body, none a 5xx; afterwards
``/metrics`` counted exactly those statuses, both gateways are ready and still serve, and every worker's
KV blocks are free (polled with a deadline: heartbeats lag)."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import httpx
import pytest

from pdserve.live_system import MODEL, SystemPair, metric_samples
from tests.conformance.helpers import leak_check
from tests.gateway import test_bad_input as fake_suite
from tests.live import API_KEY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GATEWAYS = ("disagg", "colo")
OVER_CONTEXT = 10_000  # tokens: more than the live workers' context (8192)
RESCALED = {"max_tokens-over-context": {"max_tokens": OVER_CONTEXT},
            "prompt-over-context": {"max_tokens": OVER_CONTEXT}}
SENT: dict[str, Counter[str]] = {g: Counter() for g in GATEWAYS}  # statuses this module caused


def _live_body(case_id: str, body: Any) -> Any:
    """The fake suite's body for the live system: served model name, context cases rescaled."""
    if isinstance(body, dict):
        body = {k: (MODEL if k == "model" and v == "fake-model" else v) for k, v in body.items()}
        body.update(RESCALED.get(case_id, {}))
    elif isinstance(body, list):
        body = [_live_body(case_id, b) for b in body]
    return body


assert fake_suite.KEY == API_KEY, "the reused cases carry the fake suite's key"
JSON_CASES = [(c[0], c[1], _live_body(c[0], c[2]), c[3], c[4]) for c in fake_suite.JSON_CASES]
RAW_CASES = [(c[0], c[1], c[2], c[3].replace(b"fake-model", MODEL.encode()), c[4], c[5])
             for c in fake_suite.RAW_CASES]
assert len(JSON_CASES) + len(RAW_CASES) >= 40


def url_of(live: SystemPair, gateway: str) -> str:
    return live.disagg_url if gateway == "disagg" else live.colo_url


def by_status(url: str) -> Counter[str]:
    """``pdserve_requests_total`` summed per status over the API endpoints (not /metrics or /ready)."""
    out: Counter[str] = Counter()
    for (name, labels), value in metric_samples(url).items():
        lab = dict(labels)
        if name == "pdserve_requests_total" and lab["endpoint"] not in ("/metrics", "/ready", "/health"):
            out[lab["status"]] += int(value)
    return out


def wait_counts(url: str, base: Counter[str], want: Counter[str], timeout: float = 5.0) -> Counter[str]:
    """Counts per status since ``base``, polled until they equal ``want`` or ``timeout`` s pass (the
    middleware counts a request once its response has ended, a moment after the client saw it)."""
    deadline = time.monotonic() + timeout
    while True:
        delta = by_status(url) - base
        if delta == want or time.monotonic() > deadline:
            return delta
        time.sleep(0.1)


@pytest.fixture(scope="module")
def before(live: SystemPair) -> dict[str, Counter[str]]:
    """Request counts per status on each gateway before this module's first request."""
    return {g: by_status(url_of(live, g)) for g in GATEWAYS}


def check_error(resp: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err: dict[str, Any] = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("gateway", GATEWAYS)
@pytest.mark.parametrize(("path", "body", "status", "param"), [c[1:] for c in JSON_CASES],
                         ids=[c[0] for c in JSON_CASES])
def test_json_bad_input(live: SystemPair, before: dict[str, Counter[str]], gateway: str, path: str, body: Any,
                        status: int, param: str | None) -> None:
    SENT[gateway][str(status)] += 1
    resp = httpx.post(url_of(live, gateway) + path, content=json.dumps(body),
                      headers={**AUTH, "content-type": "application/json"}, timeout=30)
    check_error(resp, status, param)


@pytest.mark.parametrize("gateway", GATEWAYS)
@pytest.mark.parametrize(("method", "path", "content", "headers", "status"), [c[1:] for c in RAW_CASES],
                         ids=[c[0] for c in RAW_CASES])
def test_raw_bad_input(live: SystemPair, before: dict[str, Counter[str]], gateway: str, method: str,
                       path: str, content: bytes, headers: dict[str, str], status: int) -> None:
    SENT[gateway][str(status)] += 1
    hdrs = {**AUTH, "content-type": "application/json", **headers}
    resp = httpx.request(method, url_of(live, gateway) + path, content=content, headers=hdrs, timeout=60)
    check_error(resp, status, None)


@pytest.mark.parametrize("gateway", GATEWAYS)
def test_duplicate_request_id_in_flight(live: SystemPair, before: dict[str, Counter[str]],
                                        gateway: str) -> None:
    """A second request with the X-Request-Id of a live stream is a 400; the first is then dropped by its
    client mid-stream, which must abort it on the workers (checked by the leak check at the end)."""
    url, hdrs = url_of(live, gateway), {**AUTH, "X-Request-Id": f"dup-{gateway}"}
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=hdrs, timeout=30) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # one iterator: dropping it would close the connection (a disconnect)
        line = next(lines)
        assert line.startswith("data: ") and "choices" in json.loads(line[6:]), line
        second = httpx.post(url + "/v1/completions", json={**body, "stream": False}, headers=hdrs, timeout=30)
        assert check_error(second, 400, None)["code"] == "duplicate_request_id"
        more = [json.loads(x[6:]) for x in (next(lines) for _ in range(6)) if x.startswith("data: ")]
        assert more and all(m["choices"][0]["finish_reason"] is None for m in more), more  # still streaming
    SENT[gateway].update({"200": 1, "400": 1})


@pytest.mark.parametrize("gateway", GATEWAYS)
def test_request_id_reusable_once_client_dropped(live: SystemPair, before: dict[str, Counter[str]],
                                                 gateway: str) -> None:
    """After a client drops a stream, its X-Request-Id is free again at the gateway: reusing it at once
    must be served (200, right output), not fail on a worker that still holds the old request.
    Bug found here (fixed in gateway/service.py ``worker_request_id``): the colocated worker's late
    tokens of the dropped stream were delivered to the new request ('. Paris.' instead of ' Paris.'),
    and a prefill worker still holding the old id refused the new one ("already in the scheduler")."""
    url, hdrs = url_of(live, gateway), {**AUTH, "X-Request-Id": f"reuse-{gateway}"}
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    ref = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60).json()
    long = {**body, "max_tokens": 100, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=long, headers=hdrs, timeout=30) as s:
        lines = s.iter_lines()
        assert next(lines).startswith("data: ")
    SENT[gateway].update({"200": 2})
    again = httpx.post(url + "/v1/completions", json=body, headers=hdrs, timeout=60)
    SENT[gateway][str(again.status_code)] += 1
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["text"] == ref["choices"][0]["text"]  # none of the old one's tokens
    assert again.json()["id"] == f"cmpl-reuse-{gateway}"  # the client's id, though workers saw another


def test_healthy_after_bad_input(live: SystemPair, before: dict[str, Counter[str]]) -> None:
    """Runs last in the module: /metrics counted exactly the statuses sent (none 5xx), both gateways are
    ready and serve a request, every KV block is free and nothing is in flight."""
    for gateway in GATEWAYS:
        url = url_of(live, gateway)
        delta = wait_counts(url, before[gateway], SENT[gateway])
        assert not [s for s in delta if s.startswith("5")], delta
        assert delta == SENT[gateway], (gateway, delta, SENT[gateway])
        assert httpx.get(url + "/ready", timeout=5).status_code == 200
        resp = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3,
                                                         "ignore_eos": True}, headers=AUTH, timeout=60)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    assert not live.dead(), live.dead()
    leak_check(live)
