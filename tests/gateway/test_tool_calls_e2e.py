"""Tool calls and reasoning end to end, deterministically: a real gateway (``--reasoning-parser qwen3``,
tool-call parser chosen by SmolLM2's template: Hermes) in front of fake workers whose tokens decode to a
reasoning block, a sentence and a ``<tool_call>`` block, then eos. The official openai client reads the
calls, streamed and not, disaggregated (prefill + decode fakes) and colocated, with the same results.
Each test ends with a leak check."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.text import TextProcessor
from tests.gateway.conftest import (
    MSGS,
    Cluster,
    assert_no_leaks_by_name,
    disaggregated_and_colocated,
    read_record,
)

pytestmark = pytest.mark.slow  # starts processes

THINK = "The user wants the weather, so call the tool."
CALL = {"name": "weather", "arguments": {"city": "Paris", "days": 2}}
REPLY = f"<think>\n{THINK}\n</think>\n\nLet me check.\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>"
TOOLS: Any = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path,
             proc: TextProcessor) -> Iterator[dict[str, Cluster]]:
    ids = ",".join(map(str, [*proc.encode(REPLY), proc.eos_token_id]))
    yield from disaggregated_and_colocated(tmp_path_factory, tokenizer_dir, ids, proc.eos_token_id,
                                           reasoning_parser="qwen3")


def _whole(c: Cluster, **kw: Any) -> dict[str, Any]:
    r = c.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=80, **kw)
    choice = r.choices[0]
    m = choice.message
    calls = [(t.function.name, t.function.arguments) for t in m.tool_calls or []]
    for t in m.tool_calls or []:
        assert t.type == "function" and t.id.startswith("call_")
    return {"content": m.content, "reasoning": (m.model_extra or {}).get("reasoning_content"),
            "calls": calls, "finish": choice.finish_reason}


def _streamed(c: Cluster, **kw: Any) -> dict[str, Any]:
    content, reasoning, calls, finish = "", "", {}, None
    ids: dict[int, str] = {}
    for chunk in c.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=80,
                                                    stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        d = ch.delta
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        for t in d.tool_calls or []:
            if t.index not in calls:  # a call's first delta: id, type and name (OpenAI's stream layout)
                assert t.id and t.id.startswith("call_") and t.type == "function" and t.function
                assert t.function.name and t.function.arguments == ""
                calls[t.index], ids[t.index] = [t.function.name, ""], t.id
            else:
                assert t.id is None and t.function and t.function.name is None
                calls[t.index][1] += t.function.arguments or ""
        if ch.finish_reason is not None:
            assert finish is None
            finish = ch.finish_reason
    return {"content": content or None, "reasoning": reasoning or None,
            "calls": [tuple(calls[i]) for i in sorted(calls)], "finish": finish}


@pytest.mark.parametrize("name", ["disagg", "colo"])
def test_tool_call_with_reasoning(clusters: dict[str, Cluster], name: str) -> None:
    c = clusters[name]
    whole = _whole(c, tools=TOOLS)
    assert whole == {"content": "Let me check.", "reasoning": f"\n{THINK}\n",
                     "calls": [("weather", json.dumps(CALL["arguments"]))], "finish": "tool_calls"}
    assert _streamed(c, tools=TOOLS) == whole
    assert_no_leaks_by_name(c, name)


@pytest.mark.parametrize("name", ["disagg", "colo"])
def test_tool_choice_none_and_no_tools_parse_no_calls(clusters: dict[str, Cluster], name: str) -> None:
    c = clusters[name]
    text = f"Let me check.\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>"
    expected = {"content": text, "reasoning": f"\n{THINK}\n", "calls": [], "finish": "stop"}
    for kw in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        assert _whole(c, **kw) == expected
        assert _streamed(c, **kw) == expected
    assert_no_leaks_by_name(c, name)


def test_disaggregated_equals_colocated(clusters: dict[str, Cluster]) -> None:
    runs = {name: (_whole(c, tools=TOOLS, parallel_tool_calls=False), _streamed(c, tools=TOOLS))
            for name, c in clusters.items()}
    assert runs["disagg"] == runs["colo"]
    for name, c in clusters.items():
        assert_no_leaks_by_name(c, name)


def test_replayed_call_and_result_reach_the_template(clusters: dict[str, Cluster],
                                                     proc: TextProcessor) -> None:
    """A history with an assistant message holding only tool calls and a tool message is served (200) and
    rendered with SmolLM2's template through the Hermes fallback."""
    c = clusters["disagg"]
    history: Any = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}]
    r = c.client().chat.completions.create(model="fake-model", messages=history, max_tokens=80, tools=TOOLS)
    assert r.choices[0].finish_reason == "tool_calls"
    record: Any = read_record(c.tmp / "p1.jsonl")  # the prefill fake's messages (Cluster.start_worker)
    prompt = proc.decode(record[-1]["prompt_token_ids"], skip_special_tokens=False)
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n' \
           "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response>" \
           in prompt
    assert prompt.startswith("<|im_start|>system\nFunctions you may call:\n<tools>\n")
    c.assert_no_leaks(("d1",))


def test_logprobs_and_choices_survive_parsing(clusters: dict[str, Cluster]) -> None:
    """Streamed with ``n=2`` and logprobs: every generated token's logprob arrives once (held text's
    entries ride on the next chunk), and each choice gets its own call."""
    c = clusters["disagg"]
    whole = c.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=80, tools=TOOLS,
                                               n=2, logprobs=True)
    assert whole.usage is not None
    assert sum(len(ch.logprobs.content or []) for ch in whole.choices if ch.logprobs) == \
        whole.usage.completion_tokens
    # the fake decode worker's 64 blocks hold one n=2 request of this prompt: wait until a heartbeat
    # reports them free again, or admission control answers the next one 429 (as it should)
    c.assert_no_leaks(("d1",))
    entries, calls, finishes = 0, {0: 0, 1: 0}, {}
    for chunk in c.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=80,
                                                    tools=TOOLS, n=2, logprobs=True, stream=True):
        for ch in chunk.choices:
            entries += len(ch.logprobs.content or []) if ch.logprobs else 0
            calls[ch.index] += sum(1 for t in ch.delta.tool_calls or [] if t.id)
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert entries == whole.usage.completion_tokens
    assert calls == {0: 1, 1: 1} and finishes == {0: "tool_calls", 1: "tool_calls"}
    c.assert_no_leaks(("d1",))


@pytest.mark.parametrize("name", ["disagg", "colo"])
def test_responses_logprobs_and_reasoning_summary(clusters: dict[str, Cluster], name: str) -> None:
    """``/v1/responses`` with ``include: ["message.output_text.logprobs"]`` and a reasoning summary:
    the reasoning item's summary is its text, the message's logprobs are those of the tokens that made
    its text (not the reasoning's nor the call's), the same streamed and not."""
    c = clusters[name]
    kw: Any = {"model": "fake-model", "input": "Weather in Paris?", "max_output_tokens": 80,
               "tools": [{"type": "function", **TOOLS[0]["function"]}],
               "include": ["message.output_text.logprobs"], "top_logprobs": 1,
               "reasoning": {"summary": "auto"}}
    whole = c.client().responses.create(**kw)
    counted = c.metric("pdserve_generation_tokens_total")
    events = list(c.client().responses.create(stream=True, **kw))
    streamed = events[-1].response
    assert streamed.usage is not None  # a streamed response's tokens are counted like any other's
    assert c.metric("pdserve_generation_tokens_total") == counted + streamed.usage.output_tokens
    for r in (whole, streamed):
        assert [i.type for i in r.output] == ["reasoning", "message", "function_call"]
        reasoning, message, call = r.output
        assert [s.text for s in reasoning.summary or []] == [f"\n{THINK}\n"]
        assert message.content[0].text == "Let me check." and call.name == "weather"
        logprobs = message.content[0].logprobs or []
        tokens = "".join(e.token for e in logprobs)
        assert tokens == "Let me check.", tokens
        assert all(len(e.top_logprobs) == 1 for e in logprobs)
    assert whole.output[1].content[0].logprobs == streamed.output[1].content[0].logprobs
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [x.model_dump() for e in deltas for x in e.logprobs or []] == [
        x.model_dump() for x in streamed.output[1].content[0].logprobs or []]
    summary = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    assert summary == f"\n{THINK}\n"
    assert_no_leaks_by_name(c, name)
