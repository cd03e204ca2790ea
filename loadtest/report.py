"""Outputs: the JSON result file, the Markdown summary, and ``compare`` of two result files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from loadtest.records import BenchResult, LatencyStats, RunResult, Summary
from loadtest.report_format import ms, read_json, table, write_json


def save_json(result: BenchResult, path: str | Path) -> None:
    """Write ``result`` (every raw record and the summaries) as indented JSON."""
    write_json(result, path)


def load_json(path: str | Path) -> BenchResult:
    """Read a result file written by ``save_json``. Raises ValueError naming the file if it is not one."""
    return read_json(path, BenchResult, "pdserve bench result file")


_COLUMNS: list[tuple[str, Callable[[Summary], str]]] = [
    ("ok/sent", lambda s: f"{s.completed}/{s.num_requests}"),
    ("req/s", lambda s: f"{s.request_throughput:.2f}"),
    ("out tok/s", lambda s: f"{s.output_token_throughput:.1f}"),
    ("goodput req/s", lambda s: f"{s.goodput:.2f}"),
    ("TTFT mean/p50/p99 ms",
     lambda s: f"{ms(s.ttft_ms, 'mean')}/{ms(s.ttft_ms, 'median')}/{ms(s.ttft_ms, 'p99')}"),
    ("TPOT mean/p99 ms", lambda s: f"{ms(s.tpot_ms, 'mean')}/{ms(s.tpot_ms, 'p99')}"),
    ("ITL p50/p99 ms", lambda s: f"{ms(s.itl_ms, 'median')}/{ms(s.itl_ms, 'p99')}"),
    ("E2E p50/p99 ms", lambda s: f"{ms(s.e2e_ms, 'median')}/{ms(s.e2e_ms, 'p99')}"),
    ("errors", lambda s: ", ".join(f"{k}={v}" for k, v in s.errors_by_kind.items()) or "-"),
]


def markdown_summary(result: BenchResult) -> str:
    """A Markdown report: one row per run, then per run its errors (kind, count, an example message),
    faults, phases and the KV-block scrape where present."""
    first = result.runs[0].summary if result.runs else None
    slo = f"TTFT <= {first.slo_ttft_ms:g} ms, TPOT <= {first.slo_tpot_ms:g} ms" if first else "-"
    lines = ["# pdserve bench", "", f"Goodput SLOs: {slo}", ""]
    lines += table(["run"] + [c[0] for c in _COLUMNS],
                    [[run.label] + [fn(run.summary) for _, fn in _COLUMNS] for run in result.runs])
    for run in result.runs:
        lines += _run_details(run)
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """``text`` made safe for one Markdown table cell (no pipe, no line break)."""
    return " ".join(text.split()).replace("|", "\\|") or "-"


def _run_details(run: RunResult) -> list[str]:
    lines: list[str] = []
    if run.summary.error_groups:
        lines += ["", f"## Errors ({run.label})", ""]
        lines += table(["error", "count", "example message"],
                        [[g.label, str(g.count), _cell(g.example)] for g in run.summary.error_groups])
    if run.faults:
        lines += ["", f"## Faults ({run.label})", ""]
        lines += table(["at s", "started s", "status", "rc", "cmd"],
                        [[f"{f.at_s:g}", "-" if f.started_s is None else f"{f.started_s:.2f}", f.status,
                          str(f.returncode), f.cmd.replace("|", "\\|")] for f in run.faults])
        lines += ["", f"## Phases ({run.label})", "",
                  "Requests by the phase they were sent in (one sent before a fault may fail at it).", ""]
        lines += table(["phase", "sent from s", "sent to s", "completed", "failed", "timed out"],
                        [[p.name, f"{p.start_s:.2f}", "end" if p.end_s is None else f"{p.end_s:.2f}",
                          str(p.completed), str(p.failed), str(p.timed_out)] for p in run.phases])
    share = run.gateway_share
    if share is not None:
        lines += ["", f"Time per output token outside the engine loop ({run.label}): " + (
            f"not measured: {share.error}" if share.error else
            f"client {_fmt(share.client_itl_ms)} ms over {share.client_tokens} tokens, decode-side workers' "
            f"step interval {_fmt(share.worker_itl_ms)} ms over {share.worker_tokens} tokens: share "
            + ("-" if share.share is None else f"{share.share * 100:.1f} %"))]
    kv = run.kv
    if kv.error:
        lines += ["", f"KV blocks ({run.label}): not scraped: {kv.error}"]
    else:
        lines += ["", f"KV blocks used ({run.label}): before {kv.before:g}, after {kv.after:g}, "
                      f"leaked {kv.leaked:g}" + ("  **LEAK**" if (kv.leaked or 0) > 0 else "")]
    return lines


def _stat(stats: LatencyStats | None, field: str) -> float | None:
    return None if stats is None else float(getattr(stats, field))


_COMPARED: list[tuple[str, Callable[[Summary], float | None]]] = [
    ("completed", lambda s: s.completed),
    ("request throughput (req/s)", lambda s: s.request_throughput),
    ("output token throughput (tok/s)", lambda s: s.output_token_throughput),
    ("goodput (req/s)", lambda s: s.goodput),
    ("TTFT mean (ms)", lambda s: _stat(s.ttft_ms, "mean")),
    ("TTFT p99 (ms)", lambda s: _stat(s.ttft_ms, "p99")),
    ("TPOT mean (ms)", lambda s: _stat(s.tpot_ms, "mean")),
    ("TPOT p99 (ms)", lambda s: _stat(s.tpot_ms, "p99")),
    ("ITL p99 (ms)", lambda s: _stat(s.itl_ms, "p99")),
    ("E2E p99 (ms)", lambda s: _stat(s.e2e_ms, "p99")),
]


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def compare(a: BenchResult, b: BenchResult, name_a: str = "A", name_b: str = "B") -> str:
    """Markdown tables of A and B side by side with the ratio B/A, one per pair of runs (in order).

    Runs are paired by position; unpaired runs are listed as such.
    """
    lines = [f"# compare: A = {name_a}, B = {name_b}"]
    for i, (ra, rb) in enumerate(zip(a.runs, b.runs, strict=False)):
        lines += ["", f"## run {i}: A {ra.label} vs B {rb.label}", ""]
        rows = []
        for name, fn in _COMPARED:
            va, vb = fn(ra.summary), fn(rb.summary)
            ratio = "-" if va is None or vb is None or va == 0 else f"{vb / va:.3f}"
            rows.append([name, _fmt(va), _fmt(vb), ratio])
        lines += table(["metric", "A", "B", "B/A"], rows)
    extra = a.runs[len(b.runs):] or b.runs[len(a.runs):]
    if extra:
        lines += ["", "unpaired runs: " + ", ".join(r.label for r in extra)]
    return "\n".join(lines) + "\n"
