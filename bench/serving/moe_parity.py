"""Greedy parity of a mixture of experts, disaggregated against colocated, on one device (not a test).

A random-weight Qwen3-MoE checkpoint (``--layers`` decoder layers of hidden ``--hidden``, ``--experts``
routed experts of width ``--expert-width``, top-``--top-k``, ``--dtype``; synthetic tokenizer) is written to a
temporary directory and served by two systems at once (``pdserve.live_system.live_systems``): a
disaggregated one (a prefill and a decode worker, KV over NIXL) and a colocated one, every worker on
``--device``. ``bench.serving.parity``'s 8 prompts (4 chat, 4 completion) go to both, one at a time, greedy,
``--max-tokens`` each; the report counts identical answers (text, finish reason, token count) and checks
that every KV block is free afterwards and no child died. Exit status 0 when all 8 agree.

    python -m bench.serving.moe_parity --device cuda:0          # the H200 run (bf16)
    python -m bench.serving.moe_parity --device cpu --dtype float32 --hidden 64 --expert-width 32 \
        --experts 8 --top-k 2 --layers 2                       # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.argtypes import positive_float, positive_int
from bench.serving.parity import check_parity
from pdserve.live_system import SystemSpec, live_systems, wait_all_free


def write_model(path: Path, args: argparse.Namespace) -> None:
    """A random Qwen3-MoE of ``args``' shape (seed 5) and its synthetic tokenizer, saved at ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from engine.models.dummy_tokenizer import write_dummy_tokenizer

    torch.manual_seed(5)
    heads = max(1, args.hidden // 64)
    cfg = Qwen3MoeConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         moe_intermediate_size=args.expert_width, num_hidden_layers=args.layers,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                         num_experts=args.experts,
                         num_experts_per_tok=args.top_k, norm_topk_prob=True, vocab_size=1024,
                         max_position_embeddings=2048, initializer_range=0.05, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype)).save_pretrained(path)
    write_dummy_tokenizer(path, json.loads((path / "config.json").read_text()))


def run(args: argparse.Namespace) -> int:
    """Start both systems, compare the 8 answers, check the leak; returns the exit status."""
    work = Path(tempfile.mkdtemp(prefix="moe-parity-"))
    path = work / "moe"
    write_model(path, args)
    flags = ("--max-num-batched-tokens", "64", "--dtype", args.dtype)
    specs = [SystemSpec("disagg", work / "disagg", str(path), (args.device, args.device), 256, flags),
             SystemSpec("colocated", work / "colo", str(path), (args.device,), 256, flags)]
    with live_systems(specs, ready_timeout_s=args.ready_timeout) as (disagg, colo):
        cases = check_parity(disagg.url, colo.url, str(path), max_tokens=args.max_tokens)
        for c in cases:
            print(f"{'identical' if c.identical else 'DIFFERENT'} {c.kind}: {c.a[2]} tokens", flush=True)
        same = sum(c.identical for c in cases)
        print(f"MoE {args.dtype} on {args.device}: disaggregated == colocated for {same} of {len(cases)} "
              "prompts", flush=True)
        wait_all_free(disagg.url, {"live-prefill", "live-decode"})
        wait_all_free(colo.url, {"live-colocated"})
        dead = disagg.sup.dead() + colo.sup.dead()
        print(f"every KV block free; dead children: {dead or 'none'}", flush=True)
    return 0 if same == len(cases) and not dead else 1


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0", help="every worker's device (cpu, cuda:N)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--hidden", type=positive_int, default=1024)
    p.add_argument("--expert-width", type=positive_int, default=512)
    p.add_argument("--experts", type=positive_int, default=64)
    p.add_argument("--top-k", type=positive_int, default=8)
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--ready-timeout", type=positive_float, default=300.0)
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run, exit with the parity status."""
    sys.exit(run(build_parser().parse_args(argv)))


if __name__ == "__main__":
    main()
