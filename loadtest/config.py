"""Frozen configuration of one `pdserve bench` invocation (validated on construction)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from loadtest.faults import FaultSpec
from loadtest.lengths import LengthDist

WorkloadKind = Literal["random", "sharegpt", "multi-turn"]
PromptFormat = Literal["tokens", "text"]
Endpoint = Literal["completions", "chat"]
ArrivalKind = Literal["poisson", "gamma", "constant", "closed"]


@dataclass(frozen=True)
class WorkloadConfig:
    """What to send.

    ``kind``: ``random`` (synthetic prompts), ``sharegpt`` (a ShareGPT-format JSON file at
    ``dataset_path``, which only this kind reads: None for the others), ``multi-turn`` (synthetic
    conversations of ``num_turns`` turns that share a growing prefix). ``prompt_format``: ``tokens`` sends
    token-id prompts (exact lengths, completions endpoint only) and ``text`` sends words (about one token
    each). ``num_turns`` caps turns per ShareGPT conversation too. Token ids are drawn uniformly from
    ``[vocab_low, vocab_high)``.
    """

    kind: WorkloadKind = "random"
    prompt_format: PromptFormat = "tokens"
    input_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 128))
    output_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 64))
    dataset_path: str | None = None
    num_turns: int = 1
    vocab_low: int = 100
    vocab_high: int = 10000

    def __post_init__(self) -> None:
        if self.kind not in ("random", "sharegpt", "multi-turn"):
            raise ValueError(f"--workload must be random|sharegpt|multi-turn, got {self.kind!r}")
        if self.prompt_format not in ("tokens", "text"):
            raise ValueError(f"--prompt-format must be tokens|text, got {self.prompt_format!r}")
        if self.kind == "sharegpt" and not self.dataset_path:
            raise ValueError("--workload sharegpt needs --dataset-path")
        if self.kind != "sharegpt" and self.dataset_path:
            raise ValueError(f"--dataset-path: only read by --workload sharegpt (got --workload {self.kind})")
        if self.kind != "random" and self.prompt_format == "tokens":
            raise ValueError(f"--workload {self.kind} sends text: use --prompt-format text")
        if self.num_turns < 1:
            raise ValueError(f"--num-turns must be >= 1, got {self.num_turns}")
        if not 0 <= self.vocab_low < self.vocab_high:
            raise ValueError(f"need 0 <= vocab_low < vocab_high, got {self.vocab_low}, {self.vocab_high}")


@dataclass(frozen=True)
class SLOConfig:
    """Service-level objectives for goodput (DistServe, OSDI'24): TTFT and TPOT limits, milliseconds."""

    ttft_ms: float = 1000.0
    tpot_ms: float = 100.0

    def __post_init__(self) -> None:
        if not all(math.isfinite(v) and v > 0 for v in (self.ttft_ms, self.tpot_ms)):
            raise ValueError(f"SLOs (--slo-ttft-ms, --slo-tpot-ms) must be finite numbers of ms > 0, got "
                             f"ttft {self.ttft_ms}, tpot {self.tpot_ms}")


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark: a sweep over ``rates`` (requests/s; ``inf`` = all at once) or one closed loop.

    Stopping: after ``num_requests`` measured requests or ``duration_s`` seconds of issuing, whichever
    comes first (at least one must be set); each request is bounded by ``request_timeout_s``.
    ``burstiness`` is the gamma shape (1 = Poisson, < 1 burstier). Traffic goes only to ``base_url``.
    ``decode_metrics``: the decode-side workers' metrics servers (``http://host:port``, or their pages
    ``http://host:port/metrics`` as ``pdserve up`` prints them), read around each
    run for the gateway's share of the time per output token (``loadtest/gateway_share.py``); empty: not
    measured.
    """

    base_url: str
    model: str
    endpoint: Endpoint = "completions"
    api_key: str | None = None
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    arrival: ArrivalKind = "poisson"
    rates: tuple[float, ...] = (math.inf,)
    burstiness: float = 1.0
    concurrency: int = 1
    num_requests: int | None = 100
    duration_s: float | None = None
    warmup: int = 0
    seed: int = 0
    request_timeout_s: float = 60.0
    ignore_eos: bool = False
    temperature: float = 0.0
    slo: SLOConfig = field(default_factory=SLOConfig)
    faults: tuple[FaultSpec, ...] = ()
    metrics_path: str | None = "/metrics"
    leak_settle_s: float = 2.0
    progress: bool = True
    decode_metrics: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"--endpoint must be completions|chat, got {self.endpoint!r}")
        if self.endpoint == "chat" and self.workload.prompt_format == "tokens":
            raise ValueError("token-id prompts need the completions endpoint; use --prompt-format text")
        if self.arrival not in ("poisson", "gamma", "constant", "closed"):
            raise ValueError(f"--arrival must be poisson|gamma|constant|closed, got {self.arrival!r}")
        if not self.rates:
            raise ValueError("--request-rate: give at least one rate")
        if bad := [r for r in self.rates if not r > 0]:
            raise ValueError(f"--request-rate values must be > 0 requests/s, got {bad[0]:g}")
        if self.arrival != "closed" and self.num_requests is None and any(math.isinf(r) for r in self.rates):
            raise ValueError("--request-rate inf sends everything at once: set --num-requests")
        if not (math.isfinite(self.burstiness) and self.burstiness > 0):
            raise ValueError(f"--burstiness must be a finite number > 0, got {self.burstiness}")
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if not 0.0 <= self.temperature <= 2.0:  # the OpenAI range the gateway holds requests to
            raise ValueError(f"--temperature must be in [0, 2], got {self.temperature}")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("set --num-requests or --duration so the run ends on its own")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"--duration must be > 0 s, got {self.duration_s}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"--request-timeout must be > 0 s, got {self.request_timeout_s}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if self.leak_settle_s < 0:
            raise ValueError(f"--leak-settle must be >= 0 s, got {self.leak_settle_s}")
        for url in self.decode_metrics:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--decode-metrics: URLs must start with http:// or https://, got {url!r}")
