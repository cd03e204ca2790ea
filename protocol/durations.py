"""Durations on the command line: ``"500ms"``, ``"5s"``, ``"5"`` (seconds) or ``"1m"`` (no torch).

One parser for every seconds-valued flag, so ``PDSERVE_REQUEST_TIMEOUT=30s`` means the same to the gateway
as ``--request-timeout 30s`` to ``pdserve bench``.
"""

from __future__ import annotations

import math
import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}


def parse_duration(text: str) -> float:
    """``"500ms"``, ``"5s"``, ``"5"`` (seconds) or ``"1m"`` → seconds (float).

    Raises:
        ValueError: anything else (negative numbers, other units and a number too large to be finite, such
            as 400 digits, included).
    """
    m = _DURATION.match(text)
    if not m and text.strip().startswith("-") and _DURATION.match(text.strip()[1:]):
        raise ValueError(f"bad duration {text!r}: must not be negative")
    if not m:
        raise ValueError(f"bad duration {text!r}: use a number with ms, s or m (e.g. 5s)")
    seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if not math.isfinite(seconds):
        raise ValueError(f"bad duration {text!r}: too large (not a finite number of seconds)")
    return seconds


def flag_duration(flag: str, text: str) -> float:
    """``parse_duration(text)`` for ``flag``: the error names the flag (``--duration: bad duration '5x':
    ...``). Raises ValueError."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None
