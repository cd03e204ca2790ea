"""Compatibility check run at connect time (both sides); no torch."""

from __future__ import annotations

from kvtransfer.api import PROTOCOL_VERSION, KVLayout, TransferConfig
from kvtransfer.wire import PeerInfo


def peer_info(config: TransferConfig, layout: KVLayout) -> PeerInfo:
    """This worker's handshake record from its config and KV layout."""
    return PeerInfo(
        protocol_version=PROTOCOL_VERSION,
        model_id=config.model_id,
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_strides=tuple(layout.strides[2:]),
        tp_size=config.tp_size,
        tp_rank=config.tp_rank,
        backend=config.backend,
    )


def mismatches(local: PeerInfo, remote: PeerInfo) -> list[str]:
    """Each differing field as "field: local=<x> remote=<y>"; empty when compatible.

    Every field must be equal: heterogeneous tensor parallelism, dtype conversion and layout
    transposition are not supported (a pair that differs is refused instead of receiving garbage).
    """
    out = []
    for field in PeerInfo.__struct_fields__:
        a, b = getattr(local, field), getattr(remote, field)
        if a != b:
            out.append(f"{field}: local={a!r} remote={b!r}")
    return out
