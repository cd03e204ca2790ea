"""The agent benchmark's outputs: a Markdown report (per system a per-turn table, then the systems side by
side) and the JSON file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from loadtest.agent_records import AgentResult, AgentSystemResult, TurnStats
from loadtest.report_format import ms, read_json, table, write_json


def save_agent_json(result: AgentResult, path: str | Path) -> None:
    """Write ``result`` (every raw record, the per-turn stats) as indented JSON."""
    write_json(result, path)


def load_agent_json(path: str | Path) -> AgentResult:
    """Read a file written by ``save_agent_json``. Raises ValueError naming the file if it is not one."""
    return read_json(path, AgentResult, "pdserve bench agent result file")


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.1f}"


def _num(value: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.2f}"


def _growth(system: AgentSystemResult, suffix: str = "") -> str:
    """``ttft_last_over_first`` (``1.84x``), or why there is none: ``n/a (one turn)`` with ``--turns 1``,
    ``n/a (no TTFT on turn 1)``, ``n/a (no TTFT after turn 1)``."""
    if system.ttft_last_over_first is not None:
        return f"{system.ttft_last_over_first:.2f}{suffix}"
    measured = [t.turn for t in system.turns if t.ttft_ms is not None]
    if len(system.turns) <= 1:
        return "n/a (one turn)"
    if 0 not in measured:
        return "n/a (no TTFT on turn 1)"
    if len(measured) < 2:
        return "n/a (no TTFT after turn 1)"
    return "n/a (turn 1's TTFT p50 is 0)"


def _split(turn: TurnStats) -> str:
    split = None if turn.counters is None else turn.counters.prefill.mean_ms()
    return "-" if split is None else f"{split[0]:.0f} + {split[1]:.0f}"


_TURN_COLUMNS: list[tuple[str, Callable[[TurnStats], str]]] = [
    ("turn", lambda t: str(t.turn + 1)),
    ("ok/sent", lambda t: f"{t.completed}/{t.sent}"),
    ("prompt tok (mean)", lambda t: _num(t.prompt_tokens_mean)),
    ("new tok", lambda t: _num(t.suffix_tokens)),
    ("TTFT p50/p90 ms", lambda t: f"{ms(t.ttft_ms, 'median')}/{ms(t.ttft_ms, 'p90')}"),
    ("TPOT p50/p90 ms", lambda t: f"{ms(t.tpot_ms, 'median')}/{ms(t.tpot_ms, 'p90')}"),
    ("prefill hit %", lambda t: _pct(t.prefill_hit_rate)),
    ("decode hit %", lambda t: _pct(t.decode_hit_rate)),
    ("prefill worker queue + compute ms (mean)", lambda t: _split(t)),
    ("KV MiB moved", lambda t: _mib(t.kv_bytes)),
    ("new tokens' KV MiB", lambda t: _mib(t.suffix_kv_bytes)),
    ("moved / new", lambda t: _num(t.kv_over_suffix, "{:.2f}")),
    ("within SLOs", lambda t: f"{t.slo_met}/{t.completed}"),
]


def _system_lines(system: AgentSystemResult) -> list[str]:
    s = system.summary
    lines = ["", f"## {system.label} ({system.url})", ""]
    lines += table([c[0] for c in _TURN_COLUMNS], [[fn(t) for _, fn in _TURN_COLUMNS] for t in system.turns])
    run = system.run_counters
    lines += ["", f"Run: {s.completed}/{s.num_requests} completed in {s.duration_s:.1f} s (think time "
                  "included), "
                  f"goodput {s.goodput:.2f} req/s ({sum(t.slo_met for t in system.turns)} within both SLOs); "
                  f"TTFT p50 last turn / turn 1: {_growth(system, 'x')}"]
    if run is not None:
        lines += [f"Prefix-cache hit rate over the run (device tier): "
                  f"prefill {_pct(run.prefill.hit_rate())} %, "
                  f"decode {_pct(run.decode.block_hit_rate())} % of prompt blocks; "
                  f"KV sent {_mib(run.prefill.kv_sent_bytes)} MiB, "
                  f"received {_mib(run.decode.kv_received_bytes)} MiB"]
    else:
        lines += [f"Worker counters not read: {system.counters_error}"]
    if system.sessions_ended_by_context:
        lines += [f"Sessions ended by --max-context: {system.sessions_ended_by_context}"]
    for group in s.error_groups:
        lines += [f"Errors: {group.count} x {group.label}: {' '.join(group.example.split())}"]
    kv = system.kv
    if kv.error:
        lines += [f"KV blocks: not scraped: {kv.error}"]
    else:
        lines += [f"KV blocks used: before {kv.before:g}, after {kv.after:g}, leaked {kv.leaked:g}"
                  + ("  **LEAK**" if (kv.leaked or 0) > 0 else "")]
    return lines


_COMPARED: list[tuple[str, Callable[[TurnStats], str]]] = [
    ("TTFT p50 ms", lambda t: ms(t.ttft_ms, "median")),
    ("moved / new KV", lambda t: _num(t.kv_over_suffix, "{:.2f}")),
    ("prefill hit %", lambda t: _pct(t.prefill_hit_rate)),
]


def _comparison_lines(systems: list[AgentSystemResult]) -> list[str]:
    labels = [s.label for s in systems]
    header = ["turn"] + [f"{name} {label}" for name, _ in _COMPARED for label in labels]
    by_turn = [{t.turn: t for t in s.turns} for s in systems]
    rows = []
    for turn in sorted({t for turns in by_turn for t in turns}):
        row = [str(turn + 1)]
        for _, fn in _COMPARED:
            row += [fn(turns[turn]) if turn in turns else "-" for turns in by_turn]
        rows.append(row)
    lines = ["", "## Side by side", "", *table(header, rows)]
    lines += ["", *table(["system", "TTFT p50 last turn / turn 1", "goodput req/s", "completed"],
                         [[s.label, _growth(s), f"{s.summary.goodput:.2f}",
                           f"{s.summary.completed}/{s.summary.num_requests}"] for s in systems])]
    return lines


def agent_markdown(result: AgentResult) -> str:
    """The report: the workload, each system's per-turn table and run lines, then (with several systems)
    the per-turn TTFT, KV ratio and hit rate side by side."""
    cfg = result.config
    lines = ["# pdserve bench: multi-turn agent sessions", "",
             f"{cfg.get('sessions')} sessions x {cfg.get('turns')} turns in lockstep, think time "
             f"{cfg.get('think_time_s')} s; SLOs: TTFT <= {_slo(cfg, 'ttft_ms')} ms, TPOT <= "
             f"{_slo(cfg, 'tpot_ms')} ms; KV bytes per token: {cfg.get('kv_bytes_per_token') or 'unknown'}"]
    for system in result.systems:
        lines += _system_lines(system)
    if len(result.systems) > 1:
        lines += _comparison_lines(result.systems)
    return "\n".join(lines) + "\n"


def _slo(cfg: dict[str, object], key: str) -> str:
    slo = cfg.get("slo")
    return f"{slo.get(key):g}" if isinstance(slo, dict) and isinstance(slo.get(key), int | float) else "-"
