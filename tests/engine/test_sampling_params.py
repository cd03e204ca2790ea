"""SamplingParams validation and wire round trip."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from engine.sampling_params import SamplingParams, SamplingParamsError

BAD: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": 0}, r"max_tokens must be an int >= 1"),
    ({"max_tokens": 2.5}, r"max_tokens must be an int >= 1"),
    ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens must be an int in \[0, max_tokens=4\]"),
    ({"min_tokens": -1}, r"min_tokens"),
    ({"temperature": -0.1}, r"temperature must be a finite number >= 0"),
    ({"temperature": float("nan")}, r"temperature"),
    ({"top_p": -0.1}, r"top_p must be a number in \[0, 1\]"),
    ({"top_p": 1.01}, r"top_p must be a number in \[0, 1\]"),
    ({"top_k": 0}, r"top_k must be -1 \(off\) or an int >= 1"),
    ({"top_k": -2}, r"top_k"),
    ({"min_p": 1.5}, r"min_p must be a number in \[0, 1\]"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be a number > 0"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\]"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be a number in \[-2, 2\]"),
    ({"seed": "7"}, r"seed must be None or an int"),
    ({"logprobs": 21}, r"logprobs must be None or an int in \[0, 20\]"),
    ({"logprobs": -1}, r"logprobs"),
    ({"stop": ("ok", "")}, r"stop must be a tuple of non-empty strings"),
    ({"stop_token_ids": (3, -1)}, r"stop_token_ids must be a tuple of ints >= 0"),
    ({"ignore_eos": 1}, r"ignore_eos must be a bool"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD)
def test_bad_values_raise_naming_field_and_range(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_edges_of_ranges_are_accepted() -> None:
    p = SamplingParams(max_tokens=1, min_tokens=1, temperature=0.0, top_p=1.0, top_k=1, min_p=1.0,
                       presence_penalty=-2.0, frequency_penalty=2.0, logprobs=20, seed=0)
    assert p.greedy
    assert not SamplingParams(temperature=0.7).greedy


def test_lists_become_tuples_and_round_trip_through_msgspec() -> None:
    p = SamplingParams(max_tokens=5, temperature=0.5, stop=["a", "b"], stop_token_ids=[7],  # type: ignore[arg-type]
                       seed=3, logprobs=2)
    assert p.stop == ("a", "b") and p.stop_token_ids == (7,)
    wire = msgspec.msgpack.encode(p)
    back = msgspec.msgpack.decode(wire, type=SamplingParams)
    assert back == p


def test_decoding_rejects_unknown_fields_and_bad_values() -> None:
    with pytest.raises(msgspec.ValidationError, match=r"unknown field `best_of`"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"best_of": 2}), type=SamplingParams)
    with pytest.raises(msgspec.ValidationError, match=r"max_tokens must be an int >= 1"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"max_tokens": 0}), type=SamplingParams)


def test_error_names_the_field() -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(top_k=0)
    assert info.value.field == "top_k"


def test_with_seed_keeps_the_rest() -> None:
    p = SamplingParams(max_tokens=3, temperature=0.5)
    assert p.with_seed(9) == SamplingParams(max_tokens=3, temperature=0.5, seed=9)


def test_logit_bias_round_trips_and_is_validated() -> None:
    p = SamplingParams(logit_bias=[[5, 100.0], (7, -2.5)])  # type: ignore[list-item]
    assert p.logit_bias == ((5, 100.0), (7, -2.5))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p
    for bad in (((5, 100.5),), ((-1, 1.0),), ((5, 1.0), (5, 2.0)), ((5, float("nan")),), ((5,),)):
        with pytest.raises(SamplingParamsError) as info:
            SamplingParams(logit_bias=bad)  # type: ignore[arg-type]
        assert info.value.field == "logit_bias"
