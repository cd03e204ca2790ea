"""``pdserve_requests_total`` counts user traffic only: the health/readiness probes (`pdserve up` polls
``/ready`` every 0.5 s during start-up, Kubernetes probes ``/health`` and ``/ready``) and Prometheus'
own ``/metrics`` scrapes are not counted (as vLLM excludes them). Found by a new-user trial: a fresh
``pdserve up`` showed dozens of ``/ready`` requests (503s, i.e. "errors") before any user request."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.middleware import ENDPOINTS, MODEL_ENDPOINT, PROBE_PATHS
from gateway.routes import router
from tests.gateway.inprocess import inprocess_gateway


def request_counts(base: str) -> dict[tuple[str, str], float]:
    """``pdserve_requests_total`` samples of the gateway at ``base``: (endpoint, status) → count."""
    text = httpx.get(base + "/metrics", timeout=5).text
    return {(s.labels["endpoint"], s.labels["status"]): s.value
            for fam in text_string_to_metric_families(text) if fam.name == "pdserve_requests"
            for s in fam.samples if s.name == "pdserve_requests_total"}


def test_probes_are_not_counted_user_requests_are() -> None:
    assert {"/health", "/ready", "/metrics"} == PROBE_PATHS
    with inprocess_gateway("served-model") as base, httpx.Client(base_url=base, timeout=5) as c:
        for _ in range(3):
            assert c.get("/health").status_code == 200
            assert c.get("/ready").status_code == 503  # no worker: not ready (and not an "error" to count)
            assert c.get("/metrics").status_code == 200
        assert c.get("/v1/models").status_code == 200
        bad = c.post("/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2})
        assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"
        assert c.post("/v1/responses", json={"model": "nope", "input": "hi"}).status_code == 404
        assert c.get("/no/such/path").status_code == 404
        counts = request_counts(base)
    # the middleware counts a response once it has ended: all of the above ended before the last scrape
    assert counts == {("/v1/models", "200"): 1, ("/v1/completions", "404"): 1, ("/v1/responses", "404"): 1,
                      ("other", "404"): 1}


def test_every_route_has_its_own_endpoint_label() -> None:
    """No API path of the router is counted as ``other`` (only unknown paths are)."""
    paths = {getattr(r, "path", "") for r in router.routes}
    assert paths - PROBE_PATHS - {"/v1/models/{model_id:path}"} == ENDPOINTS
    assert MODEL_ENDPOINT == "/v1/models/{id}" and "/v1/models/{model_id:path}" in paths
