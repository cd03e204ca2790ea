"""Latency metrics and goodput from request records (pure functions, no I/O).

Definitions follow vLLM's serving benchmark and DistServe (OSDI'24): TTFT = time to first token; TPOT =
(E2E - TTFT) / (output_tokens - 1), the mean time per output token after the first; ITL = each gap
between token chunks; goodput = requests per second that complete within both the TTFT and the TPOT
SLO. Percentiles use numpy's default linear interpolation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from loadtest.config import SLOConfig
from loadtest.records import ErrorGroup, LatencyStats, RequestRecord, Summary


def tpot_s(rec: RequestRecord) -> float | None:
    """TPOT in seconds, or None when undefined (failed request, or fewer than two output tokens)."""
    if not rec.success or rec.ttft_s is None or rec.e2e_s is None or rec.output_tokens < 2:
        return None
    return (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1)


def latency_stats(values_s: Sequence[float]) -> LatencyStats | None:
    """Stats in milliseconds of ``values_s`` (seconds); None for an empty sequence."""
    if not values_s:
        return None
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return LatencyStats(len(ms), float(ms.mean()), float(p50), float(p90), float(p99), float(ms.max()))


def meets_slo(rec: RequestRecord, slo: SLOConfig) -> bool:
    """True if ``rec`` succeeded with TTFT <= slo.ttft_ms and TPOT <= slo.tpot_ms.

    A one-token output has no TPOT and is judged on TTFT alone.
    """
    if not rec.success or rec.ttft_s is None or rec.ttft_s * 1000.0 > slo.ttft_ms:
        return False
    tpot = tpot_s(rec)
    return tpot is None or tpot * 1000.0 <= slo.tpot_ms


def error_label(rec: RequestRecord) -> str:
    """How a failed request is grouped: ``"<status> <code>"`` for an HTTP error (``"404
    model_not_found"``, or just ``"500"`` when the body had no code), else its ``error_kind``."""
    if rec.error_kind == "http_status" and rec.http_status is not None:
        return f"{rec.http_status} {rec.error_code}" if rec.error_code else str(rec.http_status)
    return rec.error_kind or "unknown"


def error_groups(records: Sequence[RequestRecord]) -> list[ErrorGroup]:
    """Failed ``records`` grouped by ``error_label``: count and the first (lowest index) message of
    each, most frequent first (ties by label)."""
    failed = sorted((r for r in records if not r.success), key=lambda r: r.index)
    counts = Counter(error_label(r) for r in failed)
    examples: dict[str, str] = {}
    for r in failed:
        examples.setdefault(error_label(r), r.error)
    return [ErrorGroup(label, n, examples[label])
            for label, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLOConfig) -> Summary:
    """Aggregate ``records`` of a run that lasted ``duration_s`` seconds (must be > 0).

    Throughputs count completed requests only; total token throughput adds the server-reported prompt
    tokens of completed requests (0 where the server sent no usage). Raises ValueError if duration_s <= 0.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    errors = Counter(r.error_kind or "unknown" for r in records if not r.success)
    tpots = [t for t in (tpot_s(r) for r in ok) if t is not None]
    return Summary(
        num_requests=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        errors_by_kind=dict(sorted(errors.items())),
        duration_s=duration_s,
        request_throughput=len(ok) / duration_s,
        output_token_throughput=out_tokens / duration_s,
        total_token_throughput=(out_tokens + in_tokens) / duration_s,
        goodput=sum(meets_slo(r, slo) for r in ok) / duration_s,
        slo_ttft_ms=slo.ttft_ms,
        slo_tpot_ms=slo.tpot_ms,
        ttft_ms=latency_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_ms=latency_stats(tpots),
        itl_ms=latency_stats([g for r in ok for g in r.itl_s]),
        e2e_ms=latency_stats([r.e2e_s for r in ok if r.e2e_s is not None]),
        error_groups=error_groups(records),
    )
