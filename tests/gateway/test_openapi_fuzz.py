"""``/openapi.json`` documents every endpoint with request/response schemas, and a bounded, deterministic
schemathesis run against it (hypothesis ``derandomize``, 50 generated cases per operation; each POST body
is sent as generated and again with ``model`` set to the served model, so the cases reach past the model
check; ~200 calls in all) never gets a 5xx. Afterwards the gateway has nothing in flight."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from tests.gateway.conftest import Cluster

pytestmark = pytest.mark.slow  # starts processes

ENDPOINTS = {("post", "/v1/chat/completions"), ("post", "/v1/completions"), ("post", "/v1/responses"),
             ("get", "/v1/models"),
             ("get", "/v1/models/{model_id}"), ("post", "/tokenize"), ("post", "/detokenize"),
             ("get", "/v1/status"), ("get", "/health"), ("get", "/ready"), ("get", "/metrics")}
CASES_PER_OPERATION = 50


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("fuzz"), tokenizer_dir, max_n=4)
    cluster.start_worker("colocated", "c1", max_model_len=64, token_delay=0, prefill_delay=0)
    yield cluster
    cluster.close()


def _resolve(spec: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    return spec["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else node


def test_openapi_documents_every_endpoint(gw: Cluster) -> None:
    spec = httpx.get(gw.base + "/openapi.json", timeout=10).json()
    ops = {(m, path): op for path, item in spec["paths"].items() for m, op in item.items()}
    assert set(ops) == ENDPOINTS
    for (method, path), op in ops.items():
        ok = op["responses"]["200"]["content"]
        assert "schema" in next(iter(ok.values())), (method, path)
        if path != "/metrics":
            assert _resolve(spec, ok["application/json"]["schema"])["properties"], (method, path)
    for path, model in (("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/v1/completions", "CompletionRequest"), ("/v1/responses", "ResponsesRequest")):
        op = ops[("post", path)]
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].endswith("/" + model)
        assert "text/event-stream" in op["responses"]["200"]["content"]
        for status in ("400", "401", "404", "413", "429", "503"):
            err = op["responses"][status]["content"]["application/json"]["schema"]
            assert err["$ref"].endswith("/ErrorResponse")
    assert {"messages", "n", "logprobs", "top_logprobs", "stream_options", "logit_bias",
            "chat_template_kwargs"} <= set(
        spec["components"]["schemas"]["ChatCompletionRequest"]["properties"])
    for path, model in (("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        body = ops[("post", path)]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].endswith("/" + model)
    assert _resolve(spec, ops[("get", "/v1/models/{model_id}")]["responses"]["200"]["content"][
        "application/json"]["schema"])["required"] == ["id", "object", "created", "owned_by", "root",
                                                       "max_model_len"]


def check(case: Any, statuses: Counter[int]) -> None:
    resp = case.call(base_url=gw_base(case), timeout=20)
    statuses[resp.status_code] += 1
    assert resp.status_code < 500 or (case.path == "/ready" and resp.status_code == 503), (
        case.method, case.path, case.body, resp.status_code, resp.text[:500])
    if resp.status_code >= 400 and case.path != "/ready":
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def gw_base(case: Any) -> str:
    return str(case.operation.base_url)


@pytest.mark.timeout(240)
def test_schemathesis_no_5xx(gw: Cluster) -> None:
    schema = schemathesis.openapi.from_url(gw.base + "/openapi.json")
    statuses: Counter[int] = Counter()

    for result in schema.get_all_operations():
        operation = result.ok()  # type: ignore[union-attr]  # an Err raises here: a broken schema

        @given(case=operation.as_strategy())
        @settings(max_examples=CASES_PER_OPERATION, derandomize=True, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def run(case: Any) -> None:
            check(case, statuses)
            if isinstance(case.body, dict):
                case.body = {**case.body, "model": "fake-model"}
                check(case, statuses)

        run()
    assert sum(statuses.values()) >= 150 and statuses[200] >= 10 and statuses[400] >= 10, statuses
    gw.assert_no_leaks()
