"""Tool-call and reasoning parsers on hand-written model outputs: the non-streamed result holds the right
content, reasoning and calls, and the same text cut into any pieces streams events that add up to it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.chat_output import ChatOutputParser, ChatOutputSpec, parse_whole
from gateway.reasoning import select_reasoning_parser
from gateway.tool_parsers import select_tool_parser
from gateway.tool_parsers.events import (
    ContentText,
    Event,
    ParsedOutput,
    ReasoningText,
    ToolCallArguments,
    ToolCallStart,
    fold,
)

W = {"city": "Paris", "unit": "c"}
WJ = json.dumps(W)

# (spec, model output, content, reasoning, [(name, arguments dict)])
CASES = [
    (ChatOutputSpec(tools="hermes"),
     f'<tool_call>\n{{"name": "weather", "arguments": {WJ}}}\n</tool_call>', None, None, [("weather", W)]),
    (ChatOutputSpec(tools="hermes"),
     f'Let me check.\n<tool_call>{{"name": "weather", "arguments": {WJ}}}</tool_call>\n'
     '<tool_call>{"name": "time", "arguments": {}}</tool_call>\n', "Let me check.", None,
     [("weather", W), ("time", {})]),
    (ChatOutputSpec(tools="hermes"), "Paris is sunny today.\n", "Paris is sunny today.\n", None, []),
    (ChatOutputSpec(tools="hermes"), "a < b and <tool_ c", "a < b and <tool_ c", None, []),
    (ChatOutputSpec(tools="hermes"), "<tool_call>not json</tool_call> ok",
     "<tool_call>not json</tool_call> ok", None, []),
    (ChatOutputSpec(tools="hermes"), f'<tool_call>{{"name": "weather", "arguments": {WJ}}}', None, None,
     [("weather", W)]),
    (ChatOutputSpec(tools="hermes"), '<tool_call>{"name": "weather", "argu',
     '<tool_call>{"name": "weather", "argu', None, []),
    (ChatOutputSpec(tools="hermes"), '<tool_call>{"name": "w", "arguments": "{\\"a\\": 1}"}</tool_call>',
     None, None, [("w", {"a": 1})]),
    (ChatOutputSpec(tools="hermes", parallel_tool_calls=False),
     '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}'
     '</tool_call>', None, None, [("a", {})]),
    (ChatOutputSpec(tools="llama3_json"), f'{{"name": "weather", "parameters": {WJ}}}', None, None,
     [("weather", W)]),
    (ChatOutputSpec(tools="llama3_json"), f'<|python_tag|>{{"name": "a", "parameters": {{}}}}; '
     f'{{"name": "weather", "parameters": {WJ}}}', None, None, [("a", {}), ("weather", W)]),
    (ChatOutputSpec(tools="llama3_json"), "  The weather is {fine}.", "  The weather is {fine}.", None, []),
    (ChatOutputSpec(tools="llama3_json"), '{"answer": 42}', '{"answer": 42}', None, []),
    (ChatOutputSpec(tools="mistral"), f'[TOOL_CALLS][{{"name": "weather", "arguments": {WJ}}}, '
     '{"name": "t", "arguments": {}}]', None, None, [("weather", W), ("t", {})]),
    (ChatOutputSpec(tools="mistral"), f'Sure. [TOOL_CALLS]weather[ARGS]{WJ}', "Sure.", None,
     [("weather", W)]),
    (ChatOutputSpec(tools="mistral"), f'[{{"name": "weather", "arguments": {WJ}}}]', None, None,
     [("weather", W)]),
    (ChatOutputSpec(tools="mistral"), "[1] is a list [TOOL_CALLS]oops", "[1] is a list [TOOL_CALLS]oops",
     None, []),
    (ChatOutputSpec(tools="mistral"), "[TOOL", "[TOOL", None, []),
    (ChatOutputSpec(tools="hermes"), '<tool_call>{"arguments": {"a": "}{"}, "name": "w"}</tool_call>', None,
     None, [("w", {"a": "}{"})]),
    (ChatOutputSpec(tools="hermes"), '<tool_call>{"name": "w", "arguments": {"a": "x\\"}"}} tail</tool_call>',
     "tail", None, [("w", {"a": 'x"}'})]),
    (ChatOutputSpec(tools="hermes"), '<tool_call>{"name": "w"}</tool_call>', None, None, [("w", {})]),
    (ChatOutputSpec(tools="hermes"), '<tool_call>{"name": 1, "arguments": {}}</tool_call>',
     '<tool_call>{"name": 1, "arguments": {}}</tool_call>', None, []),
    (ChatOutputSpec(tools="hermes"), '<tool_call>{"name": "w", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "w", "arguments": [1]}</tool_call>', None, []),
    (ChatOutputSpec(tools="llama3_json"), '{"name": "a", "parameters": {"n": [1, {"m": 2}]}} and more',
     "and more", None, [("a", {"n": [1, {"m": 2}]})]),
    (ChatOutputSpec(tools="llama3_json"), '<|python_tag|>{"answer": 42}', '<|python_tag|>{"answer": 42}',
     None, []),
    (ChatOutputSpec(tools="mistral"), '[TOOL_CALLS]a[ARGS]{"x": "[ARGS]"}[TOOL_CALLS]b[ARGS]{}', None, None,
     [("a", {"x": "[ARGS]"}), ("b", {})]),
    (ChatOutputSpec(tools="mistral"), "[TOOL_CALLS][1, 2]", "[TOOL_CALLS][1, 2]", None, []),
    (ChatOutputSpec(tools="forced_json"), f'[{{"name": "weather", "arguments": {WJ}}}, '
     '{"name": "t", "arguments": {}}]', None, None, [("weather", W), ("t", {})]),
    (ChatOutputSpec(tools="forced_json"), '[{"name": "weath', None, None, []),
    (ChatOutputSpec(reasoning="qwen3"), "<think>\nHmm, 2+2.\n</think>\n\nIt is 4.", "It is 4.",
     "\nHmm, 2+2.\n", []),
    (ChatOutputSpec(reasoning="qwen3"), "It is 4.", "It is 4.", None, []),
    (ChatOutputSpec(reasoning="qwen3"), "<think>cut sho", None, "cut sho", []),
    (ChatOutputSpec(reasoning="deepseek_r1"), "Hmm.</think>4", "4", "Hmm.", []),
    (ChatOutputSpec(reasoning="deepseek_r1"), "<think>Hmm, still", None, "Hmm, still", []),
    (ChatOutputSpec(reasoning="qwen3", tools="hermes"),
     f'<think>need weather</think>\n<tool_call>{{"name": "weather", "arguments": {WJ}}}</tool_call>', None,
     "need weather", [("weather", W)]),
    (ChatOutputSpec(reasoning="qwen3", tools="hermes"),
     '<think>a <tool_call> in thought</think>fine', "fine", "a <tool_call> in thought", []),
]


def _check(out: ParsedOutput, content: str | None, reasoning: str | None,
           calls: list[tuple[str, dict[str, object]]]) -> None:
    assert (out.content, out.reasoning) == (content, reasoning)
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == calls
    for c in out.calls:
        assert c.id.startswith("call_") and len(c.id) == 29


@pytest.mark.parametrize(("spec", "text", "content", "reasoning", "calls"), CASES)
def test_whole_output(spec: ChatOutputSpec, text: str, content: str | None, reasoning: str | None,
                      calls: list[tuple[str, dict[str, object]]]) -> None:
    _check(parse_whole(spec, text), content, reasoning, calls)


def _stream(spec: ChatOutputSpec, pieces: list[str]) -> list[Event]:
    parser = ChatOutputParser(spec)
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def _cut(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_any_chunking_adds_up_to_the_whole(case: tuple, cuts: list[int]) -> None:  # type: ignore[type-arg]
    spec, text, content, reasoning, calls = case
    events = _stream(spec, _cut(text, cuts))
    _check(fold(events), content, reasoning, calls)
    # OpenAI's order: each call's start comes before its arguments; no empty text events
    started: set[int] = set()
    for e in events:
        if isinstance(e, ToolCallStart):
            started.add(e.index)
        elif isinstance(e, ToolCallArguments):
            assert e.index in started
        else:
            assert isinstance(e, ContentText | ReasoningText) and e.text


# (parser, output with two calls; the first call's arguments are ARGS_TEXT, as written)
ARGS_TEXT = '{"city": "Paris", "days": [1, 2], "note": "a } and a \\" inside"}'
SECOND = '{"name": "time", "%s": {}}'
TWO_CALLS = [
    ("hermes", f'<tool_call>\n{{"name": "weather", "arguments": {ARGS_TEXT}}}\n</tool_call>\n'
               '<tool_call>{"name": "time", "arguments": {}}</tool_call>'),
    ("llama3_json", f'{{"name": "weather", "parameters": {ARGS_TEXT}}}; ' + SECOND % "parameters"),
    ("mistral",
     f'[TOOL_CALLS][{{"name": "weather", "arguments": {ARGS_TEXT}}}, ' + SECOND % "arguments" + "]"),
    ("mistral", f"[TOOL_CALLS]weather[ARGS]{ARGS_TEXT}[TOOL_CALLS]time[ARGS]{{}}"),
    ("forced_json", f'[{{"name": "weather", "arguments": {ARGS_TEXT}}}, ' + SECOND % "arguments" + "]"),
]


@pytest.mark.parametrize(("tools", "text"), TWO_CALLS)
def test_arguments_stream_as_they_are_written(tools: str, text: str) -> None:
    """Fed a character at a time, a call starts (id and name) once its arguments open and each later
    character of the arguments is its own fragment at once: nothing waits for the call's end. The
    fragments add up to the arguments as written, which is the non-streamed result."""
    parser = ChatOutputParser(ChatOutputSpec(tools=tools))
    fragments: dict[int, list[str]] = {}
    starts: list[tuple[int, str]] = []
    for pos, ch in enumerate(text):
        inside = starts == [(0, "weather")] and len("".join(fragments[0])) < len(ARGS_TEXT)
        events = parser.feed(ch)
        for e in events:
            assert not isinstance(e, ContentText), (pos, e)
            if isinstance(e, ToolCallStart):
                starts.append((e.index, e.name))
                fragments[e.index] = []
            elif isinstance(e, ToolCallArguments):
                fragments[e.index].append(e.fragment)
        if inside:  # the first call's arguments: each character is a fragment at once
            assert "".join(fragments[0]) == ARGS_TEXT[:len("".join(fragments[0]))]
            assert any(isinstance(e, ToolCallArguments) and e.fragment == ch for e in events), (pos, ch)
    assert parser.finish() == []
    assert starts == [(0, "weather"), (1, "time")]
    assert ["".join(fragments[0]), "".join(fragments[1])] == [ARGS_TEXT, "{}"]
    assert len(fragments[0]) == len(ARGS_TEXT)
    whole = parse_whole(ChatOutputSpec(tools=tools), text)
    assert [(c.name, c.arguments) for c in whole.calls] == [("weather", ARGS_TEXT), ("time", "{}")]
    assert whole.content is None


def test_a_call_cut_short_keeps_the_arguments_written() -> None:
    """``max_tokens`` cut the call inside its arguments: the call stands with the text written (as
    OpenAI's would, with finish reason ``length``); cut before the arguments opened, it is content in the
    model's own formats (``auto``: it may not have been a call) and dropped in the forced one (below)."""
    for tools, text in TWO_CALLS:
        cut = text[:text.index('"Paris"')]
        out = parse_whole(ChatOutputSpec(tools=tools), cut)
        assert [(c.name, c.arguments) for c in out.calls] == [("weather", '{"city": ')], tools
        before = text[:text.index("weather") + 3]
        out = parse_whole(ChatOutputSpec(tools=tools), before)
        assert (out.content, out.calls) == ((None, []) if tools == "forced_json" else (before, [])), tools


# a required / named tool_choice's output as the grammar lets it be written (whitespace as xgrammar may
# put it, escapes and brackets inside strings), its calls as (name, arguments text)
FORCED_CALLS = [("weather", ARGS_TEXT), ("time", "{}"), ("w", r'{ "q" : "[{\"name\": \"x\"}]" , "n":1 }')]
FORCED_TEXT = "[" + ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in FORCED_CALLS[:2]) \
    + ',\n { "name" : "w" ,"arguments":' + FORCED_CALLS[2][1] + "}]"


def _forced_expected(cut: str) -> list[tuple[str, str]]:
    """The calls ``cut`` (a beginning of FORCED_TEXT) stands for: each call whose name's closing quote
    was written, with its arguments' text written so far (empty before they opened)."""
    expected: list[tuple[str, str]] = []
    pos = 0
    for name, args in FORCED_CALLS:
        name_end = FORCED_TEXT.index(f'"{name}"', pos) + len(name) + 2
        args_start = FORCED_TEXT.index(args, name_end)
        pos = args_start + len(args)
        if len(cut) < name_end:
            break
        expected.append((name, cut[args_start:pos]))
    return expected


def _no_content(events: list[Event]) -> None:
    assert not [e for e in events if isinstance(e, ContentText | ReasoningText)], events


@pytest.mark.parametrize("parallel", [True, False])
def test_forced_output_cut_anywhere_is_never_content(parallel: bool) -> None:
    """A required / named tool_choice's output cut by ``max_tokens`` after each of its characters: never
    any content (pdserve's internal array format is not the assistant's text); every call whose name is
    whole stands with the arguments written so far (empty before they opened), one cut inside its name
    is dropped; streamed a character at a time, in two pieces, and whole give the same calls; with
    ``parallel_tool_calls`` false the first call only."""
    assert json.loads(FORCED_TEXT)[2]["arguments"]["q"] == '[{"name": "x"}]'  # the escapes reach the text
    spec = ChatOutputSpec(tools="forced_json", parallel_tool_calls=parallel)
    seen_empty_args = False
    for n in range(len(FORCED_TEXT) + 1):
        cut = FORCED_TEXT[:n]
        expected = _forced_expected(cut)[:None if parallel else 1]
        seen_empty_args |= any(args == "" for _, args in expected)
        whole = parse_whole(spec, cut)
        assert whole.content is None and whole.reasoning is None, (n, whole)
        assert [(c.name, c.arguments) for c in whole.calls] == expected, (n, cut)
        for pieces in (list(cut), [cut[:n // 2], cut[n // 2:]]):
            events = _stream(spec, pieces)
            _no_content(events)
            assert [(c.name, c.arguments) for c in fold(events).calls] == expected, (n, pieces)
    assert seen_empty_args


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, len(FORCED_TEXT)), cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_forced_output_cut_and_chunked_anyhow(n: int, cuts: list[int]) -> None:
    """Any cut of the forced output, streamed in any pieces: the same calls as non-streamed, no content,
    each call's start before its arguments."""
    cut = FORCED_TEXT[:n]
    events = _stream(ChatOutputSpec(tools="forced_json"), _cut(cut, cuts))
    _no_content(events)
    assert [(c.name, c.arguments) for c in fold(events).calls] == _forced_expected(cut)
    started: set[int] = set()
    for e in events:
        if isinstance(e, ToolCallStart):
            started.add(e.index)
        else:
            assert isinstance(e, ToolCallArguments) and e.index in started and e.fragment


def test_forced_output_the_grammar_does_not_make_stays_content() -> None:
    """Text the array reader cannot continue with (not produced under the forced grammar) is still never
    dropped: it stays content as written, after any calls read before it."""
    out = parse_whole(ChatOutputSpec(tools="forced_json"), "Sure: [1]")
    assert (out.content, out.calls) == ("Sure: [1]", [])
    out = parse_whole(ChatOutputSpec(tools="forced_json"), '[{"name": "a", "arguments": {}} oops')
    assert (out.content, [(c.name, c.arguments) for c in out.calls]) == ("oops", [("a", "{}")])


def test_one_character_at_a_time_holds_back_only_marker_prefixes() -> None:
    """Text streams before the output ends: only a possible marker beginning (and trailing blanks) waits."""
    parser = ChatOutputParser(ChatOutputSpec(tools="hermes"))
    events = [e for ch in "Hello there <tool" for e in parser.feed(ch)]
    streamed = "".join(e.text for e in events if isinstance(e, ContentText))
    assert streamed == "Hello there"


def test_parser_choice_by_template_and_flag() -> None:
    assert select_tool_parser("auto", "{{ messages }}") == "hermes"  # no tools: the Hermes fallback prompt
    assert select_tool_parser("auto", "{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert select_tool_parser("auto", "{% if tools %}[AVAILABLE_TOOLS]{% endif %}") == "mistral"
    assert select_tool_parser("auto", "{% if tools %}<|python_tag|>{% endif %}") == "llama3_json"
    assert select_tool_parser("auto", "{% for t in tools %}{{ t }}{% endfor %}") == "none"
    assert select_tool_parser("mistral", "{{ messages }}") == "mistral"
    assert select_reasoning_parser("auto", "{{ messages }}") == "none"
    assert select_reasoning_parser("auto", "{% if enable_thinking %}<think>{% endif %}") == "qwen3"
    assert select_reasoning_parser("auto", "<｜Assistant｜><think>\n") == "deepseek_r1"
    assert select_reasoning_parser("qwen3", None) == "qwen3"
