"""Engine throughput benchmark (not a test).

CPU mode (default): prefill and decode tokens/s of pdserve's engine next to transformers ``generate``
on the same model, machine and run, printed as ratios (engine / transformers), and written to
``docs/benchmarks/engine-cpu.md`` with the command, machine and date.

GPU mode (``--device cuda --model llama3-8b --load-format dummy``): decode tokens/s for each batch and
context in each of ``--modes`` (CUDA graphs; graphs with asynchronous scheduling, engine/async_step.py;
the same with a second set of graphs captured without programmatic dependent launch, engine/ops/pdl.py,
or with the batch-1 GEMV projections of ``--alt-gemv``; eager), as a fraction of the HBM roofline ``batch
* bandwidth / (weight bytes + batch * context * KV bytes per token)`` (a decode step reads every weight
once, except the input embedding, and each sequence's KV; bandwidth measured in the same run as a device-
to-device copy, read + write bytes counted), ``--parity-batches``: the same greedy tokens with and
without asynchronous scheduling, then transformers ``generate`` on the same model at ``--hf-batches``.

    .venv/bin/python -m bench.engine                       # SmolLM2 on CPU, fp32
    .venv/bin/python -m bench.engine --device cuda --model llama3-8b --load-format dummy --dtype bfloat16 \
        --attention-backend triton --num-blocks 34000 --max-num-seqs 128 --new-tokens 32
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from bench.async_parity import async_parity
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.cuda_graphs import DecodeCudaGraphs
from engine.engine_core import EngineCore
from engine.models.hf_attention import install_paged_attention
from engine.models.registry import resolve_model
from engine.ops.pdl import pdl_enabled, set_pdl
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "engine-cpu.md"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 30000), (batch, length), generator=gen).tolist()


def engine_rates(core: EngineCore, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s): the first step(s) until every prompt has its first token
    count as prefill; the rest as decode. Unique prompt ids per call keep the prefix cache cold."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    tag = time.monotonic_ns()
    for i, p in enumerate(prompts):
        core.add_request(f"b{tag}-{i}", p, params)
    device = core.runner.device
    started = time.perf_counter()
    first = 0
    while first < len(prompts):
        first += len(core.step())
    _sync(device)
    prefill_s = time.perf_counter() - started
    started = time.perf_counter()
    while core.has_unfinished():
        core.step()
    _sync(device)
    decode_s = time.perf_counter() - started
    core.check_no_leaks()
    prefill_tokens = sum(len(p) for p in prompts)
    return prefill_tokens / prefill_s, len(prompts) * (new_tokens - 1) / max(decode_s, 1e-9)


@torch.inference_mode()
def hf_rates(model: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of transformers ``generate`` on the same equal-length batch:
    prefill = a 1-token generate; decode = the extra time of an ``new_tokens`` generate."""
    ids = torch.tensor(prompts, device=next(model.parameters()).device)
    kwargs = dict(do_sample=False, pad_token_id=0)
    started = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    prefill_s = time.perf_counter() - started
    started = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
    decode_s = time.perf_counter() - started - prefill_s
    return ids.numel() / prefill_s, len(prompts) * (new_tokens - 1) / max(decode_s, 1e-9)


def _engine(args: argparse.Namespace, num_blocks: int | None) -> EngineCore:
    core = _new_engine(args, num_blocks)
    gemv = [p for p in (getattr(args, "gemv", "") or "").split(",") if p]
    runner = core.runner
    if gemv and hasattr(runner.net, "gemv_projections"):  # batch-1 projections through engine.ops.gemv
        setattr(runner.net, "gemv_projections", frozenset(gemv))  # noqa: B010  (net is typed Module)
        if runner.decode_graphs is not None:
            runner.decode_graphs.capture()  # re-capture with the GEMV inside
    return core


def _new_engine(args: argparse.Namespace, num_blocks: int | None) -> EngineCore:
    return EngineCore(
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
            ),
            CacheConfig(block_size=16, num_blocks=num_blocks, enable_prefix_caching=False),
            SchedulerConfig(max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=max(2048, args.batch * args.prompt_len)),
        )
    )


def run_cpu(args: argparse.Namespace) -> str:
    """Engine vs transformers on CPU; returns the markdown report."""
    core = _engine(args, num_blocks=args.batch * (args.prompt_len + args.new_tokens) // 16 + args.batch + 8)
    model = AutoModelForCausalLM.from_pretrained(
        str(resolve_model(args.model)), dtype=core.runner.dtype
    ).eval()
    prompts = _prompts(args.batch, args.prompt_len, core.runner.vocab_size, seed=0)
    engine_rates(core, _prompts(2, 8, core.runner.vocab_size, seed=1), 3)  # warm-up
    hf_rates(model, _prompts(2, 8, core.runner.vocab_size, seed=1), 3)
    rows = []
    for rep in range(args.repeats):
        e_pre, e_dec = engine_rates(core, prompts, args.new_tokens)
        h_pre, h_dec = hf_rates(model, prompts, args.new_tokens)
        rows.append((rep, e_pre, h_pre, e_dec, h_dec))
        print(
            f"run {rep}: prefill engine {e_pre:,.0f} tok/s, transformers {h_pre:,.0f} tok/s "
            f"(ratio {e_pre / h_pre:.2f}); decode engine {e_dec:,.1f} tok/s, transformers {h_dec:,.1f} tok/s "
            f"(ratio {e_dec / h_dec:.2f})"
        )
    return _markdown(args, rows, str(core.runner.dtype).removeprefix("torch."))


def _markdown(
    args: argparse.Namespace, rows: list[tuple[int, float, float, float, float]], dtype: str
) -> str:
    lines = [
        "# Engine vs transformers on CPU",
        "",
        f"- command: `{' '.join(['python -m bench.engine', *sys.argv[1:]])}`",
        f"- date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {platform.machine()}, {torch.get_num_threads()} torch threads, {platform.platform()}, "
        f"torch {torch.__version__}; shared machine, numbers are noisy",
        f"- model: {args.model} ({dtype}), batch {args.batch}, prompt {args.prompt_len} tokens, "
        f"{args.new_tokens} new tokens, attention backend {args.attention_backend}",
        "",
        "| run | prefill engine tok/s | prefill HF tok/s | ratio "
        "| decode engine tok/s | decode HF tok/s | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for rep, e_pre, h_pre, e_dec, h_dec in rows:
        lines.append(
            f"| {rep} | {e_pre:,.0f} | {h_pre:,.0f} | {e_pre / h_pre:.2f} | {e_dec:,.1f} | "
            f"{h_dec:,.1f} | {e_dec / h_dec:.2f} |"
        )
    # Best-of-runs per side: on a shared machine contention only ever slows a run down.
    pre = max(r[1] for r in rows) / max(r[2] for r in rows)
    dec = max(r[3] for r in rows) / max(r[4] for r in rows)
    lines += ["", f"Best-of-runs ratio (engine / transformers): prefill {pre:.2f}, decode {dec:.2f}."]
    print(lines[-1])
    return "\n".join(lines) + "\n"


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    started = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * iters / (time.perf_counter() - started)


def decode_rate(core: EngineCore, batch: int, context: int, new_tokens: int) -> float:
    """Decode tokens/s of ``batch`` sequences with ``context`` tokens of KV each, entered through the
    decode-worker path (``add_waiting_for_kv`` + ``kv_landed``: no prefill run; the KV contents do not
    change the speed). The first decode step is a warm-up and is not timed."""
    sched, vocab = core.scheduler, core.runner.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    tag = time.monotonic_ns()
    for i, prompt in enumerate(_prompts(batch, context, vocab, seed=context + batch)):
        seq = Sequence(f"d{tag}-{i}", prompt, params, time.monotonic(), core.eos_token_id)
        if not sched.add_waiting_for_kv(seq):
            raise RuntimeError(f"no KV blocks for batch {batch} x {context} tokens: raise --num-blocks")
        sched.kv_landed(seq.request_id, first_token=5)
    core.step()
    _sync(core.runner.device)
    started, tokens = time.perf_counter(), 0
    while core.has_unfinished():
        tokens += len(core.step())
    _sync(core.runner.device)
    core.check_no_leaks()
    return tokens / (time.perf_counter() - started)


def _hf_decode(core: EngineCore, batch: int, context: int, new_tokens: int) -> float:
    """transformers ``generate`` decode tokens/s on the engine's own model, switched to SDPA for the call."""
    model = core.runner.model
    model.set_attn_implementation("sdpa")
    try:
        return hf_rates(model, _prompts(batch, context, core.runner.vocab_size, seed=7), new_tokens)[1]
    finally:
        install_paged_attention(model)


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
    """Decode tokens/s with and without CUDA graphs against the HBM roofline (see module docstring)."""
    core = _engine(args, num_blocks=args.num_blocks)
    runner = core.runner
    graphs = runner.decode_graphs
    read_bytes = sum(p.numel() * p.element_size() for n, p in runner.model.named_parameters()
                     if "embed_tokens" not in n)  # the input embedding is gathered (B rows), not read whole
    kv_token = runner.kv_cache.bytes_per_block // runner.kv_cache.block_size
    bandwidth = copy_bandwidth(runner.device)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(runner.device), "rows": [],
                           "weight_read_bytes": read_bytes, "kv_bytes_per_token": kv_token,
                           "copy_bandwidth": bandwidth,
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
                rate = decode_rate(core, batch, context, args.new_tokens)
                row = dict(mode=mode, batch=batch, context=context, tok_s=rate, roofline=roofline)
                res["rows"].append(row)
                print(f"{mode:6s} batch {batch:4d} context {context:5d}: {rate:9.1f} tok/s "
                      f"= {rate / roofline:6.1%} of roofline {roofline:9.1f} tok/s", flush=True)
    runner.decode_graphs, core.async_scheduling = graphs, False
    for batch in args.hf_batches:
        hf = _hf_decode(core, batch, args.hf_context, args.new_tokens)
        ours = decode_rate(core, batch, args.hf_context, args.new_tokens)
        res["rows"].append(dict(mode="hf", batch=batch, context=args.hf_context, tok_s=hf, engine_tok_s=ours))
        print(f"transformers generate batch {batch} context {args.hf_context}: {hf:.1f} tok/s; "
              f"engine (graphs) {ours:.1f} tok/s; ratio {ours / hf:.2f}", flush=True)
    return res


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and run the CPU or GPU benchmark."""
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
    parser.add_argument("--repeats", type=int, default=2)
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
    parser.add_argument("--gemv", default="", help="comma list of qkv,o,gate_up,down,silu_down,lm_head: "
                        "batch-1 projections through engine.ops.gemv (silu_down: SiLU·mul folded into "
                        "down's GEMV); default: the engine's")
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
    parser.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks/engine-cpu.md")
    args = parser.parse_args(argv)
    if torch.device(args.device).type == "cuda":
        result = run_gpu(args)
        if args.json is not None:
            args.json.write_text(json.dumps({"argv": sys.argv[1:], **result}, indent=1))
        return
    report = run_cpu(args)
    if not args.no_write:
        DOC.parent.mkdir(parents=True, exist_ok=True)
        DOC.write_text(report)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
