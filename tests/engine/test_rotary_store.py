"""``rotary_store_kv`` (engine/ops/rotary_store.py): bit-identical to ``apply_rotary`` then ``store_kv`` (the
two kernels it fuses) and close to the plain-torch references, on views of a fused QKV output, scattered
blocks and padding slots; nothing written outside ``slot_mapping``. CPU: Triton interpreter (fp32, fp16)."""

from __future__ import annotations

import pytest
import torch

from engine.ops.rotary import apply_rotary
from engine.ops.rotary_store import rotary_store_kv, rotary_store_kv_reference
from engine.ops.store_kv import store_kv
from tests.engine.test_fused_ops import DEVICE, DTYPES, TOL, _rand
from tests.engine.test_kernels import assert_no_stray_writes, make_batch


def _inputs(dtype: torch.dtype, h: int, hkv: int, d: int) -> tuple[torch.Tensor, ...]:
    t = 5
    qkv = _rand(t, (h + 2 * hkv) * d, dtype=dtype, seed=4)
    angles = _rand(t, d // 2, dtype=torch.float32, seed=5) * 3
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    return qkv, cos, sin


def _views(qkv: torch.Tensor, h: int, hkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = qkv.shape[0]
    return (qkv[:, : h * d].view(t, h, d), qkv[:, h * d: (h + hkv) * d].view(t, hkv, d),
            qkv[:, (h + hkv) * d:].view(t, hkv, d))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,hkv,d", [(4, 2, 64), (6, 3, 32), (8, 1, 128)])
def test_equals_rotary_then_store_kernels_and_references(dtype: torch.dtype, h: int, hkv: int,
                                                         d: int) -> None:
    batch = make_batch([(0, 2), (5, 1), (3, 2)], h, hkv, d, 4, dtype)  # 5 new tokens, scattered blocks
    slots = batch.meta.slot_mapping.clone()
    slots[3] = -1  # a padding row: rotated, never stored
    qkv, cos, sin = _inputs(dtype, h, hkv, d)
    caches = [(batch.pool.k_cache(0).clone(), batch.pool.v_cache(0).clone()) for _ in range(3)]
    outs = [qkv.clone() for _ in range(3)]
    q, k, v = _views(outs[0], h, hkv, d)
    rotary_store_kv(q, k, v, cos, sin, *caches[0], slots)
    q, k, v = _views(outs[1], h, hkv, d)
    apply_rotary(q, k, cos, sin)
    store_kv(k, v, *caches[1], slots)
    assert torch.equal(outs[0], outs[1])  # q, k rotated in place, v untouched: bit-identical
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    keep = slots >= 0
    q, k, v = _views(outs[2], h, hkv, d)
    rotary_store_kv_reference(q[keep], k[keep], v[keep], cos[keep], sin[keep], *caches[2], slots[keep])
    for got, want in zip(caches[0], caches[2], strict=True):
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    pad = batch.meta.slot_mapping[3].item()
    blk, off = divmod(int(pad), batch.pool.block_size)
    assert torch.equal(caches[0][0][blk, off], batch.pool.k_cache(0)[blk, off])  # padding slot unwritten
    batch.pool.k_cache(0).copy_(caches[0][0])
    batch.pool.v_cache(0).copy_(caches[0][1])
    assert_no_stray_writes(batch)


def test_bad_inputs_change_nothing() -> None:
    qkv, cos, sin = _inputs(torch.float32, 4, 2, 64)
    q, k, v = _views(qkv, 4, 2, 64)
    cache = torch.zeros(4, 4, 2, 64, device=DEVICE)
    before = qkv.clone()
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_store_kv(q, k, v, cos, sin, cache, cache.clone(), torch.arange(5, device=DEVICE).int())
    with pytest.raises(ValueError, match="cos and sin"):
        rotary_store_kv(q, k, v, cos[:, :32], sin, cache, cache.clone(), torch.arange(5, device=DEVICE))
    assert torch.equal(qkv, before) and not cache.any()
    none = torch.arange(0, device=DEVICE)
    rotary_store_kv(q[:0], k[:0], v[:0], cos[:0], sin[:0], cache, cache.clone(), none)
    assert not cache.any()
