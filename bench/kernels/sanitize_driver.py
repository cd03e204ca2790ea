"""Driver for ``scripts/sanitize_kernels.sh``: every Triton kernel of ``engine/ops`` on a small shape grid.

Under NVIDIA compute-sanitizer (memcheck: out-of-bounds / misaligned accesses; racecheck: shared-memory
hazards) each kernel launch is ~100x slower, so the grid is small: block-boundary lengths with
``block_size`` 16 (1, 15, 16, 17, 32, 33 tokens ...), GQA ratios 1 and 4, ``head_dim`` 64 and 128, bf16
and fp16; ``store_kv``, ``rotary_store_kv``, ``paged_prefill_attention`` (cached prefixes included; whole
and with the KV in slices) and
``paged_decode_attention`` at several ``num_splits``; the fused decoder-layer kernels ``rms_norm`` (with
and without the residual add), ``apply_rotary`` (in place on views of a QKV row) and ``silu_mul``; the
one-row ``gemv``, plain and gated, at an N of each tile class. Every output is also checked against the
plain-torch references of ``engine/ops`` and the cache slots no sequence owns must still hold their
sentinel (no stray writes), so a run without the sanitizer is a correctness smoke test too.

On a machine without CUDA the kernels run through Triton's interpreter (``TRITON_INTERPRET=1`` is set here
before Triton is imported): use ``--tiny`` (fp16 only, one ``head_dim``; the interpreter has no bf16). The
kernels use fixed tile sizes (no Triton autotuning), so what runs is what is sanitized.

python -m bench.kernels.sanitize_driver [--tiny] [--device cuda|cpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any import of triton (engine.ops, lazily)

BLOCK_SIZE = 16
SENTINEL = 7.0
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# (num_computed_tokens, query_len): prefixes and chunks that start/end on and next to block boundaries
PREFILL_SPECS = ((0, 16), (15, 17), (16, 1), (0, 33), (31, 2))
DECODE_SEQ_LENS = (1, 15, 16, 17, 33, 64, 65)


@dataclass(frozen=True)
class KernelCase:
    """One point of the shape grid: ``num_heads = num_kv_heads * gqa``; dtype is a ``torch`` dtype name."""

    dtype: str
    num_kv_heads: int
    gqa: int
    head_dim: int
    num_splits: tuple[int, ...]


def shape_grid(tiny: bool) -> list[KernelCase]:
    """The cases to run. Full (GPU): {bf16, fp16} x GQA {1, 4} x head_dim {64, 128}, 2 KV heads, decode
    at ``num_splits`` 1, 2 and 5. Tiny (CPU interpreter, seconds): one case, fp16, head_dim 64, GQA 4,
    splits 1 and 3."""
    if tiny:
        return [KernelCase("float16", 2, 4, 64, (1, 3))]
    return [KernelCase(dtype, 2, gqa, d, (1, 2, 5))
            for dtype in ("bfloat16", "float16") for gqa in (1, 4) for d in (64, 128)]


@dataclass
class _Paged:
    """A packed step over a sentinel-filled one-layer paged cache (inputs of all three kernels)."""

    k_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    seq_lens: torch.Tensor  # int32 [S]
    query_start_loc: torch.Tensor  # int32 [S+1]
    slot_mapping: torch.Tensor  # int64 [T]
    q: torch.Tensor  # [T, H, D]
    k_new: torch.Tensor  # [T, Hkv, D]
    v_new: torch.Tensor
    used: torch.Tensor  # bool [num_blocks * BLOCK_SIZE]: slots owned by a sequence
    max_query_len: int
    max_seq_len: int


def _paged(specs: tuple[tuple[int, int], ...], case: KernelCase, device: str, seed: int) -> _Paged:
    """Random K/V/Q for ``specs``; blocks permuted (scattered); cached prefixes written by indexing."""
    dtype = DTYPES[case.dtype]
    gen = torch.Generator().manual_seed(seed)
    hkv, d = case.num_kv_heads, case.head_dim
    needed = [math.ceil((c + q) / BLOCK_SIZE) for c, q in specs]
    num_blocks = sum(needed) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [perm[sum(needed[:i]):sum(needed[:i + 1])] for i in range(len(specs))]
    cache = torch.full((2, num_blocks * BLOCK_SIZE, hkv, d), SENTINEL, dtype=dtype)
    used = torch.zeros(num_blocks * BLOCK_SIZE, dtype=torch.bool)
    slots: list[int] = []
    k_new, v_new = [], []
    for (computed, qlen), table in zip(specs, tables, strict=True):
        kv = torch.randn(2, computed + qlen, hkv, d, generator=gen).to(dtype)
        seq_slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(computed + qlen)]
        used[seq_slots] = True
        cache[:, seq_slots[:computed]] = kv[:, :computed]
        slots += seq_slots[computed:]
        k_new.append(kv[0, computed:])
        v_new.append(kv[1, computed:])
    width = max(needed)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qlens = [q for _, q in specs]
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(qlens), hkv * case.gqa, d, generator=gen).to(dtype)
    cache = cache.to(device).view(2, num_blocks, BLOCK_SIZE, hkv, d)
    to = lambda t: t.to(device)  # noqa: E731
    return _Paged(cache[0], cache[1], to(bt), to(torch.tensor([c + q for c, q in specs], dtype=torch.int32)),
                  to(qsl), to(torch.tensor(slots, dtype=torch.int64)), to(q), to(torch.cat(k_new)),
                  to(torch.cat(v_new)), used, max(qlens), max(c + q for c, q in specs))


def _close(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    err = (got.float() - want.float()).abs().max().item()
    if not err <= TOL[dtype] * 4:
        raise AssertionError(f"{name}: max abs error {err:.3g} > {TOL[dtype] * 4:.3g}")


def _no_stray_writes(name: str, p: _Paged) -> None:
    """Leak check of the cache: every slot no sequence owns still holds the sentinel."""
    for cache in (p.k_cache, p.v_cache):
        flat = cache.reshape(-1, *cache.shape[2:]).cpu()
        if not bool((flat[~p.used] == SENTINEL).all()):
            raise AssertionError(f"{name}: a kernel wrote outside its sequences' slots")


def run_case(case: KernelCase, device: str, seed: int = 0) -> int:
    """Run every kernel of ``case`` once (decode once per ``num_splits``) and check each against its
    reference. Returns the number of kernel calls. Raises AssertionError naming the kernel on a mismatch."""
    from engine.ops.paged_decode import paged_decode_attention, paged_decode_attention_reference
    from engine.ops.paged_prefill import paged_prefill_attention, paged_prefill_attention_reference
    from engine.ops.store_kv import store_kv

    dtype, scale, calls = DTYPES[case.dtype], case.head_dim ** -0.5, 0
    decode_specs = tuple((n - 1, 1) for n in DECODE_SEQ_LENS)
    for kind, specs in (("prefill", PREFILL_SPECS), ("decode", decode_specs)):
        p = _paged(specs, case, device, seed)
        store_kv(p.k_new, p.v_new, p.k_cache, p.v_cache, p.slot_mapping)
        calls += 1
        flat_k = p.k_cache.reshape(-1, *p.k_cache.shape[2:])
        _close(f"store_kv {case}", flat_k[p.slot_mapping], p.k_new, dtype)
        if kind == "prefill":
            args = (p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, p.query_start_loc)
            want = paged_prefill_attention_reference(*args, p.max_query_len, p.max_seq_len, scale)
            # unpacked, GQA-packed, and packed with the KV cut into 3 slices (partials + combine kernel)
            for pack_gqa, splits in ((False, 1), (True, 1), (True, 3)):
                got = paged_prefill_attention(*args, p.max_query_len, scale, pack_gqa=pack_gqa,
                                              num_splits=splits)
                _close(f"paged_prefill_attention pack_gqa={pack_gqa} num_splits={splits} {case}", got, want,
                       dtype)
                calls += 1 if splits == 1 else 2
        else:
            args2 = (p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, p.max_seq_len, scale)
            want = paged_decode_attention_reference(*args2)
            for splits in case.num_splits:
                got = paged_decode_attention(*args2, num_splits=splits)
                _close(f"paged_decode_attention num_splits={splits} {case}", got, want, dtype)
                calls += 2  # split + reduce launches
        _no_stray_writes(f"{kind} {case}", p)
        calls += _rotary_store(kind, _paged(specs, case, device, seed + 1), case, seed)
        if kind == "decode" and case.head_dim == 1 << (case.head_dim.bit_length() - 1):
            calls += _decode_rope(specs, case, device, seed + 2)
    calls += run_layer_ops(case, device, seed)
    calls += run_gemv(case, device, seed)
    if device != "cpu":
        torch.cuda.synchronize()
    return calls


def _rotary_store(kind: str, p: _Paged, case: KernelCase, seed: int) -> int:
    """``rotary_store_kv`` on the step's new tokens against ``apply_rotary_reference`` + the cache slots;
    nothing written outside them. Returns the number of kernel launches."""
    from engine.ops.rotary import apply_rotary_reference
    from engine.ops.rotary_store import rotary_store_kv

    dtype = DTYPES[case.dtype]
    cos, sin = _cos_sin(case, p.k_new.shape[0], seed, p.q.device)
    q, k = p.q.clone(), p.k_new.clone()
    want_q, want_k = p.q.clone(), p.k_new.clone()
    apply_rotary_reference(want_q, want_k, cos, sin)
    rotary_store_kv(q, k, p.v_new, cos, sin, p.k_cache, p.v_cache, p.slot_mapping)
    _close(f"rotary_store_kv q {kind} {case}", q, want_q, dtype)
    flat_k = p.k_cache.reshape(-1, *p.k_cache.shape[2:])
    flat_v = p.v_cache.reshape(-1, *p.v_cache.shape[2:])
    _close(f"rotary_store_kv k cache {kind} {case}", flat_k[p.slot_mapping], want_k, dtype)
    _close(f"rotary_store_kv v cache {kind} {case}", flat_v[p.slot_mapping], p.v_new, dtype)
    _no_stray_writes(f"rotary_store_kv {kind} {case}", p)
    return 1


def _cos_sin(case: KernelCase, t: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(t, case.head_dim // 2, generator=torch.Generator().manual_seed(seed)) * 6
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(DTYPES[case.dtype]).to(device)
                for f in (torch.cos, torch.sin))
    return cos, sin


def _decode_rope(specs: tuple[tuple[int, int], ...], case: KernelCase, device: str, seed: int) -> int:
    """Decode attention with RoPE and the K/V store inside its split kernel (``rope=RopeStore``) against
    ``rotary_store_kv`` then the plain decode kernel on a copy of the same step; nothing written outside
    the sequences' slots. Returns the number of kernel launches."""
    from engine.ops.paged_decode import RopeStore, paged_decode_attention
    from engine.ops.rotary_store import rotary_store_kv

    p, ref = _paged(specs, case, device, seed), _paged(specs, case, device, seed)
    cos, sin = _cos_sin(case, p.k_new.shape[0], seed, p.q.device)
    q, k = ref.q.clone(), ref.k_new.clone()
    rotary_store_kv(q, k, ref.v_new, cos, sin, ref.k_cache, ref.v_cache, ref.slot_mapping)
    scale, splits = case.head_dim ** -0.5, case.num_splits[-1]
    want = paged_decode_attention(q, ref.k_cache, ref.v_cache, ref.block_tables, ref.seq_lens,
                                  ref.max_seq_len, scale, num_splits=splits)
    rope = RopeStore(p.k_new, p.v_new, cos, sin, p.slot_mapping)
    got = paged_decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, p.max_seq_len, scale,
                                 num_splits=splits, rope=rope)
    name = f"paged_decode_attention rope {case}"
    _close(name, got, want, DTYPES[case.dtype])
    if not (torch.equal(p.k_cache, ref.k_cache) and torch.equal(p.v_cache, ref.v_cache)):
        raise AssertionError(f"{name}: the cache differs from rotary_store_kv's")
    _no_stray_writes(name, p)
    return 5  # rotary_store_kv + two decode launches, twice


def run_layer_ops(case: KernelCase, device: str, seed: int) -> int:
    """``rms_norm`` (plain and residual), ``apply_rotary`` and ``silu_mul`` at 1, 3 and 17 tokens, each
    against its reference; the V part of the QKV rows must stay untouched by the rotary. Returns the
    number of kernel launches. Raises AssertionError naming the kernel on a mismatch."""
    from engine.ops.rms_norm import rms_norm, rms_norm_reference
    from engine.ops.rotary import apply_rotary, apply_rotary_reference
    from engine.ops.silu_mul import silu_mul, silu_mul_reference

    dtype, gen = DTYPES[case.dtype], torch.Generator().manual_seed(seed)
    hkv, h, d = case.num_kv_heads, case.num_kv_heads * case.gqa, case.head_dim
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dtype).to(device)  # noqa: E731
    for t in (1, 3, 17):
        x, res, w = rnd(t, h * d), rnd(t, h * d), rnd(h * d)
        _close(f"rms_norm {case} T={t}", rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5), dtype)
        res_ref = res.clone()
        _close(f"rms_norm+residual {case} T={t}", rms_norm(x, w, 1e-5, res),
               rms_norm_reference(x, w, 1e-5, res_ref), dtype)
        _close(f"rms_norm residual update {case} T={t}", res, res_ref, dtype)
        qkv, angles = rnd(t, (h + 2 * hkv) * d), torch.rand(t, d // 2, generator=gen).to(device) * 6
        cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
        want = qkv.clone()
        views = [(buf[:, : h * d].view(t, h, d), buf[:, h * d:(h + hkv) * d].view(t, hkv, d))
                 for buf in (qkv, want)]
        apply_rotary(*views[0], cos, sin)
        apply_rotary_reference(*views[1], cos, sin)
        _close(f"apply_rotary {case} T={t}", qkv, want, dtype)
        if not torch.equal(qkv[:, (h + hkv) * d:], want[:, (h + hkv) * d:]):
            raise AssertionError(f"apply_rotary {case} T={t}: wrote into the V columns")
        gate_up = rnd(t, 2 * (3 * h * d + 7))
        _close(f"silu_mul {case} T={t}", silu_mul(gate_up), silu_mul_reference(gate_up), dtype)
    return 3 * 4


def run_gemv(case: KernelCase, device: str, seed: int) -> int:
    """The one-row ``gemv``, plain and gated (SiLU·mul folded in), with the tiles of each class of
    ``gemv_tile`` (N <= 2048, <= 4096, in between, >= 16384) and a K that is no multiple of the tile,
    against ``gemv_reference``. On a GPU N is of the class (1000, 3000, 6000, 17000); on the CPU every
    class runs at N = 61 with its tiles passed explicitly (the interpreter runs each program as Python:
    N = 17000 is 8,500 programs, minutes; 61 is no multiple of any ``block_n`` above 1, so the 2-, 4- and
    8-row tiles end in a masked row tail). Returns the number of kernel launches. Raises AssertionError on
    a mismatch."""
    from engine.ops.gemv import gemv, gemv_reference, gemv_tile

    dtype, gen = DTYPES[case.dtype], torch.Generator().manual_seed(seed + 7)
    k = case.num_kv_heads * case.gqa * case.head_dim + 7
    for n in (1000, 3000, 6000, 17000):
        rows = n if device != "cpu" else 61
        (pn, pk, pw), (gn, gk, gw) = gemv_tile(n, False, k), gemv_tile(n, True, k)
        w = (torch.randn(rows, k, generator=gen) * 0.05).to(dtype).to(device)
        x, gate_up = (torch.randn(1, m, generator=gen).to(dtype).to(device) for m in (k, 2 * k))
        _close(f"gemv {case} N={rows} K={k} tile {(pn, pk, pw)}",
               gemv(x, w, block_n=pn, block_k=pk, num_warps=pw), gemv_reference(x, w), dtype)
        _close(f"gemv gated {case} N={rows} K={k} tile {(gn, gk, gw)}",
               gemv(gate_up, w, gated=True, block_n=gn, block_k=gk, num_warps=gw),
               gemv_reference(gate_up, w, gated=True), dtype)
    return 4 * 2


def run(tiny: bool, device: str) -> dict[str, Any]:
    """Run the whole grid; returns ``{"device", "cases", "kernel_launches", "seconds", "interpreter"}``.
    Raises AssertionError on the first mismatch (named)."""
    started = time.perf_counter()
    grid = shape_grid(tiny)
    launches = 0
    for i, case in enumerate(grid):
        n = run_case(case, device, seed=i)
        launches += n
        print(f"sanitize_driver: ok {case} ({n} launches)", flush=True)
    return {"device": device, "cases": [asdict(c) for c in grid], "kernel_launches": launches,
            "seconds": time.perf_counter() - started,
            "interpreter": os.environ.get("TRITON_INTERPRET") == "1"}


def main(argv: list[str] | None = None) -> int:
    """CLI entry: returns 0 when every kernel matched its reference, 1 on a mismatch, 2 on bad arguments."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU-interpreter sized grid")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    args = parser.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        print(f"sanitize_driver: --device {args.device} but CUDA is not available", file=sys.stderr)
        return 2
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("sanitize_driver: on CPU set TRITON_INTERPRET=1 before Triton is imported", file=sys.stderr)
        return 2
    try:
        result = run(args.tiny, args.device)
    except AssertionError as exc:
        print(f"sanitize_driver: MISMATCH {exc}", file=sys.stderr)
        return 1
    print(f"sanitize_driver: {len(result['cases'])} cases, {result['kernel_launches']} kernel launches, "
          f"all match their references ({result['seconds']:.1f} s)")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
