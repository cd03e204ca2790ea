"""build_attention_metadata: the slot mapping of every new token, for decode rows (python loop) and long
queries (expanded a block at a time) mixed in one step, against the per-token formula."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.metadata import build_attention_metadata


def slots_by_token(tables: list[list[int]], computed: list[int], qlens: list[int],
                   block_size: int) -> list[int]:
    return [table[pos // block_size] * block_size + pos % block_size
            for table, c, q in zip(tables, computed, qlens, strict=True) for pos in range(c, c + q)]


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_slot_mapping_matches_the_per_token_formula(block_size: int) -> None:
    rng = random.Random(block_size)
    # decodes first, then chunks that start mid-block, at a block boundary, and a long fresh prompt,
    # with short and long queries interleaved so both ways of building the slots meet in one step
    specs = [(5, 1), (block_size * 3, 1), (0, 1), (block_size + 3, 40), (7, 2), (0, 1000),
             (2 * block_size, 31), (block_size * 4, 32), (1, 33)]
    tables, computed, qlens = [], [], []
    used = set()
    for c, q in specs:
        n = -(-(c + q) // block_size) + rng.randrange(3)  # tables may hold spare blocks at the end
        table = rng.sample([b for b in range(5000) if b not in used], n)
        used.update(table)
        tables.append(table)
        computed.append(c)
        qlens.append(q)
    meta = build_attention_metadata(tables, computed, qlens, block_size)
    want = slots_by_token(tables, computed, qlens, block_size)
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.slot_mapping.tolist() == want
    assert meta.num_decodes == 3 and meta.max_query_len == 1000


def test_slot_mapping_of_one_long_or_one_short_query() -> None:
    table = [9, 4, 7, 1]
    assert build_attention_metadata([table], [3], [60], 16).slot_mapping.tolist() == \
        slots_by_token([table], [3], [60], 16)
    assert build_attention_metadata([table], [17], [2], 16).slot_mapping.tolist() == [4 * 16 + 1, 4 * 16 + 2]
