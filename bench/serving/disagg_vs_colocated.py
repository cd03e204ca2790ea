"""Disaggregated (1 prefill + 1 decode worker) vs colocated (N colocated workers, chunked prefill), the same
``pdserve bench`` workload on both, plus a greedy-parity check between them.

GPU (2 GPUs): ``python3 -m bench.serving.disagg_vs_colocated --device cuda --work-dir $OUT/work
--doc $OUT/report.md`` — Llama-3-8B shapes with dummy weights (same seed on every worker), bf16;
disaggregated = prefill on cuda:0 + decode on cuda:1, KV over NIXL; colocated = two colocated workers
(cuda:0, cuda:1) behind one gateway. Every worker: ``--max-num-batched-tokens 2048`` (chunked prefill)
and the same ``--num-blocks``. Workload ``long`` = 3000 input / 150 output tokens (token-id prompts,
``ignore_eos``), Poisson arrivals at 2, 4, 6, 8 req/s for 20 s each; SLOs TTFT p90 <= 1 s, TPOT p90 <= 25 ms.
``--mixes long,short`` adds 1000 / 300 (or ``IN:OUT``); a mix after the first is skipped when it would
end after ``--time-budget`` seconds (estimate: per rate and system, the duration + 15 s).
CPU smoke (tiny-llama, ~1 min): ``--device cpu --mixes 256:32 --rates 1,2 --duration 10s``.

Both systems start together (their start-up overlaps; they share the GPUs' memory but only one is
loaded at a time), then: parity (8 prompts, chat and completion, max_tokens 32, temperature 0, one at a
time) → per mix, ``pdserve bench`` on colocated then disaggregated into ``WORK/<mix>/<mode>/`` →
``pdserve bench compare`` → the Markdown report at ``--doc`` (default ``WORK/report.md``) with plots in
the folder beside it (same name without ``.md``) → a summary table printed last. The figures worth
keeping go into docs/benchmarks/serving.md by hand. Exit code: 0 all good; 1 a bench run failed (no
request completed, or KV leaked); 2 bad arguments; 3 greedy outputs differ between the systems.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.argtypes import non_negative_int, positive_float, positive_int
from bench.machine import machine_info
from bench.serving import disagg_report as rep
from engine.models.registry import is_dummy_alias
from pdserve.live_system import LiveSystem, Mode, SystemSpec, live_systems

MIXES = {"long": (3000, 150), "short": (1000, 300)}
DEFAULTS = {  # per --device: model, rates, duration, blocks, colocated workers, TTFT and TPOT SLO (ms)
    "cuda": dict(model="llama3-8b", rates="2,4,6,8", duration="20s", num_blocks=12000, colocated_workers=2,
                 slo_ttft_ms=1000.0, slo_tpot_ms=25.0, request_timeout="30s"),
    "cpu": dict(model="tiny-llama", rates="1,2", duration="10s", num_blocks=1024, colocated_workers=1,
                slo_ttft_ms=2000.0, slo_tpot_ms=250.0, request_timeout="60s"),
}

READING = """How to read it: both setups use the same devices. Colocated, each of the {n} workers runs prefill
and decode on its own device and splits a new prompt into chunks of at most `--max-num-batched-tokens`
that share steps with the running decodes (chunked prefill): prefill capacity is {n}x, but every chunk
lengthens the steps of the requests decoding beside it (TPOT, and the ITL tail). Disaggregated, one
device only prefills and one only decodes: decode steps never carry a prompt chunk, but all prefill
work queues on one device (TTFT at high rates) and each request pays the KV handoff. Which effect wins
depends on the rate; the crossover line of each mix says where it flips."""


def parse_mix(text: str) -> tuple[str, int, int]:
    """``long`` / ``short`` / ``IN:OUT`` → (name, input tokens, output tokens). Raises ValueError."""
    if text in MIXES:
        return (text, *MIXES[text])
    try:
        n_in, n_out = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"bad mix {text!r}: use long, short or IN:OUT token counts") from None
    if n_in < 1 or n_out < 2:
        raise ValueError(f"bad mix {text!r}: need input >= 1 and output >= 2 tokens")
    return f"in{n_in}-out{n_out}", n_in, n_out


def devices(args: argparse.Namespace, mode: Mode) -> tuple[str, ...]:
    """Worker devices: disagg = (prefill, decode), colocated = one per worker (``cuda:i`` on GPUs)."""
    if args.device == "cuda":
        return ("cuda:0", "cuda:1") if mode == "disagg" else tuple(
            f"cuda:{i}" for i in range(args.colocated_workers))
    return ("cpu", "cpu") if mode == "disagg" else ("cpu",) * args.colocated_workers


def spec(args: argparse.Namespace, mode: Mode, work: Path) -> SystemSpec:
    """The system ``mode`` of this benchmark (every worker gets the same engine flags)."""
    flags = ("--dtype", args.dtype, "--attention-backend", args.attention_backend, "--load-format",
             args.load_format, "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--max-num-seqs", str(args.max_num_seqs))
    return SystemSpec(mode, work / f"{mode}-logs", args.model, devices(args, mode), args.num_blocks, flags,
                      (), args.transfer_backend, args.heartbeat_timeout)


def bench_argv(args: argparse.Namespace, url: str, out: Path, n_in: int | str, n_out: int | str) -> list[str]:
    """The ``pdserve bench`` flags of one sweep (identical for both systems but URL and output dir)."""
    return ["--base-url", url, "--endpoint", "completions", "--prompt-format", "tokens",
            "--input-len", f"fixed:{n_in}", "--output-len", f"fixed:{n_out}", "--ignore-eos",
            "--temperature", "0", "--arrival", "poisson", "--request-rate", args.rates,
            "--duration", args.duration, "--warmup", str(args.warmup), "--seed", "0",
            "--request-timeout", args.request_timeout, "--slo-ttft-ms", f"{args.slo_ttft_ms:g}",
            "--slo-tpot-ms", f"{args.slo_tpot_ms:g}", "--leak-settle", "5s", "--no-progress",
            "--output-dir", str(out)]


def _parity(systems: dict[str, LiveSystem], args: argparse.Namespace, work: Path) -> tuple[int, int]:
    """Greedy parity disagg vs colocated; writes WORK/parity.json; (identical, total)."""
    from bench.serving.parity import check_parity, save_parity
    from loadtest.models import first_model

    model = asyncio.run(first_model(systems["colocated"].url, None))
    cases = check_parity(systems["disagg"].url, systems["colocated"].url, model, args.parity_max_tokens)
    save_parity(cases, work / "parity.json")
    same = sum(c.identical for c in cases)
    for c in cases:
        if not c.identical:
            print(f"!! PARITY MISMATCH ({c.kind} {c.prompt!r}):\n   disagg    {c.a}\n   colocated {c.b}",
                  flush=True)
    print(f"== greedy parity disaggregated == colocated: {same}/{len(cases)} identical", flush=True)
    return same, len(cases)


def _sweep_seconds(args: argparse.Namespace) -> float:
    """Rough wall time of one mix on both systems: per rate the duration plus 15 s of warm-up/drain."""
    from loadtest.faults import parse_duration

    return 2 * len(args.rates.split(",")) * (parse_duration(args.duration) + 15.0)


def run_all(args: argparse.Namespace, work: Path, t0: float) -> dict[str, Any]:
    """Start both systems, check parity, run every mix that fits the time budget; the run's metadata."""
    from loadtest.cli import main as bench_main

    meta: dict[str, Any] = {"exit_codes": {}, "skipped": [], "parity": None}
    specs = [spec(args, mode, work) for mode, _ in rep.MODES]
    with live_systems(specs, args.ready_timeout) as started:
        systems: dict[str, LiveSystem] = dict(zip([m for m, _ in rep.MODES], started, strict=True))
        print(f"== both systems ready after {time.monotonic() - t0:.0f} s", flush=True)
        meta["parity"] = _parity(systems, args, work)
        for i, mix in enumerate(args.mixes.split(",")):
            name, n_in, n_out = parse_mix(mix)
            if i > 0 and time.monotonic() - t0 + _sweep_seconds(args) > args.time_budget:
                print(f"== skipping mix {name}: it would not finish within --time-budget", flush=True)
                meta["skipped"].append(name)
                continue
            for mode, _ in rep.MODES:
                out = work / name / mode
                flags = " ".join(bench_argv(args, "URL", out, n_in, n_out))
                print(f"== {name} {mode}: pdserve bench {flags}", flush=True)
                rc = bench_main(bench_argv(args, systems[mode].url, out, n_in, n_out))
                meta["exit_codes"][f"{name}/{mode}"] = rc
    return meta


def _mix_section(args: argparse.Namespace, work: Path, mix: str, plots: Path, rel: str
                 ) -> tuple[list[str], dict[str, list[rep.RateRow]]]:
    """The report section of one mix (tables, rep.crossover, plots, compare) and its rows per mode."""
    from loadtest.report import compare, load_json, markdown_summary

    name, n_in, n_out = parse_mix(mix)
    res = {mode: load_json(work / name / mode / "results.json") for mode, _ in rep.MODES}
    slo = (args.slo_ttft_ms, args.slo_tpot_ms)
    rows: dict[str, list[rep.RateRow]] = {mode: rep.rate_rows(res[mode], *slo) for mode in res}
    rep.plot_mix({label: rows[mode] for mode, label in rep.MODES}, args.slo_ttft_ms, args.slo_tpot_ms,
             f"{args.model}, {n_in} in / {n_out} out tokens", plots / f"{name}.png")
    cmp = compare(res["colocated"], res["disagg"], "colocated", "disaggregated")
    (work / name / "compare.md").write_text(cmp, encoding="utf-8")
    goodput = {mode: rep.system_goodput(r) for mode, r in rows.items()}
    exact, total, leaks = rep.exact_lengths([r for v in res.values() for r in v.runs], n_out)
    lines = [f"## Mix `{name}`: {n_in} input / {n_out} output tokens", "",
             *rep.goodput_table(rows["colocated"], rows["disagg"]), "",
             f"System goodput (highest rate meeting both p90 SLOs): colocated {goodput['colocated']:g} req/s,"
             f" disaggregated {goodput['disagg']:g} req/s.", "",
             rep.crossover(rows["colocated"], rows["disagg"]), "",
             f"{exact} of {total} requests completed with exactly {n_out} output tokens; KV leaks: "
             f"{', '.join(leaks) or 'none (gauge back to its start value after every run)'}.", "",
             f"![goodput, TTFT p90, TPOT p90, ITL p99 against rate]({rel}/{name}.png)", ""]
    for mode, label in rep.MODES:
        shutil.copyfile(work / name / mode / "latency_cdf.png", plots / f"{name}-{mode}-latency_cdf.png")
        lines += [f"### {label}", "", rep.demote(rep.demote(markdown_summary(res[mode]))), "",
                  f"![{label} latency CDFs]({rel}/{name}-{mode}-latency_cdf.png)", ""]
    lines += ["### `pdserve bench compare` (A = colocated, B = disaggregated)", "",
              rep.demote(rep.demote(cmp)), ""]
    return lines, rows


def write_report(args: argparse.Namespace, work: Path, meta: dict[str, Any]) -> list[str]:
    """Write the Markdown report to ``args.doc`` (plots beside it); return the summary lines."""
    doc = Path(args.doc)
    plots = doc.with_suffix("")
    plots.mkdir(parents=True, exist_ok=True)
    info: dict[str, str] = meta["machine"]
    parity: tuple[int, int] | None = (meta["parity"][0], meta["parity"][1]) if meta["parity"] else None
    n_colo = args.colocated_workers
    weights = "dummy (seed 0)" if args.load_format == "dummy" or is_dummy_alias(args.model) else "real"
    each = " ".join(bench_argv(args, "URL", Path("WORK/<mix>/<mode>"), "IN", "OUT"))
    par = f"{parity[0]}/{parity[1]} identical (details: WORK/parity.json)" if parity else "not run"
    lines = [f"# Disaggregated vs colocated on {args.device} (`pdserve bench`)", "",
             f"- command: `python -m bench.serving.disagg_vs_colocated {' '.join(meta['argv'])}`",
             f"- each run: `pdserve bench {each}`"
             " (IN/OUT: the mix's lengths)",
             f"- machine: {'; '.join(f'{k} {v}' for k, v in info.items())}", f"- date: {meta['date']} (UTC)",
             f"- model `{args.model}` ({weights} weights, dtype {args.dtype}), {args.num_blocks} KV "
             f"blocks of 16 tokens per worker, `--max-num-batched-tokens {args.max_num_batched_tokens}` "
             f"(chunked prefill) on every worker; (a) colocated: gateway + {n_colo} colocated worker(s) on "
             f"{', '.join(devices(args, 'colocated'))}; (b) disaggregated: gateway + prefill on "
             f"{devices(args, 'disagg')[0]} + decode on {devices(args, 'disagg')[1]}, KV over "
             f"{args.transfer_backend}",
             f"- workload: Poisson arrivals at {args.rates} req/s, {args.duration} per rate (+{args.warmup} "
             f"warm-up requests), token-id prompts, ignore_eos, greedy; SLOs TTFT p90 <= "
             f"{args.slo_ttft_ms:g} ms and TPOT p90 <= {args.slo_tpot_ms:g} ms",
             f"- bench exit codes: {meta['exit_codes']}; mixes skipped for time: {meta['skipped'] or 'none'}",
             f"- greedy parity (8 prompts, chat + completion, max_tokens {args.parity_max_tokens}): {par}",
             "",
             READING.format(n=n_colo), "", *[f"Note: {n}\n" for n in args.note]]
    mixes: dict[str, dict[str, list[rep.RateRow]]] = {}
    rel = plots.name
    for mix in args.mixes.split(","):
        name = parse_mix(mix)[0]
        if name in meta["skipped"]:
            continue
        section, mixes[name] = _mix_section(args, work, mix, plots, rel)
        lines += section
    doc.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return rep.summary_lines(mixes, parity)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Flags (see the module docstring); device-dependent defaults filled in. Raises SystemExit(2)."""
    p = argparse.ArgumentParser(prog="python -m bench.serving.disagg_vs_colocated", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = shutil.which("nvidia-smi") is not None
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if gpu else "cpu")
    p.add_argument("--model", help="alias or HF dir (default: llama3-8b on cuda, tiny-llama on cpu)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--dtype", default="auto", help="auto = bf16 on GPU, fp32 on CPU")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--mixes", default="long", help="comma list of long (3000/150), short (1000/300), IN:OUT")
    p.add_argument("--rates", help="Poisson rates (req/s), comma-separated")
    p.add_argument("--duration", help="issuing time per rate, e.g. 30s")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="unmeasured requests before each rate")
    p.add_argument("--request-timeout", help="per-request bound of the bench (default 30s cuda, 60s cpu)")
    p.add_argument("--num-blocks", type=positive_int,
                   help="KV blocks per worker (default 12000 cuda, 1024 cpu)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                   help="chunked-prefill token budget")
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--colocated-workers", type=positive_int, help="default 2 on cuda (one per GPU), 1 on cpu")
    p.add_argument("--transfer-backend", default="nixl", choices=("nixl", "ucx", "loopback"))
    p.add_argument("--heartbeat-timeout", type=positive_float, default=5.0, help="gateway flag (seconds)")
    p.add_argument("--ready-timeout", type=positive_float, default=240.0, help="start-up bound (seconds)")
    p.add_argument("--time-budget", type=positive_float, default=450.0,
                   help="seconds: skip a mix after the first when it would end later than this")
    p.add_argument("--slo-ttft-ms", type=positive_float)
    p.add_argument("--slo-tpot-ms", type=positive_float)
    p.add_argument("--parity-max-tokens", type=positive_int, default=32)
    p.add_argument("--work-dir", default="/tmp/pdserve-disagg-vs-colocated", help="raw results and logs")
    p.add_argument("--doc", help="report path (default WORK/report.md)")
    p.add_argument("--note", action="append", default=[], help="a paragraph added to the report")
    p.add_argument("--report-only", action="store_true", help="rebuild the report from WORK/meta.json")
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.doc = args.doc or str(Path(args.work_dir) / "report.md")
    try:
        for mix in args.mixes.split(","):
            parse_mix(mix)
        rates = [float(r) for r in args.rates.split(",")]
        if not all(0 < r < float("inf") for r in rates):
            raise ValueError(f"--rates must be finite and > 0 req/s, got {args.rates!r}")
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run everything (see the module docstring); the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, t0 = parse_args(argv), time.monotonic()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        meta = json.loads((work / "meta.json").read_text())
    else:
        started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")
        try:
            meta = {"machine": machine_info(), "date": started, "argv": argv, **run_all(args, work, t0)}
        except (RuntimeError, OSError, ValueError) as exc:  # start-up failed: show why, here and now
            print(f"!! {type(exc).__name__}: {exc}", file=sys.stderr)
            for log in sorted(work.glob("*-logs/*.log")):
                tail = log.read_text(errors="replace").splitlines()[-25:]
                print(f"---- {log} (last {len(tail)} lines)", *tail, sep="\n", file=sys.stderr)
            return 1
        (work / "meta.json").write_text(json.dumps(meta, indent=2))
    summary = write_report(args, work, meta)
    plots = Path(args.doc).with_suffix("")
    print(f"report written to {args.doc} (plots in {plots}/), raw results in {work}/")
    print("\n".join(summary), flush=True)
    parity = meta["parity"]
    if parity and parity[0] != parity[1]:
        print(f"!! GREEDY PARITY FAILED: {parity[0]}/{parity[1]} identical (see {work}/parity.json)")
        return 3
    return 1 if any(meta["exit_codes"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
