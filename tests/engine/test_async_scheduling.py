"""Asynchronous scheduling (engine/async_step.py, ``SchedulerConfig.async_scheduling``).

The decode graphs' static-buffer forward runs uncaptured (on CPU under the Triton interpreter), so the
same code path as with captured graphs launches step N+1 from step N's device tokens; on a GPU
(scripts/gpu_tests.sh) one more test compares captured graphs with and without async scheduling.
Checked against the synchronous engine: the same tokens for batches whose requests stop at different
steps (``max_tokens``, eos, stop ids), cross block boundaries, mix greedy with seeded sampling, abort
between steps and arrive between steps, hold grammars (structured outputs) beside free rows; that a
launched step really is in flight across calls; that ``BlockManager.free`` waits for it; no leaks.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.cuda_graphs import DecodeCudaGraphs
from engine.engine_core import EngineCore
from engine.models.dummy_tokenizer import write_dummy_tokenizer
from engine.sampling_params import SamplingParams, StructuredOutput
from tests.engine.test_loader import tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 48 tokens (3 of the interpreter's 16-token tiles) hold every request here (prompt <= 10 tokens plus
# max_tokens <= 24) and give the decode kernel one split: half the split kernel's programs of 96 tokens
MAX_LEN = 48
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton interpreter; graphs uncaptured


def save_one_layer_model(path: Path) -> Path:
    """The tiny Llama (``tiny_config``, random weights, seed 5) with one layer, saved at ``path``:
    scheduling is per step, not per layer, and under the Triton interpreter each layer's attention
    launches cost about half a second per step."""
    torch.manual_seed(5)
    config = tiny_config("LlamaForCausalLM")
    config.num_hidden_layers = 1
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_one_layer_model(tmp_path_factory.mktemp("async") / "m")


def make_core(path: Path, async_scheduling: bool, graphs: bool = True, num_blocks: int = 160) -> EngineCore:
    core = EngineCore(EngineConfig(
        ModelConfig(str(path), dtype="float32", device=DEVICE, attention_backend="triton",
                    max_model_len=min(MAX_LEN, 4 * num_blocks), enforce_eager=True),  # within the KV
        CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=True),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, async_scheduling=async_scheduling),
    ))
    if graphs:  # uncaptured (enforce_eager): the static-buffer forward a graph replays
        r = core.runner
        r.decode_graphs = DecodeCudaGraphs(r.net, r.kv_cache, r.backend, 8, r.max_model_len)
    return core


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randrange(2, 11))] for _ in range(n)]


class Run:
    """Drives an engine step by step, recording tokens and finish reasons per request."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str | None] = {}
        self.steps = 0

    def add(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        self.core.add_request(rid, prompt, params)
        self.tokens[rid] = []

    def step(self) -> None:
        self.steps += 1
        for out in self.core.step():
            assert self.finish.get(out.request_id) is None, f"token after the finish of {out.request_id}"
            self.tokens[out.request_id].append(out.token_id)
            self.finish[out.request_id] = out.finish_reason

    def drain(self) -> None:
        while self.core.has_unfinished():
            self.step()
        self.core.check_no_leaks()


def scenario(core: EngineCore, eos_of: dict[str, int] | None = None) -> Run:
    """Five requests: greedy with different max_tokens (one crossing many blocks), one with a stop
    token id, one seeded-sampling; a sixth arrives mid-run and one is aborted mid-run."""
    run = Run(core)
    ps = prompts(6, seed=11)
    run.add("a", ps[0], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    run.add("b", ps[1], SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True))
    run.add("c", ps[2], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True,
                                       stop_token_ids=tuple((eos_of or {}).values())))
    run.add("d", ps[3], SamplingParams(temperature=0.7, seed=3, max_tokens=6, ignore_eos=True))
    run.add("e", ps[4], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    for _ in range(4):
        run.step()
    run.add("f", ps[5], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    for _ in range(2):
        run.step()
    core.abort_request("e")
    run.drain()
    return run


def test_same_tokens_as_synchronous_engine(tiny_path: Path) -> None:
    # a stop id that request c really samples (its 4th greedy token) ends it early in both engines
    probe = Run(make_core(tiny_path, async_scheduling=False))
    probe.add("c", prompts(6, seed=11)[2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    probe.drain()
    stop = {"c": probe.tokens["c"][3]}
    sync = scenario(make_core(tiny_path, async_scheduling=False), stop)
    core = make_core(tiny_path, async_scheduling=True)
    launched = count_launches(core)
    asy = scenario(core, stop)
    assert asy.tokens == sync.tokens
    assert asy.finish == sync.finish
    assert sync.finish["c"] == "stop" and len(sync.tokens["c"]) <= 4
    assert launched["ahead"] > 0  # steps really went ahead


def count_launches(core: EngineCore) -> dict[str, int]:
    counts = {"first": 0, "ahead": 0}
    launch = core.runner.launch

    def counting(output, feed=None):  # type: ignore[no-untyped-def]
        counts["ahead" if feed is not None else "first"] += 1
        return launch(output, feed)

    core.runner.launch = counting  # type: ignore[method-assign]
    return counts


def test_greedy_batch_runs_ahead_every_step_and_free_waits(tiny_path: Path) -> None:
    core = make_core(tiny_path, async_scheduling=True)
    counts = count_launches(core)
    run = Run(core)
    for i, p in enumerate(prompts(3, seed=4)):
        run.add(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    run.step()  # prefill (eager)
    run.step()  # first decode: launched, and the next one ahead of it
    assert counts == {"first": 1, "ahead": 1}
    assert core._ahead is not None and core.block_manager.before_free is not None
    waited: list[bool] = []
    wait = core._ahead.wait

    def logged_wait() -> None:
        waited.append(True)
        wait()

    core._ahead.wait = logged_wait  # type: ignore[method-assign]
    core.block_manager.before_free = core._ahead.wait
    core.abort_request("g1")  # frees g1's blocks: must wait for the step in flight first
    assert waited == [True]
    run.drain()
    assert run.finish == {"g0": "length", "g2": "length", "g1": None}
    assert [len(run.tokens[r]) for r in ("g0", "g2")] == [7, 7]
    ref = Run(make_core(tiny_path, async_scheduling=False))
    for i, p in enumerate(prompts(3, seed=4)):
        ref.add(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    ref.drain()
    assert run.tokens["g0"] == ref.tokens["g0"] and run.tokens["g2"] == ref.tokens["g2"]
    assert run.tokens["g1"] == ref.tokens["g1"][: len(run.tokens["g1"])]
    # 6 decode steps: each ran ahead but the first, the one after the abort (the step applied then
    # still had g1's row, so the next one was not certain) and the last (max_tokens: none follows)
    assert counts == {"first": 2, "ahead": 4}


def test_off_without_graphs_or_flag(tiny_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("DEBUG", logger="engine.engine_core"):
        no_graphs = make_core(tiny_path, async_scheduling=True, graphs=False)
    assert "async_scheduling inactive" in caplog.text  # at DEBUG: the default; a CPU is no error
    for core in (no_graphs, make_core(tiny_path, async_scheduling=False)):
        counts = count_launches(core)
        run = Run(core)
        run.add("x", prompts(1, seed=9)[0], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        run.drain()
        assert counts == {"first": 0, "ahead": 0} and len(run.tokens["x"]) == 5


def test_preemption_under_block_pressure_same_tokens(tiny_path: Path) -> None:
    def go(async_scheduling: bool) -> tuple[dict[str, list[int]], int]:
        run = Run(make_core(tiny_path, async_scheduling, num_blocks=7))
        preempted: list[str] = []
        schedule = run.core.scheduler.schedule

        def recording():  # type: ignore[no-untyped-def]
            out = schedule()
            preempted.extend(out.preempted)
            return out

        run.core.scheduler.schedule = recording  # type: ignore[method-assign]
        for i, p in enumerate(prompts(3, seed=8)):
            run.add(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        run.drain()
        return run.tokens, len(preempted)

    tokens, preemptions = go(True)
    assert (tokens, preemptions > 0) == (go(False)[0], True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run by scripts/gpu_tests.sh)")
def test_gpu_captured_graphs_same_tokens_with_and_without_async(tiny_path: Path) -> None:
    def go(async_scheduling: bool) -> tuple[dict[str, list[int]], dict[str, int]]:
        core = EngineCore(EngineConfig(
            ModelConfig(str(tiny_path), dtype="float32", device="cuda", attention_backend="triton",
                        max_model_len=MAX_LEN),
            CacheConfig(block_size=4, num_blocks=200),
            SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, async_scheduling=async_scheduling),
        ))
        assert core.runner.decode_graphs is not None and core.runner.decode_graphs.captured
        counts = count_launches(core)
        run = Run(core)
        for i, p in enumerate(prompts(11, seed=21)):
            run.add(f"q{i}", p, SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True))
        run.drain()
        return run.tokens, counts

    tokens, counts = go(True)
    assert tokens == go(False)[0]
    assert counts["ahead"] > counts["first"] > 0


def test_seeded_sampling_runs_ahead_with_the_same_tokens(tiny_path: Path) -> None:
    """Seeded sampling rows (temperature, top-k, top-p, min-p; the Gumbel noise hashes seed and output
    position) sample on the device, so they run ahead too; a ``min_tokens`` row joins only once its mask
    is off, and a logprobs row keeps its batch synchronous until it finishes."""
    def go(async_scheduling: bool) -> tuple[dict[str, list[int]], dict[str, int]]:
        core = make_core(tiny_path, async_scheduling)
        counts = count_launches(core)
        run = Run(core)
        ps = prompts(4, seed=13)
        run.add("t", ps[0], SamplingParams(temperature=0.9, top_k=20, seed=1, max_tokens=9, ignore_eos=True))
        run.add("p", ps[1], SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, seed=2, max_tokens=9,
                                           ignore_eos=True))
        run.add("m", ps[2], SamplingParams(temperature=0.8, seed=3, max_tokens=8, min_tokens=3,
                                           stop_token_ids=(7, 11, 13), ignore_eos=True))
        run.add("l", ps[3], SamplingParams(temperature=0.8, seed=4, max_tokens=3, logprobs=2,
                                           ignore_eos=True))
        run.drain()
        return run.tokens, counts

    (tokens, counts), (want, none) = go(True), go(False)
    assert tokens == want
    assert none == {"first": 0, "ahead": 0} and counts["ahead"] >= 3


def test_min_tokens_boundary_is_not_sampled_ahead_with_a_stale_mask(tiny_path: Path) -> None:
    """A greedy row whose ``min_tokens``-th output is a stop token must stop there: a step launched
    before the row's previous token reached the host would still see the stop token masked (the sampler
    counts the outputs the host has), so such a row joins launched steps only once its mask is off."""
    ps = prompts(2, seed=17)

    def go(async_scheduling: bool, stop: tuple[int, ...]) -> Run:
        run = Run(make_core(tiny_path, async_scheduling))
        run.add("g", ps[0], SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3, stop_token_ids=stop,
                                           ignore_eos=True))
        run.add("r", ps[1], SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True))
        run.drain()
        return run

    free = go(False, ()).tokens["g"]
    assert free[3] not in free[:3], "pick another prompt seed: the stop token must first come at output 3"
    want = go(False, (free[3],))
    assert want.tokens["g"] == free[:4] and want.finish["g"] == "stop"
    got = go(True, (free[3],))
    assert (got.tokens, got.finish) == (want.tokens, want.finish)


# Grammars over the dummy tokenizer's words (token id j spells "t<j>", bos/eos "<s>"/"</s>"): tokens
# spelling t1* and t2* words alternate; a choice ends in eos once one of its strings is complete.
ALTERNATING = StructuredOutput(kind="regex", spec="(t1[0-9]*t2[0-9]*)+")
CHOICE = StructuredOutput(kind="choice", spec='["t10t20t30", "t11t21"]')


@pytest.fixture(scope="module")
def grammar_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one-layer tiny model with the dummy tokenizer beside it (what the grammar compiles against)."""
    path = save_one_layer_model(tmp_path_factory.mktemp("async-grammar") / "m")
    write_dummy_tokenizer(path, json.loads((path / "config.json").read_text()))
    return path


def grammar_scenario(core: EngineCore) -> Run:
    """A mixed batch: greedy and seeded rows under the alternating regex, a choice that ends by its
    grammar, and a free greedy row, with different max_tokens."""
    run = Run(core)
    ps = prompts(4, seed=23)
    run.add("g", ps[0], SamplingParams(temperature=0.0, max_tokens=6, structured_output=ALTERNATING))
    run.add("s", ps[1], SamplingParams(temperature=0.9, seed=4, max_tokens=5, structured_output=ALTERNATING))
    run.add("c", ps[2], SamplingParams(temperature=0.0, max_tokens=8, structured_output=CHOICE))
    run.add("f", ps[3], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    run.drain()
    return run


def words(tokens: list[int]) -> str:
    return "".join(f"t{t}" for t in tokens if t != 2)


def test_grammar_rows_run_ahead_with_the_same_tokens(grammar_path: Path) -> None:
    """Rows with a grammar no longer make a step synchronous: after the one prefill step every decode
    step is launched, most of them ahead of the previous step's tokens, and the tokens and finish
    reasons equal the synchronous engine's."""
    want = grammar_scenario(make_core(grammar_path, async_scheduling=False))
    core = make_core(grammar_path, async_scheduling=True)
    got = grammar_scenario(core)
    assert (got.tokens, got.finish) == (want.tokens, want.finish)
    for rid in ("g", "s"):
        assert re.fullmatch(r"(t1[0-9]*t2[0-9]*)*(t1[0-9]*)?", words(got.tokens[rid])), got.tokens[rid]
    assert words(got.tokens["c"]) in ("t10t20t30", "t11t21") and got.finish["c"] == "stop"
    assert got.tokens["c"][-1] == 2  # eos, the only token a complete choice allows
    counts = core.step_counts
    assert counts.synchronous == 1, counts  # the prefill step; every decode step was launched
    assert counts.launched == got.steps - 1 and counts.ahead > 0, counts


def test_grammar_mask_is_filled_after_the_forward_is_enqueued(grammar_path: Path) -> None:
    """Each launched step with a grammar row enqueues its forward before the host fills its bitmask (the
    fill overlaps the forward on a GPU); the fill of a step launched ahead advances the matchers over the
    previous step's tokens, which the scheduler has not applied yet."""
    core = make_core(grammar_path, async_scheduling=True)
    runner = core.runner
    assert runner.decode_graphs is not None
    calls: list[str] = []
    run_graph, bitmasks = runner.decode_graphs.run, runner._grammar_bitmasks()
    fill = bitmasks.fill

    def forward(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append("forward")
        return run_graph(*args, **kwargs)

    def filling(states):  # type: ignore[no-untyped-def]
        seq = core.scheduler.get("g")
        assert seq is not None and seq.grammar is not None
        calls.append("fill-ahead" if seq.grammar.num_accepted == seq.num_output_tokens + 1 else "fill")
        return fill(states)

    runner.decode_graphs.run = forward  # type: ignore[method-assign]
    bitmasks.fill = filling  # type: ignore[method-assign]
    run = Run(core)
    ps = prompts(2, seed=29)
    run.add("g", ps[0], SamplingParams(temperature=0.0, max_tokens=6, structured_output=ALTERNATING))
    run.add("f", ps[1], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    run.drain()
    # the prefill step (eager, synchronous) masks the first token; the first launched step saw every
    # token applied; the one launched ahead of it accepts that step's tokens first
    assert calls[:5] == ["fill", "forward", "fill", "forward", "fill-ahead"], calls
    launched = calls[1:]
    assert all(a == "forward" and b.startswith("fill") for a, b in zip(launched[::2], launched[1::2],
                                                                           strict=True)), calls
    assert core.step_counts.ahead >= 3 and core.step_counts.synchronous == 1
    assert len(run.tokens["g"]) == 6 or run.finish["g"] == "stop"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run by scripts/gpu_tests.sh)")
def test_gpu_grammar_rows_same_tokens_with_and_without_async(grammar_path: Path) -> None:
    """Captured graphs, the bitmask copied on the side stream: the same tokens with and without
    asynchronous scheduling, and the decode steps launched."""
    def go(async_scheduling: bool) -> tuple[Run, EngineCore]:
        core = EngineCore(EngineConfig(
            ModelConfig(str(grammar_path), dtype="float32", device="cuda", attention_backend="triton",
                        max_model_len=MAX_LEN),
            CacheConfig(block_size=4, num_blocks=200),
            SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, async_scheduling=async_scheduling),
        ))
        assert core.runner.decode_graphs is not None and core.runner.decode_graphs.captured
        return grammar_scenario(core), core

    (got, core), (want, _) = go(True), go(False)
    assert (got.tokens, got.finish) == (want.tokens, want.finish)
    assert core.step_counts.synchronous == 1 and core.step_counts.ahead > 0

