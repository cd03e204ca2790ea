"""The paged KV cache: one tensor holding every layer's K and V blocks.

Layout (vLLM PagedAttention, Kwon et al., SOSP'23, "Efficient Memory Management for Large Language Model
Serving with PagedAttention"): ``kv_buffer [num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]``; index 0 of dim 1 is K, 1 is V. A token at cache slot ``s`` lives at block ``s // block_size``,
offset ``s % block_size``. One allocation keeps a request-layer's blocks addressable as plain memory for
the KV transfer (``layer_block_bytes`` is the unit it moves).
"""

from __future__ import annotations

import torch

_K, _V = 0, 1


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


class KVCachePool:
    """Paged K/V storage for all layers of one model replica.

    Args:
        num_layers: transformer layers.
        num_blocks: blocks per layer (same block ids in every layer).
        block_size: tokens per block.
        num_kv_heads: KV heads (per tensor-parallel rank).
        head_dim: elements per head.
        dtype: the model's dtype (e.g. ``torch.bfloat16``).
        device: where the buffer lives.

    Attributes:
        kv_buffer: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` of ``dtype``,
            zero-initialised.

    Raises:
        ValueError: a size is not a positive int.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        _check_positive(
            num_layers=num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_buffer = torch.zeros(shape, dtype=dtype, device=torch.device(device))
        # the buffer's own device: "cuda" becomes "cuda:0", so it compares equal to tensors' devices
        self.device = self.kv_buffer.device

    @staticmethod
    def block_bytes(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes over all layers, K and V together."""
        element = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * element

    @classmethod
    def from_memory(
        cls,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        memory_fraction: float = 0.9,
        cpu_kv_bytes: int = 1 << 30,
        num_blocks: int | None = None,
    ) -> KVCachePool:
        """Build a pool sized by ``num_blocks`` if given, else by a memory budget.

        The budget is ``memory_fraction`` of the free device memory (``torch.cuda.mem_get_info``) on CUDA,
        or of ``cpu_kv_bytes`` on CPU; ``num_blocks = budget // bytes_per_block``.

        Raises:
            ValueError: ``memory_fraction`` outside (0, 1], a negative budget, or fewer than one block fits
                (the message gives the budget and the block size in bytes).
        """
        if num_blocks is None:
            num_blocks = cls.fit_num_blocks(num_layers, block_size, num_kv_heads, head_dim, dtype, device,
                                            memory_fraction, cpu_kv_bytes)
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)

    @classmethod
    def fit_num_blocks(
        cls,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        memory_fraction: float = 0.9,
        cpu_kv_bytes: int = 1 << 30,
    ) -> int:
        """The block count ``from_memory`` allocates without ``num_blocks`` (nothing allocated).

        Raises:
            ValueError: as ``from_memory``.
        """
        if not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        dev = torch.device(device)
        if dev.type == "cuda":
            free_bytes, _total = torch.cuda.mem_get_info(dev)
        else:
            if cpu_kv_bytes < 0:
                raise ValueError(f"cpu_kv_bytes must be >= 0, got {cpu_kv_bytes}")
            free_bytes = cpu_kv_bytes
        budget = int(free_bytes * memory_fraction)
        per_block = cls.block_bytes(num_layers, block_size, num_kv_heads, head_dim, dtype)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds no block: one block takes {per_block} bytes "
                f"({num_layers} layers x K,V x {block_size} tokens x {num_kv_heads} heads x {head_dim})"
            )
        return int(num_blocks)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")

    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K blocks: a view ``[num_blocks, block_size, num_kv_heads, head_dim]``.

        Raises:
            IndexError: ``layer`` out of range.
        """
        self._check_layer(layer)
        return self.kv_buffer[layer, _K]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s V blocks: a view ``[num_blocks, block_size, num_kv_heads, head_dim]``.

        Raises:
            IndexError: ``layer`` out of range.
        """
        self._check_layer(layer)
        return self.kv_buffer[layer, _V]

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer, K or V alone (the unit of a KV transfer)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.kv_buffer.element_size()

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers, K and V together."""
        return self.num_layers * 2 * self.layer_block_bytes

    @property
    def num_slots(self) -> int:
        """Token slots per layer: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size
