"""The prefix-cache block hash, the same in every process and on every host (no torch, no project imports).

A full block's hash chains over its parent's: ``block_hash(parent, tokens)`` is the first 8 bytes of
BLAKE2b (RFC 7693; ``hashlib.blake2b``, ``digest_size=8``) over the parent hash as 8 little-endian bytes
followed by the block's token ids as little-endian uint32, read back as a little-endian unsigned int
(``[0, 2**64)``). The first block's parent is ``ROOT_HASH``. Equal hashes of block ``i`` thus mean (up to
a 2**-64 collision) equal token ids in blocks ``0..i``: the worker's prefix cache (engine/block_manager.py)
and the gateway's prefix index (gateway/prefix_index.py), fed by the workers' KV events, name a block by
the same number. Python's built-in ``hash`` does not: ``hash(None)`` differs between processes, and it
is not a fixed contract across interpreter versions.

Cost: about 1.5 µs per 16-token block against 0.2 µs for ``hash((parent, tuple(tokens)))`` on the
project's 2-core CPU machine (``python -m bench.engine.block_hash`` prints both); ``block_hashes`` over
many blocks costs about half that per block. A worker hashes each block of a sequence at most once
(``Sequence.full_block_hashes`` keeps the chain), and not the blocks a prefix lookup finds cached
(``BlockManager.allocate_prefix`` looks those up by parent hash and token ids).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b

ROOT_HASH = 0  # the parent hash of a sequence's first block

if array("I").itemsize != 4 or array("Q").itemsize != 8:  # pragma: no cover - not on CPython's platforms
    raise ImportError("engine.block_hash needs array('I') of 4 bytes and array('Q') of 8")
_SWAP = sys.byteorder != "little"


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    packed = array("I", token_ids)
    if _SWAP:  # pragma: no cover - big-endian hosts only
        packed.byteswap()
    return packed.tobytes()


def block_hash(parent: int, token_ids: Sequence[int]) -> int:
    """The chained hash of one block: ``parent`` (the previous block's hash, ``ROOT_HASH`` for block 0,
    in ``[0, 2**64)``) and the block's ``token_ids`` (each in ``[0, 2**32)``). Returns an int in
    ``[0, 2**64)``.

    Raises:
        OverflowError: ``parent`` or a token id out of its range.
    """
    digest = blake2b(parent.to_bytes(8, "little") + _token_bytes(token_ids), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Chained hashes of the full ``block_size``-token blocks of ``token_ids`` (a trailing partial block
    has none), as ``block_hash`` gives them one by one from ``parent`` (``ROOT_HASH``: ``token_ids``
    starts at block 0; else the hash of the block before ``token_ids[0]``, to extend a chain).

    The chain is carried as the 8 digest bytes (the parent's little-endian bytes are its digest) and the
    digests are read back as ints in one pass at the end, so a block costs one BLAKE2b call.

    Raises:
        ValueError: ``block_size`` < 1.
        OverflowError: a token id outside ``[0, 2**32)`` or ``parent`` outside ``[0, 2**64)``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_full = len(token_ids) // block_size
    if not num_full:
        return []
    data = _token_bytes(token_ids[: num_full * block_size])
    step = 4 * block_size
    digests: list[bytes] = []
    keep = digests.append
    prev = parent.to_bytes(8, "little")
    for start in range(0, len(data), step):
        prev = blake2b(prev + data[start : start + step], digest_size=8).digest()
        keep(prev)
    out = array("Q", b"".join(digests))
    if _SWAP:  # pragma: no cover - big-endian hosts only
        out.byteswap()
    return out.tolist()
