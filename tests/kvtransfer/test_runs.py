"""Run merging and piece offsets (no torch in the code under test)."""

import torch

from kvtransfer.runs import direct_pieces, joint_runs, layer_pieces, make_tag, merge_runs, source_cuts
from kvtransfer.staging import gather_layer, layout_of, staging_view


def test_merge_runs_adjacent_and_scattered():
    assert merge_runs([4, 5, 6, 9, 10, 2]) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert merge_runs([7]) == [(0, 7, 1)]
    assert merge_runs([3, 2, 1]) == [(0, 3, 1), (1, 2, 1), (2, 1, 1)]


def test_contiguous_allocation_is_two_pieces_per_layer():
    kv = torch.zeros(3, 2, 16, 4, 2, 8, dtype=torch.float16)
    layout = layout_of(kv)
    pieces = layer_pieces(layout, tuple(range(5, 13)), 1)
    bb = 4 * 2 * 8 * 2
    assert pieces == [(0, layout.offset(1, 0, 5), 8 * bb), (8 * bb, layout.offset(1, 1, 5), 8 * bb)]


def test_pieces_copy_staging_into_the_right_blocks():
    """Apply pieces by hand as a transport would and compare with direct block assignment."""
    src = torch.randn(3, 2, 16, 4, 2, 8)
    dst = torch.zeros_like(src)
    src_ids, dst_ids = [1, 9, 3, 4, 0], [6, 7, 8, 2, 11]
    staging = torch.empty(10_000, dtype=torch.uint8)
    view = staging_view(staging, src, len(src_ids))
    gather_layer(src, 2, torch.tensor(src_ids), view)
    dst_bytes = dst.view(-1).view(torch.uint8)
    pieces = layer_pieces(layout_of(dst), tuple(dst_ids), 2)
    assert len(pieces) == 6  # runs (6,7,8), (2), (11) for K and V
    for s, d, n in pieces:
        dst_bytes[d:d + n] = staging[s:s + n]
    assert torch.equal(dst[2][:, dst_ids], src[2][:, src_ids])
    assert dst[:2].abs().sum() == 0 and dst[2][:, [1, 3, 4, 5]].abs().sum() == 0


def test_bad_inputs_are_named():
    layout = layout_of(torch.zeros(2, 2, 4, 2, 1, 4))
    for bad, word in ((lambda: layer_pieces(layout, (0, 4), 0), "block ids"),
                      (lambda: layer_pieces(layout, (0,), 2), "layer"),
                      (lambda: make_tag(1, 5000), "layer"),
                      (lambda: layout_of(torch.zeros(2, 3, 4, 2, 1, 4)), "kv_buffer")):
        try:
            bad()
        except ValueError as exc:
            assert word in str(exc)
        else:
            raise AssertionError(f"no ValueError for {word}")
    assert make_tag(1, 3) == (1 << 32) | (3 << 20)


def test_joint_runs_split_where_source_or_destination_breaks():
    # source runs 3..5 | 9..10, destination runs 20..21 | 7..9: joint ranges at positions 0, 2, 3
    assert source_cuts([3, 4, 5, 9, 10]) == (3,)
    assert joint_runs([3, 4, 5, 9, 10], [20, 21, 7, 8, 9]) == [(0, 3, 20, 2), (2, 5, 7, 1), (3, 9, 8, 2)]
    assert joint_runs(list(range(8)), list(range(30, 38))) == [(0, 0, 30, 8)]  # one piece for K, one for V
    assert joint_runs([5, 3, 1], [0, 1, 2]) == [(0, 5, 0, 1), (1, 3, 1, 1), (2, 1, 2, 1)]
    try:
        joint_runs([1, 2], [3])
    except ValueError as exc:
        assert "2 source blocks for 1" in str(exc)
    else:
        raise AssertionError("no ValueError for a length mismatch")


def test_direct_pieces_copy_source_blocks_and_match_receiver_pieces():
    """Apply direct pieces by hand (source → destination bytes) and compare with block assignment;
    the receiver's layer_pieces with the source cuts yields the same destination ranges in order."""
    src = torch.randn(3, 2, 16, 4, 2, 8)
    dst = torch.zeros(3, 2, 20, 4, 2, 8)
    src_ids, dst_ids = [4, 5, 6, 11, 12, 0], [17, 18, 2, 3, 4, 9]
    runs = joint_runs(src_ids, dst_ids)
    assert len(runs) == 4  # (4,5)->(17,18), (6)->(2), (11,12)->(3,4), (0)->(9)
    pieces = direct_pieces(layout_of(src), layout_of(dst), runs, 1)
    src_bytes, dst_bytes = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
    for s, d, n in pieces:
        dst_bytes[d:d + n] = src_bytes[s:s + n]
    assert torch.equal(dst[1][:, dst_ids], src[1][:, src_ids])
    assert dst[0].abs().sum() == 0 and dst[2].abs().sum() == 0
    receiver = layer_pieces(layout_of(dst), tuple(dst_ids), 1, source_cuts(src_ids))
    assert [(d, n) for _, d, n in receiver] == [(d, n) for _, d, n in pieces]
    other = layout_of(torch.zeros(3, 2, 20, 8, 2, 8))  # another block size
    try:
        direct_pieces(layout_of(src), other, runs, 0)
    except ValueError as exc:
        assert "block bytes" in str(exc)
    else:
        raise AssertionError("no ValueError for differing block sizes")
