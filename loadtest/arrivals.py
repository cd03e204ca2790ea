"""Open-loop arrival processes: seeded streams of send times (seconds after the run starts).

Gaps are gamma-distributed with shape ``burstiness`` and mean ``1/rate``, as in vLLM's serving
benchmark: burstiness 1 is a Poisson process, < 1 is burstier, > 1 more regular; ``constant`` sends
every ``1/rate`` seconds; an infinite rate sends everything at t = 0. (Closed-loop load, a fixed number
of sessions in flight, is driven by the runner and needs no arrival times.)
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator


def arrival_times(kind: str, rate: float, seed: int, burstiness: float = 1.0) -> Iterator[float]:
    """Endless, non-decreasing send times in seconds for ``rate`` requests/s.

    ``kind``: ``poisson``, ``gamma`` (shape ``burstiness``) or ``constant``. The first send is at the
    first gap (0 for constant). Raises ValueError for an unknown kind or rate/burstiness <= 0.
    """
    if kind not in ("poisson", "gamma", "constant"):
        raise ValueError(f"arrival kind must be poisson|gamma|constant, got {kind!r}")
    if not rate > 0 or not burstiness > 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate}, {burstiness}")
    if math.isinf(rate):
        return itertools.repeat(0.0)
    if kind == "constant":
        return (i / rate for i in itertools.count())
    shape = 1.0 if kind == "poisson" else burstiness
    return itertools.accumulate(_gamma_gaps(random.Random(seed), shape, 1.0 / (rate * shape)))


def _gamma_gaps(rng: random.Random, shape: float, scale: float) -> Iterator[float]:
    while True:
        yield rng.gammavariate(shape, scale)
