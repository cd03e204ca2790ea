"""A JSON body sent without ``Content-Type: application/json`` (curl's default ``-d`` form type,
``text/plain``, no Content-Type at all) gets a 400 saying so, in the OpenAI error shape; FastAPI hands
such a body to validation unparsed (``strict_content_type``), which answered ``body: must be an object,
got a value`` (a new-user trial, D9). vLLM refuses these too (``validate_json_request``)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.gateway.inprocess import inprocess_gateway

COMPLETION = json.dumps({"model": "served-model", "prompt": "hi", "max_tokens": 2}).encode()
CHAT = json.dumps({"model": "served-model", "messages": [{"role": "user", "content": "hi"}]}).encode()
RESPONSE = json.dumps({"model": "served-model", "input": "hi"}).encode()


def _refusal(content_type: str | None) -> dict[str, object]:
    got = "no Content-Type" if content_type is None else f"Content-Type: {content_type}"
    return {"error": {"message": f"the request body must be JSON sent with Content-Type: application/json, "
                                 f"got {got}", "type": "invalid_request_error", "param": None,
                      "code": "unsupported_media_type"}}


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with inprocess_gateway() as url:
        yield url


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                                            ("/v1/responses", RESPONSE)])
@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain",
                                          "text/plain; charset=utf-8", "multipart/form-data; boundary=x",
                                          None])
def test_a_json_body_of_another_content_type_is_a_400_naming_it(base: str, path: str, body: bytes,
                                                                content_type: str | None) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    resp = httpx.post(base + path, content=body, headers=headers, timeout=10)
    assert resp.request.headers.get("content-type") == content_type  # None: httpx sent no Content-Type
    assert resp.status_code == 400
    assert resp.json() == _refusal(content_type)


@pytest.mark.parametrize("headers", [{"Content-Type": "application/json"},
                                     {"Content-Type": "Application/JSON; charset=utf-8"},
                                     {"Content-Type": "application/vnd.api+json"}])
def test_a_json_content_type_is_read_as_json(base: str, headers: dict[str, str]) -> None:
    """Read and validated as before: the served model with no worker yet is a 503, a missing field a 400
    naming it."""
    ok = httpx.post(base + "/v1/completions", content=COMPLETION, headers=headers, timeout=10)
    assert ok.status_code == 503, ok.text
    missing = httpx.post(base + "/v1/completions", content=b'{"model": "served-model"}', headers=headers,
                         timeout=10)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt"
