"""The prefill grid (``SchedulerConfig.prefill_grid``, ``--prefill-grid``): does a prefix-cache hit change
the answer, and what does the grid cost? One engine per grid size (0: off), all in one process.

1. Answers: ``--num-prompts`` random prompts of ``--prompt-len`` tokens, each sent twice, alone, greedy
   with the sampled token's logprob, ``--max-tokens`` tokens; the second is served from the prefix
   cache. Per grid: how many second answers equal the first bit for bit (token ids and logprobs), how
   many differ in tokens, the largest logprob difference, and the prefix hit (tokens). With a grid every
   pair must be identical: the script exits 1 if one is not.
2. Cost, timed after the answers (every engine warmed by them), the engines interleaved in each of
   ``--repeats`` rounds: a fresh prefill of ``--timing-len`` random tokens (``max_tokens=1``; prefill
   tokens/s, from ``add_request`` to the first token, device synchronised), and a second turn: that
   prompt plus ``--suffix-len`` new tokens, whose prefill reuses the first turn's cached prefix (TTFT;
   the grid recomputes the first turn's last partial grid chunk). Ratios are against the grid-less
   engine of the same run; medians over the rounds (``--repeats 0``: answers only).

GPU (the lead's H200 check; ``llama3-8b`` dummy weights, bf16, triton, CUDA graphs for decode)::

    python -m bench.engine.prefix_grid --json -

CPU (the embedded SmolLM2, fp32, torch attention; one torch thread)::

    python -m bench.engine.prefix_grid --model smollm2-135m --num-prompts 4 --prompt-len 289 \\
        --max-tokens 16 --timing-len 1000 --suffix-len 128 --grids 0,256,512 --threads 1 --repeats 5

(289 tokens: the grid-less hit leaves a one-token suffix; 1000 tokens: not on either grid, so the
second turn pays the rounding.)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any import of triton (engine.ops, lazily)

from bench.common import add_model_args, random_prompts, sync
from bench.engine.prefill import dummy_model_dir
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams

BLOCK_SIZE = 16


@dataclass
class Answers:
    """Greedy-twice results of one grid size over the prompts."""

    grid: int
    prompts: int = 0
    identical: int = 0  # token ids and logprobs equal bit for bit
    token_diffs: int = 0  # the token ids differ
    max_logprob_diff: float = 0.0
    hits: tuple[int, ...] = ()  # prefix-cache hit of each second request (tokens)


def make_core(args: argparse.Namespace, grid: int, max_len: int) -> EngineCore:
    """An engine with prefix caching on, ``grid`` (0: off) and the default 2048-token step budget (raised
    to the grid when larger)."""
    if args.model in ("tiny", "llama3-8b"):
        model, load = str(dummy_model_dir(args.model, max_len + BLOCK_SIZE)), "dummy"
    else:
        model, load = args.model, "auto"
    return EngineCore(EngineConfig(
        ModelConfig(model, dtype=args.dtype, load_format=load, device=args.device,
                    attention_backend=args.attention_backend, max_model_len=max_len + BLOCK_SIZE),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=args.num_blocks),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max(2048, grid), prefill_grid=grid),
    ))


def run_one(core: EngineCore, rid: str, ids: list[int],
            max_tokens: int) -> tuple[list[int], list[float], int]:
    """Run one greedy request alone: (token ids, their logprobs, prefix-cache hit in tokens)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    seq = core.add_request(rid, ids, params)
    tokens: list[int] = []
    logprobs: list[float] = []
    while core.has_unfinished():
        for out in core.step():
            tokens.append(out.token_id)
            logprobs.append(float(out.logprob if out.logprob is not None else float("nan")))
    return tokens, logprobs, seq.num_cached_tokens


def answers(core: EngineCore, grid: int, prompts: list[list[int]], max_tokens: int) -> Answers:
    """Each prompt twice, alone (section 1 of the module docstring); ends with a KV leak check."""
    result = Answers(grid)
    hits = []
    for i, ids in enumerate(prompts):
        t1, l1, _ = run_one(core, f"a{i}", ids, max_tokens)
        t2, l2, hit = run_one(core, f"b{i}", ids, max_tokens)
        hits.append(hit)
        result.prompts += 1
        result.identical += (t1, l1) == (t2, l2)
        result.token_diffs += t1 != t2
        same = [abs(a - b) for a, b, x, y in zip(l1, l2, t1, t2, strict=True) if x == y]
        result.max_logprob_diff = max([result.max_logprob_diff, *same])
    result.hits = tuple(hits)
    core.check_no_leaks()
    return result


def timed(core: EngineCore, rid: str, ids: list[int]) -> float:
    """Seconds from ``add_request`` to the first token of one request (``max_tokens=1``), alone."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    sync(core.runner.device)
    started = time.perf_counter()
    core.add_request(rid, ids, params)
    while core.has_unfinished():
        core.step()
    sync(core.runner.device)
    return time.perf_counter() - started


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    cuda = torch.cuda.is_available()
    p.add_argument("--grids", default="0,256,512,2048", help="grid sizes in tokens, comma-separated (0: off)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=3000 if cuda else 289)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timing-len", type=int, default=8000 if cuda else 1000)
    p.add_argument("--suffix-len", type=int, default=512 if cuda else 128)
    p.add_argument("--repeats", type=int, default=3, help="timing rounds (0: answers only)")
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here (- for stdout)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    grids = [int(g) for g in args.grids.split(",")]
    max_len = max(args.prompt_len + args.max_tokens, args.timing_len + args.suffix_len) + 1
    cores = {g: make_core(args, g, max_len) for g in grids}
    vocab = next(iter(cores.values())).runner.vocab_size
    prompts = random_prompts(args.num_prompts, args.prompt_len, vocab, args.seed)
    found = {g: answers(core, g, prompts, args.max_tokens) for g, core in cores.items()}
    for g in grids:
        a = found[g]
        print(f"grid {g:5d}: {a.identical}/{a.prompts} second answers identical bit for bit, "
              f"{a.token_diffs} with other tokens, max logprob diff {a.max_logprob_diff:.3g}, "
              f"hits {sorted(set(a.hits))} tokens", flush=True)
    fresh: dict[int, list[float]] = {g: [] for g in grids}
    turn2: dict[int, list[float]] = {g: [] for g in grids}
    for r in range(args.repeats):
        first, new = random_prompts(2, args.timing_len, vocab, args.seed + 1000 + r)
        second = first + new[: args.suffix_len]
        for g, core in cores.items():
            rid = f"t{r}-{g}"
            ids = [(t + g) % vocab for t in first]  # per-engine prompt: no engine shares another's cache
            fresh[g].append(timed(core, rid + "-fresh", ids))
            turn2[g].append(timed(core, rid + "-turn2", ids + second[args.timing_len:]))
    rows = []
    for g in grids if args.repeats else []:
        base_fresh, base_turn2 = statistics.median(fresh[grids[0]]), statistics.median(turn2[grids[0]])
        f, t = statistics.median(fresh[g]), statistics.median(turn2[g])
        rows.append({"grid": g, "fresh_s": fresh[g], "turn2_s": turn2[g],
                     "prefill_tok_per_s": args.timing_len / f, "fresh_vs_first": base_fresh / f,
                     "turn2_ttft_s": t, "turn2_vs_first": base_turn2 / t})
        print(f"grid {g:5d}: fresh prefill {args.timing_len / f:9.0f} tok/s ({base_fresh / f:.3f}x of grid "
              f"{grids[0]}), second turn TTFT {t * 1e3:8.1f} ms ({base_turn2 / t:.3f}x speed); rounds: "
              f"{[round(x, 3) for x in fresh[g]]} s, {[round(x, 3) for x in turn2[g]]} s", flush=True)
    for core in cores.values():
        core.check_no_leaks()
    report: dict[str, Any] = {
        "args": vars(args), "device": str(next(iter(cores.values())).runner.device),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "answers": [asdict(found[g]) for g in grids], "timing": rows,
    }
    cores.clear()
    gc.collect()
    if args.json == "-":
        json.dump(report, sys.stdout, indent=1)
        print()
    elif args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    bad = [g for g in grids if g and found[g].identical != found[g].prompts]
    if bad:
        print(f"FAIL: a cache hit changed the answer with grid {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
