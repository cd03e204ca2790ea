"""SGLang's ``tool_choice`` cases (``test/srt/openai_server/function_call/test_tool_choice.py``), ported
to the live disaggregated gateway serving the embedded SmolLM2: ``auto``, ``required`` and a named
function, streamed and not, and a named function that is not among the tools. The live gateways'
``--max-prompt-tokens 100`` leaves room for one small tool in the fallback tool prompt, so each case
offers one tool (the peer offers three; its two-tool travel scenarios are not ported, see README.md).
``required`` and a named function are constrained decoding in pdserve, so even this model returns a
call whose arguments satisfy the schema; ``auto`` may or may not call. Each case names its peer test."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import jsonschema
import pytest

from pdserve.live_system import MODEL, SystemPair
from tests.conformance.helpers import leak_check
from tests.conformance.peer.common import disagg, refused, together

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER: Any = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
ASK: Any = [{"role": "user", "content": "Weather in Paris?"}]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


def _create(live: SystemPair, **kw: Any) -> Any:
    """``max_tokens`` 24 (a forced call is about 20 tokens); ``auto`` answers get 12 (a free answer)."""
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 12 if kw.get("tool_choice") == "auto" else 24)
    c = disagg(live)
    return c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], **kw)


def _streamed_calls(live: SystemPair, **kw: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish reason) of a streamed answer, rebuilt from its deltas."""
    content, calls, finish = "", {}, None
    for chunk in _create(live, stream=True, **kw):
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for t in ch.delta.tool_calls or []:
            fn = t.function
            assert fn is not None
            if t.index not in calls:
                assert t.id and t.type == "function" and fn.name, "a call's first delta names it"
                calls[t.index] = [fn.name, ""]
            calls[t.index][1] += fn.arguments or ""
        finish = ch.finish_reason or finish
    return content, [(name, args) for name, args in (calls[i] for i in sorted(calls))], finish


def _valid(calls: list[tuple[str, str]]) -> None:
    assert calls, "no tool call"
    for name, args in calls:
        assert name == "get_weather"
        jsonschema.validate(json.loads(args), PARAMS)


# from sglang function_call/test_tool_choice.py::test_tool_choice_auto_non_streaming
def test_tool_choice_auto_non_streaming(live: SystemPair) -> None:
    r = _create(live, tool_choice="auto")
    msg = r.choices[0].message
    if msg.tool_calls:  # optional under auto; when present, well formed
        _valid([(t.function.name, t.function.arguments) for t in msg.tool_calls])
        assert r.choices[0].finish_reason == "tool_calls"
    else:
        assert isinstance(msg.content, str) and r.choices[0].finish_reason in ("stop", "length")


# from sglang function_call/test_tool_choice.py::test_tool_choice_auto_streaming
def test_tool_choice_auto_streaming(live: SystemPair) -> None:
    (content, calls, finish), r = together(partial(_streamed_calls, live, tool_choice="auto"),
                                           partial(_create, live, tool_choice="auto"))
    whole = r.choices[0]
    assert finish == whole.finish_reason and (content or None) == whole.message.content
    assert calls == [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or []]


# from sglang function_call/test_tool_choice.py::test_tool_choice_required_non_streaming
def test_tool_choice_required_non_streaming(live: SystemPair) -> None:
    # parallel_tool_calls=False (the peer leaves it on): at temperature 0.2 SmolLM2 sometimes starts a
    # second call, which max_tokens 24 would cut before any call is complete
    r = _create(live, tool_choice="required", temperature=0.2, parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    _valid([(t.function.name, t.function.arguments) for t in calls])


# from sglang function_call/test_tool_choice.py::test_tool_choice_required_streaming
def test_tool_choice_required_streaming(live: SystemPair) -> None:
    _, calls, finish = _streamed_calls(live, tool_choice="required")
    assert finish == "tool_calls"
    _valid(calls)


# from sglang function_call/test_tool_choice.py::test_tool_choice_specific_function_non_streaming
def test_tool_choice_specific_function_non_streaming(live: SystemPair) -> None:
    calls = _create(live, tool_choice=NAMED).choices[0].message.tool_calls
    assert calls and len(calls) >= 1
    _valid([(t.function.name, t.function.arguments) for t in calls])


# from sglang function_call/test_tool_choice.py::test_tool_choice_specific_function_streaming
def test_tool_choice_specific_function_streaming(live: SystemPair) -> None:
    _, calls, _ = _streamed_calls(live, tool_choice=NAMED)
    assert calls and calls[0][0] == "get_weather"
    _valid(calls)


# from sglang function_call/test_tool_choice.py::test_error_handling_invalid_tool_choice
def test_error_handling_invalid_tool_choice(live: SystemPair) -> None:
    """The peer accepts either a warning or an error; pdserve's documented answer is a 400 naming
    ``tool_choice`` (a named function not in ``tools``)."""
    missing = {"type": "function", "function": {"name": "nonexistent_function"}}
    err = refused(lambda: _create(live, tool_choice=missing), "tool_choice")
    assert "nonexistent_function" in err.message
    leak_check(live)
