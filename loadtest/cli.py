"""`pdserve bench` / `python -m loadtest`: flags, the run action and the compare action.

``pdserve bench --base-url URL [flags]`` runs the load and writes the outputs; ``pdserve bench compare
A.json B.json`` prints two result files side by side. Every flag ``--foo-bar`` also reads the
environment variable ``PDSERVE_FOO_BAR``, checked as for every pdserve command (protocol/cli_env.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loadtest.agent_cli import add_agent_arguments, check_flags, run_agent_bench
from loadtest.config import BenchConfig, SLOConfig, WorkloadConfig
from loadtest.faults import FaultSpec
from loadtest.lengths import LengthDist
from protocol.cli_env import EnvAdder, OneLineParser
from protocol.durations import flag_duration


def compare_parser(bench_prog: str) -> OneLineParser:
    """The parser of ``<bench_prog> compare A.json B.json``, whose ``--help`` is compare's own."""
    parser = OneLineParser(prog=f"{bench_prog} compare",
                           description="print two result files (results.json of two runs) side by side: "
                                       "Markdown tables of A and B with the ratio B/A, runs paired in order")
    parser.add_argument("a", metavar="A.json", help="the baseline's results.json")
    parser.add_argument("b", metavar="B.json", help="the results.json compared with it")
    return parser


class _BenchHelp(argparse.Action):
    """``-h``/``--help`` of ``bench``: after ``compare``, compare's usage and flags (``compare_parser``);
    otherwise, ``run`` given or not, bench's own (the load run's flags). Exits 0."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: Any = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if getattr(namespace, "bench_action", None) == "compare":
            compare_parser(parser.prog).print_help()
        else:
            parser.print_help()
        parser.exit()


def add_bench_arguments(parser: OneLineParser, env: Mapping[str, str] | None = None) -> None:
    """Add the ``bench`` flags and positionals (``[run|compare] [FILES...]``) to ``parser``; each flag's
    default comes from its ``PDSERVE_*`` variable in ``env`` (default ``os.environ``), read and checked as
    for the other commands (protocol/cli_env.py: a bad value is refused when ``parser`` parses, in one line
    naming the variable and the flag, exit 2). A ``parser`` made with ``add_help=False`` (as ``pdserve
    bench`` and ``python -m loadtest`` are) gets a ``-h``/``--help`` that prints compare's help after
    ``compare`` (``_BenchHelp``); one with argparse's own help keeps it (bench's help, after ``compare``
    too)."""
    add = EnvAdder(parser, os.environ if env is None else env)
    if not parser.add_help:
        parser.add_argument("-h", "--help", action=_BenchHelp, default=argparse.SUPPRESS,
                            help="show this help message and exit (after compare: compare's)")
    parser.add_argument("bench_action", metavar="action", nargs="?", default="run",
                        choices=("run", "compare"),
                        help="run the load (default) or compare two results (compare --help: its usage)")
    parser.add_argument("bench_files", metavar="files", nargs="*", help="compare: A.json B.json")
    add("--base-url", default="http://127.0.0.1:8000", help="server URL; no other host is used")
    add("--model", help="model name to send (default: the first of GET /v1/models)")
    add("--endpoint", default="completions", choices=("completions", "chat"))
    add("--api-key", help="sent as 'Authorization: Bearer KEY'")
    add("--workload", default="random", choices=("random", "sharegpt", "multi-turn", "agent"),
         help="agent: concurrent multi-turn sessions in lockstep, reported per turn (loadtest/agent_cli.py)")
    add("--prompt-format", choices=("tokens", "text"),
        help="tokens: token-id prompts (completions, random workload only); text: words (default: tokens "
             "where they can go, else text)")
    add("--input-len", default="fixed:128", help="fixed:N | uniform:LO,HI | normal:MEAN,STD")
    add("--output-len", default="fixed:64", help="max_tokens distribution (same syntax)")
    add("--dataset-path", help="ShareGPT JSON file (read by workload sharegpt only; refused with "
                                        "another)")
    add("--num-turns", type=int, default=1, help="turns per conversation (multi-turn, sharegpt)")
    add("--ignore-eos", action="store_true", help="pin output lengths to max_tokens")
    add("--temperature", type=float, default=0.0)
    add("--arrival", default="poisson", choices=("poisson", "gamma", "constant", "closed"))
    add("--request-rate", default="inf", help="req/s; comma list = sweep (e.g. 1,2,4)")
    add("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    add("--concurrency", type=int, default=1,
        help="sessions in flight (arrival closed), and warm-up requests in flight (any arrival)")
    add("--num-requests", type=int, help="measured requests per run (default 100 w/o duration)")
    add("--duration", help="stop issuing after this long, e.g. 30s")
    add("--warmup", type=int, default=0, help="uncounted requests sent first")
    add("--seed", type=int, default=0)
    add("--request-timeout", default="60s", help="per-request bound, e.g. 60s")
    add("--slo-ttft-ms", type=float, default=1000.0, help="goodput TTFT SLO (ms)")
    add("--slo-tpot-ms", type=float, default=100.0, help="goodput TPOT SLO (ms)")
    add("--fault", action="append", default=[], env_one_value=True,
        help='repeatable: "at=5s[,timeout=30s],cmd=..." (PDSERVE_FAULT holds one)')
    add("--metrics-path", default="/metrics", help="KV-gauge page on the server; '' = off")
    add("--leak-settle", default="2s", help="how long to wait for KV blocks to come back")
    add("--decode-metrics",
         help="URL[,URL...]: the decode-side (decode or colocated) workers' metrics pages, as `pdserve up` "
              "prints them (http://host:port/metrics; http://host:port reads the same page); report the "
              "share of the time per output token spent outside their engine loop. A page that cannot be "
              "read before the load ends the bench (exit 2), one unreadable after a run gives exit 1")
    add("--output-dir", help="write results.json, summary.md and PNG plots here")
    add("--no-progress", action="store_true", help="no progress bar")
    add_agent_arguments(add)


def _rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"bad --request-rate {text!r}: numbers (or inf) separated by commas") from None


def config_from_args(args: argparse.Namespace, model: str) -> BenchConfig:
    """Build and validate the frozen config. Raises ValueError naming the bad flag value (with ``--workload
    sharegpt``, a ``--dataset-path`` that is not a file included; its content is read when the run starts).
    Another workload does not read the dataset: its ``dataset_path`` is None (a ``--dataset-path`` given
    with it is refused by ``check_flags``, which runs first)."""
    dataset_path = args.dataset_path if args.workload == "sharegpt" else None
    if dataset_path and not Path(dataset_path).is_file():
        why = "a directory, not a file" if Path(dataset_path).is_dir() else "no such file"
        raise ValueError(f"--dataset-path {dataset_path}: {why}")
    workload = WorkloadConfig(
        kind=args.workload,
        prompt_format=args.prompt_format or (
            "tokens" if args.endpoint == "completions" and args.workload == "random" else "text"),
        input_len=LengthDist.parse_flag("--input-len", args.input_len),
        output_len=LengthDist.parse_flag("--output-len", args.output_len),
        dataset_path=dataset_path, num_turns=int(args.num_turns),
    )
    duration = flag_duration("--duration", args.duration) if args.duration else None
    num = int(args.num_requests) if args.num_requests is not None else (None if duration else 100)
    return BenchConfig(
        base_url=args.base_url.rstrip("/"), model=model, endpoint=args.endpoint, api_key=args.api_key,
        workload=workload, arrival=args.arrival, rates=_rates(args.request_rate),
        burstiness=float(args.burstiness), concurrency=int(args.concurrency), num_requests=num,
        duration_s=duration, warmup=int(args.warmup), seed=int(args.seed),
        request_timeout_s=flag_duration("--request-timeout", args.request_timeout),
        ignore_eos=bool(args.ignore_eos),
        temperature=float(args.temperature),
        slo=SLOConfig(ttft_ms=float(args.slo_ttft_ms), tpot_ms=float(args.slo_tpot_ms)),
        faults=tuple(FaultSpec.parse(f) for f in args.fault), metrics_path=args.metrics_path or None,
        leak_settle_s=flag_duration("--leak-settle", args.leak_settle), progress=not args.no_progress,
        decode_metrics=tuple(u for u in (args.decode_metrics or "").split(",") if u),
    )


def _load_flags_given(args: argparse.Namespace) -> list[str]:
    """The ``bench`` flags whose value in ``args`` differs from their default (the environment's, as the
    parse read it): flags of the load run, which ``compare`` would otherwise ignore."""
    blank = OneLineParser(prog="bench", add_help=False)
    add_bench_arguments(blank)
    defaults = vars(blank.parse_args([]))
    return sorted("--" + name.replace("_", "-") for name, value in vars(args).items()
                  if name in defaults and name not in ("bench_action", "bench_files")
                  and value != defaults[name])


def _compare(files: list[str]) -> int:
    from loadtest.report import compare, load_json

    if len(files) != 2:
        print(f"error: compare needs exactly two result files, got {len(files)}", file=sys.stderr)
        return 2
    try:
        print(compare(load_json(files[0]), load_json(files[1]), files[0], files[1]), end="")
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def run_bench(args: argparse.Namespace) -> int:
    """Run the ``bench`` action in ``args``; return the exit code.

    0: done; 1: no request completed, KV blocks leaked, or a ``--decode-metrics`` page could not be read
    around a run; 2: bad arguments or input files, or a ``--decode-metrics`` page that cannot be read
    before any load is sent.
    """
    if args.bench_action == "compare":
        given = _load_flags_given(args)
        if given:
            print(f"error: compare reads only A.json B.json, not the load run's {', '.join(given)}",
                  file=sys.stderr)
            return 2
        return _compare(args.bench_files)
    if args.bench_files:
        print(f"error: unexpected arguments {args.bench_files}", file=sys.stderr)
        return 2
    if args.workload == "agent":
        return run_agent_bench(args)
    from loadtest.models import first_model
    from loadtest.runner import check_decode_pages
    from loadtest.runner import run_bench as run_all

    try:
        check_flags(args)
        config_from_args(args, args.model or "placeholder")  # validate before touching the network
        model = args.model or asyncio.run(first_model(args.base_url.rstrip("/"), args.api_key))
        cfg = config_from_args(args, model)
        asyncio.run(check_decode_pages(cfg))
        result = asyncio.run(run_all(cfg))
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return _write_outputs(result, args.output_dir)


def _write_outputs(result: Any, output_dir: str | None) -> int:
    from loadtest.plots import write_plots
    from loadtest.report import markdown_summary, save_json

    text = markdown_summary(result)
    print(text, end="")
    if output_dir:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_json(result, out / "results.json")
        (out / "summary.md").write_text(text, encoding="utf-8")
        write_plots(result, out)
        print(f"results written to {out}/ (results.json, summary.md, *.png)")
    leaked = any((run.kv.leaked or 0) > 0 for run in result.runs)
    none_ok = any(run.summary.completed == 0 for run in result.runs)
    for run in result.runs:  # say why the exit code is 1
        if run.summary.completed == 0:
            print(f"error: run {run.label}: no request completed", file=sys.stderr)
        if (run.kv.leaked or 0) > 0:
            print(f"error: run {run.label}: {run.kv.leaked:g} KV blocks still used after the run",
                  file=sys.stderr)
    unread = [f"{run.label}: {run.gateway_share.error}" for run in result.runs
              if run.gateway_share is not None and run.gateway_share.error]
    for line in unread:  # asked for and not measured: not a finished benchmark
        print(f"error: --decode-metrics not read ({line})", file=sys.stderr)
    return 1 if leaked or none_ok or unread else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m loadtest``: parse ``argv`` and run."""
    parser = OneLineParser(prog="python -m loadtest", description=__doc__, add_help=False)
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


__all__ = ["add_bench_arguments", "compare_parser", "config_from_args", "main", "run_bench"]
