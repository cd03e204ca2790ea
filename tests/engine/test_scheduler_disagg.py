"""Scheduler flows of disaggregation: a prefill-only engine keeps a request's blocks until the transfer
released them, a decode engine admits requests whose KV is landing (WAITING_FOR_KV), contiguous block
runs for the transfer, and a first token that arrives with the KV. Helpers shared with test_scheduler.py."""

from __future__ import annotations

import pytest

from engine.sequence import SequenceStatus
from tests.engine.test_scheduler import EOS, _drain, _plan, _sched, _seq, _step


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
