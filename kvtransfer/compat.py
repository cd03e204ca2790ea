"""Pairing compatibility: what must match for a prefill worker to write KV into a decode worker (no torch).

One record, `KVCompat`, and one check, `mismatches`, used in both places a pair is judged:

- the gateway, when it pairs registered workers (`protocol.messages.RegisterWorker.compat`,
  `gateway.registry.pairing_mismatch`): an incompatible pair is never chosen, and a request that only
  such pairs could serve gets a 503 naming each mismatch;
- the KV handshake (wire.Hello carries the sender's record, the receiver answers the mismatches in its
  HelloReply): a sender refused there raises `IncompatiblePeerError` naming them.

Every field must be equal: heterogeneous tensor parallelism, dtype conversion and layout transposition
are not supported, so a pair that differs is refused instead of receiving garbage. This module imports
only msgspec and kvtransfer.types (the gateway, which has no torch, imports it).
"""

from __future__ import annotations

import msgspec

from kvtransfer.types import PROTOCOL_VERSION, KVLayout


class KVCompat(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's KV compatibility record; two workers may exchange KV iff `mismatches` is empty.

    model_id: the model both sides run (the worker's ``--model``); dtype: torch dtype name without
    prefix ("bfloat16"); block_size: tokens per block; kv_layout: the KV buffer's dimension order
    ("LTBHD": [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]); block_strides:
    element strides of one layer's (block, token, head, dim) dims; tp_size/tp_rank: tensor parallel
    size and rank; transfer_backend: "nixl" | "ucx" | "loopback" ("none": a worker that moves no KV);
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


def kv_compat(model_id: str, transfer_backend: str, layout: KVLayout, tp_size: int = 1,
              tp_rank: int = 0, prefill_grid: int = 0) -> KVCompat:
    """The record of a worker that runs `model_id` over `transfer_backend` with a KV buffer of `layout`."""
    return KVCompat(model_id=model_id, dtype=layout.dtype, block_size=layout.block_size,
                    num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                    block_strides=tuple(layout.strides[2:]), tp_size=tp_size, tp_rank=tp_rank,
                    transfer_backend=transfer_backend, prefill_grid=prefill_grid)


def mismatches(a: KVCompat, b: KVCompat) -> list[str]:
    """Each field that differs, as "<field> <a's value> != <b's value>" (repr of each value, e.g.
    "dtype 'bfloat16' != 'float16'", "block_size 16 != 32"), in field order; [] when compatible."""
    out = []
    for name in KVCompat.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if x != y:
            out.append(f"{name} {x!r} != {y!r}")
    return out
