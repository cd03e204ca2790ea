"""Structured outputs through the live system: ``response_format`` (json_schema, json_object) and vLLM's
``structured_outputs`` (choice, regex, grammar) give identical, valid outputs disaggregated and
colocated, streamed and not; a schema whose first tokens are forced is masked on the prefill worker and
continued by the decode worker; a bad schema, regex or grammar is a 400 naming the field."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import pytest

from pdserve.live_system import MODEL, SystemPair
from tests.conformance.conftest import Quad
from tests.conformance.helpers import leak_check

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK_PERSON = [{"role": "user", "content": "Reply with JSON: name and age of a person."}]
# the first tokens are forced ({"answer": "), the rest is free text up to 16 characters
FORCED_START = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 16}},
                "required": ["answer"]}


def test_json_schema_on_chat(quad: Quad) -> None:
    out = quad("chat", messages=ASK_PERSON, max_tokens=40, temperature=0,
               response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                       "strict": True}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.texts()[0]), PERSON)


def test_forced_first_token_crosses_the_split(quad: Quad) -> None:
    """Unconstrained, the model starts with prose; constrained, the prefill worker's first token is the
    schema's and the decode worker continues inside the grammar (identical to the colocated run)."""
    free = quad("chat", max_tokens=3, temperature=0)
    assert not free.texts()[0].startswith("{")
    out = quad("chat", max_tokens=30, temperature=0,
               response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": FORCED_START}})
    assert out.texts()[0].startswith('{"answer": "')
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.texts()[0]), FORCED_START)


def test_json_object_on_completions(quad: Quad) -> None:
    prompt = "<|im_start|>user\nReply with JSON: name and age of a person.<|im_end|>\n<|im_start|>assistant\n"
    out = quad("completions", prompt=prompt, max_tokens=40, temperature=0,
               extra_body={"response_format": {"type": "json_object"}})
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.texts()[0]), dict)


def test_structured_outputs_choice_regex_grammar(quad: Quad) -> None:
    choice = quad("completions", prompt="The capital of France is", max_tokens=8, temperature=0,
                  extra_body={"structured_outputs": {"choice": ["Paris", "Rome", "Madrid"]}})
    assert choice.texts() == ["Paris"] and choice.choices[0].finish_reason == "stop"
    regex = quad("chat", max_tokens=12, temperature=0,
                 extra_body={"structured_outputs": {"regex": "[A-Z][a-z]{1,9}"}})
    assert re.fullmatch("[A-Z][a-z]{1,9}", regex.texts()[0]) and regex.choices[0].finish_reason == "stop"
    grammar = 'root ::= "The answer is " digit "."\ndigit ::= [0-9]'
    ebnf = quad("chat", messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=12, temperature=0,
                extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"The answer is [0-9]\.", ebnf.texts()[0]) and ebnf.choices[0].finish_reason == "stop"


def test_min_tokens_yields_to_a_complete_grammar(quad: Quad) -> None:
    """``min_tokens`` beyond what the grammar allows: the choice (one token, then eos, which the decode
    worker's min_tokens ban would forbid) still ends with "stop" on every path; a regex that can go on
    keeps going until ``min_tokens`` tokens."""
    choice = quad("completions", prompt="The capital of France is", max_tokens=8, temperature=0,
                  extra_body={"structured_outputs": {"choice": ["Paris", "Rome"]}, "min_tokens": 6})
    assert choice.texts() == ["Paris"] and choice.choices[0].finish_reason == "stop"
    digits = quad("completions", prompt="Count: 1, 2,", max_tokens=10, temperature=0,
                  extra_body={"structured_outputs": {"regex": "[0-9 ,]{1,20}"}, "min_tokens": 6})
    assert digits.usage is not None and digits.usage[1] >= 6


def test_max_tokens_first_is_length(quad: Quad) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 30}
    out = quad("chat", max_tokens=4, temperature=0,
               response_format={"type": "json_schema", "json_schema": {"name": "l", "schema": schema}})
    assert out.choices[0].finish_reason == "length" and out.texts()[0].startswith("[")


# through the real workers (the full list of bad specs: tests/gateway/test_bad_input.py, fake workers)
BAD: list[tuple[dict[str, Any], str]] = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_bad_spec_is_a_400_naming_the_field(live: SystemPair, fields: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    for url in (live.disagg_url, live.colo_url):
        resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {live.api_key}"})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param, error
        assert error["type"] == "invalid_request_error" and error["message"]


# specs the gateway's checks pass but xgrammar refuses: an inverted character range, a regex word
# boundary (also inside a JSON schema's pattern)
WORKER_REJECTS = [
    ({"structured_outputs": {"grammar": "root ::= [z-a]"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": r"\bfoo\b"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": {"type": "string", "pattern": r"\bfoo\b"}}}}, "response_format"),
]


@pytest.mark.parametrize(("fields", "param"), WORKER_REJECTS)
@pytest.mark.parametrize("max_tokens", [4, 1])  # 1: the prefill worker alone compiles it
def test_spec_the_worker_cannot_compile_is_a_400(live: SystemPair, fields: dict[str, Any], param: str,
                                                 max_tokens: int) -> None:
    """The worker that compiles the spec first (the decode worker at ``ReserveKV``, the prefill worker
    alone at ``max_tokens: 1``, the colocated one at admission) answers ``RequestRejected``: a 400 naming
    the request's field with the grammar engine's reason, streamed or not, before any token, with no
    retry elsewhere and nothing held afterwards."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            **fields}
    for url in (live.disagg_url, live.colo_url):
        for stream in (False, True):
            resp = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": stream}, timeout=60,
                              headers={"Authorization": f"Bearer {live.api_key}"})
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", error
            assert "does not compile" in error["message"], error  # the worker's grammar engine said it
    leak_check(live)


def test_no_leak_after_structured_requests(live: SystemPair) -> None:
    leak_check(live)
