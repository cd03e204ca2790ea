"""PNG plots of a bench result with matplotlib's Agg canvas (no display needed).

``latency_cdf.png``: empirical CDFs of TTFT, TPOT, ITL and E2E (ms), one line per run;
``throughput_vs_rate.png``: request throughput and goodput, and output token throughput, against the
offered rate (open-loop runs only; skipped otherwise); ``timeline.png``: each request's TTFT and each
ITL against the time they happened (s since the run started).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from loadtest.metrics import tpot_s
from loadtest.records import BenchResult, RequestRecord


def _figure(figsize: tuple[float, float]) -> Figure:
    """A figure on an Agg canvas (no pyplot: no global state, no display)."""
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def _latencies(records: list[RequestRecord]) -> dict[str, list[float]]:
    ok = [r for r in records if r.success]
    return {
        "TTFT": [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None],
        "TPOT": [t * 1e3 for t in (tpot_s(r) for r in ok) if t is not None],
        "ITL": [g * 1e3 for r in ok for g in r.itl_s],
        "E2E": [r.e2e_s * 1e3 for r in ok if r.e2e_s is not None],
    }


def plot_latency_cdf(result: BenchResult, path: Path) -> None:
    """Write the latency CDF figure to ``path``."""
    fig = _figure((10, 7))
    axes = fig.subplots(2, 2)
    for ax, name in zip(axes.flat, ("TTFT", "TPOT", "ITL", "E2E"), strict=True):
        for run in result.runs:
            values = np.sort(_latencies(run.records)[name])
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=run.label)
        ylabel = "fraction of token gaps" if name == "ITL" else "fraction of requests"
        ax.set(title=f"{name} CDF", xlabel=f"{name} (ms)", ylabel=ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def plot_throughput_vs_rate(result: BenchResult, path: Path) -> bool:
    """Write throughput and goodput against offered rate; False (nothing written) if no rate is finite."""
    runs = [r for r in result.runs if r.rate is not None and np.isfinite(r.rate)]
    if not runs:
        return False
    rates = [r.rate for r in runs]
    fig = _figure((10, 4))
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot(rates, [r.summary.request_throughput for r in runs], "o-", label="request throughput")
    ax1.plot(rates, [r.summary.goodput for r in runs], "s-", label="goodput (TTFT & TPOT SLOs)")
    ax1.set(title="Throughput and goodput", xlabel="offered rate (req/s)", ylabel="req/s")
    ax1.legend(fontsize=8)
    ax2.plot(rates, [r.summary.output_token_throughput for r in runs], "o-")
    ax2.set(title="Output token throughput", xlabel="offered rate (req/s)", ylabel="tokens/s")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return True


def plot_timeline(result: BenchResult, path: Path) -> None:
    """Write TTFT (per request, at its send time) and ITL (per gap, at its end) against run time."""
    fig = _figure((10, 6))
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    for run in result.runs:
        ok = [r for r in run.records if r.success and r.ttft_s is not None]
        ax1.plot([r.start_s for r in ok], [(r.ttft_s or 0.0) * 1e3 for r in ok], ".", label=run.label)
        xs, ys = [], []
        for r in ok:
            t = r.start_s + (r.ttft_s or 0.0)
            for gap in r.itl_s:
                t += gap
                xs.append(t)
                ys.append(gap * 1e3)
        ax2.plot(xs, ys, ".", markersize=2, label=run.label)
    for fault in (f for run in result.runs for f in run.faults if f.started_s is not None):
        for ax in (ax1, ax2):
            ax.axvline(fault.started_s, color="red", linestyle="--", linewidth=1)
    ax1.set(title="TTFT over time", ylabel="TTFT (ms)")
    ax2.set(title="ITL over time", xlabel="time since run start (s)", ylabel="ITL (ms)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def write_plots(result: BenchResult, out_dir: str | Path) -> list[Path]:
    """Write every plot into ``out_dir`` (created if missing); return the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "latency_cdf.png", out / "timeline.png"]
    plot_latency_cdf(result, written[0])
    plot_timeline(result, written[1])
    if plot_throughput_vs_rate(result, out / "throughput_vs_rate.png"):
        written.append(out / "throughput_vs_rate.png")
    return written
