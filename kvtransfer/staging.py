"""Torch side of a transfer: layout of a KV tensor, gather into staging, checksums.

Tensors: `kv_buffer [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` of any dtype; a
staging buffer is a flat uint8 tensor, used as `[2, n, block_size, num_kv_heads, head_dim]` of that dtype.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

from kvtransfer.types import KVLayout


def layout_of(kv_buffer: torch.Tensor) -> KVLayout:
    """KVLayout of a 6-d paged KV tensor; raises ValueError if the shape is wrong or a block of one
    layer (K or V) is not contiguous in memory (transfers copy whole blocks as byte ranges)."""
    if kv_buffer.dim() != 6 or kv_buffer.shape[1] != 2:
        raise ValueError(f"kv_buffer must be [num_layers, 2, num_blocks, block_size, heads, head_dim], "
                         f"got {tuple(kv_buffer.shape)}")
    num_layers, _, num_blocks, block_size, heads, head_dim = kv_buffer.shape
    s = kv_buffer.stride()
    if (s[5], s[4], s[3], s[2]) != (1, head_dim, heads * head_dim, block_size * heads * head_dim):
        raise ValueError(f"kv_buffer blocks are not contiguous (strides {s})")
    return KVLayout(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                    num_kv_heads=heads, head_dim=head_dim, dtype=str(kv_buffer.dtype).removeprefix("torch."),
                    itemsize=kv_buffer.element_size(), strides=tuple(s))


def staging_view(staging: torch.Tensor, kv_buffer: torch.Tensor, n: int) -> torch.Tensor:
    """`staging` (flat uint8) as `[2, n, block_size, heads, head_dim]` of kv_buffer's dtype.

    Raises ValueError if staging is too small.
    """
    shape = (2, n, *kv_buffer.shape[3:])
    nbytes = 2 * n * kv_buffer[0, 0, 0].numel() * kv_buffer.element_size()
    if staging.numel() < nbytes:
        raise ValueError(f"staging buffer of {staging.numel()} bytes < {nbytes} needed")
    return staging[:nbytes].view(kv_buffer.dtype).view(shape)


def gather_layer(kv_buffer: torch.Tensor, layer: int, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """Copy K and V of `block_ids` (int64 [n], token order) of `layer` into `out [2, n, bs, H, D]`."""
    torch.index_select(kv_buffer[layer], 1, block_ids, out=out)


def checksum(t: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes (copied to host if on a GPU): a debug check, not cryptographic."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return zlib.crc32(flat.numpy().data)


def layer_checksum(kv_buffer: torch.Tensor, layer: int, block_ids: tuple[int, ...]) -> int:
    """CRC32 of `layer`'s K and V of `block_ids` in token order, laid out as a staging buffer would be:
    equal on both sides only if every block arrived intact and in the right place."""
    idx = torch.tensor(block_ids, dtype=torch.int64, device=kv_buffer.device)
    return checksum(torch.index_select(kv_buffer[layer], 1, idx))


class StagingRing:
    """`depth` staging slots in one flat uint8 tensor on kv_buffer's device, so that `depth`
    request-layers can be in flight at once (gathered, being written) without registering memory per
    transfer. The tensor is (re)allocated, and `on_new(tensor)` called so a transport can register it,
    only when a request-layer needs a bigger slot and no slot is in use. Not thread-safe (the sender
    loop owns it).

    Raises ValueError if depth < 1.
    """

    GRANULE = 1 << 20  # slot sizes are rounded up to whole MiB, so growth happens rarely

    def __init__(self, kv_buffer: torch.Tensor, depth: int, on_new: Callable[[torch.Tensor], None]) -> None:
        if depth < 1:
            raise ValueError(f"staging ring depth must be >= 1, got {depth}")
        self.kv_buffer = kv_buffer
        self.depth = depth
        self.on_new = on_new
        self.slot_bytes = 0
        self.data = torch.empty(0, dtype=torch.uint8, device=kv_buffer.device)
        self._free = list(range(depth - 1, -1, -1))  # a stack: the lowest free slot is reused first

    def bytes_for(self, n: int) -> int:
        """Bytes of a request-layer of n blocks (K and V)."""
        return 2 * n * self.kv_buffer[0, 0, 0].numel() * self.kv_buffer.element_size()

    @property
    def free_slots(self) -> int:
        """Slots not acquired."""
        return len(self._free)

    @property
    def in_use(self) -> int:
        """Slots acquired and not yet released."""
        return self.depth - len(self._free)

    def acquire(self, n: int) -> int | None:
        """A free slot for a request-layer of n blocks, or None (all slots busy, or the ring must grow
        and has to drain first). Grows (reallocates and re-registers) only while no slot is in use."""
        need = self.bytes_for(n)
        if not self._free or (need > self.slot_bytes and self.in_use):
            return None
        if need > self.slot_bytes:
            self.slot_bytes = -(-need // self.GRANULE) * self.GRANULE
            self.data = torch.empty(self.depth * self.slot_bytes, dtype=torch.uint8,
                                    device=self.kv_buffer.device)
            self.on_new(self.data)
        return self._free.pop()

    def release(self, slot: int) -> None:
        """Return a slot; raises ValueError if it is not in use."""
        if not 0 <= slot < self.depth or slot in self._free:
            raise ValueError(f"staging slot {slot} is not in use")
        self._free.append(slot)

    def offset(self, slot: int) -> int:
        """Byte offset of `slot` in the flat tensor."""
        return slot * self.slot_bytes

    def view(self, slot: int, n: int) -> torch.Tensor:
        """`[2, n, block_size, heads, head_dim]` view of `slot` for n blocks."""
        start = self.offset(slot)
        return staging_view(self.data[start:start + self.slot_bytes], self.kv_buffer, n)
