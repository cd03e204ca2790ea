"""FP8 weights on one GPU: decode against the HBM roofline and bf16, prefill against an FP8 GEMM ceiling
(not a test).

Everything on the Llama-3-8B shape (``llama3-8b`` dummy weights, ``--quantization fp8``: each decoder
projection quantized per output channel on load, engine/ops/fp8_gemm.py): one-row steps (batch-1
decode) run the weight-only Triton ``fp8_gemv`` (engine/ops/fp8_gemv.py), larger ones ``torch._scaled_mm``
with dynamic per-token activation scales. With ``--block`` the projections are 128 x 128 block-scaled
instead (the layout of the Qwen3-FP8 / DeepSeek checkpoints) and multi-row steps run the Triton
``w8a8_block_gemm``. The bf16 peer is the same engine on the bf16 model (its one-row steps through
``engine.ops.gemv``).

1. Decode at batch 1, ``--context`` tokens of KV, ``--new-tokens`` output tokens (CUDA graphs and
   asynchronous scheduling as the engine runs by default; ``bench.engine.decode.decode_rate``), for the
   FP8 model and the bf16 model, in the same process. Each model's roofline counts the bytes one step
   really reads:

       bytes = every parameter except the input embedding (a gather): FP8 projections at 1 byte per weight
               plus their float32 scales, norms and the bf16 LM head at 2 bytes
             + (context + new_tokens / 2) * KV bytes per token

       roofline tok/s = copy bandwidth / bytes

   with the copy bandwidth (read + write, best of 20 1 GiB copies, ``bench.ceilings.copy_bandwidth``)
   measured in the same run. Printed: tok/s, tok/s / roofline, FP8 tok/s / bf16 tok/s.
2. Prefill of ``--prefill-tokens`` (8k) tokens, one step, timed from ``add_request`` to the first token
   (``bench.engine.prefill.time_prefill``), against the ceiling of the same FP8 GEMMs alone: for every
   decoder projection shape ``[T, K] x [K, N]`` (merged QKV, O, merged gate/up, down) a
   ``torch._scaled_mm`` with row-wise scales, event-timed, best of ``--gemm-repeats`` (>= 20), times the
   layer count. Printed: ceiling seconds / prefill seconds (the share of the prefill's time the GEMMs at
   their best would take; attention, norms and quantizing the activations are the rest). The prefill
   runs as the engine does (one fresh long prompt: attention through cuDNN, engine/ops/cudnn_attention.py)
   and again with the paged Triton attention kernel, both printed.

On an H200 (the exact command)::

    python -m bench.engine.fp8 --device cuda --context 1024 --new-tokens 128 --prefill-tokens 8192

Needs nothing outside the repository (dummy weights, synthetic tokenizer).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
from pathlib import Path
from typing import Any

import torch

from bench.ceilings import copy_bandwidth
from bench.engine.decode import decode_rate
from bench.engine.prefill import dummy_model_dir, time_prefill
from bench.timing import Spread, ceiling_seconds
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.models.fp8 import Fp8Linear
from engine.ops.fp8_gemm import quantize_fp8_groups
from engine.ops.fp8_weight import FP8_DTYPE

BLOCK_SIZE = 16


def _block_checkpoint_dir(base: Path) -> Path:
    """A copy of ``base``'s config that says "128 x 128 block-scaled FP8 checkpoint" (dummy weights)."""
    raw = json.loads((base / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [128, 128]}
    out = base.parent / f"{base.name}-fp8-block"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    return out


def make_core(args: argparse.Namespace, fp8: bool, max_tokens: int, graphs: bool) -> EngineCore:
    """The llama3-8b engine in bf16 (``fp8`` False) or FP8, for prompts of up to ``max_tokens``."""
    path = dummy_model_dir(args.model, max_tokens + BLOCK_SIZE)
    quantization = None
    if fp8 and args.block:
        path = _block_checkpoint_dir(path)
    elif fp8:
        quantization = "fp8"
    blocks = 2 * math.ceil((max_tokens + 1) / BLOCK_SIZE) + 8
    return EngineCore(EngineConfig(
        ModelConfig(str(path), dtype="bfloat16", load_format="dummy", device=args.device,
                    attention_backend="triton", max_model_len=max_tokens + BLOCK_SIZE,
                    enforce_eager=not graphs, quantization=quantization),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=blocks, enable_prefix_caching=False),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max(2048, max_tokens),
                        enable_chunked_prefill=False),
    ))


def step_weight_bytes(model: Any) -> int:  # a transformers causal LM
    """Bytes of the parameters a decode step reads: all but the input embedding (FP8 weights 1 byte each,
    their scales 4)."""
    embed = model.model.embed_tokens.weight
    total = 0
    for p in model.parameters():
        if p is not embed:
            total += p.numel() * p.element_size()
    return total


def projection_shapes(model: Any) -> list[tuple[str, int, int]]:  # a transformers causal LM
    """``(name, N, K)`` of one decoder layer's merged projections."""
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    qkv = attn.q_proj.out_features + attn.k_proj.out_features + attn.v_proj.out_features
    return [("qkv", qkv, attn.q_proj.in_features), ("o", attn.o_proj.out_features, attn.o_proj.in_features),
            ("gate_up", 2 * mlp.gate_proj.out_features, mlp.gate_proj.in_features),
            ("down", mlp.down_proj.out_features, mlp.down_proj.in_features)]


def scaled_mm_ceiling(shapes: list[tuple[str, int, int]], tokens: int, device: torch.device,
                      repeats: int) -> dict[str, Spread]:
    """Seconds of one row-wise-scaled ``torch._scaled_mm`` ``[tokens, K] x [K, N]`` per shape (best of
    ``repeats`` event-timed calls), activations already FP8."""
    out: dict[str, Spread] = {}
    for name, n, k in shapes:
        a = torch.randn(tokens, k, device=device).to(FP8_DTYPE)
        w = torch.randn(n, k, device=device).to(FP8_DTYPE)
        sa = torch.rand(tokens, 1, device=device) + 0.5
        sb = torch.rand(1, n, device=device) + 0.5
        def gemm(a: torch.Tensor = a, w: torch.Tensor = w, sa: torch.Tensor = sa,
                 sb: torch.Tensor = sb) -> torch.Tensor:
            return torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        out[name] = ceiling_seconds(gemm, device, repeats)
        del a, w
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both parts (module docstring); returns the JSON-ready result."""
    device = torch.device(args.device)
    copies = copy_bandwidth(device)
    bandwidth = copies.max
    print(f"# {torch.cuda.get_device_name(device)}; copy bandwidth (read + write) best "
          f"{bandwidth / 1e12:.3f} TB/s", flush=True)
    res: dict[str, Any] = {"copy_bandwidth": copies.as_dict(), "block": args.block, "decode": {}}
    for label, fp8 in (("bf16", False), ("fp8", True)):
        core = make_core(args, fp8, args.context + args.new_tokens + BLOCK_SIZE, graphs=True)
        model = core.runner.model
        n_fp8 = sum(isinstance(m, Fp8Linear) for m in model.modules())
        kv_token = core.runner.kv_cache.bytes_per_block // core.runner.kv_cache.block_size
        weights = step_weight_bytes(model)
        step_bytes = weights + kv_token * (args.context + args.new_tokens / 2)
        roofline = bandwidth / step_bytes
        decode_rate(core, 1, 16, 4)  # warm-up: Triton compiles, graphs replayed once
        rates = Spread.of([decode_rate(core, 1, args.context, args.new_tokens) for _ in range(args.repeats)])
        share = rates.scaled(100 / roofline)
        res["decode"][label] = dict(tok_s=rates.as_dict(), step_bytes=step_bytes, roofline=roofline,
                                    fp8_projections=n_fp8)
        print(f"decode {label}: {n_fp8} FP8 projections; step reads {step_bytes / 1e9:.3f} GB "
              f"(weights {weights / 1e9:.3f} GB, KV {kv_token} B/token); {rates.fmt('.1f', ' tok/s')} = "
              f"{share.fmt('.1f', ' %')} of the roofline {roofline:.1f} tok/s", flush=True)
        del core, model
        gc.collect()
        torch.cuda.empty_cache()
    ratio = res["decode"]["fp8"]["tok_s"]["median"] / res["decode"]["bf16"]["tok_s"]["median"]
    res["decode"]["fp8_over_bf16"] = ratio
    print(f"decode FP8 / bf16 tok/s (medians): {ratio:.2f}x", flush=True)

    core = make_core(args, True, args.prefill_tokens, graphs=False)
    shapes = projection_shapes(core.runner.model)
    layers = len(core.runner.model.model.layers)
    times = Spread.of(time_prefill(core, args.prefill_tokens, args.repeats))
    backend = core.runner.backend
    paged: Spread | None = None
    if getattr(backend, "cudnn_fresh_prefill", False):  # the same prefill with the paged Triton kernel
        backend.cudnn_fresh_prefill = backend.cudnn_paged_prefill = False  # type: ignore[attr-defined]
        paged = Spread.of(time_prefill(core, args.prefill_tokens, args.repeats))
        backend.cudnn_fresh_prefill = backend.cudnn_paged_prefill = True  # type: ignore[attr-defined]
    gemms = scaled_mm_ceiling(shapes, args.prefill_tokens, device, args.gemm_repeats)
    ceiling = layers * sum(s.min for s in gemms.values())
    x = torch.randn(args.prefill_tokens, shapes[0][2], device=device, dtype=torch.bfloat16)
    quant = ceiling_seconds(lambda: quantize_fp8_groups(x, x.shape[1]), device, args.gemm_repeats)
    res["prefill"] = dict(tokens=args.prefill_tokens, seconds=times.as_dict(), gemm_ceiling_seconds=ceiling,
                          gemm_seconds={k: v.as_dict() for k, v in gemms.items()},
                          share=ceiling / times.min, quantize_seconds=quant.min,
                          paged_attention_seconds=paged.as_dict() if paged is not None else None)
    for name, n, k in shapes:
        tflops = 2 * args.prefill_tokens * n * k / gemms[name].min / 1e12
        print(f"  _scaled_mm {name:8s} [{args.prefill_tokens}, {k}] x [{k}, {n}]: "
              f"{gemms[name].min * 1e3:.3f} ms ({tflops:.0f} TFLOP/s)", flush=True)
    print(f"prefill FP8 {args.prefill_tokens} tokens: {times.scaled(1e3).fmt('.1f', ' ms')}; the same FP8 "
          f"GEMMs alone ({layers} layers): {ceiling * 1e3:.1f} ms = {100 * ceiling / times.min:.1f} % of the "
          f"best prefill (one per-token activation quantization of [T, {shapes[0][2]}]: "
          f"{quant.min * 1e3:.3f} ms)", flush=True)
    if paged is not None:
        print(f"  the same prefill with the paged Triton attention instead of cuDNN: "
              f"{paged.scaled(1e3).fmt('.1f', ' ms')} (GEMMs alone {100 * ceiling / paged.min:.1f} %)",
              flush=True)
    return res


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b", help="a dense dummy alias")
    p.add_argument("--device", default="cuda")
    p.add_argument("--block", action="store_true",
                   help="128 x 128 block-scaled FP8 (Triton w8a8_block_gemm) instead of per-channel")
    p.add_argument("--context", type=int, default=1024, help="KV tokens at decode")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prefill-tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gemm-repeats", type=int, default=20)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and run (CUDA only)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        parser.error("needs a CUDA device (FP8 GEMMs: compute capability >= 8.9)")
    result = run(args)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
