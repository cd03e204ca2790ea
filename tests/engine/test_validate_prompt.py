"""``EngineCore.validate_prompt``: the ids it refuses (not an int, below 0, at or above the vocabulary
size), named in its message, and the prompts it lets through."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from engine.engine_core import EngineCore

VOCAB = 100


def _validate(prompt: list[Any], max_model_len: int = 1000) -> None:
    core = SimpleNamespace(runner=SimpleNamespace(vocab_size=VOCAB), max_model_len=max_model_len)
    EngineCore.validate_prompt(cast(EngineCore, core), prompt)


@pytest.mark.parametrize(("prompt", "named"), [
    ([1, 2, -1, 3], "[-1]"),
    ([1, VOCAB, 2, VOCAB + 5], f"[{VOCAB}, {VOCAB + 5}]"),
    ([1, 2.0, 3], "[2.0]"),  # compares like an int, still not a token id
    ([None, 4], "[None]"),
    (["7", 4], "['7']"),
    ([0, 2**70], f"[{2**70}]"),
])
def test_bad_ids_are_named(prompt: list[Any], named: str) -> None:
    with pytest.raises(ValueError) as err:
        _validate(prompt)
    assert str(err.value) == f"prompt token ids {named} outside [0, vocab_size={VOCAB})"


def test_valid_prompts_pass_and_length_is_checked() -> None:
    _validate([0, VOCAB - 1] * 50)
    _validate([True, 3])  # bool is an int subclass: accepted as id 1
    with pytest.raises(ValueError, match="prompt is empty"):
        _validate([])
    with pytest.raises(ValueError, match="prompt of 10 tokens does not fit max_model_len=10"):
        _validate([1] * 10, max_model_len=10)
