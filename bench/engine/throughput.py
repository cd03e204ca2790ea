"""Engine throughput against transformers ``generate`` and the HBM roofline (not a test).

CPU mode (default): prefill and decode tokens/s of pdserve's engine next to transformers ``generate`` on
the same model and batch, ``--warmup`` untimed calls of each, then ``--repeats`` interleaved repeats
(bench/timing.py); printed with their spread and the ratio engine / transformers.

GPU mode (``--device cuda --model llama3-8b --load-format dummy``): decode tokens/s for each batch and
context in each of ``--modes`` (CUDA graphs; graphs with asynchronous scheduling, engine/async_step.py;
the same with a second set of graphs captured without programmatic dependent launch, engine/ops/pdl.py,
or with the batch-1 GEMV projections of ``--alt-gemv``; eager), ``--repeats`` times each, as a fraction
of the HBM roofline

    roofline tok/s = batch * bandwidth / (weight bytes + batch * (context + new_tokens / 2) * KV B/token)

(a decode step reads every weight once, except the input embedding, and each sequence's KV; bandwidth:
the best of 20 device-to-device copies in the same process, read + write bytes counted,
``bench.ceilings.copy_bandwidth``). ``--parity-batches``: the same greedy tokens with and without
asynchronous scheduling. ``--hf-batches``: decode tokens/s of the engine (graphs, synchronous) and of
transformers ``generate`` on the same model object (SDPA), same batch, context and new tokens, each
warmed up ``--warmup`` times at that shape and timed ``--repeats`` times, interleaved; ratio = median
engine tok/s / median transformers tok/s, with the spread of the per-repeat ratios.

Decode tokens are counted exactly (bench/engine/decode.py): the tokens of the steps inside the timed
window, none of the untimed warm-up step's, also under asynchronous scheduling.

    .venv/bin/python -m bench.engine.throughput                       # SmolLM2 on CPU, fp32
    python3 -m bench.engine.throughput --device cuda --model llama3-8b --load-format dummy --dtype bfloat16 \
        --attention-backend triton --num-blocks 34000 --max-num-seqs 128 --new-tokens 96
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from bench.ceilings import copy_bandwidth
from bench.common import random_prompts, sync
from bench.engine.async_parity import async_parity
from bench.engine.decode import decode_rate
from bench.engine.transformers_peer import Rates, hf_decode, hf_rates
from bench.timing import Spread, interleaved, paired_ratio
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.cuda_graphs import DecodeCudaGraphs
from engine.engine_core import EngineCore
from engine.models.registry import resolve_model
from engine.ops.pdl import pdl_enabled, set_pdl
from engine.sampling_params import SamplingParams


def engine_rates(core: EngineCore, prompts: list[list[int]], new_tokens: int,
                 clock: Callable[[], float] = time.perf_counter) -> Rates:
    """One repeat of the engine on ``prompts``: prefill tok/s = prompt tokens / seconds until every
    prompt has its first token; decode tok/s = tokens returned by the later steps / their seconds
    (counted, not assumed). Unique request ids per call; prefix caching is off. Raises ValueError for
    ``new_tokens`` < 2."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 (a prefill token and a decode one), got {new_tokens}")
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    tag = time.monotonic_ns()
    for i, p in enumerate(prompts):
        core.add_request(f"b{tag}-{i}", p, params)
    device = core.runner.device
    sync(device)
    first: set[str] = set()
    started = clock()
    while len(first) < len(prompts):
        first.update(out.request_id for out in core.step())
    sync(device)
    prefill_s = clock() - started
    started, decoded = clock(), 0
    while core.has_unfinished():
        decoded += len(core.step())
    sync(device)
    decode_s = clock() - started
    core.check_no_leaks()
    return Rates(sum(len(p) for p in prompts) / prefill_s, decoded / decode_s)


def build_engine(args: argparse.Namespace, num_blocks: int | None) -> EngineCore:
    """The engine of ``args`` (model, dtype, device, attention backend, eager, fused ops, PDL, quantization
    where ``args`` has it, batch and prompt length for the token budget), prefix caching off; ``--gemv``
    re-captures the decode graphs with that comma list of batch-1 GEMV projections."""
    core = EngineCore(
        EngineConfig(
            ModelConfig(
                args.model,
                dtype=args.dtype,
                load_format=args.load_format,
                device=args.device,
                attention_backend=args.attention_backend,
                enforce_eager=args.enforce_eager,
                fused_ops=getattr(args, "fused_ops", "auto"),
                pdl=getattr(args, "pdl", "on") == "on",
                quantization=getattr(args, "quantization", None),
                max_model_len=getattr(args, "max_model_len", None),
            ),
            CacheConfig(block_size=16, num_blocks=num_blocks, enable_prefix_caching=False),
            SchedulerConfig(max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=max(2048, args.batch * args.prompt_len)),
        )
    )
    gemv = [p for p in (getattr(args, "gemv", "") or "").split(",") if p]
    runner = core.runner
    if gemv and hasattr(runner.net, "gemv_projections"):  # batch-1 projections through engine.ops.gemv
        setattr(runner.net, "gemv_projections", frozenset(gemv))  # noqa: B010  (net is typed Module)
        if runner.decode_graphs is not None:
            runner.decode_graphs.capture()  # re-capture with the GEMV inside
    return core


def run_cpu(args: argparse.Namespace) -> str:
    """Engine vs transformers on CPU (module docstring); returns the markdown report."""
    blocks = args.batch * (args.prompt_len + args.new_tokens) // 16 + args.batch + 8
    core = build_engine(args, num_blocks=blocks)
    model = AutoModelForCausalLM.from_pretrained(
        str(resolve_model(args.model)), dtype=core.runner.dtype
    ).eval()
    prompts = random_prompts(args.batch, args.prompt_len, core.runner.vocab_size, seed=0)
    ours, hf = interleaved(lambda: engine_rates(core, prompts, args.new_tokens),
                           lambda: hf_rates(model, prompts, args.new_tokens), args.warmup, args.repeats)
    for rep, (e, h) in enumerate(zip(ours, hf, strict=True)):
        print(f"repeat {rep}: prefill engine {e.prefill:,.0f} tok/s, transformers {h.prefill:,.0f} tok/s; "
              f"decode engine {e.decode:,.1f} tok/s, transformers {h.decode:,.1f} tok/s", flush=True)
    report = cpu_markdown(args, ours, hf, str(core.runner.dtype).removeprefix("torch."))
    print(report)
    return report


def ratio_line(what: str, ours: list[float], peer: list[float]) -> str:
    """``"<what>: engine / transformers = R (per-repeat a–b, n=N); engine M (min–max), transformers M
    (min–max) tok/s"``: R is the ratio of the two medians."""
    e, h = Spread.of(ours), Spread.of(peer)
    per_repeat = paired_ratio(ours, peer)
    return (f"{what}: engine / transformers = {e.median / h.median:.2f} (per-repeat {per_repeat.min:.2f}–"
            f"{per_repeat.max:.2f}, n={per_repeat.n}); engine {e.fmt(',.1f')} tok/s, "
            f"transformers {h.fmt(',.1f')} tok/s")


def cpu_markdown(args: argparse.Namespace, ours: list[Rates], hf: list[Rates], dtype: str) -> str:
    """The CPU report: command, date, machine, model, one row per repeat, the two ratios."""
    lines = [
        "# Engine vs transformers on CPU",
        "",
        f"- command: `{' '.join(['python -m bench.engine.throughput', *sys.argv[1:]])}`",
        f"- date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {platform.machine()}, {torch.get_num_threads()} torch threads, {platform.platform()}, "
        f"torch {torch.__version__}",
        f"- model: {args.model} ({dtype}), batch {args.batch}, prompt {args.prompt_len} tokens, "
        f"{args.new_tokens} new tokens, attention backend {args.attention_backend}; {args.warmup} untimed "
        f"call(s) of each side, then {args.repeats} interleaved repeats",
        "",
        "| repeat | prefill engine tok/s | prefill transformers tok/s | decode engine tok/s "
        "| decode transformers tok/s |",
        "|---|---|---|---|---|",
    ]
    for rep, (e, h) in enumerate(zip(ours, hf, strict=True)):
        lines.append(f"| {rep} | {e.prefill:,.0f} | {h.prefill:,.0f} | {e.decode:,.1f} | {h.decode:,.1f} |")
    lines += ["", "- " + ratio_line("prefill", [r.prefill for r in ours], [r.prefill for r in hf]),
              "- " + ratio_line("decode", [r.decode for r in ours], [r.decode for r in hf])]
    return "\n".join(lines) + "\n"


MODES = ("graphs", "async", "async-nopdl", "async-alt", "eager")


def _second_graphs(core: EngineCore, max_num_seqs: int, pdl: bool, gemv: str | None,
                   rope_table: bool = True, decode_rope: bool = True) -> DecodeCudaGraphs:
    """A second set of decode graphs, captured with programmatic dependent launch ``pdl`` (engine/ops/pdl.py)
    and, when ``gemv`` is given, that comma list as the batch-1 GEMV projections (engine/models/
    fused_model.py), without the RoPE table unless ``rope_table``, with RoPE + KV store as their own
    launch unless ``decode_rope`` (engine/attention/triton_backend.py), replayed by the ``async-nopdl`` /
    ``async-alt`` modes beside the default set, so a setting is compared in one process on one GPU (these
    machines are noisy between processes)."""
    runner = core.runner
    net: Any = runner.net
    before, projections = pdl_enabled(), getattr(net, "gemv_projections", None)
    table = getattr(net, "rope_table", None)
    set_pdl(pdl)
    if gemv is not None and projections is not None:
        net.gemv_projections = frozenset(p for p in gemv.split(",") if p)
    if not rope_table and table is not None:
        net.rope_table = None
    fuse = getattr(runner.backend, "fuse_decode_rope", None)
    if fuse is not None:
        runner.backend.fuse_decode_rope = decode_rope  # type: ignore[attr-defined]
    try:
        graphs = DecodeCudaGraphs(runner.net, runner.kv_cache, runner.backend, max_num_seqs,
                                  runner.max_model_len)
        graphs.capture()
    finally:
        set_pdl(before)
        if projections is not None:
            net.gemv_projections = projections
        if table is not None:
            net.rope_table = table
        if fuse is not None:
            runner.backend.fuse_decode_rope = fuse  # type: ignore[attr-defined]
    return graphs


def run_gpu(args: argparse.Namespace) -> dict[str, Any]:
    """Decode tokens/s against the HBM roofline per mode, async parity, then engine vs transformers
    (module docstring); returns the JSON-ready result (rates in tok/s, spreads as min/median/max/n)."""
    core = build_engine(args, num_blocks=args.num_blocks)
    runner = core.runner
    graphs = runner.decode_graphs
    read_bytes = sum(p.numel() * p.element_size() for n, p in runner.model.named_parameters()
                     if "embed_tokens" not in n)  # the input embedding is gathered (B rows), not read whole
    kv_token = runner.kv_cache.bytes_per_block // runner.kv_cache.block_size
    copies = copy_bandwidth(runner.device)
    bandwidth = copies.max
    print(f"copy bandwidth (read + write): best {bandwidth / 1e12:.3f} TB/s, "
          f"{copies.scaled(1e-12).fmt('.3f', ' TB/s')}", flush=True)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(runner.device), "rows": [],
                           "weight_read_bytes": read_bytes, "kv_bytes_per_token": kv_token,
                           "copy_bandwidth": copies.as_dict(), "repeats": args.repeats, "warmup": args.warmup,
                           "capture_s": graphs.capture_seconds if graphs else None}
    decode_rate(core, 2, 16, 4)  # warm-up: Triton compiles, eager and graph paths
    second: dict[str, tuple[bool, str | None, bool, bool]] = {
        "async-nopdl": (False, None, True, True),
        "async-alt": (pdl_enabled(), args.alt_gemv, args.alt_rope_table == "on",
                      args.alt_decode_rope == "on")}
    other = {mode: _second_graphs(core, args.max_num_seqs, *second[mode])
             for mode in args.modes if mode in second and graphs is not None}
    if "eager" in args.modes:
        runner.decode_graphs = None
        decode_rate(core, 2, 16, 4)
    for batch in args.parity_batches:
        same = async_parity(core, batch, args.new_tokens)
        res["rows"].append(dict(mode="parity", batch=batch, equal=same))
        verdict = "equal" if same else "DIFFERENT"
        print(f"greedy tokens, async vs graphs, batch {batch}: {verdict}", flush=True)
    for context in args.contexts:
        for batch in args.batches:
            kv_read = batch * kv_token * (context + args.new_tokens / 2)
            roofline = batch * bandwidth / (read_bytes + kv_read)
            for mode in args.modes:
                chosen = other.get(mode, graphs)
                runner.decode_graphs = None if mode == "eager" else chosen
                core.async_scheduling = mode.startswith("async")
                rates = Spread.of([decode_rate(core, batch, context, args.new_tokens)
                                   for _ in range(args.repeats)])
                res["rows"].append(dict(mode=mode, batch=batch, context=context, tok_s=rates.as_dict(),
                                        roofline=roofline))
                share = rates.scaled(100 / roofline)
                print(f"{mode:6s} batch {batch:4d} context {context:5d}: {rates.fmt('9.1f', ' tok/s')} "
                      f"= engine / roofline {share.fmt('.1f', ' %')} of {roofline:9.1f} tok/s", flush=True)
    runner.decode_graphs, core.async_scheduling = graphs, False
    res["rows"] += versus_transformers(core, args)
    return res


def versus_transformers(core: EngineCore, args: argparse.Namespace) -> list[dict[str, Any]]:
    """For each of ``args.hf_batches``: decode tok/s of the engine in its current mode and of
    transformers ``generate`` on its model, ``args.warmup`` untimed calls of each at that batch, context
    (``args.hf_context``) and ``args.new_tokens``, then ``args.repeats`` interleaved repeats; one
    JSON-ready row per batch (each side's spread, ratio of medians engine / transformers, per-repeat
    ratio spread), also printed."""
    rows = []
    for batch in args.hf_batches:
        ours, hf = interleaved(functools.partial(decode_rate, core, batch, args.hf_context, args.new_tokens),
                               functools.partial(hf_decode, core, batch, args.hf_context, args.new_tokens),
                               args.warmup, args.repeats)
        rows.append(dict(mode="hf", batch=batch, context=args.hf_context,
                         engine_tok_s=Spread.of(ours).as_dict(), hf_tok_s=Spread.of(hf).as_dict(),
                         ratio_engine_over_hf=Spread.of(ours).median / Spread.of(hf).median,
                         ratio_per_repeat=paired_ratio(ours, hf).as_dict()))
        print(ratio_line(f"decode, batch {batch}, context {args.hf_context}, engine (graphs, synchronous) vs "
                         "transformers generate (SDPA)", ours, hf), flush=True)
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed calls of each side (engine and transformers) before the repeats")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of every figure")
    parser.add_argument("--num-blocks", type=int, default=None, help="GPU: KV blocks")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--modes", nargs="+", default=["graphs", "eager"], choices=MODES,
                        help="GPU decode modes: graphs, async (graphs + asynchronous scheduling), "
                        "async-nopdl (the same, graphs captured without programmatic dependent launch), "
                        "async-alt (the same, graphs captured with --alt-gemv), eager")
    parser.add_argument("--parity-batches", type=int, nargs="*", default=[],
                        help="GPU: check that async and graphs modes give the same greedy tokens")
    parser.add_argument("--fused-ops", default="auto", choices=["auto", "on", "off"],
                        help="merged GEMMs + fused small kernels (ModelConfig.fused_ops)")
    parser.add_argument("--pdl", choices=["on", "off"], default="on",
                        help="programmatic dependent launch of the Triton kernels (ModelConfig.pdl)")
    parser.add_argument("--gemv", default="",
                        help="comma list of qkv,o,gate_up,down,silu_down,lm_head,router: batch-1 projections "
                        "through engine.ops.gemv (silu_down: SiLU·mul folded into down's GEMV; router: a "
                        "softmax top-k router's logits); default: the engine's")
    parser.add_argument("--alt-gemv", default=None,
                        help="the async-alt mode's batch-1 GEMV projections (comma list, as --gemv; default: "
                        "the engine's)")
    parser.add_argument("--alt-rope-table", choices=["on", "off"], default="on",
                        help="off: the async-alt mode's graphs compute RoPE cos/sin per step (no table)")
    parser.add_argument("--alt-decode-rope", choices=["on", "off"], default="on",
                        help="off: the async-alt mode's graphs rotate and store K/V in their own launch, not "
                        "inside the decode attention kernel")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128], help="GPU decode batches")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096], help="GPU KV tokens/seq")
    parser.add_argument("--hf-batches", type=int, nargs="*", default=[1, 32])
    parser.add_argument("--hf-context", type=int, default=1024)
    parser.add_argument("--json", type=Path, default=None, help="GPU: write the results here")
    parser.add_argument("--out", type=Path, default=None, help="CPU: write the Markdown report here")
    parser.add_argument("--no-write", action="store_true", help="CPU: do not write --out")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and run the CPU or GPU benchmark."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.repeats < 1 or args.new_tokens < 2:
        parser.error("need --warmup >= 0, --repeats >= 1 and --new-tokens >= 2")
    if torch.device(args.device).type == "cuda":
        result = run_gpu(args)
        if args.json is not None:
            args.json.write_text(json.dumps({"argv": sys.argv[1:], **result}, indent=1))
        return
    report = run_cpu(args)
    if args.out is not None and not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
