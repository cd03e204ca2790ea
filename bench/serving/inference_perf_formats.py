"""inference-perf 0.7.0's file formats, as ``bench.serving.inference_perf`` reads and writes them: the
``successes`` of its two JSON summaries (``summary_prometheus_metrics.json``: the vLLM collector's reading
through Prometheus; ``summary_lifecycle_metrics.json``: the client's own measurements), the sections of
its config this project sets, and Prometheus' ``/api/v1/targets`` answer. Field names and types follow
inference-perf's sources (``inference_perf/reportgen/base.py``, ``inference_perf/config/``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, TypedDict, TypeVar

import msgspec


class CollectorStats(msgspec.Struct, frozen=True, omit_defaults=True):
    """A non-counter field of inference-perf's Prometheus summary (``summarize_prometheus_metrics`` in
    ``inference_perf/reportgen/base.py``): a histogram's or gauge's ``mean``, ``median``, ``p90``, ``p99``
    (its unit: seconds for latencies, tokens, percent); ``prompt_len``/``output_len``: ``mean`` and
    ``rate`` (per second); a tally or hit ratio: ``mean`` alone. The keys a field lacks are None (and
    absent again in ``msgspec.to_builtins``)."""

    mean: float
    median: float | None = None
    p90: float | None = None
    p99: float | None = None
    rate: float | None = None

    def present(self) -> list[tuple[str, float]]:
        """The keys this field carries with their values, in inference-perf's order."""
        keys = (("mean", self.mean), ("median", self.median), ("p90", self.p90), ("p99", self.p99),
                ("rate", self.rate))
        return [(k, v) for k, v in keys if v is not None]


# A collector field: a counter's windowed total (``count``, ``rate``, ``request_success_count``,
# ``prompt_tokens_cached``, ``corrupted_requests``) or the statistics of any other metric.
CollectorValue = float | CollectorStats
# The collector's ``successes``: field name → value, in the order inference-perf writes them.
CollectorSuccesses = dict[str, CollectorValue]


class PrometheusSummary(msgspec.Struct, frozen=True):
    """``summary_prometheus_metrics.json``; only ``successes`` is read (``failures`` is always empty),
    each of its values converted on its own (``read_collector``) so that an error names the field."""

    successes: dict[str, object]


class Percentiles(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The percentile keys of inference-perf's ``summarize`` (``reportgen/base.py``): ``median`` for 50,
    ``p<p:g>`` for the others of the report config's ``percentiles`` (default 0.1, 1, 5, 10, 25, 50, 75,
    90, 95, 99, 99.9, which this module's config keeps); one the config leaves out is None. Keyword-only
    so a subclass's own fields come first, as inference-perf writes them."""

    p0_1: float | None = msgspec.field(default=None, name="p0.1")
    p1: float | None = None
    p5: float | None = None
    p10: float | None = None
    p25: float | None = None
    median: float | None = None
    p75: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    p99_9: float | None = msgspec.field(default=None, name="p99.9")


class Distribution(Percentiles, frozen=True):
    """inference-perf's ``summarize`` of a non-empty sample (seconds for the latencies)."""

    mean: float
    min: float
    max: float


class Latency(msgspec.Struct, frozen=True):
    """The client's ``latency`` (seconds per span; per output token for the two ``*_per_output_token``);
    a span none of the successes measured (no streamed token timings, or no success) is None."""

    request_latency: Distribution | None
    normalized_time_per_output_token: Distribution | None
    time_per_output_token: Distribution | None
    time_to_first_token: Distribution | None
    inter_token_latency: Distribution | None


class Throughput(msgspec.Struct, frozen=True):
    """The client's ``throughput`` over the run (per second; 0.0 when the run took no time)."""

    input_tokens_per_sec: float
    output_tokens_per_sec: float
    total_tokens_per_sec: float
    requests_per_sec: float
    images_per_sec: float
    videos_per_sec: float
    audios_per_sec: float


class PromptTokens(Percentiles, frozen=True):
    """The client's ``prompt_tokens`` (``summarize_prompt_token_usage``): the successes' prompt tokens in
    all, those the responses' ``usage`` reported cached and the rest, then the per-request distribution
    (None without a success)."""

    total: float
    cached: float
    uncached: float
    mean: float | None = None
    min: float | None = None
    max: float | None = None


class OutputTokens(Percentiles, frozen=True):
    """The client's ``output_tokens`` (``summarize_output_token_usage``): the successes' output tokens in
    all (the server's ``usage`` count where it gave one), then the per-request distribution (None without
    a success)."""

    total: float
    mean: float | None = None
    min: float | None = None
    max: float | None = None


class ClientSuccesses(msgspec.Struct, frozen=True):
    """The part of the client's ``successes`` (``summarize_requests``) this module reads and saves:
    ``count`` requests that succeeded, their latencies, throughput and token counts."""

    count: int
    latency: Latency
    throughput: Throughput
    prompt_tokens: PromptTokens
    output_tokens: OutputTokens


class LifecycleSummary(msgspec.Struct, frozen=True):
    """``summary_lifecycle_metrics.json``; only ``successes`` is read."""

    successes: ClientSuccesses


_Summary = TypeVar("_Summary", PrometheusSummary, LifecycleSummary)


def read_summary(path: Path, kind: type[_Summary]) -> _Summary:
    """``path`` (an inference-perf JSON report) as ``kind``. Raises ValueError naming ``path`` and the
    missing or mistyped field (e.g. ``Object missing required field `count` - at `$.successes```)."""
    # inference-perf writes its reports with Python's json.dumps, which spells a non-finite float as
    # NaN or Infinity (a Prometheus histogram_quantile landing in the +Inf bucket, or over no
    # observations); msgspec's JSON decoder refuses those tokens, json.loads reads them, so msgspec
    # validates the parsed document instead of decoding the text.
    try:
        return msgspec.convert(json.loads(path.read_text()), type=kind)
    except (json.JSONDecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"{path}: {e}") from e


class _ApiSection(TypedDict):
    type: Literal["completion"]
    streaming: bool


class _SharedPrefixSection(TypedDict):
    num_groups: int
    num_prompts_per_group: int
    system_prompt_len: int  # tokens
    question_len: int  # tokens
    output_len: int  # tokens
    seed: int


class _DataSection(TypedDict):
    type: Literal["shared_prefix"]
    shared_prefix: _SharedPrefixSection


class _StageSection(TypedDict):
    rate: float  # requests/s
    duration: int  # s


class _LoadSection(TypedDict):
    type: Literal["constant"]
    stages: list[_StageSection]


class _PrometheusClientSection(TypedDict):
    url: str
    scrape_interval: int  # s


class _MetricsSection(TypedDict):
    type: Literal["prometheus"]
    prometheus: _PrometheusClientSection


class _ServerSection(TypedDict):
    type: Literal["vllm"]
    model_name: str
    base_url: str
    ignore_eos: bool


class _TokenizerSection(TypedDict):
    pretrained_model_name_or_path: str


class _LocalStorageSection(TypedDict):
    path: str


class _StorageSection(TypedDict):
    local_storage: _LocalStorageSection


class _ReportKindSection(TypedDict):
    summary: bool
    per_stage: bool


class _ReportSection(TypedDict):
    request_lifecycle: _ReportKindSection
    prometheus: _ReportKindSection


class InferencePerfConfig(TypedDict):
    """The sections of inference-perf 0.7.0's config (``inference_perf/config/config.py`` and the
    section models under ``inference_perf/config/``) this module sets; every other key keeps its
    default. Written as JSON (which is YAML) for ``inference-perf -c``."""

    api: _ApiSection
    data: _DataSection
    load: _LoadSection
    metrics: _MetricsSection
    server: _ServerSection
    tokenizer: _TokenizerSection
    storage: _StorageSection
    report: _ReportSection


class _Target(msgspec.Struct, frozen=True):
    health: str  # "up", "down" or "unknown"


class _ActiveTargets(msgspec.Struct, frozen=True):
    active_targets: list[_Target] = msgspec.field(name="activeTargets")


class TargetsAnswer(msgspec.Struct, frozen=True):
    """Prometheus' ``/api/v1/targets`` answer, the part read here."""

    data: _ActiveTargets
