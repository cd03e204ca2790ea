"""The host KV tier (``--kv-host-cache-gib``, engine/kv_host_tier.py) with the device prefix cache forced
small: prefix hit rate and TTFT with and without the tier, beside a device cache large enough for the whole
working set (the ceiling), all in one process.

Workload: ``--sessions`` sessions, each with its own context of ``--context-len`` random tokens; in each
of ``--turns`` turns every session in turn (round robin) sends its context plus a new suffix of
``--suffix-len`` tokens, alone, greedy, ``max_tokens=1`` (TTFT: ``add_request`` to the first token,
device synchronised). Three engines of the same model see the same requests, interleaved request by
request:

* ``small``: a device pool of ``--device-blocks`` blocks (default: room for two sessions' prompts), no
  tier: round robin over more sessions than fit evicts each context before its session comes back;
* ``small+tier``: the same pool with a host tier of ``--host-gib`` GiB (default: twice the working set),
  where those evicted blocks go and come back from;
* ``large``: a device pool holding every session (the ceiling: every later turn hits on the device).

Reported per engine over the warm turns (turn 2 on; turn 1 is cold everywhere): prefix hit rate (cached
prompt tokens / prompt tokens), TTFT median and mean, the tier's hits and bytes each way; ratios: TTFT of
``small`` over ``small+tier`` (the tier's speed-up) and of ``small+tier`` over ``large`` (the copy's cost
against a device hit).

GPU (the lead's H200 run; ``llama3-8b`` dummy weights, bf16, triton)::

    python -m bench.engine.host_tier --json -

CPU (the tiny dummy model, fp32, torch attention)::

    python -m bench.engine.host_tier --model tiny --threads 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any import of triton (engine.ops, lazily)

from bench.common import add_model_args, random_prompts, sync
from bench.engine.prefill import dummy_model_dir
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.kv_cache import KVCachePool
from engine.sampling_params import SamplingParams

BLOCK_SIZE = 16
ENGINES = ("small", "small+tier", "large")


@dataclass
class Row:
    """One engine's results over the warm turns (turn 2 on)."""

    engine: str
    device_blocks: int
    host_blocks: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tier_hit_blocks: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def make_core(args: argparse.Namespace, num_blocks: int, host_bytes: int, max_len: int) -> EngineCore:
    """An engine with prefix caching on, ``num_blocks`` device blocks and a host tier of ``host_bytes``
    (0: none)."""
    path = dummy_model_dir(args.model, max_len)
    return EngineCore(EngineConfig(
        ModelConfig(str(path), dtype=args.dtype, load_format="dummy", device=args.device,
                    attention_backend=args.attention_backend, max_model_len=max_len,
                    enforce_eager=True),  # only prefills run: no decode graphs to capture
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, host_kv_bytes=host_bytes),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max(2048, args.suffix_len)),
    ))


def ttft(core: EngineCore, rid: str, ids: list[int]) -> tuple[float, int]:
    """(seconds from ``add_request`` to the first token, prefix-cache hit in tokens) of one request
    run alone (``max_tokens=1``)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    sync(core.runner.device)
    started = time.perf_counter()
    seq = core.add_request(rid, ids, params)
    while core.has_unfinished():
        core.step()
    sync(core.runner.device)
    return time.perf_counter() - started, seq.num_cached_tokens


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    cuda = torch.cuda.is_available()
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--context-len", type=int, default=4096 if cuda else 256, help="tokens per session")
    p.add_argument("--suffix-len", type=int, default=256 if cuda else 32, help="new tokens per turn")
    p.add_argument("--device-blocks", type=int, default=0,
                   help="blocks of the small device pools (0: room for two sessions' prompts)")
    p.add_argument("--host-gib", type=float, default=0.0,
                   help="host tier budget in GiB (0: twice the working set's KV)")
    p.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here (- for stdout)")
    args = p.parse_args(argv)
    if args.sessions < 3 or args.turns < 2:
        p.error("--sessions must be >= 3 (round robin over more than the small pool holds) and --turns >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt_len = args.context_len + args.suffix_len
    prompt_blocks = -(-prompt_len // BLOCK_SIZE)
    max_len = prompt_len + BLOCK_SIZE
    small = args.device_blocks or 2 * prompt_blocks + 2
    large = args.sessions * prompt_blocks + 2 * prompt_blocks
    cores: dict[str, EngineCore] = {"small": make_core(args, small, 0, max_len)}
    pool = cores["small"].runner.kv_cache
    block_bytes = KVCachePool.block_bytes(pool.num_layers, BLOCK_SIZE, pool.num_kv_heads, pool.head_dim,
                                          pool.dtype)
    host_bytes = int(args.host_gib * (1 << 30)) or 2 * args.sessions * prompt_blocks * block_bytes
    cores["small+tier"] = make_core(args, small, host_bytes, max_len)
    cores["large"] = make_core(args, large, 0, max_len)
    vocab = cores["small"].runner.vocab_size
    contexts = random_prompts(args.sessions, args.context_len, vocab, args.seed)
    rows = {name: Row(name, core.runner.kv_cache.num_blocks,
                      core.host_tier.num_blocks if core.host_tier is not None else 0)
            for name, core in cores.items()}
    warmup = random_prompts(1, prompt_len, vocab, args.seed + 999)[0]
    for name, core in cores.items():  # compile / allocate once before timing; its blocks get evicted
        ttft(core, f"warm-{name}", warmup)
    for turn in range(args.turns):
        suffixes = random_prompts(args.sessions, args.suffix_len, vocab, args.seed + 1 + turn)
        for s in range(args.sessions):
            ids = contexts[s] + suffixes[s]
            for name, core in cores.items():
                before = core.host_tier_stats()
                hits0 = before.hits if before is not None else 0
                up0, down0 = (before.saved_bytes, before.loaded_bytes) if before is not None else (0, 0)
                seconds, cached = ttft(core, f"t{turn}-s{s}-{name}", ids)
                if turn == 0:
                    continue
                row, after = rows[name], core.host_tier_stats()
                row.prompt_tokens += len(ids)
                row.cached_tokens += cached
                row.ttft_s.append(seconds)
                if after is not None:
                    row.tier_hit_blocks += after.hits - hits0
                    row.bytes_to_host += after.saved_bytes - up0
                    row.bytes_to_device += after.loaded_bytes - down0
    for core in cores.values():
        core.check_no_leaks()
    med = {name: statistics.median(row.ttft_s) for name, row in rows.items()}
    print(f"# {args.sessions} sessions x {args.turns} turns, prompts of {args.context_len} + "
          f"{args.suffix_len} tokens; block {block_bytes} bytes; warm turns only", flush=True)
    for name, row in rows.items():
        print(f"{name:>10}: {row.device_blocks:6d} device blocks, {row.host_blocks:6d} host blocks: "
              f"hit rate {row.hit_rate:6.1%}, TTFT median {med[name] * 1e3:8.2f} ms, mean "
              f"{statistics.fmean(row.ttft_s) * 1e3:8.2f} ms; tier hits {row.tier_hit_blocks} blocks, "
              f"{row.bytes_to_host / 1e6:.1f} MB to host, {row.bytes_to_device / 1e6:.1f} MB to device",
              flush=True)
    speedup, cost = med["small"] / med["small+tier"], med["small+tier"] / med["large"]
    print(f"TTFT: small / small+tier = {speedup:.2f}x (the tier's speed-up); small+tier / large = "
          f"{cost:.2f}x (a host hit against a device hit)", flush=True)
    report: dict[str, Any] = {
        "args": vars(args), "device": str(pool.device),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "block_bytes": block_bytes,
        "rows": [{**asdict(row), "hit_rate": row.hit_rate, "ttft_median_s": med[row.engine]}
                 for row in rows.values()],
        "ttft_small_over_tier": speedup, "ttft_tier_over_large": cost,
    }
    cores.clear()
    gc.collect()
    if args.json == "-":
        json.dump(report, sys.stdout, indent=1)
        print()
    elif args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
