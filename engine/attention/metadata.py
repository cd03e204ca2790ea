"""Per-step attention inputs (``AttentionMetadata``) and the helper that builds them from python lists.

All sequences of a step are packed into one row of ``T`` tokens, decodes first (vLLM v1 layout). The
python ints (``num_decodes``, ``max_query_len``, ``max_seq_len``) let backends size their launch grids
without reading device tensors back (no host synchronisation inside ``forward``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.host_copy import host_to_device

# a sequence with at least this many new tokens gets its slots by whole blocks in numpy; shorter ones
# (decode rows) by a python loop, which costs less per sequence than numpy's per-call overhead
_VECTOR_MIN_TOKENS = 32


@dataclass(frozen=True)
class AttentionMetadata:
    """What every attention layer of one step needs (shapes: T new tokens, S sequences).

    Attributes:
        slot_mapping: int64 ``[T]``, cache slot of each new token (``block_id * block_size + offset``).
        query_start_loc: int32 ``[S+1]``, cumulative query lengths (new tokens per sequence).
        seq_lens: int32 ``[S]``, tokens in KV after this step (context incl. the new tokens).
        block_tables: int32 ``[S, max_blocks]``, each sequence's block ids, padded with 0.
        num_decodes: sequences ``[0, num_decodes)`` have query length 1.
        num_decode_tokens: ``== num_decodes``.
        max_query_len: longest query (tokens) in the step.
        max_seq_len: longest ``seq_lens`` entry (tokens).
        layer_hook: called with the layer index after that layer's KV is stored (KV transfer).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    max_query_len: int
    max_seq_len: int
    layer_hook: Callable[[int], None] | None = None

    @property
    def num_seqs(self) -> int:
        """Sequences in the step (S)."""
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        """New tokens in the step (T)."""
        return int(self.slot_mapping.shape[0])


def _validate(
    block_tables: Sequence[Sequence[int]],
    num_computed_tokens: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not query_lens:
        raise ValueError("build_attention_metadata needs at least one sequence")
    if not len(block_tables) == len(num_computed_tokens) == len(query_lens):
        raise ValueError(
            f"length mismatch: {len(block_tables)} block_tables, {len(num_computed_tokens)} "
            f"num_computed_tokens, {len(query_lens)} query_lens"
        )
    rows = zip(block_tables, num_computed_tokens, query_lens, strict=True)
    for i, (table, computed, qlen) in enumerate(rows):
        if qlen < 1:
            raise ValueError(f"sequence {i}: query length must be >= 1, got {qlen}")
        if computed < 0:
            raise ValueError(f"sequence {i}: num_computed_tokens must be >= 0, got {computed}")
        if len(table) * block_size < computed + qlen:
            raise ValueError(
                f"sequence {i}: block_table of {len(table)} blocks x {block_size} tokens cannot hold "
                f"{computed + qlen} tokens"
            )
        if any(b < 0 for b in table):
            raise ValueError(f"sequence {i}: negative block id in block_table {list(table)}")


def _slot_mapping(
    block_tables: Sequence[Sequence[int]],
    num_computed_tokens: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
) -> np.ndarray:
    """int64 ``[sum(query_lens)]``: the cache slot ``table[pos // block_size] * block_size + pos %
    block_size`` of each new token ``pos`` in ``[computed, computed + query_len)``, sequences in order.
    Long queries are expanded a block at a time (an 8192-token prompt: ~0.6 ms of python otherwise)."""
    offsets = np.arange(block_size, dtype=np.int64)
    parts: list[np.ndarray] = []
    short: list[int] = []
    for table, computed, qlen in zip(block_tables, num_computed_tokens, query_lens, strict=True):
        if qlen < _VECTOR_MIN_TOKENS:
            for pos in range(computed, computed + qlen):
                short.append(table[pos // block_size] * block_size + pos % block_size)
            continue
        if short:
            parts.append(np.array(short, dtype=np.int64))
            short = []
        first, last = computed // block_size, (computed + qlen - 1) // block_size
        blocks = np.asarray(table[first:last + 1], dtype=np.int64)
        start = computed - first * block_size
        parts.append((blocks[:, None] * block_size + offsets).reshape(-1)[start:start + qlen])
    if short or not parts:
        parts.append(np.array(short, dtype=np.int64))
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def build_attention_metadata(
    block_tables: Sequence[Sequence[int]],
    num_computed_tokens: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
    device: torch.device | str = "cpu",
    layer_hook: Callable[[int], None] | None = None,
) -> AttentionMetadata:
    """Build ``AttentionMetadata`` for one packed step.

    Args:
        block_tables: per sequence, its block ids (covering at least ``num_computed + query_len`` tokens).
        num_computed_tokens: per sequence, tokens already in the KV cache (cached prefix, earlier chunks,
            decode context).
        query_lens: per sequence, new tokens this step (>= 1). Sequences must come decodes first; the
            leading run of query length 1 is counted as ``num_decodes``.
        block_size: tokens per block.
        device: where the tensors go (built on the host, then copied once each: ``host_to_device``,
            asynchronous on CUDA).
        layer_hook: passed through.

    Returns:
        The metadata; ``seq_lens[i] = num_computed_tokens[i] + query_lens[i]``.

    Raises:
        ValueError: empty batch, mismatched list lengths, a query length < 1, a negative
            ``num_computed_tokens`` or block id, or a block table too short for its tokens.
    """
    _validate(block_tables, num_computed_tokens, query_lens, block_size)
    seq_lens = [c + q for c, q in zip(num_computed_tokens, query_lens, strict=True)]
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    max_blocks = max(1, max(len(t) for t in block_tables))
    padded = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    dev = torch.device(device)
    slots = _slot_mapping(block_tables, num_computed_tokens, query_lens, block_size)
    return AttentionMetadata(
        slot_mapping=host_to_device(slots, torch.int64, dev),
        query_start_loc=host_to_device(starts, torch.int32, dev),
        seq_lens=host_to_device(seq_lens, torch.int32, dev),
        block_tables=host_to_device(padded, torch.int32, dev),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        layer_hook=layer_hook,
    )
