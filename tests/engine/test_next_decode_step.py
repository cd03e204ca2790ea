"""``Scheduler.next_decode_step`` (asynchronous scheduling's prediction; no torch): it equals what
``schedule`` returns after ``update`` when it answers at all, allocates the block a next token needs, and
answers None whenever the next step is not certain (waiting requests, a sequence left out, a length
limit reached, blocks short)."""

from __future__ import annotations

from engine.scheduler import Scheduler, SchedulerOutput
from tests.engine.test_scheduler import BS, _drain, _plan, _sched, _seq, _step


def _decoding(s: Scheduler, *lengths: int, max_tokens: int = 50) -> SchedulerOutput:
    """Sequences of ``lengths`` prompt tokens prefilled; returns their first decode step (not applied)."""
    for i, n in enumerate(lengths):
        s.add(_seq(f"r{i}", n, t=float(i), max_tokens=max_tokens, ignore_eos=True))
    _step(s)  # prefills (budget holds them all) → first tokens
    out = s.schedule()
    assert out.num_decodes == len(out.scheduled) == len(lengths)
    return out


def test_prediction_equals_the_next_schedule_and_allocates_at_block_ends() -> None:
    s = _sched()
    out = _decoding(s, BS - 1, 3, 2 * BS - 1)  # r0 and r2 need a new block for the token after next
    for _ in range(3 * BS):
        before = [len(x.seq.block_table) for x in out.scheduled]
        nxt = s.next_decode_step(out)
        assert nxt is not None
        for x, n in zip(out.scheduled, before, strict=True):  # room for num_computed_tokens + 2 tokens
            need = -(-(x.seq.num_computed_tokens + 2) // BS)
            assert len(x.seq.block_table) == max(n, need)
        s.update(out, {x.seq.request_id: 9 for x in out.scheduled})
        real = s.schedule()
        assert _plan(real) == _plan(nxt) and real.num_decodes == nxt.num_decodes
        out = real
    s.update(out, {x.seq.request_id: 9 for x in out.scheduled})
    _drain(s)


def test_none_when_the_next_step_is_not_certain() -> None:
    s = _sched()
    out = _decoding(s, 3, 4)
    s.add(_seq("late", 2, t=9.0))
    assert s.next_decode_step(out) is None  # a waiting request would be admitted
    s.abort("late")
    part = SchedulerOutput(out.scheduled[:1], 1)
    assert s.next_decode_step(part) is None  # r1 runs but is not in the step
    assert s.next_decode_step(out) is not None
    s.update(out, {x.seq.request_id: 9 for x in out.scheduled})
    _drain(s)


def test_none_at_max_tokens_and_when_blocks_are_short() -> None:
    s = _sched()
    out = _decoding(s, 3, max_tokens=2)  # the token of this step is the last one
    assert s.next_decode_step(out) is None
    s.update(out, {x.seq.request_id: 9 for x in out.scheduled})
    _drain(s)

    s = _sched(num_blocks=2)
    out = _decoding(s, BS - 1, BS - 1)  # each fills its one block: the next token needs a third block
    assert s.next_decode_step(out) is None
    assert s.block_manager.num_free_blocks == 0
    s.update(out, {x.seq.request_id: 9 for x in out.scheduled})
    _drain(s)
