"""Pairing compatibility: what must match for a prefill worker to write KV into a decode worker (no torch).

One record, `KVCompat`, and one check, `mismatches`, used in both places a pair is judged:

- the gateway, when it pairs registered workers (`protocol.messages.RegisterWorker.compat`,
  `gateway.registry.pairing_mismatch`): an incompatible pair is never chosen, and a request that only
  such pairs could serve gets a 503 naming each mismatch;
- the KV handshake (wire.Hello carries the sender's record, the receiver answers the mismatches in its
  HelloReply): a sender refused there raises `IncompatiblePeerError` naming them.

Model, dtype, block size, layout order, layers, head_dim, the model's KV heads, backend, protocol and
prefill grid must be equal: dtype conversion and layout transposition are not supported, so a pair that
differs is refused instead of receiving garbage. The tensor parallel shapes may differ: each record
carries its worker's head placement (`rank_kv_heads`, head_map.py), and a pair is refused only when the
placements cannot be mapped (a head no source rank holds, an invalid placement, a rank's blocks not dense
in (token, head, dim)) or when the backend cannot write head slices (a two-sided backend reproduces
whole-block receives: it pairs equal placements only). This module imports only msgspec and torch-free
kvtransfer modules (the gateway, which has no torch, imports it).
"""

from __future__ import annotations

import msgspec

from kvtransfer.head_map import HeadRange, head_slices, placement_problem, rank_kv_heads
from kvtransfer.types import PROTOCOL_VERSION, KVLayout

SLICE_BACKENDS = ("nixl", "loopback")  # one-sided: a sender's pieces may be any byte ranges


class KVCompat(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's KV compatibility record; two workers may exchange KV iff `mismatches` is empty.

    model_id: the model both sides run (the worker's ``--model``); dtype: torch dtype name without
    prefix ("bfloat16"); block_size: tokens per block; kv_layout: the KV buffer's dimension order
    ("LTBHD": [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]); block_strides:
    element strides of one layer's (block, token, head, dim) dims; num_kv_heads and block_strides are
    the record's rank's (its kv_buffer's); tp_size/tp_rank: tensor parallel size and the record's rank;
    total_kv_heads: KV heads of the whole model; rank_kv_heads: every rank's (first head, count) of them
    (head_map.rank_kv_heads; () in a record built by hand: one rank holding num_kv_heads);
    transfer_backend: "nixl" | "ucx" | "loopback" ("none": a worker that moves no KV);
    protocol_version: the KV control-plane protocol (wire.py); prefill_grid: the worker's
    ``--prefill-grid`` in tokens (0: off), which paired workers must share: a decode worker registers the
    landed prompt's whole grid chunks as reusable prefix cache, bit-identical to its own prefill only when
    both cut prompts on the same grid (the gateway's pairing checks it; the KV handshake's records, built by
    the sender and receiver, leave it 0). Workers build it with `kv_compat`; the defaults serve records built
    by hand (tests, fake workers).
    """

    model_id: str = ""
    dtype: str
    block_size: int
    kv_layout: str = "LTBHD"
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    block_strides: tuple[int, ...] = ()
    tp_size: int = 1
    tp_rank: int = 0
    transfer_backend: str = "none"
    protocol_version: int = PROTOCOL_VERSION
    prefill_grid: int = 0
    total_kv_heads: int = 0
    rank_kv_heads: tuple[HeadRange, ...] = ()

    @property
    def placement(self) -> tuple[HeadRange, ...]:
        """rank_kv_heads, or one rank holding heads [0, num_kv_heads) in a record without it."""
        return self.rank_kv_heads or ((0, self.num_kv_heads),)

    @property
    def model_kv_heads(self) -> int:
        """total_kv_heads, or num_kv_heads in a record without it."""
        return self.total_kv_heads or self.num_kv_heads


def kv_compat(model_id: str, transfer_backend: str, layout: KVLayout, tp_size: int = 1,
              tp_rank: int = 0, prefill_grid: int = 0, total_kv_heads: int = 0) -> KVCompat:
    """The record of tensor parallel rank `tp_rank` of `tp_size` of a worker that runs `model_id` over
    `transfer_backend` with a KV buffer of `layout` (this rank's shard). total_kv_heads: the model's KV
    heads (0: layout.num_kv_heads * tp_size, i.e. split without replication). Raises ValueError when the
    layout's heads are not the rank's share of total_kv_heads (head_map.rank_kv_heads)."""
    total = total_kv_heads or layout.num_kv_heads * tp_size
    placement = rank_kv_heads(total, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside [0, {tp_size})")
    if placement[tp_rank][1] != layout.num_kv_heads:
        raise ValueError(f"rank {tp_rank} of {tp_size} holds {placement[tp_rank][1]} of {total} KV heads, "
                         f"but its kv_buffer has {layout.num_kv_heads}")
    return KVCompat(model_id=model_id, dtype=layout.dtype, block_size=layout.block_size,
                    num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                    block_strides=tuple(layout.strides[2:]), tp_size=tp_size, tp_rank=tp_rank,
                    transfer_backend=transfer_backend, prefill_grid=prefill_grid, total_kv_heads=total,
                    rank_kv_heads=placement)


# compared through the head placements (tp_mismatches), not for equality
TP_FIELDS = ("num_kv_heads", "block_strides", "tp_size", "tp_rank", "total_kv_heads", "rank_kv_heads")


def mismatches(a: KVCompat, b: KVCompat) -> list[str]:
    """Why sender `a` cannot write KV into receiver `b`: each field that must be equal and differs, as
    "<field> <a's value> != <b's value>" (repr of each value, e.g. "dtype 'bfloat16' != 'float16'",
    "block_size 16 != 32"), in field order, then tp_mismatches; [] when compatible."""
    out = []
    for name in KVCompat.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if name not in TP_FIELDS and x != y:
            out.append(f"{name} {x!r} != {y!r}")
    return out + tp_mismatches(a, b)


def tp_mismatches(a: KVCompat, b: KVCompat) -> list[str]:
    """Why sender `a`'s head placement cannot be mapped onto receiver `b`'s, each naming both sides' tensor
    parallel shapes: the model's KV heads differ, a placement is not one of them, a head of `b` no rank of
    `a` holds, a rank's blocks are not dense [block_size, heads, head_dim] (head slices are byte ranges of
    it), or placements differ on a backend outside SLICE_BACKENDS; [] when mappable. Two records of one
    rank each (no placement) compare num_kv_heads and block_strides for equality, as other fields."""
    if a.tp_size == b.tp_size == 1 and not a.rank_kv_heads and not b.rank_kv_heads:
        return [f"{name} {getattr(a, name)!r} != {getattr(b, name)!r}"
                for name in ("num_kv_heads", "block_strides") if getattr(a, name) != getattr(b, name)]
    shapes = (f"(prefill tp_size {a.tp_size} heads {list(a.placement)}, "
              f"decode tp_size {b.tp_size} heads {list(b.placement)})")
    if a.model_kv_heads != b.model_kv_heads:
        return [f"total_kv_heads {a.model_kv_heads!r} != {b.model_kv_heads!r} {shapes}"]
    out = []
    for side, rec in (("prefill", a), ("decode", b)):
        problem = placement_problem(rec.placement, rec.model_kv_heads)
        if not problem and len(rec.placement) != rec.tp_size:
            problem = f"{len(rec.placement)} head ranges for tp_size {rec.tp_size}"
        if not problem and not 0 <= rec.tp_rank < rec.tp_size:
            problem = f"tp_rank {rec.tp_rank} outside [0, {rec.tp_size})"
        if not problem and rec.placement[rec.tp_rank][1] != rec.num_kv_heads:
            problem = (f"rank {rec.tp_rank} has num_kv_heads {rec.num_kv_heads} != its share "
                       f"{rec.placement[rec.tp_rank][1]}")
        row = rec.num_kv_heads * rec.head_dim
        dense = (rec.block_size * row, row, rec.head_dim, 1)
        if not problem and rec.block_strides and tuple(rec.block_strides) != dense:
            problem = f"block_strides {tuple(rec.block_strides)} are not dense {dense}"
        if problem:
            out.append(f"{side} head placement unusable: {problem} {shapes}")
    if out:
        return out
    try:
        head_slices(a.placement, b.placement)
    except ValueError as exc:
        return [f"head mapping impossible: {exc} {shapes}"]
    if a.placement != b.placement and a.transfer_backend not in SLICE_BACKENDS:
        return [f"transfer_backend {a.transfer_backend!r} writes whole blocks only, which the tensor "
                f"parallel shapes do not share {shapes}: use one of {list(SLICE_BACKENDS)}"]
    return []
