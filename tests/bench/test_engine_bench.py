"""bench/engine: the token count of a timed decode under asynchronous scheduling, the arithmetic of the
engine's and transformers' rates, and the transformers peer warmed up and repeated as the engine is."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest
import torch

from bench.engine import throughput
from bench.engine.decode import timed_decode
from bench.engine.transformers_peer import Rates, hf_rates

CPU = torch.device("cpu")
STEP_S = 0.01


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Out:
    request_id: str


class FakeDecodeEngine:
    """``EngineCore.step`` as asynchronous scheduling runs it (engine/async_step.py), for ``batch``
    sequences that need ``steps`` more decode steps: a call applies the step launched ahead by the last
    call (or launches one), launches the next one when async is on and steps remain, and returns the
    applied step's tokens. Each launch costs ``STEP_S`` on ``clock`` (the device's work)."""

    def __init__(self, batch: int, steps: int, clock: Clock, async_scheduling: bool) -> None:
        self.batch, self.left, self.clock = batch, steps, clock
        self.async_scheduling, self.ahead = async_scheduling, False

    def _launch(self) -> None:
        self.left -= 1
        self.clock.now += STEP_S

    def step(self) -> list[Out]:
        if not self.ahead:
            self._launch()
        self.ahead = self.async_scheduling and self.left > 0
        if self.ahead:
            self._launch()
        return [Out(f"r{i}") for i in range(self.batch)]

    def has_unfinished(self) -> bool:
        return self.left > 0 or self.ahead

    def check_no_leaks(self) -> None:
        assert not self.has_unfinished()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_timed_decode_counts_only_the_steps_it_timed(async_scheduling: bool) -> None:
    clock = Clock()
    core = FakeDecodeEngine(batch=4, steps=96, clock=clock, async_scheduling=async_scheduling)
    tokens, seconds = timed_decode(core, CPU, clock=clock)
    assert tokens == 4 * 95  # the warm-up step's 4 tokens are not counted ...
    assert seconds == pytest.approx(95 * STEP_S)  # ... and no launched step's work escapes the clock
    assert tokens / seconds == pytest.approx(4 / STEP_S)
    assert core.async_scheduling is async_scheduling  # switched back after the warm-up step


class FakeCore:
    """Steps of a prefill then decodes: the first step gives every prompt its first token, each later
    step one token per sequence, ``STEP_S`` per step on ``clock``."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.left = clock, 0
        self.ids: list[str] = []
        self.runner = argparse.Namespace(device=CPU)

    def add_request(self, rid: str, prompt: list[int], params: object) -> None:
        self.ids.append(rid)
        self.left = params.max_tokens  # type: ignore[attr-defined]

    def step(self) -> list[Out]:
        self.clock.now += STEP_S
        self.left -= 1
        return [Out(r) for r in self.ids]

    def has_unfinished(self) -> bool:
        return self.left > 0

    def check_no_leaks(self) -> None:
        assert self.left == 0


def test_engine_rates_count_the_decode_tokens_they_time() -> None:
    clock = Clock()
    rates = throughput.engine_rates(FakeCore(clock), [[5] * 100, [6] * 100], new_tokens=8,  # type: ignore[arg-type]
                                    clock=clock)
    assert rates.prefill == pytest.approx(200 / STEP_S)
    assert rates.decode == pytest.approx(2 * 7 / (7 * STEP_S))


class FakeGenerate:
    """transformers ``generate`` costing 1 ms per prompt token and 10 ms per new token after the first."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def parameters(self):  # type: ignore[no-untyped-def]
        yield torch.zeros(1)

    def generate(self, ids: torch.Tensor, max_new_tokens: int, min_new_tokens: int, **_: object) -> None:
        assert max_new_tokens == min_new_tokens
        self.clock.now += 1e-3 * ids.numel() + 10e-3 * (max_new_tokens - 1)


def test_hf_rates_time_prefill_and_decode_apart() -> None:
    clock = Clock()
    rates = hf_rates(FakeGenerate(clock), [[7] * 50, [8] * 50], new_tokens=11, clock=clock)
    assert rates.prefill == pytest.approx(100 / 0.1)
    assert rates.decode == pytest.approx(2 * 10 / 0.1)
    with pytest.raises(ValueError, match="new_tokens"):
        hf_rates(FakeGenerate(clock), [[7]], new_tokens=1, clock=clock)


def test_transformers_is_warmed_up_and_repeated_like_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []

    def rate(side: str, cold: float, warm: float):  # type: ignore[no-untyped-def]
        def call(core: object, batch: int, context: int, new_tokens: int) -> float:
            calls.append((side, batch))
            return cold if calls.count((side, batch)) == 1 else warm
        return call

    # transformers' first call at a shape is ~2.4x slower (16.9 vs 41.3 tok/s, an H200, batch 1)
    monkeypatch.setattr(throughput, "decode_rate", rate("engine", 200.0, 240.0))
    monkeypatch.setattr(throughput, "hf_decode", rate("hf", 16.9, 41.3))
    args = argparse.Namespace(hf_batches=[1, 32], hf_context=1024, new_tokens=96, warmup=1, repeats=3)
    rows = throughput.versus_transformers(object(), args)  # type: ignore[arg-type]
    assert calls == [("engine", 1), ("hf", 1)] * 4 + [("engine", 32), ("hf", 32)] * 4
    assert [r["batch"] for r in rows] == [1, 32]
    assert rows[0]["ratio_engine_over_hf"] == pytest.approx(240.0 / 41.3)  # not 240 / 16.9
    assert rows[0]["hf_tok_s"] == {"min": 41.3, "median": 41.3, "max": 41.3, "n": 3}
    assert rows[0]["ratio_per_repeat"]["n"] == 3


def test_cpu_report_names_both_sides_of_each_ratio() -> None:
    args = argparse.Namespace(model="m", batch=2, prompt_len=8, new_tokens=4, attention_backend="torch",
                              warmup=1, repeats=2)
    text = throughput.cpu_markdown(args, [Rates(100, 10), Rates(300, 30)], [Rates(50, 10), Rates(50, 10)],
                                   "float32")
    assert "- prefill: engine / transformers = 4.00 (per-repeat 2.00–6.00, n=2)" in text
    assert "- decode: engine / transformers = 2.00 (per-repeat 1.00–3.00, n=2)" in text


def test_decode_host_harness_times_synchronous_steps_and_ends_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.engine.decode_host drives schedule / execute / commit itself; an engine left with the default
    asynchronous scheduling launched a step ahead in the warm-up step that nothing applied, and the final
    leak check failed ("a step launched ahead is still held")."""
    from bench.engine import decode_host

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    parts = decode_host.measure(batch=2, context=16, steps=3, prefix_caching=True)
    assert set(parts) == {*decode_host.PARTS, "argmax", "total", "total_min", "total_max"}
    assert parts["total"] == pytest.approx(sum(parts[p] for p in decode_host.PARTS))
    assert all(parts[p] > 0 for p in decode_host.PARTS)
    assert 0 < parts["total_min"] <= parts["total_max"]
