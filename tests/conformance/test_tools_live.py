"""Tools on the live system (the embedded SmolLM2, whose template does not render tools: the gateway's
Hermes fallback prompt lists them, the Hermes parser reads the answer). A 135M model may or may not call
the tool, so each answer is checked for a valid shape either way (a call's arguments are a JSON object
and the finish reason is ``tool_calls``; no call: text and ``stop``/``length``), and the four ways
(disaggregated/colocated × streamed/not) must agree exactly, call ids aside. A history replaying a call
and its result is served (with tools too in tests/gateway/test_tool_calls_e2e.py: the live gateways'
``--max-prompt-tokens 100`` leaves no room for both); ``tool_choice`` without ``tools`` is a 400;
``required`` and a named function always return calls whose arguments satisfy the tool's schema
(constrained decoding). Every test ends with a KV leak check on both gateways."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from pdserve.live_system import MODEL, SystemPair
from tests.conformance.helpers import client, leak_check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
WEATHER: Any = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
ASK: Any = [{"role": "user", "content": "Weather in Paris?"}]


def _answer(c: openai.OpenAI, stream: bool, **kw: Any) -> tuple[Any, ...]:
    """(content, tool calls as (name, arguments), finish reason, completion tokens) of one request."""
    kw = {"model": MODEL, "messages": ASK, "max_tokens": 24, "temperature": 0, **kw}
    if not stream:
        r = c.chat.completions.create(**kw)
        (ch,) = r.choices
        calls = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
        assert all(t.id.startswith("call_") and t.type == "function" for t in ch.message.tool_calls or [])
        assert r.usage is not None
        return ch.message.content, calls, ch.finish_reason, r.usage.completion_tokens
    content, parts, finish, used = "", {}, None, None
    for chunk in c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
        for ch in chunk.choices:
            assert finish is None, "a chunk after the finish reason"
            content += ch.delta.content or ""
            for t in ch.delta.tool_calls or []:
                if t.index not in parts:
                    assert t.id and t.type == "function" and t.function and t.function.name
                    parts[t.index] = [t.function.name, t.function.arguments or ""]
                else:
                    assert t.function is not None
                    parts[t.index][1] += t.function.arguments or ""
            finish = ch.finish_reason
    return content or None, [tuple(parts[i]) for i in sorted(parts)], finish, used


def four_ways(live: SystemPair, **kw: Any) -> tuple[Any, ...]:
    """The answer, asserted identical disaggregated and colocated, streamed and not. The two systems are
    asked at once (each in its own thread, non-streamed then streamed, as ``quad`` does)."""

    def both_ways(url: str) -> list[tuple[Any, ...]]:
        return [_answer(client(url, live.api_key), stream, **kw) for stream in (False, True)]

    with ThreadPoolExecutor(max_workers=2) as pool:
        sent = {name: pool.submit(both_ways, url) for name, url in (("disagg", live.disagg_url),
                                                                     ("colo", live.colo_url))}
        outs = {(name, stream): out for name, future in sent.items()
                for stream, out in zip((False, True), future.result(), strict=True)}
    ref = outs["disagg", False]
    for way, out in outs.items():
        assert out == ref, f"{way} differs from disagg non-streamed: {out} != {ref}"
    return ref


def check_shape(answer: tuple[Any, ...], calls_allowed: bool) -> None:
    content, calls, finish, _ = answer
    if calls:
        assert calls_allowed, answer
        assert finish == "tool_calls", answer
        for name, arguments in calls:
            assert name == "weather" and isinstance(json.loads(arguments), dict), answer
    else:
        assert isinstance(content, str) and content and finish in ("stop", "length"), answer


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_tools_answer_has_a_valid_shape(live: SystemPair, choice: str) -> None:
    check_shape(four_ways(live, tools=[WEATHER], tool_choice=choice), calls_allowed=choice == "auto")
    leak_check(live)


def test_replayed_call_and_result_are_served(live: SystemPair) -> None:
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}]
    check_shape(four_ways(live, messages=history), calls_allowed=False)  # no tools: nothing parsed
    leak_check(live)


def test_tool_choice_without_tools_is_400(live: SystemPair) -> None:
    for url in (live.disagg_url, live.colo_url):
        with pytest.raises(openai.BadRequestError) as info:
            client(url, live.api_key).chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                                              tool_choice="auto")
        body: Any = info.value.body
        assert body["param"] == "tool_choice", body
    leak_check(live)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_required_and_named_return_calls_valid_for_the_schema(live: SystemPair, choice: Any) -> None:
    # the live gateways' --max-prompt-tokens 100 leaves room for one small tool in the fallback prompt
    # stop strings apply to message text, not to the forced calls (each of these is in every call's JSON)
    content, calls, finish, _ = four_ways(live, tools=[WEATHER], tool_choice=choice, max_tokens=40,
                                          stop=['"', ": "])
    assert finish == "tool_calls" and calls, (content, calls, finish)
    for name, arguments in calls:
        assert name == "weather"
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    leak_check(live)
