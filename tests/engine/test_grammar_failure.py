"""One request's grammar failure ends that request alone, in the synchronous and the asynchronous step.

A matcher that rejects a token (in the asynchronous path: the previous step's token, accepted while the
next step is launched, after its forward is enqueued) or whose bitmask fill raises gets no mask and its
``GrammarState.error`` set; the commit of its step ends its sequence FINISHED_FAILED (finish reason
``"error"``, ``StepOutput.error`` naming the grammar) and frees its blocks; the other rows of the batch
keep running with the tokens of a run without the failing request. ``workers.step.run_step`` raises no
``StepFailed``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.engine_core import EngineCore
from engine.models.dummy_tokenizer import write_dummy_tokenizer
from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarState
from tests.engine.test_async_scheduling import ALTERNATING, make_core, prompts, save_one_layer_model
from workers.step import run_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REJECT_AT = 3  # output position of the bad request's token that its grammar rejects


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = save_one_layer_model(tmp_path_factory.mktemp("grammar-failure") / "m")
    write_dummy_tokenizer(path, json.loads((path / "config.json").read_text()))
    return path


class Outcome:
    """Tokens, finish reasons and errors per request of a run driven by ``run_step``."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str | None] = {}
        self.error: dict[str, str | None] = {}


def drive(core: EngineCore, bad: str | None, before_first_step: Any = None) -> Outcome:
    """Requests ``h`` (alternating regex, greedy), ``f`` (free, greedy) and, unless ``bad`` is None, the
    bad request ``bad`` first in the batch (alternating regex); every step through ``run_step`` (a
    ``StepFailed`` fails the test)."""
    ps = prompts(3, seed=37)
    out = Outcome()
    if bad is not None:
        core.add_request(bad, ps[0], SamplingParams(temperature=0.0, max_tokens=9,
                                                    structured_output=ALTERNATING))
    core.add_request("h", ps[1], SamplingParams(temperature=0.0, max_tokens=9, structured_output=ALTERNATING))
    core.add_request("f", ps[2], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    if before_first_step is not None:
        before_first_step()
    for _ in range(40):
        if not core.has_unfinished():
            break
        for o in run_step(core):
            assert out.finish.get(o.request_id) is None, f"a token after the finish of {o.request_id}"
            out.tokens.setdefault(o.request_id, []).append(o.token_id)
            out.finish[o.request_id] = o.finish_reason
            out.error[o.request_id] = o.error
    assert not core.has_unfinished()
    core.check_no_leaks()
    return out


def reject_at(state: GrammarState, position: int, log: list[int]) -> None:
    """Make ``state``'s matcher reject the token at output ``position`` (as if the mask had let it
    through); ``log`` gets the number of pending tokens of the ``sync`` that met the rejection."""
    matcher, sync = state.matcher, state.sync
    accept = matcher.accept_token

    def rejecting(token: int, *args: Any) -> bool:
        return False if state.num_accepted == position else bool(accept(token, *args))

    def logged(generated: Any, pending: Any = (), start: int = 0) -> None:
        try:
            sync(generated, pending, start)
        except ValueError:
            log.append(len(pending))
            raise

    matcher.accept_token = rejecting  # type: ignore[method-assign]
    state.sync = logged  # type: ignore[method-assign]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_rejected_token_ends_only_its_request(model_path: Path, async_scheduling: bool) -> None:
    want = drive(make_core(model_path, async_scheduling), None)
    assert want.finish == {"h": want.finish["h"], "f": "length"} and want.finish["h"] in ("stop", "length")
    core = make_core(model_path, async_scheduling)
    log: list[int] = []

    def arm() -> None:
        seq = core.scheduler.get("g")
        assert seq is not None and seq.grammar is not None
        reject_at(seq.grammar, REJECT_AT, log)

    got = drive(core, "g", arm)
    assert got.finish["g"] == "error"
    assert len(got.tokens["g"]) == REJECT_AT + 1  # the rejected token is the last (not streamed) one
    error = got.error["g"]
    assert error is not None and f"output position {REJECT_AT} is not allowed by the regex grammar" in error
    assert (got.tokens["h"], got.tokens["f"]) == (want.tokens["h"], want.tokens["f"])
    assert (got.finish["h"], got.finish["f"]) == (want.finish["h"], want.finish["f"])
    assert got.error["h"] is None and got.error["f"] is None
    if async_scheduling:  # first met while the next step was launched, with the token still pending
        assert log[0] == 1 and core.step_counts.ahead > REJECT_AT and core.step_counts.synchronous == 1
    else:
        assert log[0] == 0 and core.step_counts.launched == 0


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_bitmask_fill_error_ends_only_its_request(model_path: Path, async_scheduling: bool,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    want = drive(make_core(model_path, async_scheduling), None)
    core = make_core(model_path, async_scheduling)
    bitmasks = core.runner._grammar_bitmasks()
    batch_fill = bitmasks._batch.batch_fill_next_token_bitmask
    fills: list[str] = []

    def arm() -> None:
        seq = core.scheduler.get("g")
        assert seq is not None and seq.grammar is not None
        bad = seq.grammar.matcher
        fill_one = bad.fill_next_token_bitmask

        def failing_one(*args: Any) -> None:
            if seq.num_output_tokens >= 2:
                fills.append("row")
                raise RuntimeError("fill failed")
            fill_one(*args)

        def failing_batch(matchers: list[Any], *args: Any) -> None:
            if any(m is bad for m in matchers) and seq.num_output_tokens >= 2:
                fills.append("batch")
                raise RuntimeError("batch fill failed")
            batch_fill(matchers, *args)

        bad.fill_next_token_bitmask = failing_one  # type: ignore[method-assign]
        bitmasks._batch.batch_fill_next_token_bitmask = failing_batch  # type: ignore[method-assign]

    got = drive(core, "g", arm)
    assert fills[:2] == ["batch", "row"], fills
    assert "bitmask fill of 2 rows raised (RuntimeError: batch fill failed)" in caplog.text
    assert got.finish["g"] == "error"
    error = got.error["g"]
    assert error is not None and "could not fill its token bitmask: RuntimeError: fill failed" in error
    assert (got.tokens["h"], got.tokens["f"]) == (want.tokens["h"], want.tokens["f"])
    assert (got.finish["h"], got.finish["f"]) == (want.finish["h"], want.finish["f"])
