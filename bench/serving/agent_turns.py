"""Multi-turn agent sessions, prefix reuse on vs off: TTFT by turn as the context grows, and the KV that
crosses per turn against the new tokens' own KV (``pdserve bench --workload agent`` on systems it starts).

H200 (prefill and decode worker sharing the one GPU, as docs/gpu.md runs them; Llama-3-8B shapes with
dummy bf16 weights; the alias's position limit, 8192, raised to ``--position-limit`` 32768 in a copy of
its config under WORK/model so the context can reach 16k tokens: with dummy weights only the shapes
matter)::

    python3 -m bench.serving.agent_turns --device cuda --work-dir $OUT/agent

runs 8 sessions x 20 turns, each turn adding 100 words of user text and a 600-word tool result and
asking for 64 output tokens (about 775 tokens per turn with the answer and the chat template; the
context reaches ~15.5k tokens at turn 20), think time 1 s, after ``--warmup-turns`` (default 2) turns
of one unrelated session that are not reported (a fresh system's first requests compile and allocate),
on a system whose workers keep their prefix
cache (``reuse-on``: the default flags, plus ``--on-flags``), then on one started with ``--off-flags``
(``reuse-off``, default ``--enable-prefix-caching false``). The systems run one after the other (each
alone on the GPU). A decode-side reuse switch goes into ``--on-flags`` / ``--off-flags`` (e.g.
``--on-flags "--X true"``): every worker of that system gets them. The texts of a dummy model are drawn
from its synthetic tokenizer's own words (``t<id>``, one token each): English words would all be its one
unknown token, and every session's prompt the same tokens. CPU smoke (SmolLM2, ~2 min)::

    python -m bench.serving.agent_turns --device cpu --sessions 2 --turns 3 --user-tokens 20 \
        --tool-tokens 40 --output-len 8 --think-time 0s

``--repeats R`` runs the workload R times on the one started reuse-on system (each run's texts from
another seed: no prefix shared with an earlier run), reported as systems ``reuse-on``, ``reuse-on-2``, ...
with the median and range of their TTFT ratios (one run's p50 over 8 sessions moves by up to +-120 ms
between neighbouring turns); ``--systems reuse-on`` leaves the reuse-off system out.

Prints and writes (``WORK/report.md``, ``WORK/results.json``) the bench's per-turn tables and side by
side view, then the two goal lines: TTFT p50 of the last turn / turn 1 per system (goal with reuse:
<= 1.5x), and per system the KV moved / the new tokens' own KV over turns 2.. (median and max; goal
<= 1.2x). Exit code: 0 done; 1 a system completed no request or leaked KV blocks; 2 bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

from bench.argtypes import duration, non_negative_int, positive_duration, positive_float, positive_int
from engine.models.registry import is_dummy_alias, resolve_model
from loadtest.agent_config import AgentConfig, SystemTarget
from loadtest.agent_records import AgentResult, AgentSystemResult
from loadtest.agent_report import agent_markdown, save_agent_json
from loadtest.agent_runner import config_dict, run_system
from loadtest.config import SLOConfig
from loadtest.kv_size import kv_bytes_per_token, load_model_config
from loadtest.lengths import LengthDist
from loadtest.models import first_model
from pdserve.live_system import LiveSystem, live_system

DEFAULTS = {  # per --device: model, dtype (KV), blocks per worker, SLOs (ms)
    "cuda": dict(model="llama3-8b", dtype="bfloat16", num_blocks=12000, slo_ttft_ms=1000.0, slo_tpot_ms=50.0),
    "cpu": dict(model="smollm2-135m", dtype="float32", num_blocks=512, slo_ttft_ms=5000.0, slo_tpot_ms=500.0),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", help="model alias or dir (default: llama3-8b on cuda, smollm2-135m on cpu)")
    p.add_argument("--num-blocks", type=positive_int,
                   help="KV blocks per worker (default 12000 cuda, 512 cpu)")
    p.add_argument("--max-model-len", type=positive_int, help="passed to every worker when set")
    p.add_argument("--position-limit", type=positive_int, default=32768,
                   help="a dummy alias whose max_position_embeddings is below --max-context runs as a copy "
                        "with this limit (WORK/model)")
    p.add_argument("--sessions", type=positive_int, default=8)
    p.add_argument("--turns", type=positive_int, default=20)
    p.add_argument("--warmup-turns", type=non_negative_int, default=2,
                   help="turns of one unrelated session run on each system before the measured ones "
                   "(0: none)")
    p.add_argument("--user-tokens", default="fixed:100")
    p.add_argument("--tool-tokens", default="fixed:600")
    p.add_argument("--output-len", default="fixed:64")
    p.add_argument("--think-time", type=duration, default="1s", help="between a reply and the next turn")
    p.add_argument("--max-context", type=positive_int, default=16384)
    p.add_argument("--slo-ttft-ms", type=positive_float)
    p.add_argument("--slo-tpot-ms", type=positive_float)
    p.add_argument("--request-timeout", type=positive_duration, default="300s")
    p.add_argument("--on-flags", default="", help="extra worker flags of the reuse-on system (shell words)")
    p.add_argument("--off-flags", default="--enable-prefix-caching false",
                   help="worker flags of the reuse-off system (shell words)")
    p.add_argument("--worker-flags", default="", help="worker flags of both systems (shell words)")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="runs of the workload on the started reuse-on system, each with other texts")
    p.add_argument("--systems", choices=("both", "reuse-on"), default="both",
                   help="reuse-on alone skips the reuse-off system")
    p.add_argument("--work-dir", default="agent-turns", help="logs, report.md, results.json")
    p.add_argument("--ready-timeout", type=positive_float, default=600.0)
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def prepare_model(args: argparse.Namespace, work: Path) -> tuple[str, list[str], tuple[str, ...] | None]:
    """The workers' ``--model``, the worker flags it needs, and the words the texts are drawn from (None:
    English words). A dummy alias gets its tokenizer's own words (``t<id>`` for ids 100..) and, when its
    position limit is below ``--max-context``, runs as a copy of its config (WORK/model) with
    ``max_position_embeddings`` = ``--position-limit`` and ``--load-format dummy``."""
    if not is_dummy_alias(args.model):
        return args.model, [], None
    source = resolve_model(args.model)
    config = json.loads((source / "config.json").read_text())
    words = tuple(f"t{i}" for i in range(100, min(int(config["vocab_size"]), 20100)))
    if args.max_context is None or config["max_position_embeddings"] >= args.max_context:
        return args.model, [], words
    copy = work / "model"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(source, copy)
    config["max_position_embeddings"] = args.position_limit
    (copy / "config.json").write_text(json.dumps(config, indent=1))
    return str(copy), ["--load-format", "dummy"], words


def agent_config(args: argparse.Namespace, kv_per_token: int, words: tuple[str, ...] | None = None
                 ) -> AgentConfig:
    """The workload both systems run (the systems and the served model name are filled in per run)."""
    return AgentConfig(
        model=args.model, systems=(SystemTarget("placeholder", "http://127.0.0.1"),), endpoint="chat",
        sessions=args.sessions, turns=args.turns, user_tokens=LengthDist.parse(args.user_tokens),
        tool_tokens=LengthDist.parse(args.tool_tokens), output_len=LengthDist.parse(args.output_len),
        think_time_s=args.think_time, max_context=args.max_context, ignore_eos=True,
        request_timeout_s=args.request_timeout,
        slo=SLOConfig(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms), kv_bytes_per_token=kv_per_token,
        words=words, leak_settle_s=10.0, progress=True)


def target(label: str, system: LiveSystem) -> SystemTarget:
    """The bench's view of a started disaggregated system: its gateway and both workers' /metrics."""
    urls = system.metrics_urls
    return SystemTarget(label, system.url, (urls["prefill"],), (urls["decode"],))


# the warm-up session's texts come from another seed, so it shares no prefix with the measured sessions;
# so do a repeat's (``--repeats``) with every earlier run's
WARMUP_SEED_OFFSET = 1_000_003
REPEAT_SEED_OFFSET = 2_000_029


def run_one(args: argparse.Namespace, cfg: AgentConfig, label: str, flags: list[str], work: Path,
            model: str, repeats: int = 1) -> list[AgentSystemResult]:
    """Start the ``label`` system of ``model`` with ``flags`` on every worker, run the workload ``repeats``
    times (run r > 0 labelled ``label-<r+1>``, its texts from seed + r x ``REPEAT_SEED_OFFSET``: no prefix
    shared with an earlier run), stop it."""
    device = "cuda:0" if args.device == "cuda" else "cpu"
    common = shlex.split(args.worker_flags) + (["--max-model-len", str(args.max_model_len)]
                                                if args.max_model_len else [])
    t0 = time.monotonic()
    with live_system("disagg", work / label, model=model, devices=(device, device),
                     num_blocks=args.num_blocks, worker_flags=[*common, *flags],
                     ready_timeout_s=args.ready_timeout,
                     gateway_flags=["--request-timeout", "900"]) as system:
        print(f"== {label} ready after {time.monotonic() - t0:.0f} s (worker flags: {flags})",
              flush=True)
        served = asyncio.run(first_model(system.url, None))
        if args.warmup_turns > 0:  # first requests of a fresh system (compiles, allocations) are not timed
            warm = dataclasses.replace(cfg, model=served, sessions=1, turns=args.warmup_turns,
                                       think_time_s=0.0, seed=cfg.seed + WARMUP_SEED_OFFSET, progress=False)
            asyncio.run(run_system(warm, target(f"{label}-warmup", system)))
            print(f"== {label}: {args.warmup_turns} warm-up turns of another session done (not reported)",
                  flush=True)
        runs = []
        for r in range(repeats):
            name = label if r == 0 else f"{label}-{r + 1}"
            run = dataclasses.replace(cfg, model=served, seed=cfg.seed + r * REPEAT_SEED_OFFSET)
            runs.append(asyncio.run(run_system(run, target(name, system))))
            print(f"== {goal_line(runs[-1])}", flush=True)  # a run cut short later still shows this one
        return runs


def goal_line(s: AgentSystemResult) -> str:
    """The two figures the issue asks for, of one system's run."""
    ratios = [t.kv_over_suffix for t in s.turns[1:] if t.kv_over_suffix is not None]
    kv = (f"median {statistics.median(ratios):.2f}x, max {max(ratios):.2f}x over turns 2..{len(s.turns)}"
          if ratios else "not measured")
    growth = "-" if s.ttft_last_over_first is None else f"{s.ttft_last_over_first:.2f}x"
    last = s.turns[-1] if s.turns else None
    context = f"{last.prompt_tokens_mean:.0f}" if last and last.prompt_tokens_mean else "-"
    return (f"{s.label}: TTFT p50 turn {len(s.turns)} / turn 1 = {growth} (context {context} "
            f"tokens; goal with reuse <= 1.5x); KV moved / new tokens' KV: {kv} (goal <= 1.2x)")


def goal_lines(result: AgentResult) -> list[str]:
    """The two figures the issue asks for, per system, and the spread of the reuse-on repeats."""
    lines = [goal_line(s) for s in result.systems]
    on = [s.ttft_last_over_first for s in result.systems
          if s.label.startswith("reuse-on") and s.ttft_last_over_first is not None]
    if len(on) > 1:
        lines.append(f"reuse-on over {len(on)} runs on one system: TTFT p50 last turn / turn 1 median "
                     f"{statistics.median(on):.2f}x (min {min(on):.2f}x, max {max(on):.2f}x; each: "
                     f"{', '.join(f'{x:.2f}x' for x in on)})")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    try:
        per_token = kv_bytes_per_token(load_model_config(resolve_model(args.model)), args.dtype)
        model, model_flags, words = prepare_model(args, work)
        cfg = agent_config(args, per_token, words)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    plan: list[tuple[str, list[str]]] = [("reuse-on", shlex.split(args.on_flags)),
                                          ("reuse-off", shlex.split(args.off_flags))]
    if args.systems == "reuse-on":
        plan = plan[:1]
    systems = [run for label, flags in plan
               for run in run_one(args, cfg, label, [*model_flags, *flags], work, model,
                                  args.repeats if label == "reuse-on" else 1)]
    data = config_dict(cfg)
    data["systems"] = [{"label": label, "worker_flags": [*model_flags, *flags]} for label, flags in plan]
    data["worker_model"] = model
    result = AgentResult(config=data, systems=systems)
    text = agent_markdown(result) + "\n" + "\n".join(goal_lines(result)) + "\n"
    print(text, end="")
    (work / "report.md").write_text(text, encoding="utf-8")
    save_agent_json(result, work / "results.json")
    print(f"written: {work}/report.md, {work}/results.json")
    return 1 if any(s.summary.completed == 0 or (s.kv.leaked or 0) > 0 for s in systems) else 0


if __name__ == "__main__":
    sys.exit(main())
