"""Schemathesis against the shared live system (real prefill, decode and colocated workers on the
embedded model): bodies generated from ``/openapi.json`` for the generation endpoints (chat
completions, completions, responses), each with ``model`` set to the served model and its token cap
forced to at most 2 (``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens``) so every case
costs little, sent to the disaggregated and the colocated gateway. Never a 5xx; every answer of 400 or
more is an OpenAI error body; no worker process dies (the ``live`` fixture then checks that every KV
block is free and nothing is in flight). Deterministic (hypothesis ``derandomize``), bounded:
``CASES_PER_OPERATION`` cases per endpoint and gateway."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from pdserve.live_system import SystemPair

pytestmark = pytest.mark.timeout(180)

GENERATION = {"/v1/chat/completions": "max_completion_tokens", "/v1/completions": "max_tokens",
              "/v1/responses": "max_output_tokens"}
CASES_PER_OPERATION = 12
MAX_NEW_TOKENS = 2


def capped(body: dict[str, Any], path: str, model: str) -> dict[str, Any]:
    """``body`` with the served model and the endpoint's token cap at most ``MAX_NEW_TOKENS``; chat's
    legacy ``max_tokens`` dropped (the one cap left is forced)."""
    out = {**body, "model": model}
    if path == "/v1/chat/completions":
        out.pop("max_tokens", None)
    cap = GENERATION[path]
    asked = out.get(cap)
    small = isinstance(asked, int) and not isinstance(asked, bool) and 1 <= asked <= MAX_NEW_TOKENS
    out[cap] = asked if small else MAX_NEW_TOKENS
    return out


def test_capped_forces_the_token_cap() -> None:
    assert capped({"max_tokens": 10**9, "prompt": "x"}, "/v1/completions", "m") == {
        "max_tokens": 2, "prompt": "x", "model": "m"}
    assert capped({"max_tokens": 5, "max_completion_tokens": 1}, "/v1/chat/completions", "m") == {
        "max_completion_tokens": 1, "model": "m"}
    assert capped({"max_output_tokens": True}, "/v1/responses", "m")["max_output_tokens"] == 2


def fuzz(operation: Any, url: str, model: str, headers: dict[str, str], statuses: Counter[int]) -> None:
    """``CASES_PER_OPERATION`` generated cases of ``operation`` against the gateway at ``url``."""

    @given(case=operation.as_strategy())
    @settings(max_examples=CASES_PER_OPERATION, derandomize=True, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        if isinstance(case.body, dict):
            case.body = capped(case.body, case.path, model)
        resp = case.call(base_url=url, headers=headers, timeout=60)
        statuses[resp.status_code] += 1
        assert resp.status_code < 500, (case.path, case.body, resp.status_code, resp.text[:500])
        if resp.status_code >= 400:
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}, resp.text[:500]

    run()


def test_schemathesis_on_real_workers(live: SystemPair) -> None:
    headers = {"Authorization": f"Bearer {live.api_key}"}
    statuses: Counter[int] = Counter()
    for url in (live.disagg_url, live.colo_url):
        model = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
        schema = schemathesis.openapi.from_url(url + "/openapi.json", headers=headers)
        for result in schema.get_all_operations():
            operation = result.ok()  # type: ignore[union-attr]  # an Err raises here: a broken schema
            if operation.method.lower() == "post" and operation.path in GENERATION:
                fuzz(operation, url, model, headers, statuses)
    assert live.dead() == []
    # the generator reaches the workers (some 200s) and the validation (some 400s)
    assert sum(statuses.values()) >= 3 * CASES_PER_OPERATION, statuses
    assert statuses[200] >= 3 and statuses[400] >= 3, statuses
