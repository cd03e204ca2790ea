"""Where a decode step's time goes on a GPU (not a test): the CUDA-graph replay alone against the whole
engine step, per batch size.

For each ``--batches`` size B with ``--context`` tokens of KV per sequence (Llama-3-8B shapes, dummy bf16
weights, Triton attention, decode CUDA graphs captured as in serving):

- ``replay``: ``graph.replay()`` of B's bucket, back to back, timed with CUDA events (device time of the
  forward pass only: weights, KV reads, every small kernel inside the graph);
- ``run``: ``DecodeCudaGraphs.run`` (host fill of the static buffers + replay), host clock, synchronized;
- ``sample``: the engine's sampler on the step's logits (greedy), host clock, synchronized;
- ``step``: ``EngineCore.step()`` of a real decode batch (scheduler, block tables, fill, replay, sampling,
  ``.tolist()``, detokenize-free bookkeeping), host clock (``bench.engine.decode.decode_rate``).

``step - replay`` is the host time a step does not overlap with the GPU (``--async-scheduling``: also
with step N+1 launched before step N's tokens are read, engine/async_step.py); ``replay`` against the
weight-read floor (weight bytes / device copy bandwidth, the best of 20 copies in the same process,
``bench.ceilings.copy_bandwidth``) is the forward pass's own efficiency. Each time is a mean over
``--iters`` calls (``step``: over one request's decode steps).

    python3 -m bench.engine.decode_breakdown --batches 1 8 32 --context 1024 [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch

from bench.ceilings import copy_bandwidth
from bench.engine.decode import decode_rate
from bench.engine.throughput import build_engine
from engine.engine_core import EngineCore
from engine.sampler import SamplingRow
from engine.sampling_params import SamplingParams


def _timed(fn: object, iters: int, device: torch.device) -> float:
    """Mean seconds per call of ``fn`` over ``iters`` calls after 3 warm-ups (host clock, synchronized)."""
    assert callable(fn)
    for _ in range(3):
        fn()
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / iters


def breakdown(args: argparse.Namespace) -> dict[str, object]:
    """Run the measurements above; returns a JSON-able dict (times in seconds). Raises RuntimeError
    without CUDA graphs (CPU device or ``--enforce-eager``)."""
    core = build_engine(args, num_blocks=args.num_blocks)
    runner = core.runner
    if runner.decode_graphs is None:
        raise RuntimeError("decode CUDA graphs are off: run on CUDA without --enforce-eager")
    weights = sum(p.numel() * p.element_size() for n, p in runner.model.named_parameters()
                  if "embed_tokens" not in n)
    bandwidth = copy_bandwidth(runner.device).max
    out: dict[str, object] = {"weight_read_bytes": weights, "copy_bandwidth": bandwidth,
                              "floor_s": weights / bandwidth, "rows": []}
    for batch in args.batches:
        row = _measure(core, batch, args)
        out["rows"].append(row)  # type: ignore[attr-defined]
        replay_s, step_s = row["replay_s"], row["step_s"]
        print(f"batch {batch:4d}: replay {replay_s * 1e3:6.2f} ms ({weights / bandwidth / replay_s:5.1%} of "
              f"the weight floor) | run {row['run_s'] * 1e3:6.2f} | sample {row['sample_s'] * 1e3:6.2f} | "
              f"step {step_s * 1e3:6.2f} ms | host not overlapped {(step_s - replay_s) * 1e3:6.2f} ms"
              + (f" | async step {row['async_step_s'] * 1e3:6.2f} ms, not overlapped "
                 f"{(row['async_step_s'] - replay_s) * 1e3:6.2f} ms" if "async_step_s" in row else ""),
              flush=True)
    return out


def _measure(core: EngineCore, batch: int, args: argparse.Namespace) -> dict[str, float]:
    """The four times of one batch size (seconds per step)."""
    runner, graphs = core.runner, core.runner.decode_graphs
    assert graphs is not None
    device, bs = runner.device, runner.kv_cache.block_size
    blocks = -(-(args.context + 1) // bs)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    run = functools.partial(graphs.run, [1] * batch, [args.context] * batch, tables)
    run_s = _timed(run, args.iters, device)
    graph = graphs._graphs[min(b for b in graphs.captured if b >= batch)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(args.iters):
        graph.replay()
    end.record()
    end.synchronize()
    replay_s = start.elapsed_time(end) / 1e3 / args.iters
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    rows = [SamplingRow(params, 0, 0, [1], []) for _ in range(batch)]
    sample_s = _timed(functools.partial(runner.sampler, run(), rows), args.iters, device)
    core.async_scheduling = False  # synchronous steps first (the default is on)
    step_s = batch / decode_rate(core, batch, args.context, args.new_tokens)
    row = dict(batch=batch, replay_s=replay_s, run_s=run_s, sample_s=sample_s, step_s=step_s)
    if args.async_scheduling:  # the same steps with asynchronous scheduling (engine/async_step.py)
        core.async_scheduling = True
        row["async_step_s"] = batch / decode_rate(core, batch, args.context, args.new_tokens)
        core.async_scheduling = False
    if args.profile:
        _profile(graph, device, args.top)
    return row


def _profile(graph: torch.cuda.CUDAGraph, device: torch.device, top: int, replays: int = 5) -> None:
    """Print the ``top`` kernels with the most device time over ``replays`` graph replays (torch.profiler),
    with their calls and mean microseconds per call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize(device)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=top,
                                    max_name_column_width=90))


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run, print one line per batch and optionally write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--fused-ops", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--pdl", choices=["on", "off"], default="on", help="ModelConfig.pdl")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--num-blocks", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="ModelConfig.max_model_len (default: the model's; it pins the decode splits)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--prompt-len", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help="top kernels inside the graph (torch.profiler)")
    p.add_argument("--top", type=int, default=15, help="kernels listed by --profile")
    p.add_argument("--quantization", default=None, choices=["fp8"], help="ModelConfig.quantization")
    p.add_argument("--async-scheduling", action="store_true",
                   help="also time the steps with asynchronous scheduling (step N+1 launched first)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    result = breakdown(args)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
