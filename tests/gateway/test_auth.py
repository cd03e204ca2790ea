"""API keys at the gateway, in process (no workers): which endpoints ask for one, and what ``/ready``
tells a caller without one."""

from __future__ import annotations

import httpx

from tests.gateway.inprocess import inprocess_gateway

KEY = "sekrit"


def test_ready_gives_the_verdict_only_and_the_status_view_needs_the_key() -> None:
    """A new-user trial: with --api-key, ``/v1/status`` answered 401 but the public ``/ready`` answered the
    same view (worker ids, KV addresses, the gateway's pid and control endpoint). ``/ready`` now gives
    ``ready`` and ``reason`` only, with the same status codes (503 here: no worker), key or not."""
    with inprocess_gateway(api_keys=(KEY,)) as base, httpx.Client(base_url=base, timeout=5) as c:
        auth = {"Authorization": f"Bearer {KEY}"}
        status = c.get("/v1/status", headers=auth)
        assert status.status_code == 200 and status.json()["process"]["pid"] > 0
        for headers in ({}, auth):
            ready = c.get("/ready", headers=headers)
            assert ready.status_code == 503
            assert ready.json() == {"ready": False, "reason": status.json()["reason"]}
            assert ready.json()["reason"].startswith("no compatible prefill+decode pair")
        assert c.get("/v1/status").status_code == 401
        assert c.get("/health").status_code == 200


def test_ready_asks_for_the_key_with_public_health_false() -> None:
    with inprocess_gateway(api_keys=(KEY,), public_health=False) as base, \
            httpx.Client(base_url=base, timeout=5) as c:
        assert c.get("/ready").status_code == 401
        assert c.get("/health").status_code == 401
        ready = c.get("/ready", headers={"Authorization": f"Bearer {KEY}"})
        assert ready.status_code == 503 and set(ready.json()) == {"ready", "reason"}
