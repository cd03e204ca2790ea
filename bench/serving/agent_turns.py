"""Multi-turn agent sessions, prefix reuse on vs off: TTFT by turn as the context grows, and the KV that
crosses per turn against the new tokens' own KV (``pdserve bench --workload agent`` on systems it starts).

H200 (prefill and decode worker sharing the one GPU, as docs/gpu.md runs them; Llama-3-8B shapes with
dummy bf16 weights)::

    python3 -m bench.serving.agent_turns --device cuda --work-dir $OUT/agent

runs 8 sessions x 20 turns, each turn adding 100 words of user text and a 650-word tool result (about
750 tokens with the chat template; the context reaches ~16k tokens by turn 20), 64 output tokens,
think time 1 s, on a system whose workers keep their prefix cache (``reuse-on``: the default flags,
plus ``--on-flags``), then on one started with ``--off-flags`` (``reuse-off``, default
``--enable-prefix-caching false``). The systems run one after the other (each alone on the GPU). A
decode-side reuse switch goes into ``--on-flags`` / ``--off-flags`` (e.g. ``--on-flags "--X true"``):
every worker of that system gets them. CPU smoke (SmolLM2, ~2 min)::

    python -m bench.serving.agent_turns --device cpu --sessions 2 --turns 3 --user-tokens 20 \
        --tool-tokens 40 --output-len 8 --think-time 0s

Prints and writes (``WORK/report.md``, ``WORK/results.json``) the bench's per-turn tables and side by
side view, then the two goal lines: TTFT p50 of the last turn / turn 1 per system (goal with reuse:
<= 1.5x), and per system the KV moved / the new tokens' own KV over turns 2.. (median and max; goal
<= 1.2x). Exit code: 0 done; 1 a system completed no request or leaked KV blocks; 2 bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import time
from pathlib import Path

from engine.models.registry import resolve_model
from loadtest.agent_config import AgentConfig, SystemTarget
from loadtest.agent_records import AgentResult, AgentSystemResult
from loadtest.agent_report import agent_markdown, save_agent_json
from loadtest.agent_runner import config_dict, run_system
from loadtest.config import SLOConfig
from loadtest.kv_size import kv_bytes_per_token, load_model_config
from loadtest.lengths import LengthDist
from pdserve.live_system import LiveSystem, live_system
from protocol.durations import parse_duration

DEFAULTS = {  # per --device: model, dtype (KV), blocks per worker, SLOs (ms)
    "cuda": dict(model="llama3-8b", dtype="bfloat16", num_blocks=12000, slo_ttft_ms=1000.0, slo_tpot_ms=50.0),
    "cpu": dict(model="smollm2-135m", dtype="float32", num_blocks=512, slo_ttft_ms=5000.0, slo_tpot_ms=500.0),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", help="model alias or dir (default: llama3-8b on cuda, smollm2-135m on cpu)")
    p.add_argument("--num-blocks", type=int, help="KV blocks per worker (default 12000 cuda, 512 cpu)")
    p.add_argument("--max-model-len", type=int, help="passed to every worker when set")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--user-tokens", default="fixed:100")
    p.add_argument("--tool-tokens", default="fixed:650")
    p.add_argument("--output-len", default="fixed:64")
    p.add_argument("--think-time", default="1s")
    p.add_argument("--max-context", type=int, default=16384)
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument("--request-timeout", default="300s")
    p.add_argument("--on-flags", default="", help="extra worker flags of the reuse-on system (shell words)")
    p.add_argument("--off-flags", default="--enable-prefix-caching false",
                   help="worker flags of the reuse-off system (shell words)")
    p.add_argument("--worker-flags", default="", help="worker flags of both systems (shell words)")
    p.add_argument("--work-dir", default="agent-turns", help="logs, report.md, results.json")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def agent_config(args: argparse.Namespace, kv_per_token: int) -> AgentConfig:
    """The workload both systems run (the systems are filled in per run)."""
    return AgentConfig(
        model=args.model, systems=(SystemTarget("placeholder", "http://127.0.0.1"),), endpoint="chat",
        sessions=args.sessions, turns=args.turns, user_tokens=LengthDist.parse(args.user_tokens),
        tool_tokens=LengthDist.parse(args.tool_tokens), output_len=LengthDist.parse(args.output_len),
        think_time_s=parse_duration(args.think_time), max_context=args.max_context, ignore_eos=True,
        request_timeout_s=parse_duration(args.request_timeout),
        slo=SLOConfig(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms), kv_bytes_per_token=kv_per_token,
        leak_settle_s=10.0, progress=True)


def target(label: str, system: LiveSystem) -> SystemTarget:
    """The bench's view of a started disaggregated system: its gateway and both workers' /metrics."""
    urls = system.metrics_urls
    return SystemTarget(label, system.url, (urls["prefill"],), (urls["decode"],))


def run_one(args: argparse.Namespace, cfg: AgentConfig, label: str, flags: list[str], work: Path
            ) -> AgentSystemResult:
    """Start the ``label`` system with ``flags`` on every worker, run the workload, stop it."""
    device = "cuda:0" if args.device == "cuda" else "cpu"
    common = shlex.split(args.worker_flags) + (["--max-model-len", str(args.max_model_len)]
                                                if args.max_model_len else [])
    t0 = time.monotonic()
    with live_system("disagg", work / label, model=args.model, devices=(device, device),
                     num_blocks=args.num_blocks, worker_flags=[*common, *flags],
                     ready_timeout_s=args.ready_timeout,
                     gateway_flags=["--request-timeout", "900"]) as system:
        print(f"== {label} ready after {time.monotonic() - t0:.0f} s (worker flags: {flags})",
              flush=True)
        return asyncio.run(run_system(cfg, target(label, system)))


def goal_lines(result: AgentResult) -> list[str]:
    """The two figures the issue asks for, per system."""
    lines = []
    for s in result.systems:
        ratios = [t.kv_over_suffix for t in s.turns[1:] if t.kv_over_suffix is not None]
        kv = (f"median {statistics.median(ratios):.2f}x, max {max(ratios):.2f}x over turns 2..{len(s.turns)}"
              if ratios else "not measured")
        growth = "-" if s.ttft_last_over_first is None else f"{s.ttft_last_over_first:.2f}x"
        last = s.turns[-1] if s.turns else None
        context = f"{last.prompt_tokens_mean:.0f}" if last and last.prompt_tokens_mean else "-"
        lines.append(f"{s.label}: TTFT p50 turn {len(s.turns)} / turn 1 = {growth} (context {context} "
                     f"tokens; goal with reuse <= 1.5x); KV moved / new tokens' KV: {kv} (goal <= 1.2x)")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    try:
        per_token = kv_bytes_per_token(load_model_config(resolve_model(args.model)), args.dtype)
        cfg = agent_config(args, per_token)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    plan = (("reuse-on", shlex.split(args.on_flags)), ("reuse-off", shlex.split(args.off_flags)))
    systems = [run_one(args, cfg, label, flags, work) for label, flags in plan]
    data = config_dict(cfg)
    data["systems"] = [{"label": label, "worker_flags": flags} for label, flags in plan]
    result = AgentResult(config=data, systems=systems)
    text = agent_markdown(result) + "\n" + "\n".join(goal_lines(result)) + "\n"
    print(text, end="")
    (work / "report.md").write_text(text, encoding="utf-8")
    save_agent_json(result, work / "results.json")
    print(f"written: {work}/report.md, {work}/results.json")
    return 1 if any(s.summary.completed == 0 or (s.kv.leaked or 0) > 0 for s in systems) else 0


if __name__ == "__main__":
    sys.exit(main())
