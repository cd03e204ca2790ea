"""Per-request gateway state: the inbox of worker messages and which workers hold state for it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from gateway.router import Route
from protocol.messages import Message, WireSamplingParams


@dataclass(frozen=True)
class WorkerLost:
    """Put into a request's inbox when a worker holding it died, left, or was replaced."""

    worker_id: str
    reason: str


@dataclass(frozen=True)
class GenerationInput:
    """One generation: prompt token ids, sampling for workers, stop strings for the gateway."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: WireSamplingParams
    stop: tuple[str, ...] = ()


@dataclass
class RequestHandle:
    """Live request: route, inbox, holders (worker_id → zmq identity), token arrival times (s)."""

    inp: GenerationInput
    route: Route
    arrival: float = field(default_factory=time.monotonic)
    inbox: asyncio.Queue[Message | WorkerLost] = field(default_factory=asyncio.Queue)
    holders: dict[str, bytes] = field(default_factory=dict)
    token_times: list[float] = field(default_factory=list)
    finished: bool = False

    @property
    def request_id(self) -> str:
        """The request id (X-Request-Id)."""
        return self.inp.request_id


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability (natural log) and its top alternatives ``(token_id, logprob)``."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Delta:
    """What the HTTP layer streams: new text, new tokens counted, the finish reason at the end, and the
    counted tokens' logprobs (empty unless the request asked for logprobs and the worker sent them)."""

    text: str
    num_tokens: int
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


class GenerationFailed(RuntimeError):
    """A worker failed or vanished while serving the request, or the request timed out."""
