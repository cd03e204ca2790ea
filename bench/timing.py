"""How the benchmarks time work: repeated calls after warm-up, and the spread over those repeats.

The rules every benchmark follows (docs/benchmarks/README.md, "Method"):

- a figure is a statistic over ``repeats`` timed calls made after ``warmup`` untimed ones, printed with
  its spread (``Spread``: min / median / max and the count);
- a peer (transformers, SDPA, a bare SSE endpoint) gets the same warm-up count, the same repetitions and
  the same statistic as pdserve, its calls interleaved with pdserve's (``interleaved``), so drift on a
  shared machine hits both sides;
- a ceiling (GEMM throughput, copy bandwidth) is the best of at least ``MIN_CEILING_REPEATS`` calls in
  the benchmark's own process, after warm-up (``ceiling_seconds``): one call, or a mean, understates it.

On CUDA a call is timed on the device: two CUDA events recorded on the current stream around it, the
calls issued back to back and read after one synchronisation ("CUDA events" in the PyTorch CUDA
semantics notes, https://pytorch.org/docs/stable/notes/cuda.html). Elsewhere the host clock times it.
``replay_seconds`` times work captured once in a CUDA graph, as a decode step runs it.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

MIN_CEILING_REPEATS = 20
T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True)
class Spread:
    """A figure over its repeats: smallest, median and largest value (in the values' own unit) and how
    many values there were."""

    min: float
    median: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """The spread of ``values``. Raises ValueError when there are none."""
        if not values:
            raise ValueError("a spread needs at least one value")
        return cls(min(values), statistics.median(values), max(values), len(values))

    def scaled(self, factor: float) -> Spread:
        """Every value times ``factor`` (> 0), e.g. seconds to milliseconds."""
        return Spread(self.min * factor, self.median * factor, self.max * factor, self.n)

    def per(self, amount: float) -> Spread:
        """``amount / value`` of each value (seconds to a rate): the fastest call gives the ``max``."""
        return Spread(amount / self.max, amount / self.median, amount / self.min, self.n)

    def fmt(self, spec: str = ".1f", unit: str = "") -> str:
        """``"median unit (min–max, n=N)"`` with each number formatted by ``spec``."""
        return f"{self.median:{spec}}{unit} ({self.min:{spec}}–{self.max:{spec}}, n={self.n})"

    def as_dict(self) -> dict[str, float]:
        """``{"min", "median", "max", "n"}`` for a JSON result."""
        return {"min": self.min, "median": self.median, "max": self.max, "n": self.n}


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> Spread:
    """The spread of ``numerators[i] / denominators[i]`` over paired repeats (the same repeat's two
    sides). Raises ValueError for lists of different lengths or a zero denominator."""
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} numerators for {len(denominators)} denominators")
    if any(d == 0 for d in denominators):
        raise ValueError("a denominator is zero")
    return Spread.of([a / b for a, b in zip(numerators, denominators, strict=True)])


def interleaved(first: Callable[[], T], second: Callable[[], U], warmup: int, repeats: int
                ) -> tuple[list[T], list[U]]:
    """``warmup`` untimed calls of ``first`` and of ``second`` (alternating, results dropped), then
    ``repeats`` rounds of ``first()``, ``second()``; returns each side's ``repeats`` results in order.
    Both sides get the same warm-up and the same repetitions. Raises ValueError for ``warmup`` < 0 or
    ``repeats`` < 1."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    for _ in range(warmup):
        first()
        second()
    a: list[T] = []
    b: list[U] = []
    for _ in range(repeats):
        a.append(first())
        b.append(second())
    return a, b


def time_calls(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int,
               clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` made after ``warmup`` untimed calls: on CUDA
    between CUDA events (device time; the calls are issued back to back and read after one
    synchronisation), elsewhere by ``clock`` around each call. Raises ValueError for ``warmup`` < 0 or
    ``repeats`` < 1."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        out = []
        for _ in range(repeats):
            started = clock()
            fn()
            out.append(clock() - started)
        return out
    with torch.cuda.device(device):  # the events on the current stream of the device the work runs on
        events = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]
        torch.cuda.synchronize(device)
        events[0].record()
        for event in events[1:]:
            fn()
            event.record()
        events[-1].synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(events)]


def ceiling_seconds(fn: Callable[[], object], device: torch.device, repeats: int = MIN_CEILING_REPEATS,
                    warmup: int = 3, clock: Callable[[], float] = time.perf_counter) -> Spread:
    """Seconds per call of ``fn`` for a ceiling: ``repeats`` (at least ``MIN_CEILING_REPEATS``) calls
    timed by ``time_calls`` after ``warmup`` ones; the ceiling is the fastest (``Spread.min``). Raises
    ValueError for fewer repeats."""
    if repeats < MIN_CEILING_REPEATS:
        raise ValueError(f"a ceiling needs at least {MIN_CEILING_REPEATS} timed calls, got {repeats}")
    return Spread.of(time_calls(fn, device, warmup, repeats, clock))


def replay_seconds(work: Callable[[], object], replays: int) -> Spread:
    """Seconds per replay of ``work()`` captured in one CUDA graph on the current device, each of
    ``replays`` replays between two CUDA events, after one untimed replay (``work`` must have run once
    outside the capture: Triton compiles, cuBLAS loads its kernels). Raises ValueError for ``replays``
    < 1, and whatever CUDA raises if ``work`` is not capturable."""
    if replays < 1:
        raise ValueError(f"replays must be >= 1, got {replays}")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    return Spread.of(time_calls(graph.replay, torch.device("cuda", torch.cuda.current_device()), 1,
                                replays))
