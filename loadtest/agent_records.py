"""Result records of the multi-turn agent benchmark (msgspec Structs, written as JSON).

Times are milliseconds in the per-turn stats (``*_ms``), seconds in the raw ``RequestRecord``s; bytes
and tokens are plain counts. A turn index is 0-based in the records, 1-based in the printed tables.
"""

from __future__ import annotations

import msgspec

from loadtest.records import KVScrape, LatencyStats, RequestRecord, Summary
from loadtest.worker_counters import Counters


class TurnStats(msgspec.Struct, kw_only=True):
    """One turn index of one system, over its sessions.

    ``prompt_tokens_mean``: the server-reported prompt tokens of the completed requests (None: no usage).
    ``suffix_tokens``: the tokens each session's prompt grew by since its previous turn (the whole prompt
    at turn 0), summed over the sessions whose growth is known. ``counters``: the change of the worker
    counters over this turn (None when not read). ``prefill_hit_rate``: prefix-cache hits / queries (the
    device tier, 0..1) on the prefill side in this turn; ``decode_hit_rate``: prompt KV blocks
    the decode side reused / (reused + received) in this turn (None: nothing looked up, or not read).
    ``kv_bytes``: KV bytes that moved from the prefill to the decode side in this turn (as the decode
    workers received them; the prefill workers' sent bytes when no decode page is read).
    ``suffix_kv_bytes``: ``suffix_tokens`` x the model's KV bytes per token; ``kv_over_suffix`` the ratio
    (1.0: only the new tokens' KV crossed). ``slo_met``: completed requests within both SLOs.
    """

    turn: int
    sent: int
    completed: int
    prompt_tokens_mean: float | None = None
    suffix_tokens: int | None = None
    ttft_ms: LatencyStats | None = None
    tpot_ms: LatencyStats | None = None
    slo_met: int = 0
    counters: Counters | None = None
    prefill_hit_rate: float | None = None
    decode_hit_rate: float | None = None
    kv_bytes: float | None = None
    suffix_kv_bytes: int | None = None
    kv_over_suffix: float | None = None


class AgentSystemResult(msgspec.Struct, kw_only=True):
    """Everything measured on one system: every request, the per-turn stats, the whole run's summary
    (``summary``: goodput over the run's wall time, think time included), the counters' change over the
    run, ``ttft_last_over_first`` (TTFT p50 of the last turn any session reached / of turn 1),
    ``sessions_ended_by_context`` (sessions stopped by ``max_context``), the KV-block leak check."""

    label: str
    url: str
    records: list[RequestRecord]
    turns: list[TurnStats]
    summary: Summary
    run_counters: Counters | None = None
    counters_error: str = ""
    ttft_last_over_first: float | None = None
    sessions_ended_by_context: int = 0
    kv: KVScrape = msgspec.field(default_factory=KVScrape)


class AgentResult(msgspec.Struct, kw_only=True):
    """The JSON output: the configuration (plain data) and one result per system, in the order run."""

    config: dict[str, object]
    systems: list[AgentSystemResult]
