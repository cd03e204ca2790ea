"""Streamed tool calls through the official openai client, for every tool-call parser: a real gateway
(``--tool-call-parser hermes``, ``llama3_json``, ``mistral``) in front of a fake colocated worker whose
tokens decode to two parallel calls in that format, then eos. The arguments arrive in several deltas
(the first delta of a call carries id, type and name; the later ones argument text as the tokens
come), the deltas concatenated equal the non-streamed arguments, and the openai library's stream
accumulator (``ChatCompletionStreamState``) rebuilds the non-streamed message. Each test ends with a leak
check."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from gateway.text import TextProcessor
from tests.gateway.conftest import MSGS, Cluster

pytestmark = pytest.mark.slow  # starts processes

WEATHER = {"city": "Paris", "days": 2, "units": ["C", "F"]}
TIME = {"zone": "Europe/Paris"}
REPLIES = {
    "hermes": f'<tool_call>\n{{"name": "weather", "arguments": {json.dumps(WEATHER)}}}\n</tool_call>\n'
              f'<tool_call>\n{{"name": "time", "arguments": {json.dumps(TIME)}}}\n</tool_call>',
    "llama3_json": f'{{"name": "weather", "parameters": {json.dumps(WEATHER)}}}; '
                   f'{{"name": "time", "parameters": {json.dumps(TIME)}}}',
    "mistral": f'[TOOL_CALLS][{{"name": "weather", "arguments": {json.dumps(WEATHER)}}}, '
               f'{{"name": "time", "arguments": {json.dumps(TIME)}}}]',
}
TOOLS: Any = [
    {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "units": {"type": "array", "items": {"type": "string"}}}}}},
    {"type": "function", "function": {"name": "time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path,
             proc: TextProcessor) -> Iterator[dict[str, Cluster]]:
    out: dict[str, Cluster] = {}
    try:
        for parser, reply in REPLIES.items():
            ids = ",".join(map(str, [*proc.encode(reply), proc.eos_token_id]))
            c = out[parser] = Cluster(tmp_path_factory.mktemp(parser), tokenizer_dir, tool_call_parser=parser)
            c.start_worker("colocated", "c1", output_ids=ids, eos_id=proc.eos_token_id)
        yield out
    finally:
        for c in out.values():
            c.close()


@pytest.mark.parametrize("parser", list(REPLIES))
def test_arguments_stream_in_pieces_and_add_up(clusters: dict[str, Cluster], parser: str) -> None:
    c = clusters[parser]
    kw: Any = {"model": "fake-model", "messages": MSGS, "max_tokens": 100, "tools": TOOLS}
    whole = c.client().chat.completions.create(**kw)
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls or []]
    assert [(n, json.loads(a)) for n, a in calls] == [("weather", WEATHER), ("time", TIME)]

    state = ChatCompletionStreamState(input_tools=TOOLS)
    pieces: dict[int, list[str]] = {}
    for chunk in c.client().chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
        for ch in chunk.choices:
            for t in ch.delta.tool_calls or []:
                assert t.function is not None
                if t.index not in pieces:  # the call's first delta: id, type, name, no argument text
                    assert t.id and t.id.startswith("call_") and t.type == "function"
                    assert (t.function.name, t.function.arguments) == (calls[t.index][0], "")
                    pieces[t.index] = []
                else:
                    assert t.id is None and t.function.name is None and t.function.arguments
                    pieces[t.index].append(t.function.arguments)
    assert ["".join(pieces[i]) for i in sorted(pieces)] == [a for _, a in calls]
    for i in range(len(calls)):  # one delta per token, not one per call
        assert len(pieces[i]) > 3, (i, pieces[i])
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in final.message.tool_calls or []] == calls
    c.assert_no_leaks()


@pytest.mark.parametrize("parser", list(REPLIES))
def test_parallel_tool_calls_false_streams_only_the_first(clusters: dict[str, Cluster], parser: str) -> None:
    c = clusters[parser]
    kw: Any = {"model": "fake-model", "messages": MSGS, "max_tokens": 100, "tools": TOOLS,
               "parallel_tool_calls": False}
    whole = c.client().chat.completions.create(**kw).choices[0]
    state = ChatCompletionStreamState(input_tools=TOOLS)
    for chunk in c.client().chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
    streamed = state.get_final_completion().choices[0]
    for ch in (whole, streamed):
        assert ch.finish_reason == "tool_calls"
        assert [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls or []] \
            == [("weather", WEATHER)]
    c.assert_no_leaks()
