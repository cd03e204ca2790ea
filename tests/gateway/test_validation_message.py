"""A request that fails validation gets one 400 naming its first bad field, and its message lists every
error under that field (each bad ``logit_bias`` key), not only the first; other fields' errors stay out
of it."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pydantic
import pytest
from fastapi.exceptions import RequestValidationError
from starlette.requests import Request

from gateway.app import MAX_LISTED, _validation_error
from gateway.openai_requests import ChatCompletionRequest


def _answer(body: Mapping[str, object]) -> dict[str, str]:
    with pytest.raises(pydantic.ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    response = _validation_error(Request({"type": "http"}), RequestValidationError(errors))
    assert response.status_code == 400
    error: dict[str, str] = json.loads(bytes(response.body))["error"]
    return error


def test_every_bad_key_of_a_field_is_listed() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "logit_bias": {"bad1": 50.0, "bad2": 20.0}}
    error = _answer(body)
    assert error["param"] == "logit_bias.bad1.[key]"
    assert "logit_bias.bad1" in error["message"] and "logit_bias.bad2" in error["message"], error
    error = _answer({**body, "n": 0})  # n comes first: named alone, logit_bias's errors not listed
    assert error["param"] == "n" and "logit_bias" not in error["message"], error


def test_the_list_is_bounded() -> None:
    bias = {f"bad{i}": 1.0 for i in range(3 * MAX_LISTED)}
    error = _answer({"model": "m", "messages": [{"role": "user", "content": "hi"}], "logit_bias": bias})
    assert error["message"].count("logit_bias.bad") == MAX_LISTED
