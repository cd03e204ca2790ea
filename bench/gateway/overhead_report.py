"""The report of ``bench.gateway.overhead``: the machine it ran on and its Markdown tables."""

from __future__ import annotations

import os
import platform
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from bench.gateway.cpu_pinning import format_cpus

if TYPE_CHECKING:
    from bench.gateway.cpu_pinning import CorePlan
    from bench.gateway.curve_cost import CurveCost
    from bench.gateway.overhead import OverheadResult
    from bench.gateway.process_scaling import ScaleLevel
    from loadtest.records import LatencyStats


def machine_info() -> dict[str, object]:
    """nproc, CPU model, load average, OS and Python of this machine."""
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    model = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "")
    return {"nproc": os.cpu_count(), "cpu": model, "loadavg_start": os.getloadavg(),
            "platform": platform.platform(), "python": platform.python_version()}


def _p(stats: LatencyStats | None) -> str:
    return "–" if stats is None else f"{stats.median:.2f} / {stats.p90:.2f} / {stats.p99:.2f}"


def render_markdown(res: OverheadResult) -> str:
    """The report: command, machine, date, one table row per target and concurrency, ratios to baseline."""
    c, m = res.config, res.machine
    lines = ["# Gateway overhead on CPU: added latency and throughput ceiling with instant fake workers", "",
             f"- command: `{res.command}`",
             f"- machine: {m['nproc']} cores ({m['cpu']}), {m['platform']}, Python {m['python']}, "
             "load average at start " + ", ".join(f"{x:.2f}" for x in m["loadavg_start"]),  # type: ignore[attr-defined]
             f"- date: {res.date}",
             f"- targets: {', '.join(dict.fromkeys(lv.target for lv in res.levels)) or 'none'}",
             f"- per level: {c['requests']} streamed `/v1/completions` requests after {c['warmup']} "
             f"warm-up, {c['max_tokens']} output tokens each; fake delays: prefill {c['prefill_delay_s']} s, "
             f"token {c['token_delay_s']} s", f"- leak check after each gateway target: {res.leaks}", "",
             "Added latency = client-observed minus the fake workers' configured delays; p50/p90/p99 in ms.",
             "", "| target | conc | ok/sent | TTFT added | TPOT added | ITL added | E2E added | req/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for lv in res.levels:
        lines.append(f"| {lv.target} | {lv.concurrency} | {lv.completed}/{lv.requests} "
                     f"| {_p(lv.added_ttft_ms)} | {_p(lv.added_tpot_ms)} | {_p(lv.added_itl_ms)} "
                     f"| {_p(lv.added_e2e_ms)} "
                     f"| {lv.req_s:.1f} |")
    base = {lv.concurrency: lv for lv in res.levels if lv.target == "baseline"}
    lines += ["", "Gateway vs the bare SSE baseline at the same concurrency: p50 E2E gateway (added) / "
              "baseline, and req/s baseline / gateway:", ""]
    for lv in res.levels:
        b = base.get(lv.concurrency)
        if lv.target != "baseline" and b and b.e2e_ms and lv.added_e2e_ms and lv.req_s > 0:
            gw, bare = lv.added_e2e_ms.median, b.e2e_ms.median
            lines.append(f"- {lv.target} @ {lv.concurrency}: p50 E2E gateway / baseline {gw / bare:.1f} "
                         f"(+{gw - bare:.2f} ms), req/s baseline / gateway {b.req_s / lv.req_s:.1f}")
    plain = {lv.concurrency: lv for lv in res.levels if lv.target == "disagg-insecure"}
    if plain:
        lines += ["", "CURVE's cost: disagg (CURVE control plane) / disagg-insecure (plain sockets), "
                  "same run: p50 added TPOT (the gateway's per-token cost), p50 added TTFT, req/s:", ""]
    for lv in res.levels:
        q = plain.get(lv.concurrency)
        if lv.target == "disagg" and q and lv.added_tpot_ms and q.added_tpot_ms and lv.added_ttft_ms \
                and q.added_ttft_ms and q.req_s > 0:
            tpot, plain_tpot = lv.added_tpot_ms.median, q.added_tpot_ms.median
            lines.append(f"- @ {lv.concurrency}: TPOT {tpot:.3f} / {plain_tpot:.3f} ms = "
                         f"{tpot / plain_tpot:.3f}, "
                         f"TTFT {lv.added_ttft_ms.median:.2f} / {q.added_ttft_ms.median:.2f} ms = "
                         f"{lv.added_ttft_ms.median / q.added_ttft_ms.median:.3f}, req/s {lv.req_s:.1f} / "
                         f"{q.req_s:.1f} = {lv.req_s / q.req_s:.3f}")
    if res.curve_cost is not None:
        lines += ["", *render_curve_cost(res.curve_cost, int(c["max_tokens"]))]  # type: ignore[call-overload]
    if res.scale:
        lines += ["", *render_scale(res.scale, int(c["max_tokens"]),  # type: ignore[call-overload]
                                    res.core_plan, res.scale_per_process)]
    return "\n".join(lines) + "\n"


def render_scale(levels: list[ScaleLevel], max_tokens: int, plan: CorePlan | None = None,
                 per_process: int | None = None) -> list[str]:
    """The ``--gateway-processes`` section: the CPU pinning (``plan``, None: not pinned) and offered load
    (``per_process`` streams per gateway process, None: the same streams at every N), then per N:
    output tokens/s over the steady window (every stream streaming) and its ratio to the first N of the
    run ("–" where a window was empty), tokens/s and req/s over the whole run and the req/s ratio,
    whether the load side kept up (CPU shares of one core), each gateway process's CPU and the cores it
    was allowed."""
    ref = levels[0]
    pinning = (f"- CPU pinning (`--pin-cpus`): {plan.describe()} (the pool's parent on "
               f"{format_cpus(plan.gateway_union)} when N > 1)" if plan is not None
               else "- CPU pinning: none (every process may run on every core)")
    load = (f"- offered load: {per_process} streams per gateway process (`--scale-concurrency-per-process`)"
            if per_process is not None else "- offered load: the same streams at every N")
    lines = [f"## Gateway processes on one host (`pdserve gateway --workers N`), {max_tokens} tokens per "
             "request", "", pinning, load, "",
             f"Ratios are to N = {ref.processes} in this run (goal on a 16-core host: 2 processes >= 1.8x, "
             "4 >= 3.2x tokens/s). Steady: output tokens/s while every stream of every client was "
             "streaming (the run's ramp-up and drain left out; \"–\": no such window, too few requests "
             "per stream); whole run: from the first client's start to the last one's end. CPU: share of "
             "one core over the measured time; a client or fake worker near 1.0 may be the limit rather "
             "than the gateway. `took`: processes that took requests. Load side cores: the clients' and fake "
             "workers' CPU together. Clock probe (`--clock-probe`): the rate of fixed Python work on a core "
             "of its own, against the first N (below 1: the host's cores ran slower at that load).", "",
             "| processes | clients | streams | ok/sent | steady tokens/s (s) | x steady tokens/s "
             "| whole-run tokens/s | req/s | x req/s "
             "| gateway cores | busiest client | fake decode workers | busiest fake worker | took | leaks "
             "| cores per gateway process | allowed cores per gateway process "
             "| requests per gateway process | load side cores | x clock probe |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|---:|---:|"]
    for lv in levels:
        tok = (f"**{lv.steady_tokens_s / ref.steady_tokens_s:.2f}**"
               if ref.steady_tokens_s > 0 and lv.steady_tokens_s > 0 else "–")
        steady = f"{lv.steady_tokens_s:.0f} ({lv.steady_s:.2f})" if lv.steady_s > 0 else "–"
        req = lv.req_s / ref.req_s if ref.req_s > 0 else 0.0
        probe = (f"{lv.probe_units_s / ref.probe_units_s:.3f}"
                 if ref.probe_units_s > 0 and lv.probe_units_s > 0 else "–")
        lines.append(f"| {lv.processes} | {lv.clients} | {lv.concurrency} | {lv.completed}/{lv.sent} "
                     f"| {steady} | {tok} | {lv.tokens_s:.0f} | {lv.req_s:.1f} | {req:.2f} "
                     f"| {lv.gateway_cores:.2f} "
                     f"| {lv.busiest_client_core:.2f} | {lv.decode_workers} | {lv.busiest_worker_core:.2f} "
                     f"| {lv.processes_used}/{lv.processes} | {lv.leaks} "
                     f"| {' / '.join(f'{c:.2f}' for c in lv.process_cores) or '–'} "
                     f"| {' / '.join(lv.gateway_cpus) or '–'} "
                     f"| {' / '.join(str(n) for n in lv.process_requests) or '–'} "
                     f"| {lv.load_cores:.2f} | {probe} |")
    errors = [f"N={lv.processes}: {lv.first_error}" for lv in levels if lv.first_error]
    if errors:
        lines += ["", "First errors: " + "; ".join(errors)]
    return lines


def _spread(values: list[float], fmt: str = ".1f") -> str:
    """median [min–max] of ``values``."""
    return (f"{statistics.median(values):{fmt}} [{min(values):{fmt}}–{max(values):{fmt}}]"
            if values else "–")


def render_curve_cost(cost: CurveCost, max_tokens: int) -> list[str]:
    """The ``--curve-cost`` section: per arm, the median [min–max] over rounds of the gateway's CPU µs per
    output token, the fake workers' and the p50 added TPOT; CURVE / plain of the medians, and per round."""
    arms = list(dict.fromkeys(r.arm for r in cost.rounds))
    by_arm = {a: [r for r in cost.rounds if r.arm == a] for a in arms}
    lines = [f"## CURVE's CPU cost at {cost.concurrency} streams ({len(by_arm.get(arms[0], []))} alternated "
             f"rounds per arm, {max_tokens} tokens per request)" if arms else "## CURVE's CPU cost", "",
             "- load average before / after: " + ", ".join(f"{x:.2f}" for x in cost.loadavg_start) + " / "
             + ", ".join(f"{x:.2f}" for x in cost.loadavg_end), f"- leak check per arm: {cost.leaks}", "",
             "Median [min–max] over rounds. CPU = user + system seconds of the process (and descendants) "
             "during the round over the output tokens streamed in it.", "",
             "| arm | ok/sent | gateway CPU µs / token | of which its zmq I/O threads "
             "| fake workers CPU µs / token | p50 added TPOT ms |",
             "|---|---:|---:|---:|---:|---:|"]
    for a in arms:
        rs = by_arm[a]
        tpot = [r.added_tpot_p50_ms for r in rs if r.added_tpot_p50_ms is not None]
        lines.append(f"| {a} | {sum(r.completed for r in rs)}/{sum(r.requests for r in rs)} "
                     f"| {_spread([r.gateway_us_per_token for r in rs])} "
                     f"| {_spread([r.gateway_zmq_io_us_per_token for r in rs])} "
                     f"| {_spread([r.workers_us_per_token for r in rs])} | {_spread(tpot, '.3f')} |")
    if len(arms) == 2:
        curve, plain = by_arm[arms[0]], by_arm[arms[1]]
        gw_c = statistics.median(r.gateway_us_per_token for r in curve)
        gw_p = statistics.median(r.gateway_us_per_token for r in plain)
        wk_c = statistics.median(r.workers_us_per_token for r in curve)
        wk_p = statistics.median(r.workers_us_per_token for r in plain)
        plain_of = {r.round: r for r in plain}
        paired = [c.gateway_us_per_token / plain_of[c.round].gateway_us_per_token for c in curve
                  if c.round in plain_of and plain_of[c.round].gateway_us_per_token > 0]
        io_c = statistics.median(r.gateway_zmq_io_us_per_token for r in curve)
        io_p = statistics.median(r.gateway_zmq_io_us_per_token for r in plain)
        pooled_c = sum(r.gateway_cpu_s for r in curve) / max(1, sum(r.tokens for r in curve)) * 1e6
        pooled_p = sum(r.gateway_cpu_s for r in plain) / max(1, sum(r.tokens for r in plain)) * 1e6
        lines += ["", f"- gateway CPU per output token, {arms[0]} / {arms[1]} (medians): {gw_c:.1f} / "
                  f"{gw_p:.1f} µs = **{gw_c / gw_p:.3f}** (CURVE adds {gw_c - gw_p:+.1f} µs, "
                  f"{(gw_c / gw_p - 1) * 100:+.1f} % of the gateway's per-token CPU)" if gw_p > 0 else "",
                  f"- per round (same round, both arms): {', '.join(f'{x:.3f}' for x in paired)}; "
                  f"median {_spread(paired, '.3f')}",
                  f"- pooled (all rounds' CPU over all rounds' tokens): {pooled_c:.1f} / {pooled_p:.1f} µs"
                  + (f" = {pooled_c / pooled_p:.3f}" if pooled_p > 0 else ""),
                  f"- the gateway's zmq I/O threads (CURVE's encryption runs there), {arms[0]} / {arms[1]} "
                  f"(medians): {io_c:.1f} / {io_p:.1f} µs per output token (CURVE adds {io_c - io_p:+.1f} µs"
                  + (f", {(io_c - io_p) / gw_p * 100:+.1f} % of the gateway's per-token CPU)" if gw_p > 0
                     else ")"),
                  f"- fake workers' CPU per output token, {arms[0]} / {arms[1]}: {wk_c:.1f} / {wk_p:.1f} µs"
                  + (f" = {wk_c / wk_p:.3f}" if wk_p > 0 else "")]
    return lines
