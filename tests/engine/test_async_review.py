"""Review of asynchronous scheduling (commit 809a9cf, engine/async_step.py): adversarial cases beside
tests/engine/test_async_scheduling.py, each checked against the synchronous engine.

Passing: switching ``async_scheduling`` off while a step is launched; ``min_tokens`` (eos/stop mask),
logprobs and seeded rows mixed with greedy ones; ``max_model_len`` reached while the batch crosses decode
graph buckets (and starts above the largest one); ``LLM.generate`` with stop strings (the request is
aborted while a launched step still holds its row), and three hazards this review found, fixed since: a
failing step waits for the steps it launched before the caller frees their blocks, ``StepFailed`` names
only requests still running, and no launched step is left once every request ended. On CPU the decode
graphs run uncaptured under the Triton interpreter (each layer's attention launches cost about half a
second per decode step), so each case is kept to a few requests and tokens of a one-layer model.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.async_step import LaunchedStep
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.cuda_graphs import DecodeCudaGraphs
from engine.engine_core import EngineCore
from engine.llm import LLM, RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from tests.engine.test_async_scheduling import Run, count_launches, save_one_layer_model
from tests.engine.test_loader import tiny_config
from workers.step import StepFailed, run_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 4


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_one_layer_model(tmp_path_factory.mktemp("async_review") / "m")


def with_graphs(core: EngineCore, max_graph_seqs: int = 8) -> EngineCore:
    """Give ``core`` uncaptured decode graphs (the static-buffer forward a captured graph replays)."""
    r = core.runner
    r.decode_graphs = DecodeCudaGraphs(r.net, r.kv_cache, r.backend, max_graph_seqs, r.max_model_len)
    return core


def make_core(path: Path, async_scheduling: bool, *, max_len: int = 64, max_graph_seqs: int = 8,
              num_blocks: int = 64) -> EngineCore:
    """fp32 CPU engine over the triton backend (Triton interpreter) with uncaptured decode graphs."""
    return with_graphs(EngineCore(EngineConfig(
        ModelConfig(str(path), dtype="float32", device="cpu", attention_backend="triton",
                    max_model_len=max_len, enforce_eager=True),
        CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, async_scheduling=async_scheduling),
    )), max_graph_seqs)


def rows_of(step: LaunchedStep | None) -> list[str]:
    return [] if step is None else [s.seq.request_id for s in step.output.scheduled]


def test_switching_async_off_while_a_step_is_launched_applies_it_once(tiny_path: Path) -> None:
    def go(async_scheduling: bool) -> Run:
        core = make_core(tiny_path, async_scheduling)
        counts = count_launches(core)
        run = Run(core)
        run.add("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        run.add("b", [9, 10, 11, 12, 13], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        run.step()  # prefill
        run.step()  # first decode; with async the next one is launched ahead
        if async_scheduling:
            assert rows_of(core._ahead) == ["a", "b"] and counts == {"first": 1, "ahead": 1}
        core.async_scheduling = False
        run.drain()
        if async_scheduling:  # the launched step was applied (once), nothing launched after the switch
            assert counts == {"first": 1, "ahead": 1} and core._ahead is None
        return run

    asy, sync = go(True), go(False)
    assert asy.tokens == sync.tokens and asy.finish == sync.finish
    assert [len(asy.tokens[r]) for r in ("a", "b")] == [6, 5] and asy.steps == sync.steps


def test_min_tokens_logprobs_and_seeded_rows_mixed_in(tiny_path: Path) -> None:
    """``m``'s stop ids cover every token but 0..2 and are masked below ``min_tokens`` (3): its steps are
    not plain greedy until 3 tokens exist; an off-by-one in ``_launchable``'s ``later`` would sample its
    4th token unmasked-too-early or masked-too-late, and change tokens or finish step."""
    stop_ids = tuple(range(3, 256))

    def go(async_scheduling: bool) -> tuple[Run, list[float], dict[str, int]]:
        core = make_core(tiny_path, async_scheduling)
        counts = count_launches(core)
        run = Run(core)
        logprobs: list[float] = []
        run.add("m", [20, 21, 22], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3,
                                                  stop_token_ids=stop_ids, ignore_eos=True))
        run.add("l", [30, 31], SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, ignore_eos=True))
        run.add("s", [40, 41, 42, 43], SamplingParams(temperature=0.8, seed=7, max_tokens=2,
                                                      ignore_eos=True))
        run.add("g", [50, 51, 52], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
        step = core.step

        def recording() -> list[Any]:
            outs = step()
            logprobs.extend(o.logprob for o in outs if o.request_id == "l" and o.logprob is not None)
            return outs

        core.step = recording  # type: ignore[method-assign]
        run.drain()
        return run, logprobs, counts

    (asy, asy_lp, counts), (sync, sync_lp, _) = go(True), go(False)
    assert asy.tokens == sync.tokens and asy.finish == sync.finish
    assert asy_lp == sync_lp and len(asy_lp) == 3
    assert all(t in (0, 1, 2) for t in sync.tokens["m"][:3])  # masked below min_tokens
    assert counts["ahead"] > 0  # once l and s finished, greedy-only batches ran ahead


def test_max_model_len_reached_across_graph_buckets(tiny_path: Path) -> None:
    """Three sequences hit ``max_model_len`` (12 tokens) at different steps: the batch starts above the
    largest graph bucket (2: eager steps), then runs ahead in bucket 2, then bucket 1."""
    prompts = {"p8": list(range(60, 68)), "p6": list(range(70, 76)), "p4": list(range(80, 84))}

    def go(async_scheduling: bool) -> tuple[Run, dict[str, int]]:
        core = make_core(tiny_path, async_scheduling, max_len=12, max_graph_seqs=2)
        counts = count_launches(core)
        run = Run(core)
        for rid, p in prompts.items():
            run.add(rid, p, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        run.drain()
        return run, counts

    (asy, counts), (sync, _) = go(True), go(False)
    assert asy.tokens == sync.tokens and asy.finish == sync.finish
    assert asy.finish == {"p8": "length", "p6": "length", "p4": "length"}
    assert {r: len(p) + len(asy.tokens[r]) for r, p in prompts.items()} == {r: 12 for r in prompts}
    assert counts["first"] >= 2 and counts["ahead"] > 0


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: Path) -> Path:
    """A config-only tiny Llama of one layer (dummy weights) with SmolLM2's tokenizer (vocab 49152), for
    text."""
    path = tmp_path_factory.mktemp("async_llm") / "m"
    path.mkdir()
    config = tiny_config("LlamaForCausalLM", vocab=49152)
    config.num_hidden_layers = 1
    (path / "config.json").write_text(config.to_json_string())
    for f in smollm2_tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    return path


def make_llm(path: Path, async_scheduling: bool) -> LLM:
    llm = LLM(str(path), load_format="dummy", dtype="float32", device="cpu", attention_backend="triton",
              enforce_eager=True, max_model_len=64, block_size=BLOCK, num_blocks=64,
              async_scheduling=async_scheduling)
    with_graphs(llm.core)
    return llm


def test_llm_generate_stop_strings_same_as_sync(llm_dir: Path) -> None:
    prompts = [[100, 200, 300], [400, 500, 600, 700]]
    ref = make_llm(llm_dir, False)
    free = ref.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert ref.tokenizer is not None and len(free[0].token_ids) == 8
    stop = ref.tokenizer.decode(free[0].token_ids[3:4])  # ends request 0 at its 4th token
    assert stop and stop not in ref.tokenizer.decode(free[0].token_ids[:3]), "pick another prompt"
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=(stop,))

    def go(async_scheduling: bool) -> tuple[list[RequestOutput], list[list[str]]]:
        llm = make_llm(llm_dir, async_scheduling)
        held: list[list[str]] = []  # rows of the launched step at each abort
        abort: Callable[[str], None] = llm.core.abort_request

        def recording(rid: str) -> None:
            if llm.core.has_unfinished() and llm.core.scheduler.get(rid) is not None:
                held.append(rows_of(llm.core._ahead))
            abort(rid)

        setattr(llm.core, "abort_request", recording)  # noqa: B010 (mypy: a method replaced)
        outs = llm.generate(prompts, params)
        llm.core.check_no_leaks()
        return outs, held

    (asy, held), (sync, _) = go(True), go(False)
    assert [(o.text, o.token_ids, o.finish_reason) for o in asy] == \
        [(o.text, o.token_ids, o.finish_reason) for o in sync]
    assert sync[0].finish_reason == "stop" and stop not in sync[0].text
    assert sync[0].token_ids == free[0].token_ids[:4] and sync[1].token_ids == free[1].token_ids
    assert held and "llm-0" in held[0]  # the stop string aborted a request a launched step still held


def test_failed_launch_ahead_waits_for_the_launched_step_before_blocks_are_freed(tiny_path: Path) -> None:
    core = make_core(tiny_path, True)
    log: list[str] = []
    launch = core.runner.launch

    def failing_ahead(output: Any, feed: LaunchedStep | None = None) -> LaunchedStep:
        if feed is not None:
            raise RuntimeError("graph replay failed")  # the launch of step N+1 fails
        step = launch(output, feed)
        wait = step.wait

        def logged_wait() -> None:
            log.append("wait")
            wait()

        step.wait = logged_wait  # type: ignore[method-assign]
        log.append("launched")
        return step

    def logged_free(seq: Sequence) -> None:
        log.append(f"free {seq.request_id}")
        free(seq)

    core.runner.launch = failing_ahead  # type: ignore[method-assign]
    free = core.block_manager.free
    core.block_manager.free = logged_free  # type: ignore[method-assign]
    core.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    run_step(core)  # prefill
    with pytest.raises(StepFailed) as failed:
        run_step(core)  # first decode launched, its successor's launch raises
    assert failed.value.request_ids == ["a"]
    core.abort_request("a")  # what a worker does for each failed request
    core.check_no_leaks()
    assert log[0] == "launched" and "free a" in log
    assert "wait" in log[: log.index("free a")], log  # the launched step was waited for before the free


def test_step_failed_names_only_requests_still_running(tiny_path: Path) -> None:
    core = make_core(tiny_path, True)
    for rid in ("a", "b"):
        core.add_request(rid, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    run_step(core)  # prefill
    run_step(core)  # first decode; the next is launched ahead with rows a, b
    assert rows_of(core._ahead) == ["a", "b"]
    core.abort_request("a")

    def device_error() -> list[int]:
        raise RuntimeError("CUDA error while reading the step's tokens")

    core._ahead.token_ids = device_error  # type: ignore[method-assign,union-attr]
    with pytest.raises(StepFailed) as failed:
        run_step(core)  # applies the launched step (row b still runs): reading its tokens raises
    core.abort_request("b")
    core.check_no_leaks()
    assert failed.value.request_ids == ["b"]


def test_nothing_launched_is_left_once_every_request_is_aborted(tiny_path: Path) -> None:
    core = make_core(tiny_path, True)
    for rid in ("a", "b"):
        core.add_request(rid, [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    core.step()  # prefill
    core.step()  # first decode; the next is launched ahead
    assert rows_of(core._ahead) == ["a", "b"]
    core.abort_request("a")
    core.abort_request("b")
    core.check_no_leaks()
    assert core._ahead is None and core.block_manager.before_free is None
