"""Which tensor parallel rank's KV heads land on which rank of the peer, and the byte copies that move them
(no torch).

Each tensor parallel rank of a worker holds a slice of the model's KV heads in its own
`kv_buffer [num_layers, 2, num_blocks, block_size, H_rank, head_dim]`: with `total` KV heads over `size`
ranks, rank r holds heads `[r * total/size, (r+1) * total/size)` when `size` divides `total`, and the one
head `r // (size/total)` when `total` divides `size` (KV heads replicated; the engine's placement,
engine.models.tensor_parallel.shard_spec). `rank_kv_heads` gives that placement as (first head, count) per
rank; `head_slices` turns a prefill placement and a decode placement into `HeadSlice`s: every destination
head is written by exactly one source rank (a head held by several source ranks, i.e. replicated, is
written by one of them, chosen round-robin over the destination ranks to spread the writes).

`slice_pieces` gives one head slice's copies for one layer, (source byte offset, destination byte offset,
bytes) as runs.Piece: a block of one layer, K or V, is `[block_size, H, head_dim]` with heads inside each
token, so a slice of fewer heads than a side holds is strided on that side and costs one piece per token;
where both sides hold exactly the slice's heads (equal tensor parallel size) a piece covers a whole run of
adjacent blocks, as runs.direct_pieces.
"""

from __future__ import annotations

import msgspec

from kvtransfer.runs import JointRun, Piece
from kvtransfer.types import KVLayout

HeadRange = tuple[int, int]  # (first KV head of the whole model, number of heads)


class HeadSlice(msgspec.Struct, frozen=True):
    """`count` KV heads that source rank `src_rank` writes into destination rank `dst_rank`: its local
    heads `[src_head, src_head + count)` land on the destination's local heads `[dst_head, dst_head +
    count)` (local: indices into that rank's kv_buffer head axis)."""

    src_rank: int
    dst_rank: int
    src_head: int
    dst_head: int
    count: int


def rank_kv_heads(total_kv_heads: int, tp_size: int) -> tuple[HeadRange, ...]:
    """Each rank's (first head, count) of `total_kv_heads` KV heads split over `tp_size` ranks (the
    module docstring's placement). Raises ValueError when neither number divides the other, or one is < 1."""
    if total_kv_heads < 1 or tp_size < 1:
        raise ValueError(f"total_kv_heads {total_kv_heads} and tp_size {tp_size} must be >= 1")
    if total_kv_heads % tp_size == 0:
        per = total_kv_heads // tp_size
        return tuple((r * per, per) for r in range(tp_size))
    if tp_size % total_kv_heads == 0:
        return tuple((r // (tp_size // total_kv_heads), 1) for r in range(tp_size))
    raise ValueError(f"tp_size {tp_size} and total_kv_heads {total_kv_heads}: one must divide the other")


def placement_problem(ranges: tuple[HeadRange, ...], total_kv_heads: int) -> str:
    """Why `ranges` (one (first head, count) per rank) is not a placement of `total_kv_heads` heads: a
    range outside [0, total) or empty, or a head no rank holds; "" when it is one."""
    if not ranges:
        return "no ranks"
    for rank, (first, count) in enumerate(ranges):
        if count < 1 or first < 0 or first + count > total_kv_heads:
            return f"rank {rank} holds heads [{first}, {first + count}) outside [0, {total_kv_heads})"
    held = {h for first, count in ranges for h in range(first, first + count)}
    missing = sorted(set(range(total_kv_heads)) - held)
    if missing:
        return f"heads {missing[:8]} held by no rank"
    return ""


def head_slices(src: tuple[HeadRange, ...], dst: tuple[HeadRange, ...]) -> list[HeadSlice]:
    """The writes that fill every destination rank's heads from the source ranks: for each destination
    rank (in order) and each of its heads, the one source rank that writes it, merged into slices of
    heads adjacent on both ranks. A head held by several source ranks is written by
    holders[dst_rank % len(holders)]. Raises ValueError naming the heads no source rank holds."""
    holders: dict[int, list[int]] = {}
    for rank, (first, count) in enumerate(src):
        for h in range(first, first + count):
            holders.setdefault(h, []).append(rank)
    out: list[HeadSlice] = []
    missing: list[int] = []
    for d, (first, count) in enumerate(dst):
        for local in range(count):
            h = first + local
            ranks = holders.get(h)
            if not ranks:
                missing.append(h)
                continue
            s = ranks[d % len(ranks)]
            src_local = h - src[s][0]
            last = out[-1] if out else None
            if (last is not None and last.dst_rank == d and last.src_rank == s
                    and last.src_head + last.count == src_local and last.dst_head + last.count == local):
                out[-1] = HeadSlice(s, d, last.src_head, last.dst_head, last.count + 1)
            else:
                out.append(HeadSlice(s, d, src_local, local, 1))
    if missing:
        raise ValueError(f"destination heads {sorted(set(missing))[:8]} are held by no source rank")
    return out


def slice_pieces(src: KVLayout, dst: KVLayout, piece: HeadSlice, runs: list[JointRun],
                 layer: int) -> list[Piece]:
    """Copies of `layer`'s heads `piece` from the source tensor into the destination tensor (byte offsets
    from each tensor's start), K runs first, then V runs; `runs` pair source and destination blocks
    (runs.joint_runs). Adjacent copies (contiguous on both sides) are merged: a slice holding every head of
    both sides gives one piece per run (= runs.direct_pieces), a strided one one piece per token.

    Raises ValueError if the layouts differ in block_size, head_dim, dtype or layers, or the slice's heads
    are outside either layout."""
    for name in ("block_size", "head_dim", "dtype", "num_layers"):
        if getattr(src, name) != getattr(dst, name):
            raise ValueError(f"{name} differs: source {getattr(src, name)}, destination {getattr(dst, name)}")
    if not (piece.count > 0 and piece.src_head >= 0 and piece.dst_head >= 0
            and piece.src_head + piece.count <= src.num_kv_heads
            and piece.dst_head + piece.count <= dst.num_kv_heads):
        raise ValueError(f"{piece} outside source heads {src.num_kv_heads} / destination heads "
                         f"{dst.num_kv_heads}")
    item = src.itemsize
    width = piece.count * src.head_dim * item  # bytes of the slice in one token
    if piece.count == src.num_kv_heads == dst.num_kv_heads:  # whole blocks on both sides
        bb = src.block_bytes
        return [(src.offset(layer, kv, s), dst.offset(layer, kv, d), n * bb)
                for kv in (0, 1) for _, s, d, n in runs]
    s_tok, d_tok = src.strides[3] * item, dst.strides[3] * item
    s_head, d_head = piece.src_head * src.strides[4] * item, piece.dst_head * dst.strides[4] * item
    out: list[Piece] = []
    for kv in (0, 1):
        for _, s, d, n in runs:
            for b in range(n):
                s0, d0 = src.offset(layer, kv, s + b) + s_head, dst.offset(layer, kv, d + b) + d_head
                for t in range(src.block_size):
                    a, z = s0 + t * s_tok, d0 + t * d_tok
                    if out and out[-1][0] + out[-1][2] == a and out[-1][1] + out[-1][2] == z:
                        out[-1] = (out[-1][0], out[-1][1], out[-1][2] + width)
                    else:
                        out.append((a, z, width))
    return out
