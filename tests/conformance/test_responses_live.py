"""POST /v1/responses against the live system through the official client (``responses.create``,
streamed and not): text and message-list input with ``instructions``, ``max_output_tokens``, a
required function tool (a ``function_call`` item whose arguments fit the schema), ``text.format``
json_schema, the streaming event sequence, identical answers disaggregated and colocated; ``store:
true``, ``previous_response_id`` and unknown fields are 400s naming the field. Ends with a KV leak check."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from pdserve.live_system import MODEL, SystemPair
from tests.conformance.conftest import CACHE_HIT_TOL
from tests.conformance.helpers import client, leak_check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
# small: its schema goes into the prompt, which the live gateways cap at 100 tokens
WEATHER: Any = {"type": "function", "name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}
PERSON: Any = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
               "required": ["name"], "additionalProperties": False}


def _both(live: SystemPair, **kw: Any) -> list[tuple[Any, list[Any]]]:
    """Per gateway and mode (non-streamed, streamed): (the final response, the stream's event types)."""
    kw = {"model": MODEL, "temperature": 0, **kw}
    out = []
    for url, _ in live.pairs():
        c: openai.OpenAI = client(url, live.api_key)
        out.append((c.responses.create(**kw), []))
        events = list(c.responses.create(stream=True, **kw))
        types = [e.type for e in events]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert types[:2] == ["response.created", "response.in_progress"], types
        assert types[-1] in ("response.completed", "response.incomplete"), types
        final = events[-1].response
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == final.output_text
        out.append((final, types))
    first = out[0][0]
    for r, _ in out[1:]:  # identical on both paths, streamed or not
        assert r.output_text == first.output_text and r.status == first.status
        assert [(i.type, getattr(i, "arguments", None)) for i in r.output] == [
            (i.type, getattr(i, "arguments", None)) for i in first.output]
        assert r.usage.output_tokens == first.usage.output_tokens
    return out


def test_text_input_and_message_list_with_instructions(live: SystemPair) -> None:
    runs = _both(live, input="The capital of France is", max_output_tokens=6)
    r, types = runs[1]
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.usage.output_tokens == 6 and r.output[0].type == "message"
    assert r.output[-1].status == "incomplete"
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    messages = _both(live, instructions="Answer in one word.", max_output_tokens=30,
                     input=[{"role": "user", "content": "Capital of France?"},
                            {"role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
                            {"role": "user", "content": [{"type": "input_text", "text": "And Italy?"}]}])
    assert messages[0][0].status in ("completed", "incomplete") and messages[0][0].usage.input_tokens > 10
    leak_check(live)


def test_required_function_tool_returns_a_function_call(live: SystemPair) -> None:
    runs = _both(live, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                 max_output_tokens=40)
    assert runs[0][0].usage.input_tokens <= 100
    for r, types in runs:
        calls = [i for i in r.output if i.type == "function_call"]
        assert calls and all(c.name == "weather" and c.call_id for c in calls), r.output
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"])
        if types:
            assert "response.function_call_arguments.delta" in types
            assert "response.function_call_arguments.done" in types
    leak_check(live)


def test_text_format_json_schema(live: SystemPair) -> None:
    runs = _both(live, input="Reply with JSON: the name of a person.", max_output_tokens=30,
                 text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    for r, _ in runs:
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), PERSON)
    leak_check(live)


def test_included_logprobs_cover_the_output_text(live: SystemPair) -> None:
    """``include: ["message.output_text.logprobs"]``: one entry per output token (no parser splits this
    answer), with ``top_logprobs`` alternatives, their texts adding up to the output text; the same tokens
    on both paths, streamed and not, and the same logprobs (exactly between sends that found as many
    prompt tokens cached, else within ``CACHE_HIT_TOL`` nats);
    ``truncation: "disabled"`` is accepted."""
    runs = _both(live, input="The capital of France is", max_output_tokens=5, truncation="disabled",
                 include=["message.output_text.logprobs"], top_logprobs=2)
    dumps = [[e.model_dump() for e in r.output[0].content[0].logprobs] for r, _ in runs]
    for r, _ in runs:
        entries = r.output[0].content[0].logprobs
        assert len(entries) == r.usage.output_tokens == 5
        assert "".join(e.token for e in entries) == r.output_text
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    # runs: disaggregated non-streamed, streamed, then colocated the same. Two sends that found the same
    # number of prompt tokens cached compute the same way and agree exactly; otherwise (a send finding the
    # prompt cached by an earlier one computes the rest over the stored prefix in another summation
    # order) they agree within CACHE_HIT_TOL. Tokens and bytes agree exactly either way.
    cached = [r.usage.input_tokens_details.cached_tokens for r, _ in runs]
    for i, j in ((0, 1), (0, 2), (1, 3), (2, 3)):
        first, second = dumps[i], dumps[j]
        if cached[i] == cached[j]:
            assert first == second, (i, j, cached)
        assert [(e["token"], e["bytes"]) for e in first] == [(e["token"], e["bytes"]) for e in second]
        for a, b in zip(first, second, strict=True):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=CACHE_HIT_TOL), (a, b)
            assert sorted(t["logprob"] for t in a["top_logprobs"]) == pytest.approx(
                sorted(t["logprob"] for t in b["top_logprobs"]), abs=CACHE_HIT_TOL), (a, b)
    leak_check(live)


@pytest.mark.parametrize(("fields", "param"), [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"reasoning": {"effort": "low"}}, "reasoning.effort"),
    ({"include": ["reasoning.encrypted_content"]}, "include.0"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format.schema"),
])
def test_refused_fields_are_400_naming_them(live: SystemPair, fields: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields}
    for url, _ in live.pairs():
        resp = httpx.post(f"{url}/v1/responses", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {live.api_key}"})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert "response_format" not in error["message"] and "messages" not in error["message"], error


@pytest.mark.parametrize("stream", [False, True])
def test_a_spec_the_worker_refuses_names_the_responses_field(live: SystemPair, stream: bool) -> None:
    """A text.format schema that passes the gateway's checks but not the workers' grammar engine (``\\b``):
    the worker's 400 (raised for the chat field ``response_format``) names ``text.format``, streamed or not,
    on both paths, before any event."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, "stream": stream, "text": {"format": {
        "type": "json_schema", "name": "w", "schema": {"type": "string", "pattern": r"\bfoo\b"}}}}
    for url, _ in live.pairs():
        resp = httpx.post(f"{url}/v1/responses", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {live.api_key}"})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "text.format" and "does not compile" in error["message"], error
        assert "response_format" not in error["message"], error
    leak_check(live)
