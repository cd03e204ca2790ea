"""A ``required`` / named ``tool_choice`` whose output ``max_tokens`` cuts, end to end: a real gateway in
front of a fake colocated worker whose tokens decode to the constrained array of calls (what the grammar
lets the model write), then eos. Cut after every token, on chat completions and ``/v1/responses``,
streamed and not (the official openai client): pdserve's internal array is never the assistant's text,
a call whose name is whole comes back as a call with the arguments written so far, a call cut inside
its name is dropped, and the streamed client ends with the same calls as the non-streamed one. Ends
with a leak check."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.text import TextProcessor
from tests.gateway.conftest import MSGS, Cluster

pytestmark = pytest.mark.slow  # starts processes

ARGS = {"city": "Paris", "days": 2}
ARRAY = f'[{{"name": "weather", "arguments": {json.dumps(ARGS)}}}]'
TOOLS: Any = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
NAMED: Any = {"type": "function", "function": {"name": "weather"}}


@pytest.fixture(scope="module")
def forced(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path,
           proc: TextProcessor) -> Iterator[tuple[Cluster, list[int]]]:
    ids = proc.encode(ARRAY)
    assert proc.decode(ids) == ARRAY
    c = Cluster(tmp_path_factory.mktemp("forced"), tokenizer_dir)
    try:
        c.start_worker("colocated", "c1", output_ids=",".join(map(str, [*ids, proc.eos_token_id])),
                       eos_id=proc.eos_token_id)
        yield c, ids
    finally:
        c.close()


def _expected(text: str) -> list[tuple[str, str]]:
    """The call ``text`` (a beginning of ARRAY) stands for: once ``"weather"`` is whole, the call with
    the arguments written so far (empty before they open)."""
    name_end = ARRAY.index('"weather"') + len('"weather"')
    args_start = ARRAY.index("{", name_end)
    args = json.dumps(ARGS)
    return [] if len(text) < name_end else [("weather", text[args_start:args_start + len(args)])]


def _chat(c: Cluster, max_tokens: int, stream: bool, choice: Any) -> tuple[Any, ...]:
    kw: Any = {"model": "fake-model", "messages": MSGS, "max_tokens": max_tokens, "tools": TOOLS,
               "tool_choice": choice}
    if not stream:
        (ch,) = c.client().chat.completions.create(**kw).choices
        calls = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
        return ch.message.content, calls, ch.finish_reason
    content, parts, finish = "", {}, None
    for chunk in c.client().chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for t in ch.delta.tool_calls or []:
                assert t.function is not None
                if t.index not in parts:
                    assert t.id and t.function.name
                    parts[t.index] = [t.function.name, ""]
                parts[t.index][1] += t.function.arguments or ""
            finish = ch.finish_reason or finish
    return content or None, [tuple(parts[i]) for i in sorted(parts)], finish


def _responses(c: Cluster, max_tokens: int, stream: bool) -> tuple[Any, ...]:
    kw: Any = {"model": "fake-model", "input": "Weather in Paris?", "max_output_tokens": max_tokens,
               "tools": [{"type": "function", **TOOLS[0]["function"]}], "tool_choice": "required"}
    if stream:
        events = list(c.client().responses.create(stream=True, **kw))
        assert not [e for e in events if e.type == "response.output_text.delta"], events
        r = events[-1].response
    else:
        r = c.client().responses.create(**kw)
    assert all(i.type == "function_call" for i in r.output), r.output
    return [(i.name, i.arguments) for i in r.output], r.status


def test_cut_forced_output_is_never_content(forced: tuple[Cluster, list[int]], proc: TextProcessor) -> None:
    c, ids = forced
    for k in [*range(1, len(ids) + 1), len(ids) + 5]:  # the last: the whole array, then eos
        text = proc.decode(ids[:k])
        calls = _expected(text)
        finish = "length" if k <= len(ids) else "tool_calls"
        for choice in ("required", NAMED):
            whole = _chat(c, k, False, choice)
            assert whole == (None, calls, finish), (k, text, whole)
            assert _chat(c, k, True, choice) == whole, (k, text)
        status = "incomplete" if k <= len(ids) else "completed"
        assert _responses(c, k, False) == (calls, status), (k, text)
        assert _responses(c, k, True) == (calls, status), (k, text)
    c.assert_no_leaks()


def test_a_forced_calls_first_streamed_chunk_has_null_content(forced: tuple[Cluster, list[int]]) -> None:
    """OpenAI's first chunk of a reply that is tool calls alone carries ``"content": null`` (a client
    that rebuilds the message from the stream then has null, as the non-streamed reply says); a reply
    that may have text starts with ``"content": ""``. A new-user trial saw ``""`` for a forced call."""
    c, _ = forced

    def first_delta(**extra: Any) -> Any:
        body = {"model": "fake-model", "messages": MSGS, "max_tokens": 4, "stream": True, **extra}
        with httpx.stream("POST", c.base + "/v1/chat/completions", json=body, timeout=20) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    return json.loads(line[6:])["choices"][0]["delta"]
        raise AssertionError("no chunk")

    for choice in ("required", NAMED):
        assert first_delta(tools=TOOLS, tool_choice=choice) == {"role": "assistant", "content": None}
    assert first_delta(tools=TOOLS, tool_choice="none") == {"role": "assistant", "content": ""}
    assert first_delta() == {"role": "assistant", "content": ""}
    c.assert_no_leaks()
