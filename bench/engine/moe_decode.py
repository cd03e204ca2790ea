"""Decode of a mixture of experts against the HBM roofline of the bytes a step really reads (not a test).

A decode step of a mixture of experts does not read every weight: each sparse layer reads only the
experts that some row of the batch was routed to. So the roofline here counts, per step,

    bytes = dense weights (attention, norms, routers, dense layers, shared experts, LM head; not the
            input embedding, which is gathered)
          + sum over sparse layers of (distinct experts routed to in that layer) * (bytes of one expert)
          + batch * (context + new_tokens / 2) * KV bytes per token

    roofline tok/s = batch * bandwidth / bytes

The distinct experts are measured, not assumed: after the timed repeats, ``--probe-steps`` decode steps
of the same batch and context run eagerly (no CUDA graph, so forward hooks on every router fire) and
record, per layer, how many distinct experts the step's rows chose; their mean enters the roofline.
Bandwidth: the best of 20 device-to-device copies in the same process (``bench.ceilings.copy_bandwidth``).
Also printed: the share of the "every expert" roofline (the whole model read per step) for comparison,
and the expected distinct count under uniform routing, ``E (1 - (1 - k / E)^B)``.

Decode tok/s come from ``bench.engine.decode.decode_rate`` (CUDA graphs and asynchronous scheduling as
the engine runs them by default on CUDA; tokens counted exactly).

    python3 -m bench.engine.moe_decode --model qwen3-30b-a3b --device cuda --dtype bfloat16 \
        --batches 1 32 --context 1024 --new-tokens 64 --num-blocks 8192
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.ceilings import copy_bandwidth
from bench.common import sync
from bench.engine.decode import decode_rate, enter_decodes
from bench.timing import Spread
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.models.fused_model import FusedCausalLM


@dataclass(frozen=True)
class MoEWeights:
    """Weight bytes of a loaded mixture of experts, split by what a decode step reads.

    Attributes:
        dense_bytes: every parameter outside the routed experts, except the input embedding.
        expert_bytes: per sparse layer (in layer order), the bytes of one routed expert (gate, up, down).
        num_experts: routed experts per sparse layer.
        top_k: experts per token.
    """

    dense_bytes: int
    expert_bytes: tuple[int, ...]
    num_experts: int
    top_k: int

    @property
    def all_bytes(self) -> int:
        """Bytes of the whole model but the input embedding (every expert read)."""
        return self.dense_bytes + self.num_experts * sum(self.expert_bytes)


def sparse_layers(model: Any) -> list[Any]:  # a transformers causal LM
    """The sparse MoE blocks (``mlp`` with ``experts`` and a router ``gate``) in layer order."""
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def moe_weights(model: Any) -> MoEWeights:  # a transformers causal LM
    """Split ``model``'s parameter bytes (``MoEWeights``). Raises ValueError for a model without sparse
    layers."""
    blocks = sparse_layers(model)
    if not blocks:
        raise ValueError("the model has no sparse MoE layer: use bench.engine.throughput")
    expert_ids: set[int] = set()
    per_layer = []
    for block in blocks:
        params = list(block.experts.parameters())  # FP8 experts: their scales too
        expert_ids.update(id(p) for p in params)
        total = sum(p.numel() * p.element_size() for p in params)
        per_layer.append(total // block.experts.gate_up_proj.shape[0])
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if id(p) not in expert_ids and "embed_tokens" not in n)
    cfg = model.config
    num_experts = int(blocks[0].experts.gate_up_proj.shape[0])
    return MoEWeights(dense, tuple(per_layer), num_experts, int(cfg.num_experts_per_tok))


def uniform_distinct(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts of one layer when ``batch`` rows each pick ``top_k`` experts uniformly."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def probe_distinct(core: EngineCore, batch: int, context: int, steps: int) -> list[float]:
    """Mean distinct experts per sparse layer over ``steps`` eager decode steps of ``batch`` rows with
    ``context`` tokens of KV (the fused forward's ``route_observer``, or forward hooks on the routers of a
    plain transformers forward; the decode graphs are set aside meanwhile)."""
    runner = core.runner
    blocks = sparse_layers(runner.model)
    counts: list[list[int]] = [[] for _ in blocks]
    position = {i: n for n, i in enumerate(i for i, layer in enumerate(runner.model.model.layers)
                                           if hasattr(layer.mlp, "experts"))}

    def observe(layer_index: int, ids: torch.Tensor) -> None:
        counts[position[layer_index]].append(int(torch.unique(ids).numel()))

    def hook(index: int) -> Any:
        def record(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            counts[index].append(int(torch.unique(output[2]).numel()))  # output: (logits, weights, ids)
        return record

    fused = runner.net if isinstance(runner.net, FusedCausalLM) else None
    handles = []
    if fused is not None:
        fused.route_observer = observe
    else:
        handles = [block.gate.register_forward_hook(hook(i)) for i, block in enumerate(blocks)]
    graphs, mode = runner.decode_graphs, core.async_scheduling
    runner.decode_graphs, core.async_scheduling = None, False
    try:
        enter_decodes(core, batch, context, steps + 1, f"probe{time.monotonic_ns()}")
        while core.has_unfinished():
            core.step()
        sync(runner.device)
    finally:
        runner.decode_graphs, core.async_scheduling = graphs, mode
        if fused is not None:
            fused.route_observer = None
        for handle in handles:
            handle.remove()
    core.check_no_leaks()
    return [sum(c) / len(c) for c in counts]


def build_engine(args: argparse.Namespace) -> EngineCore:
    """The engine of ``args``: prefix caching off, token budget for the largest batch."""
    return EngineCore(EngineConfig(
        ModelConfig(args.model, dtype=args.dtype, load_format=args.load_format, device=args.device,
                    attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                    max_model_len=args.max_model_len, quantization=args.quantization),
        CacheConfig(block_size=16, num_blocks=args.num_blocks, enable_prefix_caching=False),
        SchedulerConfig(max_num_seqs=max(args.batches), max_num_batched_tokens=2048),
    ))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Decode tok/s per batch against the active-expert roofline (module docstring); returns the
    JSON-ready result."""
    core = build_engine(args)
    runner = core.runner
    weights = moe_weights(runner.model)
    kv_token = runner.kv_cache.bytes_per_block // runner.kv_cache.block_size
    copies = copy_bandwidth(runner.device, args.copy_bytes)
    bandwidth = copies.max
    print(f"model {args.model}: dense weights {weights.dense_bytes / 1e9:.3f} GB, "
          f"{len(weights.expert_bytes)} sparse layers x {weights.num_experts} experts of "
          f"{weights.expert_bytes[0] / 1e6:.2f} MB, top-{weights.top_k}; "
          f"all weights {weights.all_bytes / 1e9:.3f} GB; KV {kv_token} B/token", flush=True)
    print(f"copy bandwidth (read + write): best {bandwidth / 1e12:.3f} TB/s, "
          f"{copies.scaled(1e-12).fmt('.3f', ' TB/s')}", flush=True)
    res: dict[str, Any] = {"model": args.model, "device": str(runner.device),
                           "dense_bytes": weights.dense_bytes, "expert_bytes": list(weights.expert_bytes),
                           "num_experts": weights.num_experts,
                           "top_k": weights.top_k, "kv_bytes_per_token": kv_token,
                           "copy_bandwidth": copies.as_dict(), "rows": []}
    decode_rate(core, 1, 16, 4)  # warm-up: Triton compiles, graphs replayed once
    for batch in args.batches:
        rates = Spread.of([decode_rate(core, batch, args.context, args.new_tokens)
                           for _ in range(args.repeats)])
        distinct = probe_distinct(core, batch, args.context, args.probe_steps)
        kv_read = batch * kv_token * (args.context + args.new_tokens / 2)
        expert_read = sum(d * b for d, b in zip(distinct, weights.expert_bytes, strict=True))
        step_bytes = weights.dense_bytes + expert_read + kv_read
        roofline = batch * bandwidth / step_bytes
        roofline_all = batch * bandwidth / (weights.all_bytes + kv_read)
        mean_distinct = sum(distinct) / len(distinct)
        share = rates.scaled(100 / roofline)
        res["rows"].append(dict(batch=batch, context=args.context, tok_s=rates.as_dict(),
                                distinct_experts_per_layer=distinct, step_read_bytes=step_bytes,
                                roofline=roofline, roofline_all_experts=roofline_all))
        print(f"batch {batch:4d} context {args.context}: {rates.fmt('9.1f', ' tok/s')}; distinct experts "
              f"per layer {mean_distinct:.1f} of {weights.num_experts} (uniform routing: "
              f"{uniform_distinct(weights.num_experts, weights.top_k, batch):.1f}); step reads "
              f"{step_bytes / 1e9:.3f} GB", flush=True)
        print(f"    = engine / active-expert roofline {share.fmt('.1f', ' %')} of {roofline:9.1f} tok/s; "
              f"engine / every-expert roofline {rates.median * 100 / roofline_all:.1f} % of "
              f"{roofline_all:9.1f} tok/s", flush=True)
    return res


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b", help="a mixture-of-experts alias or HF directory")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: experts and decoder projections quantized per row on load")
    p.add_argument("--load-format", default="auto", help="auto (aliases: dummy weights) or dummy")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from free memory)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--context", type=int, default=1024, help="KV tokens per sequence")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per batch")
    p.add_argument("--probe-steps", type=int, default=8, help="eager steps that count distinct experts")
    p.add_argument("--copy-bytes", type=int, default=1 << 30, help="size of the bandwidth ceiling's copy")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and run."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.new_tokens < 2 or args.probe_steps < 1:
        parser.error("need --repeats >= 1, --new-tokens >= 2 and --probe-steps >= 1")
    result = run(args)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
