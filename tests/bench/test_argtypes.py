"""bench/argtypes.py: the numeric flag converters, and every serving bench refusing an out-of-range number
through argparse (exit code 2, the flag named) before it starts anything."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from bench.argtypes import (
    duration,
    non_negative_int,
    positive_duration,
    positive_float,
    positive_int,
    positive_int_list,
)
from bench.serving import chaos, disagg_vs_colocated, host_cost, moe_parity, overload, pipeline, ttft


def test_converters_accept_their_range() -> None:
    assert positive_int("1") == 1 and positive_int(" 7 ") == 7
    assert non_negative_int("0") == 0 and non_negative_int("3") == 3
    assert positive_float("0.5") == 0.5 and positive_float("2") == 2.0
    assert positive_int_list("1,4") == [1, 4] and positive_int_list("8") == [8]
    assert duration("0") == 0.0 and duration("500ms") == 0.5 and positive_duration("1m") == 60.0


@pytest.mark.parametrize(("convert", "text", "message"), [
    (positive_int, "0", "must be >= 1, got 0"),
    (positive_int, "-2", "must be >= 1, got -2"),
    (positive_int, "1.5", "expected an integer, got '1.5'"),
    (non_negative_int, "-1", "must be >= 0, got -1"),
    (non_negative_int, "x", "expected an integer, got 'x'"),
    (positive_float, "0", "must be > 0, got 0"),
    (positive_float, "-0.5", "must be > 0, got -0.5"),
    (positive_float, "nan", "expected a finite number, got 'nan'"),
    (positive_float, "inf", "expected a finite number, got 'inf'"),
    (positive_int_list, "1,0", "must be >= 1, got 0"),
    (positive_int_list, "1,,2", "expected an integer, got ''"),
    (positive_int_list, "", "expected a comma-separated list of integers >= 1, got ''"),
    (duration, "-1s", "bad duration '-1s': must not be negative"),
    (duration, "2h", "bad duration '2h': use a number with ms, s or m (e.g. 5s)"),
    (positive_duration, "0ms", "must be > 0 s, got '0ms'"),
])
def test_converters_refuse_out_of_range(convert: Callable[[str], object], text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        convert(text)
    assert str(exc.value) == message


def _parse_moe_parity(argv: list[str]) -> object:
    return moe_parity.build_parser().parse_args(argv)


BAD = {  # parser → (flag, out-of-range value) pairs
    chaos.main: [("--scale", "-1")],
    overload.main: [("--num-blocks", "0"), ("--prompt-tokens", "0"), ("--max-tokens", "-1"), ("--waves", "0"),
                    ("--max-429-s", "0")],
    ttft.main: [("--repeats", "0"), ("--tokens", "-16")],
    host_cost.main: [("--lengths", "700,-1"), ("--turn-tokens", "0"), ("--repeats", "0"), ("--warmup", "-1"),
                     ("--block-size", "0")],
    pipeline.main: [("--requests", "0"), ("--concurrency", "1,0"), ("--max-tokens", "0")],
    _parse_moe_parity: [("--hidden", "0"), ("--expert-width", "0"), ("--experts", "0"), ("--top-k", "-1"),
                        ("--layers", "0"), ("--max-tokens", "0"), ("--ready-timeout", "-1")],
    disagg_vs_colocated.parse_args: [
        ("--warmup", "-1"), ("--num-blocks", "0"), ("--max-num-batched-tokens", "0"), ("--max-num-seqs", "0"),
        ("--colocated-workers", "0"), ("--heartbeat-timeout", "0"), ("--ready-timeout", "0"),
        ("--time-budget", "-5"), ("--slo-ttft-ms", "0"), ("--slo-tpot-ms", "-1"),
        ("--parity-max-tokens", "0"), ("--rates", "1,0"), ("--rates", "nan")],
}
CASES = [(parse, flag, value) for parse, pairs in BAD.items() for flag, value in pairs]


@pytest.mark.parametrize(("parse", "flag", "value"), CASES,
                         ids=[f"{p.__module__}:{f}={v}" for p, f, v in CASES])
def test_every_serving_bench_refuses_out_of_range_numbers(parse: Callable[[list[str]], object], flag: str,
                                                          value: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse([flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    # --rates is a list checked after parsing (its default depends on --device): named, not as an argument
    assert (flag in err) if flag == "--rates" else (f"argument {flag}:" in err)
