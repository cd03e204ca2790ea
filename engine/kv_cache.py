"""The paged KV cache: one tensor holding every layer's K and V blocks.

Layout (vLLM PagedAttention, Kwon et al., SOSP'23, "Efficient Memory Management for Large Language Model
Serving with PagedAttention"): ``kv_buffer [num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]``; index 0 of dim 1 is K, 1 is V. A token at cache slot ``s`` lives at block ``s // block_size``,
offset ``s % block_size``. One allocation keeps a request-layer's blocks addressable as plain memory for
the KV transfer (``layer_block_bytes`` is the unit it moves).

The buffer holds the model's dtype, or FP8 (``float8_e4m3fn``, one byte per element: twice the blocks of
bf16 in the same memory) with one scale per layer for K and one for V (``KVScale``: the cache holds
``x / scale``; engine/ops/store_kv.py). The scales are static, 1.0 for every layer, as vLLM uses when a
checkpoint carries no KV scales: a prefill worker and a decode worker must read the same bytes as the
same values, and scales computed from each worker's own traffic would differ between them. e4m3's range
(+-448) holds the K/V activations of the supported models; larger values saturate at +-448.
"""

from __future__ import annotations

import torch

from engine.ops.store_kv import FP8_KV_DTYPE, KVScale

_K, _V = 0, 1
KV_CACHE_DTYPES = ("auto", "fp8")


def resolve_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The buffer dtype of ``--kv-cache-dtype``: ``"auto"`` = the model's dtype, ``"fp8"`` =
    ``torch.float8_e4m3fn``.

    Raises:
        ValueError: another name (the message lists the choices).
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return FP8_KV_DTYPE
    raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def check_kv_cache_dtype(cache_dtype: torch.dtype, model_dtype: torch.dtype, backend: str,
                         device: torch.device) -> None:
    """Refuse an FP8 cache where it cannot run: the ``flash_attn`` backend (no FP8 path here), or the
    ``triton`` backend on a CUDA GPU older than compute capability 8.9 (no FP8 conversions before
    Ada/Hopper). No-op for a cache of the model's dtype.

    Raises:
        ValueError: naming ``kv_cache_dtype``, the backend and, for a GPU, its compute capability.
    """
    if cache_dtype == model_dtype:
        return
    if backend not in ("triton", "torch"):
        raise ValueError(f"kv_cache_dtype fp8 needs the triton or torch attention backend, got {backend}")
    if backend == "triton" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(f"kv_cache_dtype fp8 with the triton backend needs compute capability >= 8.9 "
                             f"(Ada, Hopper), {device} has {capability[0]}.{capability[1]}")


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
        dtype: the model's dtype (e.g. ``torch.bfloat16``): the dtype of the K/V handed to the cache.
        device: where the buffer lives.
        cache_dtype: the buffer's dtype: None = ``dtype``, or ``torch.float8_e4m3fn``.

    Attributes:
        kv_buffer: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` of ``cache_dtype``,
            zero-initialised.
        kv_scales: one ``KVScale`` per layer (static 1.0; see the module docstring).

    Raises:
        ValueError: a size is not a positive int; a ``cache_dtype`` that is neither ``dtype`` nor FP8.
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
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        cache_dtype = dtype if cache_dtype is None else cache_dtype
        if cache_dtype not in (dtype, FP8_KV_DTYPE):
            raise ValueError(f"cache_dtype must be the model's dtype {dtype} or {FP8_KV_DTYPE}, "
                             f"got {cache_dtype}")
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
        self.cache_dtype = cache_dtype
        self.kv_scales = tuple(KVScale(1.0, 1.0) for _ in range(num_layers))
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_buffer = torch.zeros(shape, dtype=cache_dtype, device=torch.device(device))
        # the buffer's own device: "cuda" becomes "cuda:0", so it compares equal to tensors' devices
        self.device = self.kv_buffer.device

    @staticmethod
    def block_bytes(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes over all layers, K and V together, in a buffer of ``dtype`` (the cache
        dtype: 1 byte per element for FP8)."""
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
        cache_dtype: torch.dtype | None = None,
    ) -> KVCachePool:
        """Build a pool sized by ``num_blocks`` if given, else by a memory budget.

        The budget is ``memory_fraction`` of the free device memory (``torch.cuda.mem_get_info``) on CUDA,
        or of ``cpu_kv_bytes`` on CPU; ``num_blocks = budget // bytes_per_block`` (blocks of
        ``cache_dtype``, default ``dtype``).

        Raises:
            ValueError: ``memory_fraction`` outside (0, 1], a negative budget, or fewer than one block fits
                (the message gives the budget and the block size in bytes).
        """
        buffer_dtype = dtype if cache_dtype is None else cache_dtype
        if num_blocks is None:
            num_blocks = cls.fit_num_blocks(num_layers, block_size, num_kv_heads, head_dim, buffer_dtype,
                                            device, memory_fraction, cpu_kv_bytes)
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, cache_dtype)

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
        """The block count ``from_memory`` allocates without ``num_blocks`` (nothing allocated); ``dtype``
        is the buffer's (cache) dtype.

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

    def kv_scale(self, layer: int) -> KVScale:
        """Layer ``layer``'s K and V scales (read by an FP8 cache; 1.0 for a cache of the model's dtype).

        Raises:
            IndexError: ``layer`` out of range.
        """
        self._check_layer(layer)
        return self.kv_scales[layer]

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
