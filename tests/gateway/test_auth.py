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
            assert ready.json()["reason"].startswith("no live worker (neither a colocated worker nor")
        assert c.get("/v1/status").status_code == 401
        assert c.get("/health").status_code == 200


def test_ready_asks_for_the_key_with_public_health_false() -> None:
    with inprocess_gateway(api_keys=(KEY,), public_health=False) as base, \
            httpx.Client(base_url=base, timeout=5) as c:
        assert c.get("/ready").status_code == 401
        assert c.get("/health").status_code == 401
        ready = c.get("/ready", headers={"Authorization": f"Bearer {KEY}"})
        assert ready.status_code == 503 and set(ready.json()) == {"ready", "reason"}


def test_bearer_token_takes_the_scheme_in_any_case() -> None:
    from gateway.routes import bearer_token

    for value in ("Bearer k1", "bearer k1", "BEARER k1", "bEaReR k1", "Bearer   k1"):
        assert bearer_token(value) == "k1", value
    for value in ("", "Basic k1", "Bearerk1", "Token k1"):
        assert bearer_token(value) is None, value
    assert bearer_token("Bearer") == bearer_token("bearer ") == ""  # no token: matches no key (none is empty)


def test_the_auth_scheme_is_case_insensitive() -> None:
    """A new-user trial: ``Authorization: bearer KEY`` (lower case) was a 401; RFC 7235 makes the scheme
    case-insensitive, and clients do send it so."""
    with inprocess_gateway(api_keys=(KEY, "other")) as base, httpx.Client(base_url=base, timeout=5) as c:
        for scheme in ("Bearer", "bearer", "BEARER"):
            for key in (KEY, "other"):
                got = c.get("/v1/models", headers={"Authorization": f"{scheme} {key}"})
                assert got.status_code == 200 and got.json()["data"][0]["id"] == "served-model"
        for value in (f"Basic {KEY}", f"bearer {KEY}x", "bearer", KEY, f"Bearer{KEY}"):
            got = c.get("/v1/models", headers={"Authorization": value})
            assert got.status_code == 401 and got.json()["error"]["code"] == "invalid_api_key", value
        assert c.get("/v1/models").status_code == 401
