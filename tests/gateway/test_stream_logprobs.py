"""``gateway.stream.text_deltas`` with stop strings and logprobs, over a scripted orchestrator: the
logprobs list exactly the tokens of the text returned (a token wholly inside the stop string, or after
it, has none), each with the first delta that releases some of its text; without stop strings every
logprob goes out with its own token's delta."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.sampling_params import SamplingParams
from gateway.request_state import GenerationInput, TokenLogprob, TokenOutput
from gateway.stream import Delta, text_deltas
from gateway.text import TextProcessor


class Script:
    """Stands in for the orchestrator: ``next_output`` plays ``ids`` (logprob -i for the i-th), the last
    with ``length``; ``finish`` records the reason."""

    def __init__(self, ids: list[int]) -> None:
        self.outs = [TokenOutput(t, TokenLogprob(t, -float(i)), "length" if i == len(ids) - 1 else None)
                     for i, t in enumerate(ids)]
        self.finished: str | None = None

    async def next_output(self, req: object) -> TokenOutput:
        return self.outs.pop(0)

    def finish(self, req: object, reason: str) -> None:
        self.finished = reason


class Req:
    def __init__(self, stop: tuple[str, ...]) -> None:
        self.inp = GenerationInput("r", [1, 2, 3], SamplingParams(max_tokens=16), stop=stop)


async def _run(text: TextProcessor, ids: list[int], stop: tuple[str, ...]) -> tuple[list[Delta], str | None]:
    orch = Script(ids)
    deltas = [d async for d in text_deltas(orch, text, Req(stop))]  # type: ignore[arg-type]
    return deltas, orch.finished


@pytest.fixture
def text(tokenizer_dir: Path) -> TextProcessor:
    return TextProcessor.from_dir(tokenizer_dir)


async def test_logprobs_end_with_the_text_a_stop_string_cut(text: TextProcessor) -> None:
    ids = text.encode("1. 1\n2. 2\n3. 3\n4. 4")
    deltas, reason = await _run(text, ids, ("3. 3",))
    out = "".join(d.text for d in deltas)
    assert out == "1. 1\n2. 2\n" and reason == "stop"
    listed = [lp.token_id for d in deltas for lp in d.logprobs]
    assert listed == ids[:10]  # "1. 1\n2. 2\n": not a token of "3. 3" or after it
    for d in deltas:  # a logprob goes out with (or after) its token's text, never ahead of it
        assert not d.logprobs or d.text or d.finish_reason


async def test_a_token_partly_before_the_stop_string_keeps_its_logprob(text: TextProcessor) -> None:
    ids = text.encode("Hello world")
    deltas, _ = await _run(text, ids, ("lo w",))
    assert "".join(d.text for d in deltas) == "Hel"
    assert [text.token_text(t) for t in ids] == ["Hello", " world"]
    assert [lp.token_id for d in deltas for lp in d.logprobs] == ids[:1]  # "Hello" gave "Hel"; " world" none


async def test_without_stop_strings_each_logprob_goes_with_its_token(text: TextProcessor) -> None:
    ids = text.encode("1. 1\n2. 2")
    deltas, reason = await _run(text, ids, ())
    assert reason == "length" and [[lp.token_id for lp in d.logprobs] for d in deltas] == [[t] for t in ids]
