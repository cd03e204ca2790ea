"""Tables, crossover, plots and the Markdown report of ``bench.serving.disagg_vs_colocated``.

Goodput (DistServe, OSDI'24) is reported two ways per offered rate: the harness's request goodput
(completed requests/s within both the TTFT and the TPOT SLO, ``loadtest.metrics``) and whether the rate
meets the SLOs at the 90th percentile (TTFT p90 and TPOT p90 within the SLO). A system's goodput is the
highest tested rate that meets both at p90. Ratios are disaggregated / colocated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from loadtest.records import BenchResult, LatencyStats, RunResult
from pdserve.live_system import Mode

MODES: tuple[tuple[Mode, str], ...] = (("colocated", "colocated"), ("disagg", "disaggregated"))


@dataclass(frozen=True)
class RateRow:
    """One system at one offered rate (req/s): goodput (req/s), SLO attainment (share of the sent
    requests within both SLOs, 0..1), p90 TTFT/TPOT and p99 ITL (ms), completed/sent requests, and
    whether both p90 SLOs were met."""

    rate: float
    goodput: float
    attainment: float
    ttft_p90: float
    tpot_p90: float
    itl_p99: float
    completed: int
    sent: int
    slo_met_p90: bool


def _p(stats: LatencyStats | None, field: str) -> float:
    return float(getattr(stats, field)) if stats is not None else math.nan


def rate_rows(result: BenchResult, slo_ttft_ms: float, slo_tpot_ms: float) -> list[RateRow]:
    """One ``RateRow`` per open-loop run of ``result`` (closed-loop runs, rate None, are skipped)."""
    rows = []
    for run in result.runs:
        if run.rate is None:
            continue
        s = run.summary
        ttft, tpot = _p(s.ttft_ms, "p90"), _p(s.tpot_ms, "p90")
        met = s.completed == s.num_requests > 0 and ttft <= slo_ttft_ms and tpot <= slo_tpot_ms
        attained = s.goodput * s.duration_s / s.num_requests if s.num_requests else 0.0
        rows.append(RateRow(run.rate, s.goodput, attained, ttft, tpot, _p(s.itl_ms, "p99"), s.completed,
                            s.num_requests, met))
    return rows


def system_goodput(rows: Sequence[RateRow]) -> float:
    """The highest rate (req/s) that meets both p90 SLOs, 0.0 when none does."""
    return max((r.rate for r in rows if r.slo_met_p90), default=0.0)


def ratio(b: float, a: float) -> float:
    """``b / a``; inf when only ``b`` is positive, nan when both are 0."""
    if a > 0:
        return b / a
    return math.inf if b > 0 else math.nan


def crossover(colo: Sequence[RateRow], disagg: Sequence[RateRow], tie: float = 0.05) -> str:
    """One sentence: at which tested rates disaggregation pays (a larger share of requests within both
    SLOs, by more than ``tie``; both systems see the same seeded arrivals) and where it does not, and the
    crossover (between the rates where the winner changes), if any."""
    pairs = sorted(zip(colo, disagg, strict=False), key=lambda p: p[0].rate)
    if not pairs:
        return "No rate was measured on both systems."
    signs = [0 if abs(d.attainment - c.attainment) <= tie else (1 if d.attainment > c.attainment else -1)
             for c, d in pairs]
    named = {k: ", ".join(f"{c.rate:g}" for (c, _), s in zip(pairs, signs, strict=True) if s == k)
             for k in (1, -1, 0)}
    parts = [f"{text} at {named[k]} req/s" for k, text in (
        (1, "Disaggregation pays (more requests within both SLOs)"), (-1, "it does not pay (fewer)"),
        (0, f"the two are even (within {tie:.0%})")) if named[k]]
    flips = [(pairs[i - 1][0].rate, pairs[i][0].rate) for i in range(1, len(pairs))
             if signs[i] != signs[i - 1]]
    tail = ("Crossover between " + "; ".join(f"{lo:g} and {hi:g} req/s" for lo, hi in flips) if flips
            else "No crossover within the tested rates")
    return "; ".join(parts) + ". " + tail + "."


def _f(v: float, digits: int = 1) -> str:
    return "–" if math.isnan(v) else ("inf" if math.isinf(v) else f"{v:.{digits}f}")


def goodput_table(colo: Sequence[RateRow], disagg: Sequence[RateRow]) -> list[str]:
    """Markdown rows: per rate, goodput of both and their ratio, p90 TTFT, p90 TPOT, p99 ITL, SLO met."""
    head = ("| rate (req/s) | goodput colo | goodput disagg | ratio D/C | within SLOs C / D | TTFT p90 ms "
            "C / D | TPOT p90 ms C / D | ITL p99 ms C / D | completed C / D | p90 SLOs met C / D |")
    out = [head, "|" + "---|" * 10]
    for c, d in zip(colo, disagg, strict=False):
        yes = {True: "yes", False: "no"}
        rel = _f(ratio(d.goodput, c.goodput), 2)
        out.append(f"| {c.rate:g} | {c.goodput:.2f} | {d.goodput:.2f} | {rel} | "
                   f"{c.attainment:.0%} / {d.attainment:.0%} | "
                   f"{_f(c.ttft_p90)} / {_f(d.ttft_p90)} | {_f(c.tpot_p90)} / {_f(d.tpot_p90)} | "
                   f"{_f(c.itl_p99)} / {_f(d.itl_p99)} | {c.completed}/{c.sent} / {d.completed}/{d.sent} | "
                   f"{yes[c.slo_met_p90]} / {yes[d.slo_met_p90]} |")
    return out


def plot_mix(rows: dict[str, list[RateRow]], slo_ttft_ms: float, slo_tpot_ms: float, title: str,
             path: Path) -> None:
    """Four panels against the offered rate, one line per system: goodput, TTFT p90, TPOT p90, ITL p99
    (the SLOs as dashed lines). Written as PNG to ``path``."""
    fig = Figure(figsize=(13, 3.3), dpi=80)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 4)
    panels = [("goodput (req/s)", "goodput", None), ("TTFT p90 (ms)", "ttft_p90", slo_ttft_ms),
              ("TPOT p90 (ms)", "tpot_p90", slo_tpot_ms), ("ITL p99 (ms)", "itl_p99", None)]
    for ax, (label, field, slo) in zip(axes, panels, strict=True):
        for name, mode_rows in rows.items():
            ax.plot([r.rate for r in mode_rows], [getattr(r, field) for r in mode_rows], "o-", label=name)
        if slo is not None:
            ax.axhline(slo, ls="--", color="grey", lw=1, label="SLO")
        ax.set(title=label, xlabel="offered rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def summary_lines(mixes: dict[str, dict[str, list[RateRow]]], parity: tuple[int, int] | None) -> list[str]:
    """The short plain-text table printed last: one line per mix and rate, then the parity count."""
    out = [f"{'mix':<14}{'rate':>6}{'goodput C':>11}{'goodput D':>11}{'D/C':>7}{'TTFTp90 C/D ms':>18}"
           f"{'TPOTp90 C/D ms':>17}{'ITLp99 C/D ms':>17}"]
    for mix, rows in mixes.items():
        for c, d in zip(rows["colocated"], rows["disagg"], strict=False):
            ttft = f"{_f(c.ttft_p90, 0)}/{_f(d.ttft_p90, 0)}"
            tpot, itl = f"{_f(c.tpot_p90)}/{_f(d.tpot_p90)}", f"{_f(c.itl_p99)}/{_f(d.itl_p99)}"
            out.append(f"{mix:<14}{c.rate:>6g}{c.goodput:>11.2f}{d.goodput:>11.2f}"
                       f"{_f(ratio(d.goodput, c.goodput), 2):>7}{ttft:>18}{tpot:>17}{itl:>17}")
        colo, dis = system_goodput(rows["colocated"]), system_goodput(rows["disagg"])
        out.append(f"{mix:<14}system goodput (p90 SLOs): colocated {colo:g}, disaggregated {dis:g} req/s")
    if parity is not None:
        out.append(f"greedy parity disaggregated == colocated: {parity[0]}/{parity[1]} identical")
    return out


def demote(markdown: str) -> str:
    """Drop the first heading line and push the other headings two levels down."""
    lines = markdown.splitlines()[1:]
    return "\n".join("##" + ln if ln.startswith("#") else ln for ln in lines).strip()


def exact_lengths(runs: Sequence[RunResult], output_len: int) -> tuple[int, int, list[str]]:
    """(requests with exactly ``output_len`` tokens, requests sent, labels of runs with a KV leak)."""
    total = sum(len(run.records) for run in runs)
    exact = sum(r.success and r.output_tokens == output_len for run in runs for r in run.records)
    leaks = [run.label for run in runs if run.kv.error or (run.kv.leaked or 0) > 0]
    return exact, total, leaks
