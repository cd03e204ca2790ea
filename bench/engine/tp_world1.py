"""The tensor-parallel path at world size 1 against the plain engine, on one device.

Two ``EngineCore``s of the same model live side by side: the plain one (no ``torch.distributed``) and one
with ``ParallelConfig(force_distributed=True)`` (NCCL on CUDA, gloo on the CPU: per-rank shard loading,
``TensorParallelCausalLM`` with its all-reduces and all-gather, the step message path). Prints:

- greedy parity: the same prompts (prefill and decode, ``ignore_eos``) give the same tokens on both;
- decode tokens/s per batch size (``bench.engine.decode.decode_rate``: KV entered as landed, graphs and
  asynchronous scheduling as configured), paired repeats alternating the two engines, and the ratio
  tensor-parallel / plain (1.0 = no cost).

Dummy weights are drawn from the same seed with the same shapes at world size 1, so both engines hold the
same model. Usage (H200): ``python -m bench.engine.tp_world1 --model llama3-8b --batches 1 32``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.common import add_model_args, random_prompts
from bench.engine.decode import decode_rate
from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams


def greedy_tokens(core: EngineCore, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy ``ignore_eos`` continuations of ``prompts`` run as one continuous batch."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    tag = time.monotonic_ns()
    ids = {f"g{tag}-{i}": i for i in range(len(prompts))}
    got: list[list[int]] = [[] for _ in prompts]
    for rid, i in ids.items():
        core.add_request(rid, prompts[i], params)
    while core.has_unfinished():
        for out in core.step():
            got[ids[out.request_id]].append(out.token_id)
    core.check_no_leaks()
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--context", type=int, default=512, help="KV tokens per sequence before decode")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--parity-prompts", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    model = ModelConfig(args.model, dtype=args.dtype, device=args.device,
                        attention_backend=args.attention_backend, max_model_len=args.max_model_len)
    cache, sched = CacheConfig(num_blocks=args.num_blocks), SchedulerConfig(max_num_seqs=max(args.batches))
    plain = EngineCore(EngineConfig(model, cache, sched))
    forced = EngineCore(EngineConfig(model, cache, sched, ParallelConfig(force_distributed=True)))
    try:
        assert forced.runner.tp.distributed and not plain.runner.tp.distributed
        print(f"device {plain.runner.device}, graphs plain={plain.runner.decode_graphs is not None} "
              f"tp={forced.runner.decode_graphs is not None}", flush=True)
        prompts = random_prompts(args.parity_prompts, 64, plain.runner.vocab_size, seed=7)
        a = greedy_tokens(plain, prompts, args.new_tokens)
        b = greedy_tokens(forced, prompts, args.new_tokens)
        same = sum(x == y for x, y in zip(a, b, strict=True))
        print(f"greedy parity: {same}/{len(prompts)} prompts give the same {args.new_tokens} tokens",
              flush=True)
        result: dict[str, object] = {"parity_equal": same, "parity_prompts": len(prompts), "batches": {}}
        for batch in args.batches:
            rates: dict[str, list[float]] = {"plain": [], "tp": []}
            for _ in range(args.repeats):
                for name, core in (("plain", plain), ("tp", forced)):
                    rates[name].append(decode_rate(core, batch, args.context, args.new_tokens))
            med = {k: statistics.median(v) for k, v in rates.items()}
            print(f"batch {batch}: decode tok/s plain {med['plain']:.1f}, tp world 1 {med['tp']:.1f}, "
                  f"ratio tp/plain {med['tp'] / med['plain']:.3f} (medians of {args.repeats}; "
                  f"plain {[round(r, 1) for r in rates['plain']]}, tp {[round(r, 1) for r in rates['tp']]})",
                  flush=True)
            result["batches"][batch] = {"plain": rates["plain"], "tp": rates["tp"]}  # type: ignore[index]
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        forced.close()
        del plain
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
