"""One live request at the gateway, as the orchestrator (gateway/orchestrator.py) keeps it: the client's
input (``GenerationInput``), the current ``Attempt`` and its route, the ``RequestPhase``, the inbox of
worker messages (``WorkerMessage``, ``WorkerLost``, or the gateway's own ``GatewayStopping``), the workers
holding it and the counted output tokens (``GatewayRequest``); what ``Orchestrator.next_output`` yields
(``TokenOutput`` with its ``TokenLogprob``) and raises (``GenerationFailed``, with the HTTP status it is
answered with).
"""
from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import Literal

from engine.sampling_params import SamplingParams
from gateway.errors import APIError, bad_request, gateway_timeout, unavailable, upstream_failed
from gateway.router import Route
from protocol.messages import (
    FinishReason,
    FirstToken,
    KVReserved,
    NextToken,
    PromptLogprob,
    RequestFailed,
    RequestFinished,
    RequestRejected,
)

# the worker messages of one request (in its inbox)
WorkerMessage = KVReserved | FirstToken | NextToken | RequestFinished | RequestFailed | RequestRejected


class RequestPhase(enum.Enum):
    """Where a request is (the numbered steps of the module docstring)."""

    RESERVING_KV = "reserving_kv"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(frozen=True)
class GenerationInput:
    """One generation: prompt token ids, sampling for the workers (``stop`` empty), stop strings for the
    gateway's stream, and the request field that set ``sampling.structured_output`` (named by the 400
    when a worker's grammar engine rejects it)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    structured_param: str | None = None


FailureCause = Literal["failed", "lost", "unreachable"]  # RequestFailed, worker lost, send not delivered


@dataclass(frozen=True)
class WorkerLost:
    """Put into a request's inbox when a worker holding attempt ``request_id`` died, left, or was
    replaced (``cause`` "lost"), or a message to it could not be delivered ("unreachable")."""

    request_id: str
    worker_id: str
    reason: str
    cause: FailureCause = "lost"


@dataclass(frozen=True)
class GatewayStopping:
    """Put into every live request's inbox when this gateway process stops serving what it still has in
    flight (its drain's deadline passed, a second stop signal came, or ``--drain-timeout 0``): the request
    fails with ``reason`` (503 before any output, an error event after it), and its workers are told to
    drop it as for any failed request."""

    reason: str


InboxItem = WorkerMessage | WorkerLost | GatewayStopping


@dataclass(frozen=True)
class Attempt:
    """What the workers of one routing of a request are sent: the worker request id, the prompt (the
    client's prompt, plus the tokens already streamed after a migration) and the sampling parameters
    (``max_tokens`` / ``min_tokens`` less those tokens, ``output_offset`` more)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One output token's log-probability (natural log) and its top alternatives ``(token_id, logprob)``."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """What a request produced next: one counted output token (``token_id``; ``logprob`` when the worker
    sent one), or the end without a token (``token_id`` None, from ``RequestFinished``). ``finish_reason``
    is set when the workers end the request with it (a stop string may end it earlier)."""

    token_id: int | None
    logprob: TokenLogprob | None
    finish_reason: FinishReason | None


class GenerationFailed(RuntimeError):
    """A worker failed, vanished or aborted while serving the request and it could not be recovered, or
    the request timed out, or a worker rejected it. ``status``: the HTTP status it is answered with
    before any output (400 a worker rejected the request, naming ``param``, or its grammar rejected the
    model's token, with ``code`` ``structured_output_failed``; 502 a worker failure, 503 no other worker
    could take the request over, or the gateway stops serving it with ``code`` ``gateway_stopping``,
    504 the request timed out)."""

    def __init__(self, message: str, status: int = 502, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code

    def api_error(self) -> APIError:
        """The OpenAI error answered for this failure (with ``Retry-After`` on 503)."""
        if self.status == 400:
            return bad_request(str(self), self.param, self.code)
        if self.status == 504:
            return gateway_timeout(str(self))
        if self.status == 503:
            return unavailable(str(self), code=self.code or "no_worker_for_retry")
        return upstream_failed(str(self))


@dataclass(eq=False)
class GatewayRequest:
    """A live request: the client's input (``inp``; its ``request_id`` is the first attempt's), the
    current ``attempt`` and its ``route``, phase, inbox of worker messages, holders (worker_id → zmq
    identity of each worker holding the current attempt), the counted output tokens (``output_ids``)
    with their arrival times (``time.monotonic()`` seconds, as ``arrival``), the retries and migrations
    done and the workers that failed it (left out when it is routed again), and the prompt tokens the
    worker of its first ``FirstToken`` found in its prefix cache (None before it), and the prompt
    logprobs that ``FirstToken`` carried (None unless the sampling params asked for them)."""

    inp: GenerationInput
    route: Route
    phase: RequestPhase = RequestPhase.PREFILLING
    arrival: float = field(default_factory=time.monotonic)
    inbox: asyncio.Queue[InboxItem] = field(default_factory=asyncio.Queue)
    holders: dict[str, bytes] = field(default_factory=dict)
    token_times: list[float] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    retries: int = 0
    migrations: int = 0
    failed_workers: set[str] = field(default_factory=set)
    num_cached_tokens: int | None = None  # prompt tokens the first FirstToken's worker found cached
    prompt_logprobs: list[PromptLogprob] | None = None  # entries of prompt tokens 1..n-1
    attempt: Attempt = field(init=False)

    @property
    def request_id(self) -> str:
        """The id the workers of the current attempt see (``Orchestrator.worker_request_id``)."""
        return self.attempt.request_id

    def __post_init__(self) -> None:
        self.attempt = Attempt(self.inp.request_id, self.inp.prompt_token_ids, self.inp.sampling)
