"""Result records written to the JSON output (msgspec Structs, read back by ``compare``).

Times are seconds (``*_s``) in raw records and milliseconds (``*_ms``) in summaries.
"""

from __future__ import annotations

import msgspec

ERROR_KINDS = ("http_status", "stream_error", "timeout", "connection")


class RequestRecord(msgspec.Struct, kw_only=True):
    """One request as the client saw it.

    ``start_s``: send time, seconds since the run started. ``ttft_s``: send → first non-empty token
    chunk. ``itl_s``: every gap between consecutive token chunks. ``e2e_s``: send → end of stream.
    ``output_tokens``: the server's ``usage.completion_tokens`` when it sent usage
    (``usage_reported``), else the number of token chunks. ``error_kind`` is one of ``ERROR_KINDS``;
    for ``http_status`` errors ``error_code`` is the OpenAI error body's ``code`` (its ``type`` when the
    code is not a string, as vLLM sends it) and ``error`` its ``message``.
    """

    index: int
    session_id: int
    turn: int
    start_s: float
    success: bool = False
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = msgspec.field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    usage_reported: bool = False
    error_kind: str | None = None
    http_status: int | None = None
    error_code: str | None = None
    error: str = ""


class LatencyStats(msgspec.Struct):
    """mean, median, p90, p99 and max of one latency (milliseconds) over ``count`` values."""

    count: int
    mean: float
    median: float
    p90: float
    p99: float
    max: float


class ErrorGroup(msgspec.Struct):
    """Failed requests of one kind: ``label`` (e.g. ``404 model_not_found``, ``timeout``), how many, and
    the message of the first of them (so a summary says *why* requests failed, not only how many)."""

    label: str
    count: int
    example: str


class Summary(msgspec.Struct, kw_only=True):
    """Aggregates of one run. Throughputs and goodput are per second of ``duration_s``.

    ``error_groups``: failures grouped by ``loadtest.metrics.error_label``, most frequent first (empty in
    result files written before it existed).
    """

    num_requests: int
    completed: int
    failed: int
    errors_by_kind: dict[str, int]
    duration_s: float
    request_throughput: float
    output_token_throughput: float
    total_token_throughput: float
    goodput: float
    slo_ttft_ms: float
    slo_tpot_ms: float
    ttft_ms: LatencyStats | None
    tpot_ms: LatencyStats | None
    itl_ms: LatencyStats | None
    e2e_ms: LatencyStats | None
    error_groups: list[ErrorGroup] = msgspec.field(default_factory=list)


class FaultResult(msgspec.Struct, kw_only=True):
    """A scheduled fault command: when it was due, started and finished (s since run start), how it ended.

    ``status``: ``ran`` (exited, see ``returncode``), ``timeout`` (killed), ``error`` (could not
    start), ``skipped`` (the run ended before ``at_s``).
    """

    at_s: float
    cmd: str
    status: str
    started_s: float | None = None
    finished_s: float | None = None
    returncode: int | None = None
    output: str = ""


class PhaseReport(msgspec.Struct, kw_only=True):
    """Requests sent in [start_s, end_s) (end None = to the end): completed, failed, hung (timed out)."""

    name: str
    start_s: float
    end_s: float | None
    completed: int
    failed: int
    timed_out: int


class KVScrape(msgspec.Struct, kw_only=True):
    """Sum of the server's ``pdserve_kv_blocks_used`` gauge before and after the run (blocks)."""

    before: float | None = None
    after: float | None = None
    leaked: float | None = None
    error: str = ""


class GatewayShare(msgspec.Struct, kw_only=True):
    """The time per output token outside the engine loop (``loadtest/gateway_share.py``): the decode-side
    workers' mean step interval per token over the run (``worker_itl_ms`` over ``worker_tokens``), the
    client's mean interval after each request's second token (``client_itl_ms`` over ``client_tokens``),
    and ``share = 1 - worker / client`` (None where a side counted no token); ``error`` names a page that
    could not be read (then the rest is empty)."""

    worker_itl_ms: float | None = None
    worker_tokens: int = 0
    client_itl_ms: float | None = None
    client_tokens: int = 0
    share: float | None = None
    error: str = ""


class RunResult(msgspec.Struct, kw_only=True):
    """One point of a sweep: its load (``rate`` requests/s, None = closed loop) and everything measured."""

    label: str
    rate: float | None
    concurrency: int | None
    summary: Summary
    records: list[RequestRecord]
    faults: list[FaultResult] = msgspec.field(default_factory=list)
    phases: list[PhaseReport] = msgspec.field(default_factory=list)
    kv: KVScrape = msgspec.field(default_factory=KVScrape)
    gateway_share: GatewayShare | None = None  # None: no --decode-metrics


class BenchResult(msgspec.Struct, kw_only=True):
    """The whole JSON output: the configuration (as plain data) and every run."""

    config: dict[str, object]
    runs: list[RunResult]
