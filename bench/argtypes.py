"""``type=`` converters for the benchmarks' numeric flags: a value out of range is refused by argparse
itself (``error: argument --turns: must be >= 1, got 0``, exit code 2), never clamped or read as a
default. Torch-free, so the HTTP-only benches can use them without importing the engine. Durations are
read as ``protocol.durations.parse_duration`` reads them (``500ms``, ``5s``, ``5``, ``1m``)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

# a duration >= 0 in seconds, as every pdserve command reads it
from protocol.cli_env import duration as duration


def _number(text: str, kind: Callable[[str], float]) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                         f"got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1. Raises ``argparse.ArgumentTypeError`` otherwise."""
    value = int(_number(text, int))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0. Raises ``argparse.ArgumentTypeError`` otherwise."""
    value = int(_number(text, int))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def int_at_least(minimum: int) -> Callable[[str], int]:
    """A converter for integers >= ``minimum``; it raises ``argparse.ArgumentTypeError`` otherwise."""
    def convert(text: str) -> int:
        value = int(_number(text, int))
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return convert


def positive_float(text: str) -> float:
    """A finite number > 0. Raises ``argparse.ArgumentTypeError`` otherwise (nan and inf included)."""
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value:g}")
    return value


def positive_int_list(text: str) -> list[int]:
    """A comma-separated list of integers >= 1 (``"1,4"`` → ``[1, 4]``), not empty. Raises
    ``argparse.ArgumentTypeError`` otherwise, naming the bad item."""
    items = text.split(",")
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a comma-separated list of integers >= 1, got ''")
    return [positive_int(item.strip()) for item in items]


def positive_duration(text: str) -> float:
    """A duration > 0 in seconds. Raises ``argparse.ArgumentTypeError`` otherwise."""
    value = duration(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 s, got {text!r}")
    return value
