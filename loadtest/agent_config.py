"""Frozen configuration of the multi-turn agent benchmark (``pdserve bench --workload agent``).

An agent session is a conversation of up to ``turns`` turns on one growing context: each turn adds user
text and a tool-result-sized block to the chat history (the answers so far included) and asks for an
answer. ``sessions`` sessions run concurrently, their turns in lockstep (see ``loadtest.agent_runner``).
The same workload runs against each ``SystemTarget`` in turn (e.g. prefix reuse on, then off).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loadtest.config import Endpoint, SLOConfig
from loadtest.lengths import LengthDist


@dataclass(frozen=True)
class SystemTarget:
    """One system under test: its ``label`` (e.g. ``reuse-on``), the gateway's ``url``, and the metrics
    servers of its prefill-side (prefill or colocated) and decode-side workers (``http://host:port``, or
    their pages ``http://host:port/metrics`` as ``pdserve up`` prints them; empty: the per-side counters
    are not read).

    Spec strings (``SystemTarget.parse``): ``label=NAME,url=URL[,prefill=URL+URL...][,decode=URL+...]``.
    """

    label: str
    url: str
    prefill_metrics: tuple[str, ...] = ()
    decode_metrics: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.label or any(c in self.label for c in ",=|"):
            raise ValueError(f"system label must be non-empty without ',', '=' or '|', got {self.label!r}")
        for url in (self.url, *self.prefill_metrics, *self.decode_metrics):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"system {self.label}: URLs must start with http:// or https://, "
                                 f"got {url!r}")

    @property
    def has_counters(self) -> bool:
        """Whether worker counters are read (some worker page given)."""
        return bool(self.prefill_metrics or self.decode_metrics)

    @classmethod
    def parse(cls, spec: str) -> SystemTarget:
        """Parse ``label=NAME,url=URL[,prefill=URL+URL][,decode=URL+URL]``. Raises ValueError naming the
        problem (unknown or repeated field, missing label or url)."""
        fields: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, eq, value = part.partition("=")
            if not eq or key not in ("label", "url", "prefill", "decode") or key in fields:
                raise ValueError(f"bad --system {spec!r}: unknown or repeated field {part!r} (use label=, "
                                 "url=, prefill=, decode=)")
            fields[key] = value.strip()
        if "label" not in fields or "url" not in fields:
            raise ValueError(f"bad --system {spec!r}: needs label=NAME and url=URL")

        def urls(key: str) -> tuple[str, ...]:
            return tuple(u.rstrip("/") for u in fields.get(key, "").split("+") if u)

        return cls(fields["label"], fields["url"].rstrip("/"), urls("prefill"), urls("decode"))


@dataclass(frozen=True)
class AgentConfig:
    """The agent benchmark.

    Per turn and session: ``user_tokens`` words of user text and ``tool_tokens`` words of a tool result
    (random words of ``words``, default common English words, about one token each with a BPE tokenizer;
    a word-level tokenizer such as a dummy model's needs its own vocabulary's words, or every word is the
    same unknown token; the same text for the same ``seed`` on every system)
    and ``output_len`` max_tokens. Between turns every session waits ``think_time_s`` seconds. A session
    ends before a turn whose prompt and answer could pass ``max_context`` tokens (estimated from the last
    turn's usage plus the new words and 32 tokens of chat template; None: no limit). Goodput counts the
    requests within both ``slo`` limits. ``kv_bytes_per_token`` (None: unknown) converts each turn's
    new prompt tokens into their own KV bytes, the floor a suffix-only transfer could reach. After each
    turn the worker counters are read until they settle, for at most ``settle_s`` seconds. Traffic goes
    only to the systems' URLs.
    """

    model: str
    systems: tuple[SystemTarget, ...]
    endpoint: Endpoint = "chat"
    api_key: str | None = None
    sessions: int = 8
    turns: int = 20
    user_tokens: LengthDist = field(default_factory=lambda: LengthDist("fixed", 100))
    tool_tokens: LengthDist = field(default_factory=lambda: LengthDist("fixed", 600))
    output_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 64))
    think_time_s: float = 1.0
    max_context: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    request_timeout_s: float = 60.0
    slo: SLOConfig = field(default_factory=SLOConfig)
    kv_bytes_per_token: int | None = None
    words: tuple[str, ...] | None = None  # None: loadtest.workload's common English words
    metrics_path: str | None = "/metrics"
    leak_settle_s: float = 2.0
    settle_s: float = 5.0
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.systems:
            raise ValueError("the agent benchmark needs at least one system")
        labels = [s.label for s in self.systems]
        if len(set(labels)) != len(labels):
            raise ValueError(f"system labels must differ, got {labels}")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be completions|chat, got {self.endpoint!r}")
        if self.sessions < 1:
            raise ValueError(f"--sessions must be >= 1, got {self.sessions}")
        if self.turns < 1:
            raise ValueError(f"--turns must be >= 1, got {self.turns}")
        if not 0.0 <= self.temperature <= 2.0:  # the OpenAI range the gateway holds requests to
            raise ValueError(f"--temperature must be in [0, 2], got {self.temperature}")
        if self.think_time_s < 0:
            raise ValueError(f"--think-time must be >= 0 s, got {self.think_time_s}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"--max-context must be >= 2 tokens, got {self.max_context}")
        if self.kv_bytes_per_token is not None and self.kv_bytes_per_token < 1:
            raise ValueError(f"--kv-bytes-per-token must be >= 1, got {self.kv_bytes_per_token}")
        if self.words is not None and (not self.words or any(not w or w != w.strip() or " " in w
                                                             for w in self.words)):
            raise ValueError("words must be a non-empty list of words without whitespace")
        if self.request_timeout_s <= 0 or self.leak_settle_s < 0 or self.settle_s < 0:
            raise ValueError("request timeout must be > 0 s; settle times >= 0 s")
