"""Scheduler: budget, chunking, decode-first, preemption, prefill-only, WAITING_FOR_KV; all leak-checked."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.config import CacheConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus

BS = 4
EOS = 2


def _sched(num_blocks: int = 32, budget: int = 64, max_seqs: int = 8, chunked: bool = True,
           prefill_only: bool = False, caching: bool = True) -> Scheduler:
    cache = CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=caching)
    bm = BlockManager(num_blocks, BS, caching)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          enable_chunked_prefill=chunked)
    return Scheduler(cfg, cache, bm, prefill_only=prefill_only)


def _seq(rid: str, n: int, t: float = 0.0, start: int = 10, **params: object) -> Sequence:
    return Sequence(rid, list(range(start, start + n)), SamplingParams(**params), t, eos_token_ids=(EOS,))  # type: ignore[arg-type]


def _add(s: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        s.add(seq)


def _step(s: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[Sequence]]:
    out = s.schedule()
    sampled = {x.seq.request_id: token for x in out.scheduled if x.samples}
    return out, s.update(out, sampled)


def _plan(out: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(x.seq.request_id, x.num_scheduled_tokens, x.samples) for x in out.scheduled]


def _drain(s: Scheduler) -> None:
    for _ in range(200):
        if s.has_unfinished():
            _step(s)
    assert not s.has_unfinished()
    s.block_manager.check_no_leaks()


def test_chunked_prefill_splits_prompt_to_budget_then_decodes() -> None:
    s = _sched(budget=8)
    s.add(_seq("a", 20, max_tokens=3))
    out, _ = _step(s)
    assert _plan(out) == [("a", 8, False)] and out.num_batched_tokens == 8
    out, _ = _step(s)
    assert _plan(out) == [("a", 8, False)]
    out, _ = _step(s)
    assert _plan(out) == [("a", 4, True)]  # last chunk samples the first token
    seq = out.scheduled[0].seq
    assert seq.num_computed_tokens == 20 and seq.output_token_ids == [7]
    out, _ = _step(s)
    assert _plan(out) == [("a", 1, True)] and out.num_decodes == 1
    out, done = _step(s)
    assert done == [seq] and seq.status is SequenceStatus.FINISHED_LENGTH and seq.num_output_tokens == 3
    _drain(s)


def test_decodes_come_first_and_share_budget_with_prefills() -> None:
    s = _sched(budget=10)
    s.add(_seq("a", 5, t=0.0, max_tokens=5))
    _step(s)  # a prefilled, now decoding
    s.add(_seq("b", 30, t=1.0, max_tokens=2))
    out, _ = _step(s)
    assert _plan(out) == [("a", 1, True), ("b", 9, False)]
    assert out.num_decodes == 1 and out.num_batched_tokens == 10
    _drain(s)


def test_without_chunking_a_prompt_that_does_not_fit_waits() -> None:
    s = _sched(budget=10, chunked=False)
    _add(s, _seq("a", 5, t=0.0, max_tokens=4), _seq("b", 8, t=1.0, max_tokens=1, start=80))
    out, _ = _step(s)
    assert _plan(out) == [("a", 5, True)]  # b (8) does not fit in the remaining 5
    out, _ = _step(s)
    assert _plan(out) == [("a", 1, True), ("b", 8, True)]
    with pytest.raises(ValueError, match="chunked prefill is off"):
        s.add(_seq("c", 11))
    _drain(s)


def test_max_num_seqs_limits_admission() -> None:
    s = _sched(max_seqs=2)
    for i in range(3):
        s.add(_seq(f"r{i}", 3, t=float(i), max_tokens=2))
    out, _ = _step(s)
    assert [x.seq.request_id for x in out.scheduled] == ["r0", "r1"]
    out, _ = _step(s)  # r0, r1 finish (max_tokens=2) at this step
    assert [x.seq.request_id for x in out.scheduled] == ["r0", "r1"]
    assert _plan(_step(s)[0]) == [("r2", 3, True)]
    _drain(s)


def test_prefix_cache_hit_on_admission_skips_cached_blocks() -> None:
    s = _sched()
    s.add(_seq("a", 10, max_tokens=1))
    _drain(s)
    b = _seq("b", 10, max_tokens=1)  # same prompt
    s.add(b)
    out, _ = _step(s)
    assert b.num_cached_tokens == 8
    assert _plan(out) == [("b", 2, True)]
    c = _seq("c", 8, max_tokens=1)  # prompt = exactly the cached 8 tokens: still computes one block's worth
    s.add(c)
    out, _ = _step(s)
    assert c.num_cached_tokens == 4 and _plan(out) == [("c", 4, True)]
    _drain(s)


def test_stop_conditions() -> None:
    s = _sched()
    s.add(_seq("eos", 3, t=0.0, max_tokens=9))
    s.add(_seq("ign", 3, t=1.0, max_tokens=2, ignore_eos=True))
    s.add(_seq("min", 3, t=2.0, max_tokens=9, min_tokens=2))
    s.add(_seq("stop", 3, t=3.0, max_tokens=9, stop_token_ids=(5,)))
    out = s.schedule()
    done = s.update(out, {"eos": EOS, "ign": EOS, "min": EOS, "stop": 5})
    assert {d.request_id: d.status for d in done} == {
        "eos": SequenceStatus.FINISHED_STOPPED, "stop": SequenceStatus.FINISHED_STOPPED}
    out = s.schedule()
    done = s.update(out, {"ign": EOS, "min": EOS})
    assert {d.request_id: d.status for d in done} == {
        "ign": SequenceStatus.FINISHED_LENGTH, "min": SequenceStatus.FINISHED_STOPPED}
    _drain(s)


def test_any_of_several_eos_ids_stops() -> None:
    s = _sched()
    for rid in ("first", "second", "other"):
        s.add(Sequence(rid, [10, 11, 12], SamplingParams(max_tokens=9), 0.0, eos_token_ids=(40, 41)))
    out = s.schedule()
    done = s.update(out, {"first": 40, "second": 41, "other": 42})
    assert {d.request_id: d.status for d in done} == {
        "first": SequenceStatus.FINISHED_STOPPED, "second": SequenceStatus.FINISHED_STOPPED}
    _drain(s)


def test_max_model_len_finishes_with_length() -> None:
    bm = BlockManager(8, BS)
    s = Scheduler(SchedulerConfig(), CacheConfig(block_size=BS, num_blocks=8), bm, max_model_len=6)
    seq = _seq("a", 4, max_tokens=100)
    s.add(seq)
    _step(s)
    _, done = _step(s)
    assert done == [seq] and seq.num_tokens == 6 and seq.status is SequenceStatus.FINISHED_LENGTH
    with pytest.raises(ValueError, match="max_model_len=6"):
        s.add(_seq("b", 6))
    _drain(s)


def test_add_rejects_bad_sequences_and_leaves_nothing() -> None:
    s = _sched(num_blocks=4)  # 16 tokens of cache
    with pytest.raises(ValueError, match="prompt of 16 tokens does not fit"):
        s.add(_seq("long", 16))
    s.add(_seq("a", 3))
    with pytest.raises(ValueError, match="already in the scheduler"):
        s.add(_seq("a", 3))
    assert len(s.waiting) == 1
    _drain(s)


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_by_recompute_and_readmission(caching: bool) -> None:
    s = _sched(num_blocks=4, budget=64, caching=caching)  # 16 tokens of cache
    a, b = _seq("a", 7, t=0.0, max_tokens=6), _seq("b", 7, t=1.0, max_tokens=6, start=50)
    _add(s, a, b)
    out, _ = _step(s)  # both prefilled: 2 blocks each, all 4 used; each has 8 tokens now
    assert _plan(out) == [("a", 7, True), ("b", 7, True)]
    out, _ = _step(s)  # both decode token 8 into their 2nd block (still fits)
    assert out.preempted == ()
    out, _ = _step(s)  # token 9 needs a 3rd block for a: b (latest arrival) is preempted
    assert out.preempted == ("b",) and _plan(out) == [("a", 1, True)]
    assert b.status is SequenceStatus.PREEMPTED and b.block_table == [] and b.num_computed_tokens == 0
    assert s.waiting[0] is b and b.output_token_ids == [7, 7]
    while a.status is SequenceStatus.RUNNING:
        _step(s)
    out, _ = _step(s)  # b readmitted: recomputes prompt + its outputs so far (7 + 2 = 9 tokens)
    # with prefix caching, b's first full block survived a's eviction (tail blocks are evicted first)
    assert b.num_cached_tokens == (4 if caching else 0)
    assert _plan(out) == [("b", 9 - b.num_cached_tokens, True)] and b.num_output_tokens == 3
    _drain(s)
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6


def test_preempts_itself_when_it_is_the_latest() -> None:
    s = _sched(num_blocks=3, budget=64)
    a, b = _seq("a", 4, t=0.0, max_tokens=3), _seq("b", 3, t=1.0, max_tokens=9, start=40)
    _add(s, a, b)
    _step(s)  # a: 1 block (4 tokens) + sampled 5th; b: 1 block
    out, _ = _step(s)  # a needs a 2nd block: 1 free → ok; b decodes in its block
    assert out.preempted == ()
    _step(s)  # a: 6th token fits; b's 5th token needs a block, none free → b preempts itself
    assert b.status is SequenceStatus.PREEMPTED
    _drain(s)


def test_update_missing_sample_raises_before_any_change() -> None:
    s = _sched()
    a = _seq("a", 3)
    s.add(a)
    out = s.schedule()
    with pytest.raises(KeyError, match="no sampled token"):
        s.update(out, {})
    assert a.num_computed_tokens == 0 and a.output_token_ids == []
    s.update(out, {"a": 7})
    assert a.num_computed_tokens == 3
    _drain(s)


def test_abort_in_every_state() -> None:
    s = _sched(num_blocks=4, prefill_only=False)
    w = _seq("w", 3, t=5.0)
    s.add(w)
    assert s.abort("w") is w and w.status is SequenceStatus.FINISHED_ABORTED and not s.waiting
    r = _seq("r", 3, t=0.0, max_tokens=20)
    s.add(r)
    _step(s)
    out = s.schedule()
    assert s.abort("r") is r and r.block_table == []
    assert s.update(out, {"r": 7}) == []  # aborted between schedule and update: skipped
    k = _seq("k", 3)
    assert s.add_waiting_for_kv(k)
    s.abort("k")
    assert k.status is SequenceStatus.FINISHED_ABORTED and k.block_table == []
    assert s.abort("nope") is None
    _drain(s)


def test_abort_preempted_and_prefilled() -> None:
    s = _sched(num_blocks=4)
    s.add(_seq("a", 7, t=0.0, max_tokens=6))
    b = _seq("b", 7, t=1.0, max_tokens=6, start=50)
    s.add(b)
    for _ in range(3):
        _step(s)
    assert b.status is SequenceStatus.PREEMPTED
    s.abort("b")
    assert b.status is SequenceStatus.FINISHED_ABORTED and b not in s.waiting
    _drain(s)
    p = _sched(prefill_only=True)
    c = _seq("c", 5)
    p.add(c)
    _step(p)
    assert c.status is SequenceStatus.FINISHED_PREFILLED
    p.abort("c")
    assert c.status is SequenceStatus.FINISHED_ABORTED and p.get("c") is None
    p.block_manager.check_no_leaks()


def test_recompute_longer_than_budget_is_chunked_even_without_chunked_prefill() -> None:
    # Bug found in review: a preempted sequence whose prompt + outputs exceeded the budget never readmitted.
    s = _sched(num_blocks=3, budget=4, chunked=False, caching=False)
    a, b = _seq("a", 3, t=0.0, max_tokens=9), _seq("b", 1, t=1.0, max_tokens=9, start=40)
    _add(s, a, b)
    for _ in range(10):
        if b.status is not SequenceStatus.PREEMPTED:
            _step(s)
    assert b.status is SequenceStatus.PREEMPTED and b.num_tokens > 4
    plans = [_plan(_step(s)[0]) for _ in range(12)]
    assert all(n <= 4 for plan in plans for _, n, _ in plan)
    assert b.status is SequenceStatus.FINISHED_LENGTH and b.num_output_tokens == 9
    _drain(s)
