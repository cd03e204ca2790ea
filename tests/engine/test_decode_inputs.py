"""StaticDecodeInputs (engine/decode_inputs.py): one staging copy per step, block-table rows re-sent only
when they changed, rows that move between steps, recovery after bad input. CPU only: the same code path
runs on CUDA with pinned staging (checked there by tests/engine/test_cuda_graphs.py's GPU tests)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.metadata import build_attention_metadata
from engine.decode_inputs import PAD_SLOT, StaticDecodeInputs

BS = 4
CPU = torch.device("cpu")


def _inputs(max_batch: int = 8, width: int = 6) -> StaticDecodeInputs:
    return StaticDecodeInputs(max_batch, width, BS, width * BS, CPU)


def _assert_step(inputs: StaticDecodeInputs, ids: list[int], pos: list[int], tables: list[list[int]],
                 bucket: int) -> None:
    """Rows [:n] equal build_attention_metadata's; padding rows [n:bucket] are padding."""
    n = len(ids)
    ref = build_attention_metadata(tables, pos, [1] * n, BS)
    meta = inputs.metadata(bucket)
    width = ref.block_tables.shape[1]
    assert torch.equal(meta.slot_mapping[:n], ref.slot_mapping)
    assert torch.equal(meta.seq_lens[:n], ref.seq_lens)
    for i, t in enumerate(tables):  # columns past a table's length are stale by design
        assert meta.block_tables[i, : len(t)].tolist() == t
    assert torch.equal(meta.block_tables[:n, :width] * (ref.block_tables != 0), ref.block_tables)
    assert inputs.input_ids[:n].tolist() == ids and inputs.position_ids[:n].tolist() == pos
    assert meta.slot_mapping[n:bucket].tolist() == [PAD_SLOT] * (bucket - n)
    assert meta.seq_lens[n:bucket].tolist() == [1] * (bucket - n)
    assert inputs.input_ids[n:bucket].tolist() == [0] * (bucket - n)
    assert inputs.position_ids[n:bucket].tolist() == [0] * (bucket - n)


def test_unchanged_rows_are_not_resent_grown_and_replaced_ones_are():
    inputs = _inputs()
    a, b, c = [1, 2], [3], [4, 5, 6]
    inputs.fill([7, 8, 9], [5, 2, 9], [a, b, c], 4)
    _assert_step(inputs, [7, 8, 9], [5, 2, 9], [a, b, c], 4)
    inputs.block_tables[:3] = 99  # a re-send would overwrite this
    inputs.fill([7, 8, 9], [6, 3, 10], [a, b, c], 4)
    assert inputs.block_tables[:3, 0].tolist() == [99, 99, 99]  # same lists, same lengths: not re-sent
    b.append(11)  # grown
    c2 = [12, 13, 14]  # same length, another list (e.g. freed and allocated again)
    inputs.fill([7, 8, 9], [7, 4, 11], [a, b, c2], 4)
    assert inputs.block_tables[0, 0].item() == 99
    assert inputs.block_tables[1, :2].tolist() == [3, 11] and inputs.block_tables[2, :3].tolist() == c2
    # slots come from the tables themselves (the host mirror), not from the device rows
    assert inputs.slot_mapping[:3].tolist() == [2 * BS + 3, 11 * BS + 0, 14 * BS + 3]


def test_rows_moving_between_steps_match_the_builder():
    """A sequence finishing shifts the later ones up a row; one re-admitted earlier shifts them down."""
    inputs = _inputs()
    a, b, c, d = [1], [2, 3], [4, 5, 6], [7]
    steps: list[list[list[int]]] = [[a, b, c, d], [b, c, d], [a, b, d], [d, a], [c, d, a, b]]
    for k, tables in enumerate(steps):
        tables[-1].append(20 + k)  # and one table grows in the same step
        pos = [len(t) * BS - 1 for t in tables]
        ids = list(range(len(tables)))
        inputs.fill(ids, pos, tables, 4)
        _assert_step(inputs, ids, pos, tables, 4)


def test_random_steps_against_builder_with_one_copy_per_step(monkeypatch):
    rng = random.Random(0)
    inputs = _inputs(max_batch=8, width=10)
    copies: list[int] = []
    real_copy = torch.Tensor.copy_

    def counting_copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        copies.append(1)
        return real_copy(self, src, non_blocking=non_blocking)

    live: list[list[int]] = []
    for _ in range(60):
        live = [t for t in live if rng.random() > 0.15]  # finishes
        for t in live:
            if rng.random() < 0.3 and len(t) < 10:
                t.append(rng.randrange(64))
        while len(live) < rng.randrange(1, 9):  # arrivals, at random places (re-admitted ones)
            table = [rng.randrange(64) for _ in range(rng.randrange(1, 10))]
            live.insert(rng.randrange(len(live) + 1), table)
        pos = [rng.randrange((len(t) - 1) * BS, len(t) * BS) for t in live]
        ids = [rng.randrange(1000) for _ in live]
        bucket = next(b for b in (1, 2, 4, 8) if b >= len(live))
        copies.clear()
        monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
        inputs.fill(ids, pos, live, bucket)
        monkeypatch.undo()
        assert len(copies) == 1  # one staging → device copy per step
        _assert_step(inputs, ids, pos, live, bucket)


def test_static_buffers_keep_their_addresses():
    inputs = _inputs()
    ptrs = [t.data_ptr() for t in (inputs.input_ids, inputs.position_ids, inputs.slot_mapping,
                                   inputs.seq_lens, inputs.block_tables, inputs.query_start_loc)]
    inputs.fill([1, 2], [0, 5], [[3], [4, 5]], 2)
    inputs.fill([1, 2, 3], [1, 6, 0], [[3], [4, 5], [6]], 4)
    assert ptrs == [t.data_ptr() for t in (inputs.input_ids, inputs.position_ids, inputs.slot_mapping,
                                           inputs.seq_lens, inputs.block_tables, inputs.query_start_loc)]
    assert (inputs.input_ids.dtype, inputs.seq_lens.dtype, inputs.block_tables.dtype) == (
        torch.int64, torch.int32, torch.int32)


def test_bad_input_changes_nothing_and_later_steps_recover():
    inputs = _inputs()
    a, b = [1, 2], [3]
    inputs.fill([7, 8], [5, 2], [a, b], 2)
    before = [t.clone() for t in (inputs.input_ids, inputs.slot_mapping, inputs.block_tables)]
    with pytest.raises(ValueError, match="sequence 1: position 24 outside"):
        inputs.fill([7, 8], [5, 24], [a, b], 2)
    with pytest.raises(ValueError, match="sequence 0: block_table of 1 blocks does not fit position 4"):
        inputs.fill([7, 8], [4, 2], [[9], b], 2)
    with pytest.raises(OverflowError):  # a block id beyond int64: fails in the mirror update
        inputs.fill([7, 8], [5, 2], [[40, 41], [1 << 70]], 2)
    assert all(torch.equal(x, y) for x, y in zip(
        before, (inputs.input_ids, inputs.slot_mapping, inputs.block_tables), strict=True))
    inputs.fill([7, 8], [5, 2], [a, b], 2)  # row 0 was rewritten in the mirror: must be re-sent
    _assert_step(inputs, [7, 8], [5, 2], [a, b], 2)
