"""The fault benchmarks' argument checks and their outcome rules (no process started here; the chaos
suite, tests/chaos, runs the scenarios against a live system)."""

from __future__ import annotations

from typing import cast

import pytest

from bench.serving import chaos, overload
from bench.serving.chaos import Outcome, ScenarioResult
from pdserve.live_system import LiveSystem


def test_bad_arguments_exit_2_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    for main, flag in ((overload.main, "--concurrency"), (chaos.main, "--scale")):
        with pytest.raises(SystemExit) as exc:
            main([flag, "0"])
        assert exc.value.code == 2 and f"argument {flag}: must be >= 1, got 0" in capsys.readouterr().err


def test_chaos_refuses_a_count_below_one() -> None:
    system = cast(LiveSystem, object())  # refused before the system is touched
    for scale, aborts in ((0, 1000), (1, 0)):
        with pytest.raises(ValueError, match="scale and aborts must be >= 1"):
            chaos.Chaos(system, scale=scale, aborts=aborts)
    assert chaos.Chaos(system, scale=2, aborts=3).aborts == 3
    with pytest.raises(ValueError, match="output_scale must be > 0"):
        chaos.Chaos(system, output_scale=0)


def test_chaos_output_scale_shortens_streams_down_to_a_floor() -> None:
    system = cast(LiveSystem, object())
    assert [chaos.Chaos(system)._tokens(n) for n in (48, 24, 4)] == [48, 24, 4]
    assert [chaos.Chaos(system, output_scale=1 / 3)._tokens(n) for n in (48, 64, 60, 24, 6)] == [
        16, 21, 20, 8, chaos.MIN_TOKENS]


def test_outcome_rules() -> None:
    done = Outcome(status=200, tokens=3, done=True)
    error_before_token = Outcome(status=200, error="worker failed", done=True)
    error_after_token = Outcome(status=200, tokens=2, error="worker failed", done=True)
    honest_429 = Outcome(status=429, retry_after="1", error="{}")
    bare_503 = Outcome(status=503, error="{}")
    left = Outcome(status=200, client_left=True)
    cut = Outcome(status=200, tokens=2, error="ReadError", connection_lost=True)
    assert done.completed and not done.bad_200 and not done.honest_error
    assert error_before_token.bad_200 and not error_before_token.honest_error
    assert error_after_token.honest_error and not error_after_token.bad_200
    assert honest_429.honest_error and not honest_429.bad_200
    assert bare_503.bad_200  # no Retry-After
    assert not left.bad_200 and not cut.bad_200 and not cut.honest_error
    res = ScenarioResult("x")
    res.add([done, error_before_token, error_after_token, honest_429, cut])
    assert (res.sent, res.completed, res.bad_200, res.honest_errors, res.connection_lost) == (5, 1, 1, 2, 1)
    assert res.statuses == {"200": 4, "429": 1}
