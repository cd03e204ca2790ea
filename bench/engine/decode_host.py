"""Host time of one decode step, measured on a CPU (not a test): the work a GPU waits for between replays.

On a GPU a CUDA-graph decode step is a graph replay plus host work the GPU waits for: scheduling, filling
the graph's static inputs, sampling and the scheduler update. This harness times that host work alone:
an ``EngineCore`` on the tiny dummy Llama (``tiny-llama``), its decode steps routed through
``DecodeCudaGraphs.run`` as on a GPU (uncaptured on CPU), with the model forward replaced by a stub that
returns fixed logits of Llama-3's vocabulary width (128256, float32; one row expanded to the batch, so
they stay in the CPU caches as on a GPU host), so no model FLOPs are timed.
Sequences are entered as ``bench.engine.decode`` enters them (``add_waiting_for_kv`` + ``kv_landed``, no
prefill), greedy, ``ignore_eos``. Per step, host clock (``time.perf_counter_ns``), in µs:

- ``schedule``: ``Scheduler.schedule()``;
- ``fill``: ``ModelRunner.compute_logits`` (step inputs → static buffers, plus the stub forward);
- ``sample``: the rest of ``ModelRunner.execute`` (sampling rows, the sampler, the token list) minus the
  time inside ``Tensor.argmax`` calls;
- ``update``: ``EngineCore.commit`` (``Scheduler.update`` + ``StepOutput``s);
- ``argmax``: time inside ``Tensor.argmax`` during ``execute`` (patched to time itself): on a CPU this is
  vocabulary arithmetic that a GPU does in microseconds, not host overhead, so it is not in ``sample``.

    .venv/bin/python -m bench.engine.decode_host --batches 32 128 --context 1024 [--steps 64] \
        [--no-prefix-caching]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from bench.engine.decode import enter_decodes
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.cuda_graphs import DecodeCudaGraphs
from engine.engine_core import EngineCore

VOCAB = 128256  # Llama-3's logit width
PARTS = ("schedule", "fill", "sample", "update")


def build_core(batch: int, context: int, steps: int, prefix_caching: bool) -> EngineCore:
    """A CPU ``EngineCore`` on ``tiny-llama`` whose decode steps go through a stubbed ``DecodeCudaGraphs``
    (forward → fixed float32 logits ``[bucket, 128256]``), asynchronous scheduling off (``measure`` drives
    a synchronous step's parts one by one). KV blocks for ``batch`` sequences of ``context + steps + 2``
    tokens (block_size 16)."""
    block_size = 16
    per_seq = -(-(context + steps + 2) // block_size)
    core = EngineCore(EngineConfig(
        ModelConfig("tiny-llama", dtype="float32", load_format="dummy", device="cpu",
                    attention_backend="triton", max_model_len=context + steps + 16),
        CacheConfig(block_size=block_size, num_blocks=batch * per_seq + 8,
                    enable_prefix_caching=prefix_caching),
        SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, batch),
                        async_scheduling=False),  # the parts of a synchronous step, driven one by one
    ))
    runner = core.runner
    graphs = DecodeCudaGraphs(runner.net, runner.kv_cache, runner.backend, batch, runner.max_model_len)
    # one row broadcast to every row (stride 0): the real shape, but 0.5 MB that stays in the CPU caches,
    # as on a GPU host, where the logits never pass through the host's caches
    logits = fixed_logits(graphs.buckets[-1])
    graphs.forward = lambda bucket: logits[:bucket]  # type: ignore[method-assign]
    runner.decode_graphs = graphs
    return core


def fixed_logits(rows: int) -> torch.Tensor:
    """float32 ``[rows, 128256]``: one seeded random row expanded (stride 0) to ``rows`` rows."""
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0)).expand(rows, VOCAB)


def _timed(fn: Callable[..., Any], into: list[int]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter_ns() - t0)
    return wrapper


@contextlib.contextmanager
def timed_argmax(into: list[int]) -> Iterator[None]:
    """Within the block every ``Tensor.argmax`` call adds its duration (ns) to ``into``: the vocabulary
    arithmetic the sampler does, device work on a GPU, taken out of ``sample``."""
    real = torch.Tensor.argmax

    def argmax(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        t0 = time.perf_counter_ns()
        try:
            return real(self, *args, **kwargs)
        finally:
            into.append(time.perf_counter_ns() - t0)

    torch.Tensor.argmax = argmax  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.argmax = real  # type: ignore[method-assign]


def measure(batch: int, context: int, steps: int, prefix_caching: bool) -> dict[str, float]:
    """Median µs per decode step of each part (see the module docstring) over ``steps`` steps after one
    warm-up step, their sum ``total``, and the smallest and largest per-step sum of the parts
    (``total_min``, ``total_max``); all ``batch`` sequences finish in the last step, then the leak check
    runs."""
    core = build_core(batch, context, steps, prefix_caching)
    enter_decodes(core, batch, context, steps + 2, tag="h")
    runner = core.runner
    fill_ns: list[int] = []
    argmax_ns: list[int] = []
    runner.compute_logits = _timed(runner.compute_logits, fill_ns)  # type: ignore[method-assign]
    times: dict[str, list[int]] = {p: [] for p in (*PARTS, "argmax")}
    core.step()  # warm-up
    fill_ns.clear()
    while core.has_unfinished():
        argmax_ns.clear()
        t0 = time.perf_counter_ns()
        output = core.scheduler.schedule()
        t1 = time.perf_counter_ns()
        with timed_argmax(argmax_ns):
            results = runner.execute(output)
        t2 = time.perf_counter_ns()
        outs = core.commit(output, results)
        t3 = time.perf_counter_ns()
        assert len(outs) == batch, f"{len(outs)} tokens from a step of {batch} decodes"
        times["schedule"].append(t1 - t0)
        times["sample"].append(t2 - t1 - fill_ns[-1] - sum(argmax_ns))
        times["update"].append(t3 - t2)
        times["argmax"].append(sum(argmax_ns))
    times["fill"] = fill_ns
    core.check_no_leaks()
    result = {p: statistics.median(v) / 1e3 for p, v in times.items()}
    result["total"] = sum(result[p] for p in PARTS)
    per_step = [sum(parts) / 1e3 for parts in zip(*(times[p] for p in PARTS), strict=True)]
    result["total_min"], result["total_max"] = min(per_step), max(per_step)
    return result


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, measure each batch size, print one line each (µs per step, medians)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--no-prefix-caching", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the stubbed forward never runs a kernel
    for batch in args.batches:
        r = measure(batch, args.context, args.steps, not args.no_prefix_caching)
        print(f"batch {batch:4d}: " + " | ".join(f"{k} {r[k]:8.1f}" for k in (*PARTS, "total"))
              + f" µs/step, medians (a step's sum {r['total_min']:.1f}–{r['total_max']:.1f}; argmax "
              f"{r['argmax']:.0f} µs, taken out of sample)", flush=True)


if __name__ == "__main__":
    main()
