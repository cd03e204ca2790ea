"""KVCachePool: layout, views, byte counts, sizing from a memory budget, errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.kv_cache import KVCachePool

SMOLLM2: dict[str, Any] = {"num_layers": 30, "block_size": 16, "num_kv_heads": 3, "head_dim": 64}


def test_layout_and_views_share_the_one_buffer() -> None:
    pool = KVCachePool(3, 5, 4, 2, 8, torch.float16)
    assert pool.kv_buffer.shape == (3, 2, 5, 4, 2, 8) and pool.kv_buffer.dtype == torch.float16
    assert pool.k_cache(2).shape == (5, 4, 2, 8)
    pool.k_cache(2)[1, 3] = 1.0
    pool.v_cache(0)[4, 0] = 2.0
    assert float(pool.kv_buffer.float().sum()) == 1.0 * 16 + 2.0 * 16
    assert bool((pool.kv_buffer[2, 0, 1, 3] == 1.0).all()) and bool((pool.kv_buffer[0, 1, 4, 0] == 2.0).all())
    assert pool.k_cache(1).data_ptr() == pool.kv_buffer[1, 0].data_ptr()
    assert pool.k_cache(0).is_contiguous() and pool.num_slots == 20


def test_byte_counts_for_smollm2_in_bf16() -> None:
    pool = KVCachePool(num_blocks=2, dtype=torch.bfloat16, **SMOLLM2)
    assert pool.layer_block_bytes == 16 * 3 * 64 * 2  # 6144
    assert pool.bytes_per_block == 23040 * 16  # facts.md: 23,040 bytes per token
    assert pool.bytes_per_block == KVCachePool.block_bytes(dtype=torch.bfloat16, **SMOLLM2)
    assert pool.kv_buffer.numel() * 2 == 2 * pool.bytes_per_block


def test_from_memory_on_cpu_uses_the_byte_budget() -> None:
    per_block = KVCachePool.block_bytes(dtype=torch.float32, **SMOLLM2)
    pool = KVCachePool.from_memory(dtype=torch.float32, cpu_kv_bytes=10 * per_block + 5, memory_fraction=1.0,
                                   **SMOLLM2)
    assert pool.num_blocks == 10
    half = KVCachePool.from_memory(dtype=torch.float32, cpu_kv_bytes=10 * per_block, memory_fraction=0.5,
                                   **SMOLLM2)
    assert half.num_blocks == 5
    explicit = KVCachePool.from_memory(dtype=torch.float32, cpu_kv_bytes=0, num_blocks=3, **SMOLLM2)
    assert explicit.num_blocks == 3 and explicit.kv_buffer.shape[2] == 3


def test_from_memory_errors() -> None:
    per_block = KVCachePool.block_bytes(dtype=torch.float32, **SMOLLM2)
    with pytest.raises(ValueError, match=f"holds no block: one block takes {per_block} bytes"):
        KVCachePool.from_memory(dtype=torch.float32, cpu_kv_bytes=per_block - 1, memory_fraction=1.0,
                                **SMOLLM2)
    for fraction in (0.0, 1.5):
        with pytest.raises(ValueError, match="memory_fraction"):
            KVCachePool.from_memory(dtype=torch.float32, memory_fraction=fraction, **SMOLLM2)
    with pytest.raises(ValueError, match="cpu_kv_bytes"):
        KVCachePool.from_memory(dtype=torch.float32, cpu_kv_bytes=-1, **SMOLLM2)


@pytest.mark.parametrize("field", ["num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"])
def test_constructor_rejects_non_positive_sizes(field: str) -> None:
    sizes: dict[str, Any] = dict(num_layers=2, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=8)
    sizes[field] = 0
    with pytest.raises(ValueError, match=f"{field} must be a positive int"):
        KVCachePool(dtype=torch.float32, **sizes)


def test_layer_index_out_of_range() -> None:
    pool = KVCachePool(2, 2, 4, 1, 8, torch.float32)
    with pytest.raises(IndexError, match="layer 2 out of range"):
        pool.k_cache(2)
    with pytest.raises(IndexError, match="layer -1 out of range"):
        pool.v_cache(-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_from_memory_on_cuda_uses_free_memory() -> None:
    free, _ = torch.cuda.mem_get_info()
    per_block = KVCachePool.block_bytes(dtype=torch.bfloat16, **SMOLLM2)
    pool = KVCachePool.from_memory(dtype=torch.bfloat16, device="cuda", memory_fraction=0.01, **SMOLLM2)
    assert pool.kv_buffer.is_cuda
    assert abs(pool.num_blocks - int(free * 0.01) // per_block) <= 1 + int(free * 0.0001) // per_block


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_is_normalised_to_the_buffers_device() -> None:
    """Bug seen on the H200: KVCachePool(device="cuda").device was "cuda", and tensors on "cuda:0" were
    rejected as being on another device."""
    pool = KVCachePool(1, 2, 4, 1, 8, torch.float32, "cuda")
    assert pool.device == torch.device("cuda", torch.cuda.current_device())
    assert torch.ones(1, device="cuda").device == pool.device
