"""Prefill benchmark: one long prompt through pdserve's engine, against the GEMM ceiling (not a test).

GPU mode (default on CUDA): one prompt of ``--tokens`` (default 8000) tokens on the Llama-3-8B-shaped
dummy model (``llama3-8b``, random bf16 weights; ``max_position_embeddings`` raised to fit the prompt,
which changes no shape), attention backend ``triton``, token budget >= the prompt (no chunked prefill),
prefix caching off, timed from ``add_request`` to the sampled first token (device synchronised); best of
``--repeats`` after a warm-up.

    achieved FLOP/s = (2 * P_layers * T + 2 * P_lm_head + 4 * L * H * D * T * (T + 1) / 2) / time

``P_layers``: the 2-D weights of the decoder layers (every matmul a token goes through; norms and the
input embedding, a gather, are not counted), ``P_lm_head``: the LM head, applied to the one sampled row
only; the last term is causal attention (QK^T and PV, 2 FLOPs per multiply-add, query ``i`` sees ``i + 1``
keys) over ``L`` layers, ``H`` query heads of ``D`` dims. The ceiling is a ``torch.matmul`` of
``--gemm-size``^3 (default 8192) in the model's dtype, 2 n^3 FLOPs, the best of ``--gemm-repeats``
(>= 20) event-timed products after warm-up in the same process (``bench.ceilings.gemm_tflops``), taken
twice: before the prefills, on a GPU that has been idle (an H200 then runs its first few dozen products
at its boost clock, ~790 TFLOP/s), and after them (sustained, ~680 TFLOP/s once its power limit holds the
clock down); the ceiling is the best of both. The report gives achieved (best prefill) / ceiling (best
GEMM), the best prefill over the sustained GEMM's median, and the spread of each over its repeats.

Also the attention kernel alone: ``paged_prefill_attention`` (Triton, paged KV, ``block_size`` 16) vs
``torch.nn.functional.scaled_dot_product_attention`` restricted to the flash backend (contiguous K/V,
causal, GQA), same shapes (one layer of the model at ``T`` tokens), same FLOP count, both timed alike
(``bench.timing.time_calls``: 2 warm-up calls, then 10 timed on CUDA, 1 on CPU; best and spread).

CPU smoke mode (CI): ``--device cpu --model tiny --dtype float32 --attention-backend torch --tokens 64
--gemm-size 256`` (tiny Llama config; the Triton kernel runs through the interpreter).

``--chunked-ab CHUNK`` (instead of the above): the prompt prefilled in ``CHUNK``-token chunks (chunked
prefill, token budget ``CHUNK``), with the triton backend's cuDNN paged prefill attention
(engine/ops/cudnn_paged_prefill.py, taken once a chunk attends over ``CUDNN_PAGED_MIN_KV`` tokens) on and
off in alternating rounds in one process (``--repeats`` rounds of two timed prefills each, after the
graphs' warm-up; each side goes first in every other round); reports each side's best and median and
the ratio of the medians (on / off). Where the cuDNN path cannot run (CPU, no Hopper GPU, no cuDNN
frontend) both sides run the Triton kernel, and the report says how many cuDNN graphs the warm-up built
(0).

    python -m bench.engine.prefill --tokens 16384 --chunked-ab 2048

    python -m bench.engine.prefill [--tokens 8000] [--json out.json|-]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any import of triton (engine.ops, lazily)

from bench.argtypes import int_at_least, non_negative_int, positive_int
from bench.ceilings import gemm_tflops
from bench.common import add_model_args, random_prompts, sync
from bench.timing import MIN_CEILING_REPEATS, Spread, time_calls
from engine.attention.triton_backend import TritonAttentionBackend
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.models.registry import DUMMY_CONFIGS, cache_dir
from engine.sampling_params import SamplingParams

BLOCK_SIZE = 16
TINY_CONFIG: dict[str, Any] = {
    **DUMMY_CONFIGS["llama3-8b"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
    "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32",
}


def dummy_model_dir(model: str, max_len: int) -> Path:
    """A config-only model directory for ``model`` (``"llama3-8b"`` or ``"tiny"``) whose
    ``max_position_embeddings`` is at least ``max_len`` tokens (written once under the pdserve cache).
    Raises ValueError for another name."""
    if model == "tiny":
        base = TINY_CONFIG
    elif model in DUMMY_CONFIGS:
        base = DUMMY_CONFIGS[model]
    else:
        raise ValueError(f"unknown dummy model {model!r}: use tiny or one of {', '.join(DUMMY_CONFIGS)}")
    length = max(int(base["max_position_embeddings"]), max_len)
    out = cache_dir() / "configs" / f"bench-{model}-{length}"
    if not (out / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".config.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({**base, "max_position_embeddings": length}, indent=1))
        os.replace(tmp, out / "config.json")
    return out


def make_core(args: argparse.Namespace, max_tokens: int, prefill_only: bool = False) -> EngineCore:
    """An engine for one prompt of up to ``max_tokens`` tokens at a time (one step, no chunking; blocks
    for two such prompts, prefix caching off, no CUDA graphs: only prefill runs)."""
    path = dummy_model_dir(args.model, max_tokens + BLOCK_SIZE)
    blocks = 2 * math.ceil((max_tokens + 1) / BLOCK_SIZE) + 4
    return EngineCore(EngineConfig(
        ModelConfig(str(path), dtype=args.dtype, load_format="dummy", device=args.device,
                    attention_backend=args.attention_backend, max_model_len=max_tokens + BLOCK_SIZE,
                    enforce_eager=True),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=blocks, enable_prefix_caching=False),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max(2048, max_tokens),
                        enable_chunked_prefill=False),
    ), prefill_only=prefill_only)


def prompt(tokens: int, vocab: int, seed: int) -> list[int]:
    """One prompt of ``tokens`` random token ids (``bench.common.random_prompts``)."""
    return random_prompts(1, tokens, vocab, seed)[0]


def time_prefill(core: EngineCore, tokens: int, repeats: int) -> list[float]:
    """Seconds from ``add_request`` to the sampled first token of a ``tokens``-token prompt
    (``max_tokens=1``), ``repeats`` times after one untimed warm-up; ends with a KV leak check."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for i in range(repeats + 1):
        ids = prompt(tokens, core.runner.vocab_size, seed=i)
        sync(core.runner.device)
        started = time.perf_counter()
        core.add_request(f"p{tokens}-{i}", ids, params)
        while not core.step():
            pass
        sync(core.runner.device)
        if i:
            times.append(time.perf_counter() - started)
    core.check_no_leaks()
    return times


def prefill_flops(core: EngineCore, tokens: int) -> dict[str, float]:
    """FLOPs of one prefill of ``tokens`` tokens (formula in the module docstring)."""
    cfg, model = core.runner.hf_config, core.runner.model
    layers = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2)
    lm_head = int(cfg.vocab_size) * int(cfg.hidden_size)
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads)
    attention = 4.0 * int(cfg.num_hidden_layers) * heads * head_dim * tokens * (tokens + 1) / 2
    linear = 2.0 * layers * tokens + 2.0 * lm_head
    return {"layer_params": layers, "linear": linear, "attention": attention, "total": linear + attention}


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[Callable[[], torch.Tensor], str]:
    """Causal SDPA on ``[1, H, T, D]`` / ``[1, Hkv, T, D]``: the flash backend on CUDA (GQA natively, else
    with K/V expanded to ``H`` heads), the default choice on CPU. Returns (call, how)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    if not q.is_cuda:
        return (lambda: sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=True)), "default (CPU)"

    def flash(kk: torch.Tensor, vv: torch.Tensor, gqa: bool) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(q, kk, vv, is_causal=True, scale=scale, enable_gqa=gqa)

    try:
        flash(k, v, True)
        return (lambda: flash(k, v, True)), "flash, native GQA"
    except RuntimeError:
        group = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return (lambda: flash(ke, ve, False)), "flash, K/V expanded to H heads"


def attention_compare(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: torch.device) -> dict[str, Any]:
    """One causal prefill of ``tokens`` tokens, ``heads``/``kv_heads`` heads of ``head_dim``: seconds and
    TFLOP/s (FLOPs ``4 H D T (T+1) / 2``) of ``paged_prefill_attention`` (KV paged in ``BLOCK_SIZE``-token
    blocks, scattered) and of SDPA, plus their largest output difference."""
    from engine.ops.paged_prefill import paged_prefill_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(tokens, h, head_dim, generator=gen).to(dtype).to(device)
               for h in (heads, kv_heads, kv_heads))
    num_blocks = math.ceil(tokens / BLOCK_SIZE)
    table = torch.randperm(num_blocks, generator=gen)
    caches = []
    for t in (k, v):
        padded = torch.zeros(num_blocks * BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=device)
        padded[:tokens] = t
        cache = torch.empty(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=device)
        cache[table.to(device)] = padded.view(num_blocks, BLOCK_SIZE, kv_heads, head_dim)
        caches.append(cache)
    block_tables = table.to(dtype=torch.int32, device=device)[None, :]
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = torch.empty_like(q)
    paged = lambda: paged_prefill_attention(q, caches[0], caches[1], block_tables, seq_lens, qsl,  # noqa: E731
                                            tokens, scale, out=out)
    sdpa, how = _sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale)
    iters = 10 if device.type == "cuda" else 1
    t_paged = Spread.of(time_calls(paged, device, warmup=2, repeats=iters))
    t_sdpa = Spread.of(time_calls(sdpa, device, warmup=2, repeats=iters))
    diff = (paged().float() - sdpa()[0].transpose(0, 1).float()).abs().max().item()
    flops = 4.0 * heads * head_dim * tokens * (tokens + 1) / 2
    return {"tokens": tokens, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "flops": flops,
            "triton_s": t_paged.min, "sdpa_s": t_sdpa.min, "triton_tflops": flops / t_paged.min / 1e12,
            "sdpa_tflops": flops / t_sdpa.min / 1e12, "triton_over_sdpa_speed": t_sdpa.min / t_paged.min,
            "triton_tflops_spread": t_paged.per(flops / 1e12).as_dict(),
            "sdpa_tflops_spread": t_sdpa.per(flops / 1e12).as_dict(), "sdpa": how, "max_abs_diff": diff}


def chunked_ab(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--chunked-ab`` comparison (module docstring); returns the JSON-ready result (seconds)."""
    chunk = args.chunked_ab
    path = dummy_model_dir(args.model, args.tokens + BLOCK_SIZE)
    core = EngineCore(EngineConfig(
        ModelConfig(str(path), dtype=args.dtype, load_format="dummy", device=args.device,
                    attention_backend=args.attention_backend, max_model_len=args.tokens + BLOCK_SIZE,
                    enforce_eager=True),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=2 * math.ceil((args.tokens + 1) / BLOCK_SIZE) + 4,
                    enable_prefix_caching=False),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=chunk, enable_chunked_prefill=True),
    ))
    backend = core.runner.backend
    if not isinstance(backend, TritonAttentionBackend):
        raise ValueError(f"--chunked-ab needs --attention-backend triton, got {backend.name}")
    graphs = core.runner.warm_attention_plans(chunk)
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for r in range(args.repeats):
            for on in (True, False) if r % 2 == 0 else (False, True):  # each side first in turn
                backend.cudnn_paged_prefill = on
                times[on].extend(time_prefill(core, args.tokens, 2))
    finally:
        backend.cudnn_paged_prefill = True
    with_cudnn, without = Spread.of(times[True]), Spread.of(times[False])
    name = torch.cuda.get_device_name(core.runner.device) if core.runner.device.type == "cuda" else "cpu"
    return {"device": name, "model": args.model, "dtype": str(core.runner.dtype).removeprefix("torch."),
            "tokens": args.tokens, "chunk": chunk, "warmed_graphs": graphs, "cudnn_s": times[True],
            "triton_s": times[False], "cudnn": with_cudnn.as_dict(), "triton": without.as_dict(),
            "cudnn_over_triton_median": with_cudnn.median / without.median}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark (see the module docstring); returns the JSON-ready result."""
    core = make_core(args, args.tokens)
    device, dtype = core.runner.device, core.runner.dtype
    gemm_first = gemm_tflops(args.gemm_size, dtype, device, args.gemm_repeats)
    times = time_prefill(core, args.tokens, args.repeats)
    flops = prefill_flops(core, args.tokens)
    achieved = Spread.of(times).per(flops["total"] / 1e12)
    gemm_after = gemm_tflops(args.gemm_size, dtype, device, args.gemm_repeats)
    best_gemm = max(gemm_first.max, gemm_after.max)
    cfg = core.runner.hf_config
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads)
    attn = attention_compare(args.attn_tokens or args.tokens, heads, int(cfg.num_key_value_heads), head_dim,
                             dtype, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "model": args.model, "dtype": str(dtype).removeprefix("torch."),
            "attention_backend": core.runner.backend.name, "tokens": args.tokens, "prefill_s": times,
            "best_prefill_s": min(times), "flops": flops,
            "flops_formula": "2*P_layers*T + 2*P_lm_head + 4*L*H*D*T*(T+1)/2",
            "achieved_tflops": achieved.max, "achieved_tflops_spread": achieved.as_dict(),
            "gemm": {"n": args.gemm_size, "tflops": best_gemm, "spread_first": gemm_first.as_dict(),
                     "spread_after": gemm_after.as_dict()},
            "fraction_of_gemm": achieved.max / best_gemm,
            "fraction_of_sustained_gemm": achieved.max / gemm_after.median, "attention": attn,
            "torch": torch.__version__}


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--tokens", type=positive_int, default=8000, help="prompt tokens")
    p.add_argument("--attn-tokens", type=non_negative_int, default=0,
                   help="attention comparison tokens (0 = --tokens)")
    p.add_argument("--gemm-size", type=positive_int, default=8192)
    p.add_argument("--gemm-repeats", type=int_at_least(MIN_CEILING_REPEATS), default=MIN_CEILING_REPEATS,
                   help=f"timed GEMMs for the ceiling (>= {MIN_CEILING_REPEATS}; the best counts)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed prefills after one warm-up")
    p.add_argument("--chunked-ab", type=positive_int, default=None, metavar="CHUNK",
                   help="instead: the prompt in CHUNK-token chunks, cuDNN paged prefill attention on vs off")
    p.add_argument("--json", default=None, help="write the result here ('-' = stdout)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, print a summary and write ``--json``; returns 0 (bad arguments: argparse
    exits with 2, naming the flag)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.chunked_ab is not None:
        if args.attention_backend != "triton":
            parser.error(f"--chunked-ab needs --attention-backend triton, got {args.attention_backend}")
        ab = chunked_ab(args)
        on, off = Spread(**ab["cudnn"]), Spread(**ab["triton"])
        print(f"prefill {ab['tokens']} tokens in {ab['chunk']}-token chunks ({ab['model']}, {ab['dtype']}; "
              f"{ab['warmed_graphs']} cuDNN graphs warmed): cuDNN paged {on.scaled(1e3).fmt('.1f', ' ms')}; "
              f"Triton {off.scaled(1e3).fmt('.1f', ' ms')}; cuDNN / Triton (medians) "
              f"{ab['cudnn_over_triton_median']:.3f}")
        _write_json(args.json, ab)
        return 0
    res = run(args)
    a, g = res["attention"], res["gemm"]
    achieved = Spread(**res["achieved_tflops_spread"])
    first, after = Spread(**g["spread_first"]), Spread(**g["spread_after"])
    print(f"prefill {res['tokens']} tokens ({res['model']}, {res['dtype']}, {res['attention_backend']}): "
          f"best {res['best_prefill_s'] * 1e3:.1f} ms = {res['achieved_tflops']:.1f} TFLOP/s "
          f"[{achieved.fmt('.1f', ' TFLOP/s')}]")
    print(f"ceiling, {args.gemm_size}^3 GEMM {res['dtype']}: best {g['tflops']:.1f} TFLOP/s "
          f"[before the prefills {first.fmt('.1f', ' TFLOP/s')}; after {after.fmt('.1f', ' TFLOP/s')}]")
    print(f"prefill / GEMM ceiling (best / best): {res['fraction_of_gemm']:.1%}; "
          f"best prefill / sustained GEMM (median after the prefills): "
          f"{res['fraction_of_sustained_gemm']:.1%}")
    print(f"attention alone, {a['tokens']} tokens: triton {a['triton_tflops']:.1f} TFLOP/s, "
          f"SDPA ({a['sdpa']}) {a['sdpa_tflops']:.1f} TFLOP/s (best of each), "
          f"triton speed / SDPA speed {a['triton_over_sdpa_speed']:.2f}, "
          f"max |diff| {a['max_abs_diff']:.3g}")
    _write_json(args.json, res)
    return 0


def _write_json(dest: str | None, result: dict[str, Any]) -> None:
    """``--json``: ``-`` prints ``result``, a path gets it written, None nothing."""
    if dest == "-":
        print(json.dumps(result, indent=1))
    elif dest:
        Path(dest).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
