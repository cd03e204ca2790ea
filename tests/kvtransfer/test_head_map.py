"""KV head placement across tensor parallel ranks, the pairing check over it, and head-slice copies
checked byte for byte against slicing the whole model's KV with torch."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.compat import KVCompat, kv_compat, mismatches
from kvtransfer.head_map import HeadSlice, head_slices, placement_problem, rank_kv_heads, slice_pieces
from kvtransfer.runs import joint_runs
from kvtransfer.staging import layout_of

LAYERS, BLOCKS, BS, DIM = 3, 12, 4, 8


def test_rank_kv_heads_split_and_replicated():
    assert rank_kv_heads(4, 1) == ((0, 4),)
    assert rank_kv_heads(4, 2) == ((0, 2), (2, 2))
    assert rank_kv_heads(2, 4) == ((0, 1), (0, 1), (1, 1), (1, 1))  # replicated: ranks 0,1 hold head 0
    with pytest.raises(ValueError, match="tp_size 3 and total_kv_heads 4"):
        rank_kv_heads(4, 3)


def test_head_slices_one_writer_per_destination_head():
    # P TP=2 -> D TP=1: both halves land in one head axis
    assert head_slices(rank_kv_heads(4, 2), rank_kv_heads(4, 1)) == [
        HeadSlice(0, 0, 0, 0, 2), HeadSlice(1, 0, 0, 2, 2)]
    # P TP=1 -> D TP=2: one source rank writes both destination ranks
    assert head_slices(rank_kv_heads(4, 1), rank_kv_heads(4, 2)) == [
        HeadSlice(0, 0, 0, 0, 2), HeadSlice(0, 1, 2, 0, 2)]
    # equal TP: rank to rank, whole blocks
    assert head_slices(rank_kv_heads(4, 2), rank_kv_heads(4, 2)) == [
        HeadSlice(0, 0, 0, 0, 2), HeadSlice(1, 1, 0, 0, 2)]
    # replicated source heads: one writer each, spread over the replicas
    four = head_slices(rank_kv_heads(2, 4), rank_kv_heads(2, 1))
    assert four == [HeadSlice(0, 0, 0, 0, 1), HeadSlice(2, 0, 0, 1, 1)]
    spread = head_slices(rank_kv_heads(2, 4), rank_kv_heads(2, 4))
    assert [(s.src_rank, s.dst_rank) for s in spread] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    with pytest.raises(ValueError, match=r"destination heads \[2, 3\] are held by no source rank"):
        head_slices(((0, 2),), ((0, 2), (2, 2)))


def test_placement_problem_names_it():
    assert placement_problem(rank_kv_heads(4, 2), 4) == ""
    assert "heads [2, 3] held by no rank" in placement_problem(((0, 2), (0, 2)), 4)
    assert "rank 1 holds heads [3, 5)" in placement_problem(((0, 2), (3, 2)), 4)


def record(tp_size: int, tp_rank: int = 0, total: int = 4, backend: str = "nixl") -> KVCompat:
    heads = rank_kv_heads(total, tp_size)[tp_rank][1]
    kv = torch.zeros(LAYERS, 2, BLOCKS, BS, heads, DIM)
    return kv_compat("m", backend, layout_of(kv), tp_size, tp_rank, total_kv_heads=total)


@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4)])
def test_mappable_tensor_parallel_pairs_pass(p: int, d: int):
    for rank in range(p):
        assert mismatches(record(p, rank), record(d)) == []


def test_replicated_heads_pair_and_equal_tp_records():
    assert mismatches(record(4, 3, total=2), record(1, total=2)) == []
    assert mismatches(record(4, 1, total=2), record(2, 1, total=2)) == []
    assert record(4, 3, total=2).rank_kv_heads == ((0, 1), (0, 1), (1, 1), (1, 1))


def test_unmappable_pairs_are_named():
    # the models' KV heads differ: named with both sides' tensor parallel shapes
    bad = mismatches(record(2, total=4), record(1, total=2))
    assert bad == ["total_kv_heads 4 != 2 (prefill tp_size 2 heads [(0, 2), (2, 2)], "
                   "decode tp_size 1 heads [(0, 2)])"]
    # a placement no rank of the sender can fill (a record of another placement scheme)
    odd = KVCompat(**{**_fields(record(2)), "rank_kv_heads": ((0, 2), (0, 2))})
    (msg,) = mismatches(odd, record(1))
    assert msg.startswith("prefill head placement unusable: heads [2, 3] held by no rank")
    # a rank whose blocks are not dense [block_size, heads, head_dim]
    strided = KVCompat(**{**_fields(record(1)), "block_strides": (999, 32, 8, 1)})
    (msg,) = mismatches(record(2), strided)
    assert msg.startswith("decode head placement unusable: block_strides (999, 32, 8, 1) are not dense")
    # a two-sided backend writes whole blocks: different placements refused, equal ones pass
    (msg,) = mismatches(record(2, backend="ucx"), record(1, backend="ucx"))
    assert msg.startswith("transfer_backend 'ucx' writes whole blocks only")
    assert mismatches(record(2, 1, backend="ucx"), record(2, 1, backend="ucx")) == []
    # other fields still named as before, the tensor parallel ones are not compared for equality
    other = KVCompat(**{**_fields(record(2)), "dtype": "float16"})
    assert mismatches(other, record(1)) == ["dtype 'float16' != 'float32'"]


def test_records_by_hand_compare_heads_as_before():
    a = KVCompat(model_id="m", dtype="bfloat16", block_size=4, num_kv_heads=2)
    b = KVCompat(model_id="m", dtype="bfloat16", block_size=4, num_kv_heads=4)
    assert mismatches(a, b) == ["num_kv_heads 2 != 4"]
    assert mismatches(a, a) == []


def test_kv_compat_refuses_a_shard_that_is_not_the_ranks_share():
    kv = torch.zeros(LAYERS, 2, BLOCKS, BS, 2, DIM)
    with pytest.raises(ValueError, match="rank 1 of 2 holds 4 of 8 KV heads, but its kv_buffer has 2"):
        kv_compat("m", "nixl", layout_of(kv), 2, 1, total_kv_heads=8)


def _fields(rec: KVCompat) -> dict[str, object]:
    return {name: getattr(rec, name) for name in KVCompat.__struct_fields__}


def shard(whole: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """One rank's kv_buffer: heads [first, first + count) of the whole model's, contiguous."""
    return whole[:, :, :, :, first:first + count].contiguous()


@pytest.mark.parametrize(("p", "d", "total"), [(2, 1, 4), (1, 2, 4), (2, 2, 4), (4, 2, 4), (2, 4, 4),
                                               (4, 1, 2), (1, 4, 2)])
def test_slice_pieces_reproduce_the_destination_shards(p: int, d: int, total: int):
    """Every prefill rank holds its shard of one random whole-model KV; applying every slice's pieces as a
    one-sided transport would (byte copies) must leave each decode rank's blocks equal to its shard of
    the same whole KV, and touch no other block."""
    g = torch.Generator().manual_seed(p * 10 + d)
    whole = torch.randn(LAYERS, 2, BLOCKS, BS, total, DIM, generator=g)
    src_place, dst_place = rank_kv_heads(total, p), rank_kv_heads(total, d)
    srcs = [shard(whole, *r) for r in src_place]
    dsts = [torch.zeros_like(shard(whole, *r)) for r in dst_place]
    src_ids, dst_ids = [3, 4, 5, 9, 0], [7, 8, 1, 2, 11]
    runs = joint_runs(src_ids, dst_ids)
    for sl in head_slices(src_place, dst_place):
        src_bytes = srcs[sl.src_rank].view(-1).view(torch.uint8)
        dst_bytes = dsts[sl.dst_rank].view(-1).view(torch.uint8)
        for layer in range(LAYERS):
            for s, t, n in slice_pieces(layout_of(srcs[sl.src_rank]), layout_of(dsts[sl.dst_rank]), sl, runs,
                                        layer):
                dst_bytes[t:t + n] = src_bytes[s:s + n]
    untouched = [b for b in range(BLOCKS) if b not in dst_ids]
    for rank, (first, count) in enumerate(dst_place):
        want = shard(whole, first, count)
        assert torch.equal(dsts[rank][:, :, dst_ids], want[:, :, src_ids])
        assert dsts[rank][:, :, untouched].abs().sum() == 0


def test_slice_pieces_merge_where_contiguous():
    whole = torch.zeros(LAYERS, 2, BLOCKS, BS, 4, DIM)
    runs = joint_runs([2, 3, 4], [5, 6, 7])  # one run of three blocks
    one, half = layout_of(whole), layout_of(shard(whole, 0, 2))
    # equal placements: whole blocks, one piece per run for K and for V
    same = slice_pieces(half, half, HeadSlice(0, 0, 0, 0, 2), runs, 1)
    assert same == [(half.offset(1, kv, 2), half.offset(1, kv, 5), 3 * half.block_bytes) for kv in (0, 1)]
    # half the heads into a whole head axis: strided on the destination, one piece per token
    strided = slice_pieces(half, one, HeadSlice(1, 0, 0, 2, 2), runs, 1)
    assert len(strided) == 2 * 3 * BS and {n for _, _, n in strided} == {2 * DIM * 4}
    assert strided[0] == (half.offset(1, 0, 2), one.offset(1, 0, 5) + 2 * DIM * 4, 2 * DIM * 4)
    with pytest.raises(ValueError, match="outside source heads 2"):
        slice_pieces(half, one, HeadSlice(0, 0, 1, 0, 2), runs, 0)
    with pytest.raises(ValueError, match="block_size differs"):
        wide = layout_of(torch.zeros(LAYERS, 2, BLOCKS, 2 * BS, 4, DIM))
        slice_pieces(half, wide, HeadSlice(0, 0, 0, 0, 2), runs, 0)
