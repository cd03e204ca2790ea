"""Pure helpers of the OpenAI surface: per-choice seed derivation (int64 wrap) and the completions
``logprobs`` layout (``text_offset`` in characters)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from gateway.openai_requests import INT64_MAX
from gateway.orchestrator import TokenLogprob
from gateway.prepare import derived_seed
from gateway.render import chat_logprobs, completion_logprobs
from gateway.text import TextProcessor


@pytest.mark.parametrize(("seed", "sample", "want"), [
    (None, 3, None), (5, 0, 5), (5, 2, 7), (-1, 1, 0),
    (INT64_MAX, 1, -INT64_MAX - 1), (INT64_MAX - 1, 3, -INT64_MAX)])
def test_derived_seed_wraps_into_int64(seed: int | None, sample: int, want: int | None) -> None:
    assert derived_seed(seed, sample) == want


def test_logprob_layouts(tokenizer_dir: Path) -> None:
    text = TextProcessor.from_dir(tokenizer_dir)
    ids = text.encode(" Paris is")
    entries = [TokenLogprob(t, -0.5 * (i + 1), ((t, -0.5), (t + 1, -2.0))) for i, t in enumerate(ids)]
    comp = msgspec.to_builtins(completion_logprobs(text, entries, offset=7))
    pieces = [text.token_text(t) for t in ids]
    assert "".join(pieces) == " Paris is"
    assert comp["tokens"] == pieces and comp["token_logprobs"] == [-0.5 * (i + 1) for i in range(len(ids))]
    assert comp["text_offset"] == [7 + len("".join(pieces[:i])) for i in range(len(ids))]
    assert comp["top_logprobs"][0] == {pieces[0]: -0.5, text.token_text(ids[0] + 1): -2.0}
    chat = msgspec.to_builtins(chat_logprobs(text, entries[:1]))
    assert chat["content"][0]["bytes"] == list(pieces[0].encode()) and chat["refusal"] is None
    assert [t["logprob"] for t in chat["content"][0]["top_logprobs"]] == [-0.5, -2.0]
