"""Turn a request-layer's destination blocks into few large copies (no torch).

Each descriptor costs ~7 µs (docs: /work/shared/facts.md), so per-block copies run ~60× below the link.
The sender gathers a request-layer's blocks into one contiguous staging buffer laid out
`[2 (K, V), n, block_size, num_kv_heads, head_dim]`; destination block ids that are adjacent
(b, b+1, ...) in token order are merged into runs, and each run becomes one piece for K and one for V.
A contiguous allocation (BlockManager.allocate_contiguous) therefore costs exactly two pieces per
layer; a scattered one costs two per run (we chose "one descriptor per run" over a receiver staging
area + scatter: no extra copy and no receiver staging memory, at a cost that only grows with
fragmentation).
"""

from __future__ import annotations

from kvtransfer.types import KVLayout

Piece = tuple[int, int, int]  # (staging byte offset, destination byte offset, bytes)


def merge_runs(block_ids: tuple[int, ...] | list[int]) -> list[tuple[int, int, int]]:
    """Runs of adjacent destination blocks as (position in block_ids, first block id, length)."""
    runs: list[tuple[int, int, int]] = []
    for pos, block in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((pos, block, 1))
    return runs


def layer_pieces(layout: KVLayout, block_ids: tuple[int, ...], layer: int) -> list[Piece]:
    """Copies that move a staging buffer of `block_ids` into `layer` of the destination tensor.

    Raises ValueError if a block id or the layer is out of range of `layout`.
    """
    if not 0 <= layer < layout.num_layers:
        raise ValueError(f"layer {layer} out of range [0, {layout.num_layers})")
    bad = [b for b in block_ids if not 0 <= b < layout.num_blocks]
    if bad:
        raise ValueError(f"block ids {bad[:8]} out of range [0, {layout.num_blocks})")
    n, bb = len(block_ids), layout.block_bytes
    pieces: list[Piece] = []
    for kv in (0, 1):
        for pos, first, length in merge_runs(block_ids):
            pieces.append(((kv * n + pos) * bb, layout.offset(layer, kv, first), length * bb))
    return pieces


def make_tag(key: int, layer: int) -> int:
    """64-bit tag base of a request-layer (two-sided transports): key<<32 | layer<<20; pieces add 0..2^20."""
    if not 0 <= layer < 4096:
        raise ValueError(f"layer {layer} does not fit the tag (max 4095)")
    return ((key & 0xFFFFFFFF) << 32) | (layer << 20)
