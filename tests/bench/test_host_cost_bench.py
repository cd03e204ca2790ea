"""bench/serving/host_cost.py on short prompts: the conversation it builds (the previous turn a prefix of
the current one), the pieces it times (each a positive figure) and the JSON it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.serving import host_cost
from engine.models.registry import resolve_model
from gateway.text import TextProcessor


def test_case_is_a_conversation_whose_previous_turn_is_a_prefix() -> None:
    text = TextProcessor.from_dir(resolve_model("llama3-8b"))
    case = host_cost.build_case(text, 1500, 300)
    assert len(case.prompt) >= 1500
    assert 0 < len(case.previous) < len(case.prompt) - 200
    # the synthetic tokenizer splits on whitespace: the previous prompt (its generation prompt included)
    # is the current prompt's start, as the KV both workers hold
    assert case.prompt[: len(case.previous)] == case.previous
    assert json.loads(case.body)["messages"][-1]["role"] == "user"


def test_main_prints_every_piece_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cost.json"
    assert host_cost.main(["--lengths", "300,900", "--turn-tokens", "300", "--repeats", "2", "--warmup", "0",
                           "--clock", "cpu", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    for piece in (*host_cost.PIECES, "total"):
        assert f"| {piece} |" in table
    data = json.loads(out.read_text())
    assert data["clock"] == "cpu"
    for length in ("300", "900"):
        assert data["prompt_tokens"][length] >= int(length)
        assert set(data["us"][length]) == set(host_cost.PIECES)
        assert all(v >= 0 for v in data["us"][length].values())
        assert data["us"][length]["gw.tokenize.cold"] > 0
