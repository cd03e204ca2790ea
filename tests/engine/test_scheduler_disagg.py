"""Scheduler flows of disaggregation: a prefill-only engine keeps a request's blocks until the transfer
released them, a decode engine admits requests whose KV is landing (WAITING_FOR_KV), contiguous block
runs for the transfer, and a first token that arrives with the KV. Helpers shared with test_scheduler.py."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.config import CacheConfig, SchedulerConfig
from engine.scheduler import Scheduler
from engine.sequence import SequenceStatus
from tests.engine.test_scheduler import BS, EOS, _drain, _plan, _sched, _seq, _step


def test_prefill_only_keeps_blocks_until_release() -> None:
    s = _sched(budget=6, prefill_only=True)
    a = _seq("a", 10, max_tokens=50)
    s.add(a)
    _, done = _step(s)
    assert done == []
    _, done = _step(s, token=EOS)
    assert done == [a] and a.status is SequenceStatus.FINISHED_PREFILLED and a.output_token_ids == [EOS]
    assert len(a.block_table) == 3 and not s.has_unfinished()
    assert s.schedule().is_empty
    with pytest.raises(AssertionError):
        s.block_manager.check_no_leaks()
    s.release("a")
    assert s.get("a") is None and a.block_table == []
    with pytest.raises(KeyError, match="unknown request id"):
        s.release("a")
    s.block_manager.check_no_leaks()


def test_waiting_for_kv_flow_contiguous_then_decode() -> None:
    s = _sched(num_blocks=8)
    a = _seq("a", 9, max_tokens=3)
    assert s.add_waiting_for_kv(a)
    assert a.status is SequenceStatus.WAITING_FOR_KV and a.block_table == [0, 1, 2]
    assert s.schedule().is_empty and s.has_unfinished() and s.num_waiting_for_kv == 1
    assert s.kv_landed("a", 42) is a
    assert a.status is SequenceStatus.RUNNING and a.num_computed_tokens == 9 and a.output_token_ids == [42]
    out, _ = _step(s)
    assert _plan(out) == [("a", 1, True)] and a.num_computed_tokens == 10
    with pytest.raises(ValueError, match="not WAITING_FOR_KV"):
        s.kv_landed("a", 1)
    _drain(s)


def test_waiting_for_kv_falls_back_to_scattered_blocks_or_refuses() -> None:
    s = _sched(num_blocks=5)
    holder = _seq("h", 16, start=90)
    assert s.add_waiting_for_kv(holder)  # blocks 0..3
    s.abort("h")
    hole = [_seq(f"x{i}", 4, start=60 + 4 * i) for i in range(5)]
    for h in hole:
        assert s.add_waiting_for_kv(h)
    for i in (1, 3):
        s.abort(f"x{i}")
    a = _seq("a", 8)
    assert s.add_waiting_for_kv(a) and sorted(a.block_table) == [1, 3]  # no run of 2: scattered
    b = _seq("b", 4)
    assert not s.add_waiting_for_kv(b)  # nothing free: refused, untouched
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and s.get("b") is None
    assert all(s.abort(rid) for rid in ("x0", "x2", "x4", "a"))
    _drain(s)


def test_kv_landed_first_token_can_finish_at_once() -> None:
    s = _sched()
    one, eos = _seq("one", 5, max_tokens=1), _seq("eos", 5, max_tokens=9)
    assert s.add_waiting_for_kv(one) and s.add_waiting_for_kv(eos)
    assert s.kv_landed("one", 7).status is SequenceStatus.FINISHED_LENGTH
    assert s.kv_landed("eos", EOS).status is SequenceStatus.FINISHED_STOPPED
    assert one.block_table == [] and eos.block_table == []
    _drain(s)


def _landed(s, seq, token: int = 42) -> None:
    """``seq`` reserved (no reuse), its KV landed (first token ``token``), then aborted: its full prompt
    blocks stay cached."""
    assert s.add_waiting_for_kv(seq) and seq.num_cached_tokens == 0
    s.kv_landed(seq.request_id, token)
    s.abort(seq.request_id)


def test_decode_reserve_reuses_cached_prefix_blocks_only_the_rest_awaits_kv() -> None:
    s = _sched(num_blocks=16)
    first = _seq("t1", 10)  # blocks [0..3], [4..7] full, [8, 9] partial
    _landed(s, first)
    assert s.block_manager.num_free_blocks == 16
    second = _seq("t2", 15)  # the same first 10 tokens, then 5 more
    assert s.add_waiting_for_kv(second, reuse_prefix=True)
    assert second.num_cached_tokens == 8 and second.block_table[:2] == first_blocks(s, 2) == [0, 1]
    assert len(second.block_table) == 4 and second.status is SequenceStatus.WAITING_FOR_KV
    tail = second.block_table[2:]
    assert tail == list(range(tail[0], tail[0] + 2)) and not set(tail) & set(second.block_table[:2])
    s.kv_landed("t2", 42)
    assert second.num_computed_tokens == 15 and second.num_cached_tokens == 8
    _drain(s)


def first_blocks(s, n: int) -> list[int]:
    """The blocks holding tokens 10..10+4n of _seq's prompts (the prefix cache's hits for them)."""
    probe = _seq("probe", 4 * n + 1)
    got = s.block_manager.allocate_prefix(probe)
    assert got == 4 * n
    blocks = list(probe.block_table)
    s.block_manager.free(probe)
    return blocks


def test_decode_reserve_never_reuses_the_last_prompt_tokens_block_nor_without_reuse() -> None:
    s = _sched(num_blocks=16)
    _landed(s, _seq("a", 12))
    b = _seq("b", 12)
    assert s.add_waiting_for_kv(b, reuse_prefix=True)
    assert b.num_cached_tokens == 8  # block 2 holds the last prompt token: received again
    s.abort("b")
    c = _seq("c", 12)
    assert s.add_waiting_for_kv(c)  # reuse_prefix off: every block awaits KV
    assert c.num_cached_tokens == 0 and not set(c.block_table) & set(first_blocks(s, 2))
    s.abort("c")
    _drain(s)


def test_decode_reserve_rounds_a_hit_down_to_the_prefill_grid() -> None:
    bm = BlockManager(16, BS, prefix_grid_blocks=2)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, prefill_grid=8),
                  CacheConfig(block_size=BS, num_blocks=16), bm)
    _landed(s, _seq("a", 14))  # cacheable: the whole grid chunk [0, 8) only
    b = _seq("b", 20)
    assert s.add_waiting_for_kv(b, reuse_prefix=True)
    assert b.num_cached_tokens == 8
    s.abort("b")
    _landed(s, _seq("c", 17))  # chunks [0, 8), [8, 16) cacheable now
    d = _seq("d", 14)
    assert s.add_waiting_for_kv(d, reuse_prefix=True)
    assert d.num_cached_tokens == 8  # 3 blocks could match before the last token's: rounded to 2
    s.abort("d")
    _drain(s)


def test_decode_reserve_shares_cached_blocks_and_an_abort_drops_only_its_references() -> None:
    s = _sched(num_blocks=8)
    _landed(s, _seq("a", 9))
    b, c = _seq("b", 11), _seq("c", 10)
    assert s.add_waiting_for_kv(b, reuse_prefix=True) and s.add_waiting_for_kv(c, reuse_prefix=True)
    shared = b.block_table[:2]
    assert c.block_table[:2] == shared and b.num_cached_tokens == c.num_cached_tokens == 8
    blocks = s.block_manager._blocks
    assert [blocks[i].ref_count for i in shared] == [2, 2]
    s.abort("b")  # aborted while its KV was in flight: c still holds the shared blocks
    assert [blocks[i].ref_count for i in shared] == [1, 1]
    assert all(blocks[i].block_hash is not None for i in shared)
    s.kv_landed("c", 42)
    _drain(s)
    d = _seq("d", 12)
    assert s.add_waiting_for_kv(d, reuse_prefix=True) and d.block_table[:2] == shared
    s.abort("d")
    s.block_manager.check_no_leaks()


def test_decode_reserve_with_a_hit_refused_when_too_few_blocks_free_leaves_nothing_held() -> None:
    s = _sched(num_blocks=5)
    _landed(s, _seq("a", 9))  # blocks 0, 1 cached
    hold = _seq("h", 8, start=200)
    assert s.add_waiting_for_kv(hold) and hold.block_table == [2, 3]
    b = _seq("b", 16)  # 4 blocks: the 2 cached + 2 more, but only block 4 is free besides them
    assert not s.add_waiting_for_kv(b, reuse_prefix=True)
    assert b.block_table == [] and b.num_cached_tokens == 0 and b.status is SequenceStatus.WAITING
    assert s.block_manager.num_free_blocks == 3 and s.get("b") is None
    assert first_blocks(s, 2) == [0, 1]  # still cached
    s.abort("h")
    assert s.add_waiting_for_kv(b, reuse_prefix=True)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == [0, 1]
    s.abort("b")
    s.block_manager.check_no_leaks()
