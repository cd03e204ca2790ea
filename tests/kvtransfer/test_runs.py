"""Run merging and piece offsets (no torch in the code under test)."""

import torch

from kvtransfer.runs import layer_pieces, make_tag, merge_runs
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
