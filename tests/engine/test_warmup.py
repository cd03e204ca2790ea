"""Engine warm-up (``engine.warmup``): the step shapes it covers, the engine left exactly as before (no
request, every KV block free, no prefix-cache entry), greedy outputs unchanged, every worker role's engine,
the time bound, failures mid-way, and refused settings; the prefill probe (``probe_prefill``) likewise.
Tiny fp32 CPU Llama with dummy weights (seed 0)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus
from engine.warmup import CPU_PROBE_TOKENS, WarmupConfig, probe_prefill, should_warm_up, warmup
from protocol.settings import WorkerSettings
from tests.workers.helpers import make_core as worker_core

BUDGET = 32  # max_num_batched_tokens of the test engines
BLOCK = 4
SIZES = (1, 2, 4, 8)
CFG = WarmupConfig(decode_batch_sizes=SIZES, num_output_tokens=3, long_context_tokens=48)
SMALL = WarmupConfig(decode_batch_sizes=(1, 3), num_output_tokens=2)  # fewer steps where shapes don't matter


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_core(tiny_dummy_dir: Path, *, prefill_only: bool = False, num_blocks: int = 128,
              max_num_seqs: int = 8) -> EngineCore:
    """The workers' test engine (tests/workers/helpers.py) with this file's block size and budget."""
    return worker_core(tiny_dummy_dir, prefill_only=prefill_only, num_blocks=num_blocks,
                       max_num_batched_tokens=BUDGET, max_num_seqs=max_num_seqs, block_size=BLOCK)


def fail_at_step(core: EngineCore, monkeypatch: pytest.MonkeyPatch, step: int) -> list[int]:
    """Make the ``step``-th ``core.runner.execute`` call raise RuntimeError("boom in step N"); returns
    the list that gets one entry per call."""
    real = core.runner.execute
    calls: list[int] = []

    def execute(output, layer_hook=None):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == step:
            raise RuntimeError(f"boom in step {step}")
        return real(output, layer_hook)

    monkeypatch.setattr(core.runner, "execute", execute)
    return calls


def spy_prompts(core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Record every prompt given to ``core.add_request``."""
    seen: list[list[int]] = []
    real = core.add_request

    def add(request_id: str, prompt: list[int], params: SamplingParams, arrival_time: float | None = None
            ) -> Sequence:
        seen.append(list(prompt))
        return real(request_id, prompt, params, arrival_time)

    monkeypatch.setattr(core, "add_request", add)
    return seen


def assert_clean(core: EngineCore, prompts: list[list[int]]) -> None:
    """No request held, every block free, and no warm-up prompt hits the prefix cache."""
    core.check_no_leaks()
    sched, bm = core.scheduler, core.block_manager
    assert not sched.waiting and not sched.running
    assert all(sched.get(f"warmup-{i}") is None for i in range(len(prompts)))
    assert bm.enable_prefix_caching
    for prompt in prompts:
        probe = Sequence("probe", prompt + [0] * BLOCK, SamplingParams(), 0.0)
        assert bm.allocate_prefix(probe) == 0
        bm.free(probe)
    core.check_no_leaks()


def generate(core: EngineCore, prompts: list[list[int]]) -> list[tuple[list[int], list[float | None]]]:
    """Greedy, batched, with logprobs; returns (token ids, logprobs) per prompt."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, params)
    out: dict[str, tuple[list[int], list[float | None]]] = {f"r{i}": ([], []) for i in range(len(prompts))}
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id][0].append(o.token_id)
            out[o.request_id][1].append(o.logprob)
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_colocated_warmup_covers_each_step_shape_and_leaves_engine_clean(tiny_dummy_dir, monkeypatch, caplog):
    core = make_core(tiny_dummy_dir)
    prompts = spy_prompts(core, monkeypatch)
    with caplog.at_level(logging.INFO, logger="pdserve.warmup"):
        report = warmup(core, CFG)
    assert report.completed and report.num_requests == len(prompts) > 0
    steps = report.steps
    assert any(s.num_decodes == 0 and s.num_prefills == 1 and s.num_batched_tokens == BUDGET
               and not s.chunk_after_kv for s in steps)                        # prefill chunk at the budget
    assert any(s.num_decodes == 0 and s.chunk_after_kv for s in steps)          # second chunk over cached KV
    assert any(s.num_decodes == 0 and s.num_prefills == 1 and s.num_batched_tokens == 16
               and s.chunk_after_kv for s in steps)                             # 16 tokens after 64 cached
    decode_only = {s.num_decodes for s in steps if s.num_prefills == 0}
    assert set(SIZES) <= decode_only                                            # decode batches 1, 2, 4, 8
    mixed = [s for s in steps if s.num_decodes > 0 and s.num_prefills > 0]
    assert any(s.num_batched_tokens == BUDGET and s.chunk_after_kv is False for s in mixed)
    assert any(s.chunk_after_kv for s in mixed)                                 # chunk beside decodes
    assert {1, 7} <= {s.num_decodes for s in mixed}                             # smallest, largest (8 - 1)
    assert {BUDGET + BUDGET // 2 + 1, 2 * BUDGET + 16} <= {len(p) for p in prompts}
    assert max(len(p) for p in prompts) == 2 * BUDGET + 16  # 48 cached tokens rounded up to whole chunks
    record = next(r for r in caplog.records if r.getMessage() == "warmup_done")
    assert record.levelno == logging.INFO and record.seconds == pytest.approx(report.seconds, abs=1e-3)
    assert record.steps == len(steps) and record.requests == report.num_requests
    assert_clean(core, prompts)


def test_outputs_after_warmup_equal_a_cold_engine(tiny_dummy_dir):
    prompts = [[5, 9, 33, 7, 100, 12, 3], list(range(10, 50)), [200] * 17, [42]]
    cold = make_core(tiny_dummy_dir)
    expected = generate(cold, prompts)
    warm = make_core(tiny_dummy_dir)
    assert warmup(warm, SMALL).completed
    assert generate(warm, prompts) == expected
    assert all(len(tokens) == 6 for tokens, _ in expected)
    cold.check_no_leaks()
    warm.check_no_leaks()


def test_prefill_worker_engine_warms_up_and_then_prefills(tiny_dummy_dir, monkeypatch):
    core = make_core(tiny_dummy_dir, prefill_only=True)
    prompts = spy_prompts(core, monkeypatch)
    report = warmup(core, CFG)
    assert report.completed
    assert any(s.num_prefills == 1 and s.num_batched_tokens == BUDGET for s in report.steps)
    assert any(s.chunk_after_kv for s in report.steps)
    assert any(s.num_decodes + s.num_prefills >= 8 for s in report.steps)     # several prompts in one step
    assert_clean(core, prompts)
    seq = core.add_request("real", [4, 5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0))
    outs = core.step()
    assert [o.finish_reason for o in outs] == ["prefilled"]
    assert seq.status is SequenceStatus.FINISHED_PREFILLED
    core.scheduler.release(seq)
    core.check_no_leaks()


def test_decode_worker_engine_warms_up_then_continues_landed_kv(tiny_dummy_dir, monkeypatch):
    core = make_core(tiny_dummy_dir)  # a decode worker's engine: not prefill-only
    prompts = spy_prompts(core, monkeypatch)
    assert warmup(core, SMALL).completed
    assert_clean(core, prompts)
    seq = Sequence("d1", list(range(20, 31)), SamplingParams(max_tokens=3, temperature=0.0, seed=1), 0.0,
                   (2,))
    assert core.scheduler.add_waiting_for_kv(seq)
    core.scheduler.kv_landed("d1", 17)
    tokens = [o.token_id for _ in range(2) for o in core.step()]
    assert len(tokens) == 2 and seq.is_finished and seq.output_token_ids[0] == 17
    core.check_no_leaks()


def test_small_cache_preempts_and_still_ends_clean(tiny_dummy_dir, monkeypatch):
    core = make_core(tiny_dummy_dir, num_blocks=16, max_num_seqs=8)  # 64 tokens of KV: preemption happens
    prompts = spy_prompts(core, monkeypatch)
    report = warmup(core, WarmupConfig(decode_batch_sizes=(64,), num_output_tokens=2))
    assert report.completed and max(len(p) for p in prompts) < core.max_model_len
    assert_clean(core, prompts)


def test_time_bound_cuts_the_warmup_and_aborts_its_requests(tiny_dummy_dir, monkeypatch, caplog):
    core = make_core(tiny_dummy_dir)
    prompts = spy_prompts(core, monkeypatch)
    with caplog.at_level(logging.INFO, logger="pdserve.warmup"):
        report = warmup(core, WarmupConfig(max_seconds=1e-9))
    assert not report.completed and report.steps == () and report.num_requests == 1
    assert [r.getMessage() for r in caplog.records] == ["warmup_cut"]
    assert_clean(core, prompts)


def test_failing_step_propagates_and_leaves_nothing_held(tiny_dummy_dir, monkeypatch):
    core = make_core(tiny_dummy_dir)
    prompts = spy_prompts(core, monkeypatch)
    calls = fail_at_step(core, monkeypatch, 4)
    with pytest.raises(RuntimeError, match="boom in step 4"):
        warmup(core, CFG)
    assert len(calls) == 4
    assert_clean(core, prompts)


def test_busy_engine_is_refused_and_untouched(tiny_dummy_dir):
    core = make_core(tiny_dummy_dir)
    seq = core.add_request("real", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
    with pytest.raises(RuntimeError, match="idle engine"):
        warmup(core, CFG)
    assert core.scheduler.get("real") is seq and list(core.scheduler.waiting) == [seq]
    core.abort_request("real")
    core.check_no_leaks()


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"decode_batch_sizes": ()}, "decode_batch_sizes"),
    ({"decode_batch_sizes": (4, 0)}, "decode_batch_sizes"),
    ({"num_output_tokens": 1}, "num_output_tokens"),
    ({"max_seconds": 0.0}, "max_seconds"),
    ({"max_seconds": float("nan")}, "max_seconds"),
    ({"long_context_tokens": -1}, "long_context_tokens"),
])
def test_bad_warmup_config_is_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        WarmupConfig(**kwargs)


def test_mode_auto_warms_only_on_cuda_and_bad_modes_are_refused():
    assert should_warm_up("auto", "cuda") and not should_warm_up("auto", "cpu")
    assert should_warm_up("on", "cpu") and not should_warm_up("off", "cuda")
    with pytest.raises(ValueError, match="engine warm-up mode"):
        should_warm_up("yes", "cuda")
    with pytest.raises(ValueError, match="--engine-warmup"):
        WorkerSettings(role="colocated", engine_warmup="always", insecure_control_plane=True)


@pytest.mark.parametrize("prefill_only", [True, False])
def test_probe_times_prompts_of_one_size_and_leaves_the_engine_clean(tiny_dummy_dir, monkeypatch,
                                                                      prefill_only):
    core = make_core(tiny_dummy_dir, prefill_only=prefill_only)
    prompts = spy_prompts(core, monkeypatch)
    before = time.monotonic()
    probe = probe_prefill(core)
    assert probe is not None
    assert probe.tokens == min(CPU_PROBE_TOKENS, BUDGET) == BUDGET  # a CPU engine: at most 128, the budget
    assert [len(p) for p in prompts] == [BUDGET]  # one prompt of that size on a CPU
    assert 0 < probe.seconds <= probe.ended - before <= time.monotonic() - before
    assert_clean(core, prompts)
    if not prefill_only:  # the probe changes no later output
        assert generate(core, [[5, 9, 33]]) == generate(make_core(tiny_dummy_dir), [[5, 9, 33]])


def test_probe_prompt_fits_a_small_engine(tiny_dummy_dir, monkeypatch):
    core = make_core(tiny_dummy_dir, num_blocks=3)  # 12 tokens of KV: below the 32-token budget
    prompts = spy_prompts(core, monkeypatch)
    probe = probe_prefill(core, repeats=1)
    assert probe is not None and [len(p) for p in prompts] == [probe.tokens]
    assert 1 <= probe.tokens < core.max_model_len <= 12
    assert_clean(core, prompts)


def test_a_probe_that_cannot_fit_names_both_limits(tiny_dummy_dir, caplog):
    """One 4-token block: no probe prompt leaves room for the warm-up's output tokens. The warning names
    max_model_len and the KV pool, either of which may be the cause."""
    core = make_core(tiny_dummy_dir, num_blocks=1)
    with caplog.at_level(logging.WARNING, logger="pdserve.warmup"):
        assert probe_prefill(core, repeats=1) is None
    (record,) = [r for r in caplog.records if "prefill_probe_skipped" in r.getMessage()]
    assert (f"max_model_len {core.max_model_len}, KV pool 1 blocks of {BLOCK} tokens"
            in record.getMessage())
    core.check_no_leaks()


def test_probe_keeps_the_fastest_of_its_prompts(tiny_dummy_dir, monkeypatch):
    core = make_core(tiny_dummy_dir)
    prompts = spy_prompts(core, monkeypatch)
    real, slow = core.runner.execute, [0.05]

    def execute(output, layer_hook=None):  # type: ignore[no-untyped-def]
        time.sleep(slow.pop() if slow else 0.0)  # the first prompt pays a one-time 50 ms
        return real(output, layer_hook)

    monkeypatch.setattr(core.runner, "execute", execute)
    probe = probe_prefill(core, repeats=3)
    assert probe is not None and len(prompts) == 3 and probe.seconds < 0.05
    assert_clean(core, prompts)


def test_probe_failure_propagates_and_leaves_nothing_held(tiny_dummy_dir, monkeypatch):
    core = make_core(tiny_dummy_dir)
    prompts = spy_prompts(core, monkeypatch)
    fail_at_step(core, monkeypatch, 2)
    with pytest.raises(RuntimeError, match="boom in step 2"):
        probe_prefill(core, repeats=2)
    assert_clean(core, prompts)


def test_probe_refuses_a_busy_engine(tiny_dummy_dir):
    core = make_core(tiny_dummy_dir)
    seq = core.add_request("real", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
    with pytest.raises(RuntimeError, match="idle engine"):
        probe_prefill(core)
    assert list(core.scheduler.waiting) == [seq]
    core.abort_request("real")
    core.check_no_leaks()
