"""The gateway's own added latency and throughput ceiling, measured with instant fake workers.

Run: ``.venv/bin/python -m bench.gateway.overhead [--requests 300] [--concurrency 1,8] [--max-tokens 16]
[--token-delay 0] [--prefill-delay 0] [--tokenizer smollm2-135m] [--targets disagg,colocated,baseline]
[--curve-cost [--curve-rounds 6] [--curve-concurrency 32]]
[--gateway-processes 1,2,4 [--scale-concurrency 64 | --scale-concurrency-per-process 64]
[--client-processes 8] [--fake-decode-workers 1] [--pin-cpus]]
[--json out.json]
[--out /tmp/gateway-overhead.md]``.

Three targets, started in turn on free 127.0.0.1 ports and stopped after their runs:
``disagg`` (``pdserve gateway`` + one fake prefill + one fake decode worker, ``tests/fakes/fake_worker.py``),
``colocated`` (a second gateway + one fake colocated worker) and ``baseline`` (a trivial FastAPI/uvicorn
SSE endpoint sending the same number of OpenAI-shaped chunks with no work, the peer the gateway is a ratio
to). Each target gets ``--requests`` streaming ``/v1/completions`` requests per concurrency level, closed
loop, through httpx (``loadtest.client.send_request``). Client-observed TTFT, per-token ITL and E2E
(seconds) minus the fake workers' configured delays (prefill delay; token delay per later token) is the
gateway's added latency; completed requests / wall seconds at the highest concurrency is its ceiling.
Metric definitions as in ``loadtest.metrics`` (vLLM serving benchmark). After each gateway target every
request must be out of flight and every fake decode KV block free (``leaks`` = "ok").

The gateway targets' control plane is CURVE (a key pair made for the run, kvtransfer/curve.py), as in
production; the target ``disagg-insecure`` is the same as ``disagg`` with ``--insecure-control-plane`` on
the gateway and plain sockets on the fake workers.

``--curve-cost`` (after the targets above; ``--targets ""`` runs it alone) measures CURVE's cost as CPU,
not latency: both arms (``disagg`` with CURVE, ``disagg-insecure`` without) are started side by side and
measured in ``--curve-rounds`` alternated rounds (CURVE first in even rounds, plain first in odd ones) of
``--requests`` streamed requests at ``--curve-concurrency`` streams each, after ``--warmup`` per arm. Per
round and arm: the CPU seconds (user + system, ``psutil``, the process and its descendants, clock-tick
resolution) the gateway process spent during the round, over the output tokens streamed in it = the
gateway's CPU per output token; the part of it in the gateway's libzmq I/O threads (``ZMQbg/IO/<n>``,
where libzmq encrypts and decrypts CURVE frames: where CURVE's cost goes); the fake workers' CPU per
token likewise (CURVE costs them too); and the round's p50
added TPOT (latency, noisy on a shared machine). The report gives each arm's median and spread (min–max
over rounds), the ratio of the medians and each round's CURVE / plain ratio. CPU time is what CURVE
costs the gateway (its encryption and ZAP work), independent of how long other jobs on the machine
keep it waiting, which is what made latency ratios unstable.

``--gateway-processes 1,2,4`` (after the above; ``--targets ""`` runs it alone) measures how the gateway
scales over processes on one host (``pdserve gateway --workers N``): for each N in turn, the ``disagg``
target with an N-process gateway, one fake prefill and ``--fake-decode-workers`` fake decode workers
(one fake decode worker streams every token in one Python process and can become the limit before the
gateway does), all given the N control endpoints, and
``--scale-concurrency`` streams in all, driven by ``--client-processes`` separate load-generating
processes (each its own httpx client and event loop, with an equal share of the streams and of the
``--requests``; they start measuring together after their warm-up), so that one Python client's event
loop does not cap the rate. Per N: aggregate output tokens/s and req/s (all clients' tokens and completed
requests over the wall time from the first client's start to the last one's end), and the ratio of each
to N = 1 measured in the same run (the first N in the list is the reference). Beside them, whether the
load side kept up: the CPU each client process and each fake worker used over the measured time, as a
share of one core (near 1.0: that process, not the gateway, may be the limit) and the gateway's CPU in
cores (all its processes, and each process's own), and how many of the N processes took requests (from
the fake prefill worker's record of which control socket each request came through). Leak check after
each N.

``--scale-concurrency-per-process S`` (instead of ``--scale-concurrency``) offers S streams per gateway
process, S * N at level N, so that each level's gateway is loaded alike and its capacity, not the offered
load, is what the ratios compare. ``--pin-cpus`` (Linux) gives each gateway process cores of its own and
the clients, fake workers and the bench the rest, never overlapping (bench/gateway/cpu_pinning.py: 2
cores per gateway process when the host has at least 4 per process of the largest N, else 1; refused
with fewer than N + 1 cores), so that the scheduler does not move the gateway's threads among the load
side's; the plan is printed in the report. Each gateway process's allowed cores and CPU are reported per
level, so a saturated process shows.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import shlex
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import msgspec

from bench.gateway.cpu_pinning import CorePlan, assign_cores, physical_cores, pin_process
from bench.gateway.curve_cost import CurveCost, run_curve_rounds
from bench.gateway.overhead_report import machine_info, render_markdown
from bench.gateway.overhead_targets import (
    INSECURE,
    TARGETS,
    LevelResult,
    OverheadConfig,
    check_no_leaks,
    run_level,
    start_target,
    summarize_level,
)
from bench.gateway.process_scaling import ScaleLevel, run_scale_level
from bench.gateway.sse_baseline import baseline_app
from gateway.text import TokenizerNotFoundError, resolve_tokenizer_dir
from pdserve.supervisor import Supervisor


class OverheadResult(msgspec.Struct, kw_only=True):
    """The whole run: configuration, machine, date, every level, leak check per gateway target, and
    CURVE's CPU cost when asked (``--curve-cost``), the scaling over gateway processes when asked
    (``--gateway-processes``), with its core plan (``--pin-cpus``) and streams per gateway process
    (``--scale-concurrency-per-process``) when asked."""

    config: dict[str, object]
    machine: dict[str, object]
    date: str
    command: str
    levels: list[LevelResult]
    leaks: dict[str, str]
    curve_cost: CurveCost | None = None
    scale: list[ScaleLevel] | None = None
    core_plan: CorePlan | None = None
    scale_per_process: int | None = None


def run(cfg: OverheadConfig, command: str = "", targets: Sequence[str] = TARGETS,
        curve_rounds: int = 0, curve_concurrency: int = 32, gateway_processes: Sequence[int] = (),
        scale_concurrency: int = 64, client_processes: int = 4,
        fake_decode_workers: int = 1, scale_per_process: int | None = None,
        pin_cpus: bool = False, clock_probe: bool = False,
        gateway_cores: int | None = None) -> OverheadResult:
    """Start each target, measure every concurrency level, stop it; then, with ``curve_rounds`` > 0,
    CURVE's CPU cost (run_curve_rounds); then each of ``gateway_processes`` (run_scale_level) at
    ``scale_concurrency`` streams, or ``scale_per_process`` * N when given, pinned with ``pin_cpus``
    (assign_cores over this process's CPUs; the bench itself runs on the load side's cores meanwhile),
    with ``clock_probe`` a clock probe on a core taken from the load side (bench/gateway/clock_probe.py),
    ``gateway_cores`` CPUs per gateway process (None: assign_cores's rule).
    Raises ValueError for an unknown target or tokenizer dir, bad scale arguments or too few CPUs for
    ``pin_cpus`` (before anything starts), RuntimeError when a target does not start."""
    unknown = [t for t in targets if t not in (*TARGETS, INSECURE)]
    if unknown:
        raise ValueError(f"unknown targets {unknown}; choose from {(*TARGETS, INSECURE)}")
    if curve_rounds < 0 or curve_concurrency < 1:
        raise ValueError(f"curve_rounds must be >= 0 and curve_concurrency >= 1, got {curve_rounds} and "
                         f"{curve_concurrency}")
    if fake_decode_workers < 1:
        raise ValueError(f"fake decode workers must be >= 1, got {fake_decode_workers}")
    if any(n < 1 for n in gateway_processes) or client_processes < 1 \
            or (scale_per_process is None and scale_concurrency < client_processes):
        raise ValueError(f"gateway processes must be >= 1 (got {list(gateway_processes)}), client processes "
                         f">= 1 (got {client_processes}) and the scale concurrency >= the client processes "
                         f"(got {scale_concurrency})")
    if scale_per_process is not None and gateway_processes \
            and scale_per_process * min(gateway_processes) < client_processes:
        raise ValueError(f"--scale-concurrency-per-process {scale_per_process} x {min(gateway_processes)} "
                         f"gateway processes gives fewer streams than the {client_processes} client "
                         "processes")
    if pin_cpus and not gateway_processes:
        raise ValueError("--pin-cpus needs --gateway-processes")
    if clock_probe and not pin_cpus:
        raise ValueError("--clock-probe needs --pin-cpus (the probe needs a core of its own)")
    if gateway_cores is not None and not pin_cpus:
        raise ValueError("--gateway-cores needs --pin-cpus")
    if pin_cpus and not hasattr(os, "sched_getaffinity"):
        raise ValueError("--pin-cpus needs Linux (os.sched_setaffinity)")
    cpus = sorted(os.sched_getaffinity(0)) if pin_cpus else []
    plan = assign_cores(cpus, max(gateway_processes), physical_cores(cpus), clock_probe,
                        gateway_cores) if pin_cpus else None
    tokenizer_dir = resolve_tokenizer_dir(cfg.tokenizer, None)  # TokenizerNotFoundError before any start
    machine = machine_info()
    levels, leaks = [], {}
    curve = None
    with tempfile.TemporaryDirectory(prefix="gw-overhead-") as tmp:
        for target in targets:
            sup = Supervisor(grace=5.0)
            try:
                url = start_target(target, cfg, tokenizer_dir, sup, Path(tmp))
                for conc in cfg.concurrency:
                    records, wall = asyncio.run(run_level(url, cfg, conc))
                    levels.append(summarize_level(target, conc, records, wall, cfg))
                if target != "baseline":
                    leaks[target] = check_no_leaks(url, None if target == "colocated" else "fake-decode")
            finally:
                sup.stop_all()
        if curve_rounds:
            curve = run_curve_rounds(cfg, tokenizer_dir, Path(tmp), curve_concurrency, curve_rounds)
        scale: list[ScaleLevel] = []
        own = frozenset(os.sched_getaffinity(0)) if plan is not None else frozenset[int]()
        try:
            if plan is not None:  # the processes started from here inherit it, and are pinned again
                pin_process(os.getpid(), plan.load)
            for n in gateway_processes:
                level_dir = Path(tmp) / f"processes-{n}-{len(scale)}"
                level_dir.mkdir()
                streams = scale_concurrency if scale_per_process is None else scale_per_process * n
                scale.append(run_scale_level(cfg, tokenizer_dir, level_dir, n, streams,
                                             client_processes, fake_decode_workers, plan))
        finally:
            if plan is not None:
                pin_process(os.getpid(), own)
    return OverheadResult(config=asdict(cfg), machine=machine, levels=levels, leaks=leaks, command=command,
                          date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                          curve_cost=curve, scale=scale or None, core_plan=plan,
                          scale_per_process=scale_per_process if gateway_processes else None)


def main(argv: list[str] | None = None) -> int:
    """CLI entry. Returns 0 when every request completed and nothing leaked, 1 otherwise, 2 bad arguments."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", default="1,8", help="comma-separated levels")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prefill-delay", type=float, default=0.0, help="fake workers' prefill delay (s)")
    p.add_argument("--token-delay", type=float, default=0.0, help="fake workers' per-token delay (s)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--tokenizer", default="smollm2-135m", help="tokenizer dir or cached alias")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--curve-cost", action="store_true",
                   help=f"then CURVE's CPU cost: disagg against {INSECURE}, side by side, alternated rounds")
    p.add_argument("--curve-rounds", type=int, default=None, help="--curve-cost rounds per arm [6]")
    p.add_argument("--curve-concurrency", type=int, default=None, help="--curve-cost streams [32]")
    p.add_argument("--gateway-processes", default="",
                   help="then the gateway over N processes each (pdserve gateway --workers N), e.g. 1,2,4: "
                        "aggregate tokens/s and req/s, ratios to the first")
    p.add_argument("--scale-concurrency", type=int, default=None,
                   help="--gateway-processes: streams in all, the same at every N [64]")
    p.add_argument("--scale-concurrency-per-process", type=int, default=None,
                   help="--gateway-processes: streams per gateway process (S * N at level N); not with "
                        "--scale-concurrency")
    p.add_argument("--pin-cpus", action="store_true",
                   help="--gateway-processes: each gateway process on cores of its own, the clients, fake "
                        "workers and the bench on the others (Linux; refused with too few cores)")
    p.add_argument("--gateway-cores", type=int, choices=(1, 2), default=None,
                   help="--pin-cpus: CPUs per gateway process (default 2 when that leaves the load side half "
                        "the CPUs, else 1)")
    p.add_argument("--clock-probe", action="store_true",
                   help="--pin-cpus: a process on a core of its own repeating fixed Python work; its rate "
                        "per level shows whether the host's cores slow as load is added")
    p.add_argument("--client-processes", type=int, default=4,
                   help="--gateway-processes: load-generating processes sharing the streams")
    p.add_argument("--fake-decode-workers", type=int, default=1,
                   help="--gateway-processes: fake decode workers sharing the streams (one fake worker "
                        "streaming every token can become the limit)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="Markdown report path")
    p.add_argument("--serve-baseline", type=int, default=None, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_baseline is not None:
        import uvicorn

        uvicorn.run(baseline_app(args.max_tokens), host="127.0.0.1", port=args.serve_baseline,
                    log_level="warning", access_log=False, log_config=None)
        return 0
    try:
        cfg = OverheadConfig(requests=args.requests, max_tokens=args.max_tokens, warmup=args.warmup,
                             concurrency=tuple(int(x) for x in args.concurrency.split(",")),
                             prefill_delay_s=args.prefill_delay, token_delay_s=args.token_delay,
                             tokenizer=args.tokenizer)
        command = "python -m bench.gateway.overhead " + shlex.join(sys.argv[1:] if argv is None else argv)
        targets = [t for t in args.targets.split(",") if t]
        if not args.curve_cost and (args.curve_rounds is not None or args.curve_concurrency is not None):
            raise ValueError("--curve-rounds and --curve-concurrency need --curve-cost")
        rounds = 6 if args.curve_rounds is None else args.curve_rounds
        if args.curve_cost and rounds < 1:
            raise ValueError(f"--curve-rounds must be >= 1, got {rounds}")
        processes = tuple(int(x) for x in args.gateway_processes.split(",") if x)
        per_process = args.scale_concurrency_per_process
        if per_process is not None and args.scale_concurrency is not None:
            raise ValueError("--scale-concurrency and --scale-concurrency-per-process exclude each other")
        if per_process is not None and per_process < 1:
            raise ValueError(f"--scale-concurrency-per-process must be >= 1, got {per_process}")
        if not processes and (per_process is not None or args.pin_cpus):
            raise ValueError("--scale-concurrency-per-process and --pin-cpus need --gateway-processes")
        res = run(cfg, command, tuple(targets), curve_rounds=rounds if args.curve_cost else 0,
                  curve_concurrency=32 if args.curve_concurrency is None else args.curve_concurrency,
                  gateway_processes=processes,
                  scale_concurrency=64 if args.scale_concurrency is None else args.scale_concurrency,
                  client_processes=args.client_processes, fake_decode_workers=args.fake_decode_workers,
                  scale_per_process=per_process, pin_cpus=args.pin_cpus, clock_probe=args.clock_probe,
                  gateway_cores=args.gateway_cores)
    except (ValueError, TokenizerNotFoundError) as exc:
        print(f"gateway_overhead: {exc}", file=sys.stderr)
        return 2
    if args.json:
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(res)))
    text = render_markdown(res)
    if args.out:
        args.out.write_text(text)
    print(text)
    curve = res.curve_cost
    failed = (any(lv.failed for lv in res.levels) or any(v != "ok" for v in res.leaks.values())
              or (curve is not None and (any(r.completed < r.requests for r in curve.rounds)
                                         or any(v != "ok" for v in curve.leaks.values())))
              or any(sc.completed < sc.sent or sc.leaks != "ok" for sc in res.scale or ()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
