"""The prefill grid (``SchedulerConfig.prefill_grid``), scheduler and block manager only: grid-aligned
prefill chunks (one per sequence per step, scheduled whole), prefix hits rounded down to the grid and
only whole prefill grid chunks registered in the prefix cache; config and flag validation. Every
scenario ends with a leak check. The bit-exactness this buys is tested with the model in
``test_prefix_determinism.py`` and through live workers in
``tests/system/test_prefix_determinism_live.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.block_manager import BlockManager
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.warmup import WarmupConfig, warmup
from protocol.settings import WorkerSettings

BS = 4
GRID = 8  # two blocks


def _sched(grid: int = GRID, budget: int = 64, num_blocks: int = 64, prefill_only: bool = False) -> Scheduler:
    cache = CacheConfig(block_size=BS, num_blocks=num_blocks)
    bm = BlockManager(num_blocks, BS, True, prefix_grid_blocks=max(1, grid // BS))
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, prefill_grid=grid), cache, bm,
                     prefill_only=prefill_only)


def _seq(rid: str, tokens: list[int], max_tokens: int = 2, t: float = 0.0) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), t,
                    eos_token_ids=(2,))


def _step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, {x.seq.request_id: 7 for x in out.scheduled if x.samples})
    return out


def _plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request, first position, tokens) of each scheduled entry (positions before ``update``)."""
    return [(x.seq.request_id, x.seq.num_computed_tokens - x.num_scheduled_tokens, x.num_scheduled_tokens)
            for x in out.scheduled]


def _drain(s: Scheduler) -> list[list[tuple[str, int, int]]]:
    plans = []
    for _ in range(100):
        if not s.has_unfinished():
            break
        plans.append(_plan(_step(s)))
    assert not s.has_unfinished()
    for seq in [q for q in s._requests.values() if q.status.name == "FINISHED_PREFILLED"]:
        s.release(seq)
    s.block_manager.check_no_leaks()
    return plans


PROMPT = list(range(100, 122))  # 22 tokens: grid chunks [0, 8), [8, 16), [16, 22)


def test_fresh_prefill_runs_one_grid_chunk_per_step() -> None:
    s = _sched()
    s.add(_seq("a", PROMPT))
    plans = _drain(s)
    assert plans == [[("a", 0, 8)], [("a", 8, 8)], [("a", 16, 6)], [("a", 22, 1)]]


def test_hit_is_rounded_down_to_the_grid_and_the_chunks_match_the_fresh_ones() -> None:
    s = _sched()
    s.add(_seq("a", PROMPT))
    _drain(s)
    again = _seq("b", PROMPT)
    s.add(again)
    plans = _drain(s)
    # blocks [0, 16) are whole grid chunks: hit 16; the fresh run's chunk [16, 22) runs again as it was
    assert again.num_cached_tokens == 16
    assert plans == [[("b", 16, 6)], [("b", 22, 1)]]


def test_partial_chunk_and_decoded_tokens_are_not_registered() -> None:
    s = _sched()
    a = _seq("a", PROMPT[:12], max_tokens=12)  # prompt [0, 12); decodes fill positions 12..22
    s.add(a)
    _drain(s)
    # a later prompt holding a's prompt and output: only the whole prefill chunk [0, 8) is reusable
    b = _seq("b", [*a.token_ids, 5, 6, 7])
    s.add(b)
    _drain(s)
    assert b.num_cached_tokens == 8
    # without the grid the same sequence of requests reuses every full block (control)
    s0 = _sched(grid=0)
    a0 = _seq("a", PROMPT[:12], max_tokens=12)
    s0.add(a0)
    _drain(s0)
    b0 = _seq("b", [*a0.token_ids, 5, 6, 7])
    s0.add(b0)
    _drain(s0)
    assert b0.num_cached_tokens == 20  # a's last output token has no KV yet


def test_hit_below_one_grid_chunk_is_no_hit() -> None:
    s = _sched(grid=16)
    s.add(_seq("a", PROMPT))  # one whole chunk [0, 16)
    _drain(s)
    short = _seq("b", PROMPT[:14])  # its 3 full cached blocks are less than a grid chunk
    s.add(short)
    _drain(s)
    assert short.num_cached_tokens == 0
    longer = _seq("c", [*PROMPT, 1])
    s.add(longer)
    _drain(s)
    assert longer.num_cached_tokens == 16


def test_a_chunk_that_does_not_fit_the_budget_left_waits_whole() -> None:
    s = _sched(grid=8, budget=10)
    first, second = _seq("a", PROMPT[:9], t=0.0), _seq("b", list(range(300, 316)), t=1.0)
    s.add(first)
    s.add(second)
    out = _step(s)
    # a takes 8; b's first chunk (8 tokens) does not fit the 2 left and is not cut to 2
    assert _plan(out) == [("a", 0, 8)]
    out = _step(s)
    assert _plan(out) == [("a", 8, 1), ("b", 0, 8)]
    _drain(s)


def test_prefill_worker_registers_whole_chunks_and_hits_on_the_grid() -> None:
    s = _sched(prefill_only=True)
    s.add(_seq("a", PROMPT, max_tokens=1))
    _drain(s)
    b = _seq("b", PROMPT, max_tokens=1)
    s.add(b)
    _drain(s)
    assert b.num_cached_tokens == 16


def test_preempted_sequence_recomputes_on_the_grid() -> None:
    s = _sched(num_blocks=7, budget=64)  # 28 token slots
    a, b = _seq("a", PROMPT[:12], max_tokens=8, t=0.0), _seq("b", list(range(300, 310)), max_tokens=8, t=1.0)
    s.add(a)
    s.add(b)
    plans = _drain(s)
    assert s.num_preemptions >= 1
    # every multi-token entry starts on the grid and stays inside one grid chunk
    for plan in plans:
        for _, start, n in plan:
            if n > 1:
                assert start % GRID == 0 and n <= GRID


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="prefill_grid"):
        SchedulerConfig(max_num_batched_tokens=16, prefill_grid=32)
    with pytest.raises(ValueError, match="prefill_grid"):
        SchedulerConfig(prefill_grid=1)
    with pytest.raises(ValueError, match="prefill_grid"):
        SchedulerConfig(prefill_grid=-16)
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        SchedulerConfig(prefill_grid=16, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="multiple of block_size"):
        EngineConfig(ModelConfig("tiny-llama"), CacheConfig(block_size=16), SchedulerConfig(prefill_grid=40))
    EngineConfig(ModelConfig("tiny-llama"), CacheConfig(block_size=16), SchedulerConfig(prefill_grid=48))
    with pytest.raises(ValueError, match="prefix_grid_blocks"):
        Scheduler(SchedulerConfig(prefill_grid=8), CacheConfig(block_size=BS), BlockManager(8, BS))
    with pytest.raises(ValueError, match="prefix_grid_blocks"):
        BlockManager(8, BS, prefix_grid_blocks=0)


@pytest.mark.parametrize("grid", [20, 1, 4096, -16])
def test_worker_flag_validation(grid: int) -> None:
    with pytest.raises(ValueError, match="--prefill-grid"):
        WorkerSettings(role="colocated", insecure_control_plane=True, prefill_grid=grid)
    assert WorkerSettings(role="colocated", insecure_control_plane=True, prefill_grid=64).prefill_grid == 64


def test_engine_warms_up_and_generates_on_the_grid(tiny_dummy_dir: Path) -> None:
    """The warm-up's waves (a budget-sized prompt, one of 1.5 budgets, decode batches, a prompt beside
    decodes) all complete on the grid, leave every block free, and a prompt then prefills chunk by chunk."""
    core = EngineCore(EngineConfig(
        ModelConfig(str(tiny_dummy_dir), load_format="dummy", dtype="float32", device="cpu",
                    attention_backend="torch"),
        CacheConfig(block_size=BS, num_blocks=128),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, prefill_grid=16)))
    assert core.block_manager.prefix_grid_blocks == 4
    report = warmup(core, WarmupConfig(decode_batch_sizes=(1, 3), num_output_tokens=2))
    assert report.completed
    core.check_no_leaks()
    core.add_request("r", list(range(10, 50)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    chunks = []
    while core.has_unfinished():
        out = core.scheduler.schedule()
        chunks.append([x.num_scheduled_tokens for x in out.scheduled])
        core.commit(out, core.runner.execute(out))
    assert chunks == [[16], [16], [8], [1]]
    core.check_no_leaks()


@pytest.mark.parametrize(("grid", "hit"), [(GRID, 16), (0, 20)])
def test_decode_worker_registers_the_landed_prompts_whole_chunks(grid: int, hit: int) -> None:
    s = _sched(grid=grid)
    seq = _seq("d", PROMPT, max_tokens=1)
    assert s.add_waiting_for_kv(seq)
    s.kv_landed("d", 7)  # the first token ends it at once: blocks freed, hashes kept
    assert seq.is_finished
    probe = _seq("p", [*PROMPT, 1])
    assert s.block_manager.allocate_prefix(probe) == hit
    s.block_manager.free(probe)
    s.block_manager.check_no_leaks()


def test_flag_reaches_every_worker_engine_through_up() -> None:
    from pdserve.cli import build_parser
    from pdserve.launcher import plan
    from protocol.settings import UpSettings, settings_from_args
    from workers.setup import engine_config_from_settings

    up = settings_from_args(build_parser({}).parse_args(
        ["up", "--prefill-grid", "64", "--num-decode", "2", "--insecure-control-plane"]))
    assert isinstance(up, UpSettings)
    workers = [settings_from_args(build_parser({}).parse_args(args))
               for name, args in plan(up, control_port=7777) if name != "gateway"]
    assert len(workers) == 3
    for child in workers:
        assert isinstance(child, WorkerSettings)
        assert engine_config_from_settings(child).scheduler.prefill_grid == 64
