"""Paged prefill attention over a long cached prefix, against torch SDPA flash (not a test).

A multi-turn session with prefix reuse computes only each turn's new tokens, but they attend over the
whole cached context. For each case ``SxNxC`` (``S`` sequences, ``N`` new tokens each, ``C`` cached
tokens before them) at Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, bf16, the
engine's ``block_size``, blocks scattered by a random permutation) this times
``engine.ops.paged_prefill.paged_prefill_attention`` and reports ms per call (median and min–max of
``--repeats`` event-timed calls after the check's call and 3 warm-up ones), TFLOP/s at the median, and
the ratio to a same-run ceiling: SDPA flash (``torch.nn.attention.sdpa_kernel(FLASH_ATTENTION)`` with
``torch.nn.attention.bias.causal_lower_right``, which FlashAttention-2 runs natively) over the same K/V
gathered contiguous and expanded to 32 heads, the best of at least 20 calls in the same process, taken
right before the case's kernel calls. Both sides do the same work: query ``i`` sees the ``C`` cached
keys and new keys ``0..i`` (bottom-right causal). FLOPs counted: ``4 x head_dim`` per visible
(query, key) pair per query head, ``S x H x (N x C + N (N + 1) / 2)`` pairs. The same few hundred MB of
K/V are read by every repeat, so a case whose KV fits the 50 MB L2 (C <= 8k, one sequence) is read
warm by both sides. Each output is checked against SDPA's (max |diff| / max |SDPA|).

    python -m bench.kernels.prefill_attention --json prefill_attention.json

``--candidates`` sweeps the kernel's variants (``CANDIDATES``: tiles ``(BLOCK_M, BLOCK_N, num_warps,
num_stages)``, GQA packing, longest-first launch order) over the same cases, every one timed and checked
as above (a failed compile or a check above ``CHECK_TOL`` is named and never best), and names the best
per case and overall (the smallest geometric mean over the cases of its time over the case's best
SDPA time):

    python -m bench.kernels.prefill_attention --candidates --json prefill_attention_candidates.json

``--device cpu`` runs tiny shapes (4 heads, 2 KV heads, head_dim 32, float32) through Triton's
interpreter: a smoke test of the harness, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.timing import MIN_CEILING_REPEATS, Spread, ceiling_seconds, time_calls
from engine.config import CacheConfig

BLOCK_SIZE = CacheConfig().block_size
CHECK_TOL = 2e-2  # max |out - SDPA| / max |SDPA|: bf16 rounding of both outputs


@dataclass(frozen=True)
class Shape:
    """Attention heads of the model: query heads, KV heads, head_dim, dtype."""

    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype


GPU_SHAPE = Shape(32, 8, 128, torch.bfloat16)  # Llama-3-8B
CPU_SHAPE = Shape(4, 2, 32, torch.float32)


@dataclass(frozen=True)
class Case:
    """``seqs`` sequences, each ``new`` tokens computed over ``context`` cached ones."""

    seqs: int
    new: int
    context: int

    @property
    def label(self) -> str:
        return f"{self.seqs}x{self.new}x{self.context}"

    def pairs(self) -> int:
        """Visible (query, key) pairs per query head, all sequences: bottom-right causal."""
        return self.seqs * (self.new * self.context + self.new * (self.new + 1) // 2)

    def flops(self, shape: Shape) -> float:
        """``4 x head_dim`` per visible pair per query head (QK^T and PV, a multiply-add each)."""
        return 4.0 * shape.head_dim * shape.heads * self.pairs()

    @classmethod
    def parse(cls, text: str) -> Case:
        """``"SxNxC"``. Raises ValueError for another form or a count below (1, 1, 0)."""
        parts = text.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"a case is SEQSxNEWxCONTEXT, e.g. 1x770x15360; got {text!r}")
        seqs, new, context = (int(p) for p in parts)
        if seqs < 1 or new < 1:
            raise ValueError(f"case {text!r}: needs at least one sequence and one new token")
        return cls(seqs, new, context)


GPU_CASES = tuple(Case.parse(c) for c in ("1x770x0", "1x770x4096", "1x770x8192", "1x770x15360", "8x770x0",
                                          "8x770x15360", "1x8192x0"))
CPU_CASES = tuple(Case.parse(c) for c in ("1x5x0", "1x7x20", "2x9x33"))


@dataclass(frozen=True)
class Candidate:
    """One way to run the kernel: ``tile`` None is ``prefill_tiles``' choice, ``pack_gqa`` None
    ``prefill_pack_gqa``'s, ``longest_first`` None the kernel's (the engine's defaults)."""

    tile: tuple[int, int, int, int] | None = None
    pack_gqa: bool | None = None
    longest_first: bool | None = None
    num_splits: int | None = None  # None: prefill_kv_splits' choice (the engine's default)

    @property
    def label(self) -> str:
        tile = "default tile" if self.tile is None else "{} x {}, {} warps, {} stages".format(*self.tile)
        packing = {None: "", True: ", GQA packed", False: ", not packed"}[self.pack_gqa]
        splits = "" if self.num_splits is None else f", KV in {self.num_splits}"
        order = {None: "", True: ", longest first", False: ", in order"}[self.longest_first]
        return tile + packing + order + splits


# BLOCK_M counts rows: with GQA packing 4 query heads per token, so 128 rows are 32 tokens
_PLAIN_TILES = ((64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 32, 4, 3), (64, 128, 8, 2),
                (128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 4, 2), (128, 32, 4, 3), (128, 128, 8, 2))
_PACKED_TILES = ((64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 4, 2), (128, 64, 8, 3), (128, 64, 4, 3),
                 (128, 64, 8, 2), (128, 32, 4, 3), (128, 128, 8, 2), (256, 64, 8, 2))
_SMALL_PACKED_TILES = ((32, 64, 4, 3), (32, 64, 2, 3), (32, 128, 4, 2))  # 8 tokens x 4 heads: more programs
CANDIDATES = (Candidate(), *(Candidate(num_splits=n) for n in (1, 2, 3, 4, 6)),
              *(Candidate(t, pack_gqa=False) for t in _PLAIN_TILES),
              *(Candidate(t, pack_gqa=True) for t in (*_PACKED_TILES, *_SMALL_PACKED_TILES)),
              Candidate(longest_first=True), Candidate((128, 64, 8, 3), pack_gqa=True, longest_first=True),
              Candidate((128, 64, 8, 3), pack_gqa=True, num_splits=2))
CPU_CANDIDATES = (Candidate(), Candidate((32, 32, 1, 1), pack_gqa=False),
                  Candidate((16, 16, 1, 1), pack_gqa=True), Candidate((32, 16, 1, 1), pack_gqa=True,
                                                                       longest_first=True),
                  Candidate(num_splits=2))


@dataclass
class Inputs:
    """One case's tensors: the paged step (``q [S N, H, D]``, caches, block tables, lengths) and the same
    K/V gathered for SDPA (``sdpa_q [S, H, N, D]``, ``sdpa_k`` / ``sdpa_v [S, H, C + N, D]``)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    sdpa_q: torch.Tensor
    sdpa_k: torch.Tensor
    sdpa_v: torch.Tensor


def make_inputs(case: Case, shape: Shape, device: torch.device, block_size: int = BLOCK_SIZE,
                seed: int = 0) -> Inputs:
    """Random ``q`` and K/V for ``case``; each sequence's KV in scattered blocks of ``block_size``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    s, n, total = case.seqs, case.new, case.context + case.new
    per_seq = math.ceil(total / block_size)
    tables = torch.randperm(s * per_seq, generator=gen, device=device).to(torch.int32).view(s, per_seq)
    k, v = (torch.randn(s, total, shape.kv_heads, shape.head_dim, generator=gen, device=device
                        ).to(shape.dtype) for _ in range(2))
    pos = torch.arange(total, device=device)
    slots = tables[:, pos // block_size].long() * block_size + pos % block_size  # [S, total]
    caches = []
    for t in (k, v):
        cache = torch.zeros(s * per_seq, block_size, shape.kv_heads, shape.head_dim, dtype=shape.dtype,
                            device=device)
        cache.view(-1, shape.kv_heads, shape.head_dim)[slots.reshape(-1)] = t.reshape(-1, *t.shape[2:])
        caches.append(cache)
    q = torch.randn(s * n, shape.heads, shape.head_dim, generator=gen, device=device).to(shape.dtype)
    group = shape.heads // shape.kv_heads
    return Inputs(
        q=q, k_cache=caches[0], v_cache=caches[1], block_tables=tables,
        seq_lens=torch.full((s,), total, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(0, s * n + 1, n, dtype=torch.int32, device=device),
        sdpa_q=q.view(s, n, shape.heads, shape.head_dim).transpose(1, 2),
        sdpa_k=k.repeat_interleave(group, dim=2).transpose(1, 2).contiguous(),
        sdpa_v=v.repeat_interleave(group, dim=2).transpose(1, 2).contiguous())


def sdpa_call(inp: Inputs, scale: float) -> Callable[[], torch.Tensor]:
    """SDPA with the bottom-right causal mask (``causal_lower_right``); the flash backend only on CUDA (an
    error rather than a slower backend), the default choice on CPU. The call returns ``[S, H, N, D]``.

    Raises:
        RuntimeError: on CUDA, inputs flash attention cannot run.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = inp.sdpa_q, inp.sdpa_k, inp.sdpa_v
    mask = causal_lower_right(q.shape[2], k.shape[2])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if not q.is_cuda:
        return lambda: sdpa(q, k, v, attn_mask=mask, scale=scale)

    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    # causal_lower_right falls back to another kernel, outside sdpa_kernel's reach, when flash cannot run
    if not can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, False), debug=True):
        raise RuntimeError("SDPA flash attention cannot run these inputs (see the warning above)")

    def flash() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(q, k, v, attn_mask=mask, scale=scale)
    return flash


def cudnn_call(inp: Inputs, scale: float) -> Callable[[], torch.Tensor]:
    """SDPA through cuDNN's fused attention (Hopper kernels) with a top-left causal mask: the same work
    as ``sdpa_call`` only where every sequence has no cached context (square causal). Information beside
    the ceiling, not the ceiling: the paged kernel runs the bottom-right masks cuDNN is not asked for."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = inp.sdpa_q, inp.sdpa_k, inp.sdpa_v
    if q.shape[2] != k.shape[2]:
        raise ValueError("cuDNN is timed on cases without cached context only")

    def cudnn() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return cudnn


def kernel_call(inp: Inputs, scale: float, cand: Candidate) -> Callable[[], torch.Tensor]:
    """``paged_prefill_attention`` over the whole case with ``cand``'s options; returns ``[S N, H, D]``."""
    from engine.ops.paged_prefill import paged_prefill_attention

    out = torch.empty_like(inp.q)
    max_query_len = int(inp.q.shape[0] // inp.block_tables.shape[0])
    max_seq_len = int(inp.sdpa_k.shape[2])
    return lambda: paged_prefill_attention(
        inp.q, inp.k_cache, inp.v_cache, inp.block_tables, inp.seq_lens, inp.query_start_loc,
        max_query_len, scale, out=out, tile=cand.tile, pack_gqa=cand.pack_gqa,
        longest_first=cand.longest_first, max_seq_len=max_seq_len, num_splits=cand.num_splits)


def cudnn_paged_call(inp: Inputs, scale: float) -> Callable[[], torch.Tensor]:
    """The same case through cuDNN's paged attention (``engine.ops.cudnn_paged_prefill``, the graph of the
    case's own bucket, inputs built once as a step does); returns ``[S N, H, D]``.

    Raises:
        RuntimeError: no cuDNN frontend, or cuDNN refused the bucket.
    """
    from engine.ops.cudnn_paged_prefill import (
        cudnn_paged_prefill,
        frontend_available,
        paged_graph_key,
        paged_prefill_graph,
        paged_prefill_inputs,
    )

    if not frontend_available():
        raise RuntimeError("the cuDNN frontend (nvidia-cudnn-frontend) is not installed")
    seqs = inp.block_tables.shape[0]
    key = paged_graph_key(inp.q, inp.k_cache, seqs, inp.q.shape[0] // seqs, int(inp.sdpa_k.shape[2]))
    if paged_prefill_graph(key) is None:
        raise RuntimeError(f"cuDNN refused the bucket {key}")
    inputs = paged_prefill_inputs(key, inp.block_tables, inp.seq_lens, inp.query_start_loc, 0, 0, scale)
    out = torch.empty_like(inp.q)

    def call() -> torch.Tensor:
        cudnn_paged_prefill(inp.q, inp.k_cache, inp.v_cache, inputs, out, 0)
        return out
    return call


def rel_error(out: torch.Tensor, sdpa_out: torch.Tensor) -> float:
    """max |out - SDPA| / max |SDPA| with ``out [S N, H, D]`` and ``sdpa_out [S, H, N, D]``."""
    s, h, n, d = sdpa_out.shape
    ref = sdpa_out.transpose(1, 2).reshape(s * n, h, d).float()
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def measure_case(case: Case, shape: Shape, device: torch.device, cands: tuple[Candidate, ...],
                 repeats: int) -> dict[str, Any]:
    """The ceiling and every candidate on one case; prints one markdown row per candidate."""
    inp = make_inputs(case, shape, device)
    scale = shape.head_dim ** -0.5
    flops = case.flops(shape)
    sdpa = sdpa_call(inp, scale)
    ref = sdpa()
    ceiling = ceiling_seconds(sdpa, device, max(repeats, MIN_CEILING_REPEATS))
    ceiling_tflops = ceiling.per(flops / 1e12)
    res: dict[str, Any] = {"case": case.label, "flops": flops, "sdpa_seconds": ceiling.as_dict(),
                           "sdpa_tflops": ceiling_tflops.as_dict(), "rows": []}
    if device.type == "cuda" and case.context == 0:
        try:
            cudnn = cudnn_call(inp, scale)
            err = rel_error(cudnn().transpose(1, 2).reshape(inp.q.shape), ref)
            best = ceiling_seconds(cudnn, device, max(repeats, MIN_CEILING_REPEATS))
            res["cudnn"] = {"seconds": best.as_dict(), "tflops": flops / best.min / 1e12, "rel_err": err}
            print(f"# {case.label}: cuDNN SDPA best {best.min * 1e3:.3f} ms, {flops / best.min / 1e12:.1f} "
                  f"TFLOP/s (err {err:.1e}); SDPA flash best {ceiling.min * 1e3:.3f} ms", flush=True)
        except Exception as exc:  # cuDNN attention absent or refusing these inputs: named, skipped
            res["cudnn"] = {"failed": f"{type(exc).__name__}: {str(exc)[:160]}"}
            print(f"# {case.label}: cuDNN SDPA failed: {res['cudnn']['failed']}", flush=True)
    if device.type == "cuda":
        res["cudnn_paged"] = _cudnn_paged_row(case, inp, scale, ref, flops, repeats)
    for cand in cands:
        fn = kernel_call(inp, scale, cand)
        row: dict[str, Any] = {"candidate": cand.label, "pack_gqa": cand.pack_gqa,
                               "tile": None if cand.tile is None else list(cand.tile),
                               "longest_first": cand.longest_first, "num_splits": cand.num_splits}
        try:
            err = rel_error(fn(), ref)
            t = Spread.of(time_calls(fn, device, warmup=3 if device.type == "cuda" else 0, repeats=repeats))
        except Exception as exc:  # a tile that does not fit (shared memory, registers): named, skipped
            row["failed"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            res["rows"].append(row)
            print(f"| {case.label} | {cand.label} | failed: {row['failed']} | | | | | |", flush=True)
            continue
        ok = err <= CHECK_TOL
        ratio = ceiling.min / t.median  # this kernel's TFLOP/s (median) over the ceiling's (best)
        row.update(seconds=t.as_dict(), tflops=flops / t.median / 1e12, over_sdpa=ratio, rel_err=err, ok=ok)
        res["rows"].append(row)
        print(f"| {case.label} | {cand.label} | {t.scaled(1e3).fmt('.3f')} | {flops / t.median / 1e12:.1f} | "
              f"{ceiling.min * 1e3:.3f} ({ceiling.median * 1e3:.3f} median, n={ceiling.n}) | "
              f"{ceiling_tflops.max:.1f} | {ratio:.2f} | {err:.1e}{'' if ok else ' MISMATCH'} |", flush=True)
    good = [r for r in res["rows"] if r.get("ok")]
    if good:
        best = max(good, key=lambda r: r["over_sdpa"])
        res["best"] = {"candidate": best["candidate"], "over_sdpa": best["over_sdpa"]}
    del inp, ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def _cudnn_paged_row(case: Case, inp: Inputs, scale: float, ref: torch.Tensor, flops: float,
                     repeats: int) -> dict[str, Any]:
    """cuDNN's paged attention on the case beside the default kernel, both timed by ``time_calls`` (3
    warm-up calls, then ``repeats``) in turn; prints one comment line with the ratio of their medians."""
    device = inp.q.device
    try:
        cudnn = cudnn_paged_call(inp, scale)
        err = rel_error(cudnn(), ref)
    except Exception as exc:  # no frontend, or cuDNN refusing the bucket: named, skipped
        print(f"# {case.label}: cuDNN paged failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        return {"failed": f"{type(exc).__name__}: {str(exc)[:160]}"}
    triton = kernel_call(inp, scale, Candidate())
    t_cudnn = Spread.of(time_calls(cudnn, device, warmup=3, repeats=repeats))
    t_triton = Spread.of(time_calls(triton, device, warmup=3, repeats=repeats))
    ratio = t_cudnn.median / t_triton.median
    print(f"# {case.label}: cuDNN paged {t_cudnn.scaled(1e3).fmt('.3f', ' ms')}, "
          f"{flops / t_cudnn.median / 1e12:.1f} TFLOP/s (err {err:.1e}); default kernel "
          f"{t_triton.scaled(1e3).fmt('.3f', ' ms')}; cuDNN / kernel time (medians) {ratio:.2f}", flush=True)
    return {"seconds": t_cudnn.as_dict(), "tflops": flops / t_cudnn.median / 1e12, "rel_err": err,
            "kernel_seconds": t_triton.as_dict(), "over_kernel_time": ratio}


def overall_best(cases: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The candidate with the smallest geometric mean of its median time over the case's best SDPA time,
    among those that ran and matched on every case; None when none did."""
    scores: dict[str, list[float]] = {}
    for case in cases:
        for row in case["rows"]:
            score = 1 / row["over_sdpa"] if row.get("ok") else math.inf
            scores.setdefault(row["candidate"], []).append(score)
    finite = {c: math.exp(sum(map(math.log, v)) / len(v)) for c, v in scores.items()
              if len(v) == len(cases) and all(math.isfinite(x) for x in v)}
    if not finite:
        return None
    best = min(finite, key=lambda c: finite[c])
    return {"candidate": best, "geomean_time_over_sdpa": finite[best],
            "default_geomean_time_over_sdpa": finite.get(Candidate().label)}


def run(cases: tuple[Case, ...], shape: Shape, device: torch.device, cands: tuple[Candidate, ...],
        repeats: int, json_path: Path | None = None) -> dict[str, Any]:
    """Every case (the JSON written after each one, so a run cut short keeps what it measured)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"# {name}; {shape.heads} q / {shape.kv_heads} KV heads, head_dim {shape.head_dim}, "
          f"{str(shape.dtype).removeprefix('torch.')}, block_size {BLOCK_SIZE}; {repeats} timed calls each")
    print("| case (seqs x new x context) | candidate | ms: median (min–max) | TFLOP/s | SDPA ms best | "
          "SDPA TFLOP/s best | ours / SDPA | max err / max SDPA |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    res: dict[str, Any] = {"device": name, "block_size": BLOCK_SIZE, "cases": []}
    for case in cases:
        res["cases"].append(measure_case(case, shape, device, cands, repeats))
        if json_path is not None:
            json_path.write_text(json.dumps(res, indent=2))
    if len(cands) > 1:
        res["best_overall"] = overall_best(res["cases"])
        print(f"best overall: {res['best_overall']}", flush=True)
    if json_path is not None:
        json_path.write_text(json.dumps(res, indent=2))
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse arguments and run; returns the JSON-ready result."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cases", nargs="+", default=None, metavar="SxNxC",
                   help="sequences x new tokens x cached context (default: the GPU or CPU list)")
    p.add_argument("--candidates", action="store_true", help="sweep the kernel's variants (CANDIDATES)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed calls per candidate (default 20 on a GPU, 1 on CPU)")
    p.add_argument("--json", type=Path, default=None, help="write the rows and winners here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    if gpu and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device")
    if not gpu and os.environ.get("TRITON_INTERPRET") != "1":
        p.error(f"--device {args.device} runs the Triton kernel through its interpreter: "
                "set TRITON_INTERPRET=1")
    try:
        cases = tuple(Case.parse(c) for c in args.cases) if args.cases else (GPU_CASES if gpu else CPU_CASES)
    except ValueError as exc:
        p.error(f"--cases: {exc}")
    repeats = args.repeats if args.repeats is not None else (20 if gpu else 1)
    if repeats < 1:
        p.error(f"--repeats must be >= 1, got {repeats}")
    cands = (CANDIDATES if gpu else CPU_CANDIDATES) if args.candidates else (Candidate(),)
    return run(cases, GPU_SHAPE if gpu else CPU_SHAPE, device, cands, repeats, args.json)


if __name__ == "__main__":
    main()
