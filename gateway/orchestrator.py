"""The gateway's side of one request's prefill/decode hand-off: its state, every transition, the release
rules. A request here is one choice of an HTTP request (``GenerationInput``); hops are those of
protocol/messages.py.

  1. ``submit``: the router picks the workers (gateway/router.py); the request's first message goes out:
     * disaggregated: ``ReserveKV`` → decode worker D                                  (RESERVING_KV)
     * ``max_tokens == 1``: ``PrefillRequest`` without a KV handle → prefill worker P  (PREFILLING)
     * colocated: ``ColocatedRequest`` → colocated worker C                            (PREFILLING)
  2. ``KVReserved`` from D → ``PrefillRequest`` with D's KV handle → P               (PREFILLING)
  3. ``FirstToken`` from P (or C) → an output token; P no longer holds the request (it finishes its KV
     send on its own); disaggregated and not already finished: ``DecodeRequest`` → D (DECODING)
  4. ``NextToken`` from D (or C) → one output token each.
  5. The end: ``finish`` (called by the stream, gateway/stream.py, with the finish reason of the last
     delta: a worker's eos/stop/length, ``max_tokens`` reached here, or a stop string)  (FINISHED);
     ``RequestFinished`` ends it the same way. ``RequestFailed``, a worker lost (``WorkerLost``), a worker's
     abort or ``--request-timeout`` raise ``GenerationFailed``                        (FAILED)
  6. ``release`` (always, by whoever submitted): ``AbortRequest`` to every worker still holding state,
     TTFT/ITL/TPOT/E2E metrics if FINISHED.

Holding rules: a worker holds a request from the message sent to it until it says it is done
(``RequestFinished`` / ``RequestFailed``; P after ``FirstToken``), it is lost, or the request reaches
``max_tokens`` (workers stop there too: no abort needed). A stop string ends the request early and its
holders get ``AbortRequest``. A message for a released or unknown request is answered with
``AbortRequest`` (``RequestFinished`` / ``RequestFailed`` need no answer). Tokens are counted here (at
most ``max_tokens``; their arrival times feed the metrics); the text is made by the stream.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engine.sampling_params import SamplingParams
from gateway.errors import bad_request, queue_full, unavailable
from gateway.metrics import GatewayMetrics
from gateway.registry import WorkerEntry
from gateway.router import NoWorkerError, Route, Router
from protocol.logging import log_event
from protocol.messages import (
    AbortRequest,
    ColocatedRequest,
    DecodeRequest,
    FinishReason,
    FirstToken,
    KVReserved,
    Message,
    NextToken,
    PrefillRequest,
    RequestFailed,
    RequestFinished,
    ReserveKV,
    TopLogprob,
)

log = logging.getLogger("pdserve.gateway")
RECENT_IDS = 1 << 16  # released worker request ids remembered, so a reused X-Request-Id gets a new one
WorkerMessage = KVReserved | FirstToken | NextToken | RequestFinished | RequestFailed  # per request, in
Send = Callable[[bytes, Message], Coroutine[Any, Any, bool]]  # (worker's zmq identity, message) → delivered?


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
    gateway's stream."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class WorkerLost:
    """Put into a request's inbox when a worker holding it died, left, or was replaced."""

    worker_id: str
    reason: str


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
    is set when the workers or ``max_tokens`` end the request with it (a stop string may end it earlier)."""

    token_id: int | None
    logprob: TokenLogprob | None
    finish_reason: FinishReason | None


class GenerationFailed(RuntimeError):
    """A worker failed, vanished or aborted while serving the request, or the request timed out."""


@dataclass(eq=False)
class GatewayRequest:
    """A live request: its input, route, phase, inbox of worker messages, holders (worker_id → zmq
    identity of each worker holding state for it) and the arrival times of its counted tokens
    (``time.monotonic()`` seconds, as ``arrival``)."""

    inp: GenerationInput
    route: Route
    phase: RequestPhase = RequestPhase.PREFILLING
    arrival: float = field(default_factory=time.monotonic)
    inbox: asyncio.Queue[WorkerMessage | WorkerLost] = field(default_factory=asyncio.Queue)
    holders: dict[str, bytes] = field(default_factory=dict)
    token_times: list[float] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        """The id workers see (``Orchestrator.worker_request_id``)."""
        return self.inp.request_id


class Orchestrator:
    """The live requests of one gateway and their transitions. ``send`` delivers a control message to a
    worker; ``max_queue`` bounds the requests in flight; ``request_timeout`` (seconds) bounds each."""

    def __init__(self, router: Router, metrics: GatewayMetrics, send: Send, max_queue: int,
                 request_timeout: float) -> None:
        self.router, self.registry, self.metrics = router, router.registry, metrics
        self._send, self.max_queue, self.request_timeout = send, max_queue, request_timeout
        self.requests: dict[str, GatewayRequest] = {}
        self.released: OrderedDict[str, None] = OrderedDict()  # worker ids that workers may still hold
        self._background: set[asyncio.Task[Any]] = set()

    # ---- 1. submission ----------------------------------------------------------------------------
    def worker_request_id(self, request_id: str) -> str:
        """The id workers see for a new request: ``request_id`` itself, or ``request_id~k`` (smallest free
        k ≥ 1) when that id is in flight or was released recently. Workers may still hold a released
        request (an abort in flight, a KV send finishing), and their late messages are matched by id,
        so a client that reuses an X-Request-Id must not get the old incarnation's tokens or collide
        with it in a worker's scheduler. (``~`` never occurs in client ids: see gateway/middleware.py.)"""
        candidate, k = request_id, 0
        while candidate in self.requests or candidate in self.released:
            k += 1
            candidate = f"{request_id}~{k}"
        return candidate

    @staticmethod
    def client_request_id(worker_request_id: str) -> str:
        """The X-Request-Id-derived id a worker request id was made from (``worker_request_id`` undone)."""
        return worker_request_id.partition("~")[0]

    async def submit_all(self, request_id: str, inputs: Sequence[GenerationInput]) -> list[GatewayRequest]:
        """Submit the choices of one HTTP request (X-Request-Id ``request_id``): all or none (those already
        sent are released when one cannot be). Each gets a fresh worker request id.

        Raises:
            APIError: 400 (a request with the same X-Request-Id is still in flight), 429 (queue full,
                counting all choices) or 503 (no worker can serve).
        """
        wanted = {inp.request_id for inp in inputs}
        if any(self.client_request_id(rid) in wanted for rid in self.requests):
            raise bad_request(f"request id {request_id!r} is already in flight (X-Request-Id must be unique)",
                              None, "duplicate_request_id")
        if len(self.requests) + len(inputs) > self.max_queue:
            raise queue_full()
        reqs: list[GatewayRequest] = []
        try:
            for inp in inputs:
                worker_inp = replace(inp, request_id=self.worker_request_id(inp.request_id))
                reqs.append(await self.submit(worker_inp))
        except NoWorkerError as exc:
            for req in reqs:
                self.release(req)
            raise unavailable(str(exc)) from exc
        except BaseException:
            for req in reqs:
                self.release(req)
            raise
        return reqs

    async def submit(self, inp: GenerationInput) -> GatewayRequest:
        """Admit, route and send the first message of one request (step 1).

        Raises:
            APIError: 429 when ``max_queue`` requests are in flight.
            NoWorkerError: no live worker can serve it (→ 503).
        """
        if len(self.requests) >= self.max_queue:
            raise queue_full()
        route = self.router.route(inp.prompt_token_ids, inp.sampling.max_tokens)
        req = GatewayRequest(inp, route)
        self.requests[inp.request_id] = req
        self.metrics.in_flight.set(len(self.requests))
        self.metrics.routes.labels(route.kind).inc()
        if route.fallback:
            self.metrics.fallbacks.inc()
        if route.kind == "disaggregated":
            assert route.decode is not None and route.prefill is not None
            req.phase = RequestPhase.RESERVING_KV
            await self._hold_and_send(req, route.decode, ReserveKV(
                request_id=inp.request_id, prompt_token_ids=inp.prompt_token_ids, sampling=inp.sampling,
                prefill_worker_id=route.prefill.worker_id))
        elif route.kind == "prefill_only":
            assert route.prefill is not None
            await self._hold_and_send(req, route.prefill, PrefillRequest(
                request_id=inp.request_id, prompt_token_ids=inp.prompt_token_ids, sampling=inp.sampling))
        else:
            assert route.colocated is not None
            await self._hold_and_send(req, route.colocated, ColocatedRequest(
                request_id=inp.request_id, prompt_token_ids=inp.prompt_token_ids, sampling=inp.sampling))
        log_event(log, "request_routed", request_id=inp.request_id, kind=route.kind,
                  prompt_tokens=len(inp.prompt_token_ids), fallback=route.fallback,
                  workers=",".join(w.worker_id for w in (route.prefill, route.decode, route.colocated) if w))
        return req

    # ---- messages from workers --------------------------------------------------------------------
    async def on_worker_message(self, identity: bytes, msg: WorkerMessage) -> None:
        """Queue a worker's message for its request; answer ``AbortRequest`` when the request is unknown
        (released, or never here), except to ``RequestFinished`` / ``RequestFailed``."""
        req = self.requests.get(msg.request_id)
        if req is not None:
            req.inbox.put_nowait(msg)
        elif not isinstance(msg, RequestFinished | RequestFailed):
            await self._send(identity, AbortRequest(request_id=msg.request_id, reason="unknown request"))

    def worker_lost(self, entry: WorkerEntry, reason: str) -> None:
        """``entry``'s worker is gone (dead, left, replaced): each of its requests gets ``WorkerLost``, and
        the worker itself an ``AbortRequest`` for each (a stalled, not dead, worker frees them)."""
        for request_id in list(entry.requests):
            req = self.requests.get(request_id)
            if req is not None:
                req.holders.pop(entry.worker_id, None)
                req.inbox.put_nowait(WorkerLost(entry.worker_id, reason))
        for request_id in entry.requests:
            self._spawn(self._send(entry.identity, AbortRequest(
                request_id=request_id, reason=f"worker declared lost: {reason}")))
        entry.requests.clear()

    # ---- 2-5. one request's progress ---------------------------------------------------------------
    async def next_output(self, req: GatewayRequest) -> TokenOutput:
        """Apply the request's worker messages until one yields an output (steps 2-5).

        Raises:
            GenerationFailed: a worker failed or was lost, or ``--request-timeout`` passed.
        """
        deadline = req.arrival + self.request_timeout
        while True:
            msg = await self._next_message(req, deadline)
            if isinstance(msg, NextToken):
                return self._count(req, msg.token_id, msg.logprob, msg.top_logprobs, None)
            if isinstance(msg, FirstToken):
                await self._on_first_token(req, msg)
                return self._count(req, msg.token_id, msg.logprob, msg.top_logprobs, msg.finish_reason)
            if isinstance(msg, KVReserved):
                prefill = req.route.prefill
                assert prefill is not None
                req.phase = RequestPhase.PREFILLING
                await self._hold_and_send(req, prefill, PrefillRequest(
                    request_id=req.request_id, prompt_token_ids=req.inp.prompt_token_ids,
                    sampling=req.inp.sampling, kv_handle=msg.kv_handle, decode_worker_id=msg.worker_id))
            elif isinstance(msg, RequestFinished):
                self._drop_holder(req, msg.worker_id)
                return TokenOutput(None, None, msg.finish_reason)
            elif isinstance(msg, RequestFailed):
                self._drop_holder(req, msg.worker_id)
                req.phase = RequestPhase.FAILED
                raise GenerationFailed(f"worker {msg.worker_id} failed: {msg.error}")
            else:
                req.phase = RequestPhase.FAILED
                raise GenerationFailed(f"worker {msg.worker_id} lost: {msg.reason}")

    def finish(self, req: GatewayRequest, reason: FinishReason) -> None:
        """The request ended with ``reason`` (step 5). ``length``: every holder stopped at ``max_tokens``
        too, so none gets an abort; ``stop``: holders still running get one at ``release``.

        Raises:
            GenerationFailed: ``reason`` is ``abort`` (a worker aborted the request).
        """
        if reason == "abort":
            req.phase = RequestPhase.FAILED
            raise GenerationFailed("the worker aborted the request")
        req.phase = RequestPhase.FINISHED
        if reason == "length":
            for worker_id in list(req.holders):
                self._drop_holder(req, worker_id)

    # ---- 6. release --------------------------------------------------------------------------------
    def release(self, req: GatewayRequest) -> None:
        """End the request now (idempotent); aborts go out in a background task, so this is safe inside
        a cancelled scope."""
        if self.requests.pop(req.request_id, None) is None:
            return
        self.released[req.request_id] = None
        while len(self.released) > RECENT_IDS:
            self.released.popitem(last=False)
        self._spawn(self._abort_holders(req))

    async def _abort_holders(self, req: GatewayRequest) -> None:
        self.metrics.in_flight.set(len(self.requests))
        for worker_id, identity in list(req.holders.items()):
            await self._send(identity, AbortRequest(request_id=req.request_id))
            self._drop_holder(req, worker_id)
            log_event(log, "abort_sent", request_id=req.request_id, worker_id=worker_id)
        finished = req.phase is RequestPhase.FINISHED
        if finished:
            self.metrics.observe_tokens(req.arrival, req.token_times)
        log_event(log, "request_done", request_id=req.request_id, finished=finished,
                  tokens=len(req.token_times), e2e_s=round(time.monotonic() - req.arrival, 4))

    # ---- helpers -----------------------------------------------------------------------------------
    async def _hold_and_send(self, req: GatewayRequest, worker: WorkerEntry, msg: Message) -> None:
        """Mark ``worker`` as holding state for the request, then send; a failed send → ``WorkerLost``."""
        req.holders[worker.worker_id] = worker.identity
        worker.requests.add(req.request_id)
        if not await self._send(worker.identity, msg):
            req.inbox.put_nowait(WorkerLost(worker.worker_id, "worker unreachable"))

    def _drop_holder(self, req: GatewayRequest, worker_id: str) -> None:
        """The worker no longer holds state for this request."""
        req.holders.pop(worker_id, None)
        entry = self.registry.get(worker_id)
        if entry is not None:
            entry.requests.discard(req.request_id)

    async def _on_first_token(self, req: GatewayRequest, msg: FirstToken) -> None:
        req.phase = RequestPhase.DECODING
        if req.route.kind == "colocated":
            return
        self._drop_holder(req, msg.worker_id)  # prefill is done; it finishes its KV send on its own
        decode = req.route.decode
        if req.route.kind == "disaggregated" and decode is not None and msg.finish_reason is None:
            await self._send(decode.identity, DecodeRequest(request_id=req.request_id,
                                                            first_token_id=msg.token_id,
                                                            num_cached_tokens=msg.num_cached_tokens))

    @staticmethod
    def _count(req: GatewayRequest, token_id: int, logprob: float | None, top: list[TopLogprob] | None,
               worker_reason: FinishReason | None) -> TokenOutput:
        """Count one output token (its arrival time); ``length`` once ``max_tokens`` are counted, else the
        worker's finish reason."""
        req.token_times.append(time.monotonic())
        entry = None if logprob is None else TokenLogprob(
            token_id, logprob, () if top is None else tuple((t.token_id, t.logprob) for t in top))
        reason = "length" if len(req.token_times) >= req.inp.sampling.max_tokens else worker_reason
        return TokenOutput(token_id, entry, reason)

    @staticmethod
    async def _next_message(req: GatewayRequest, deadline: float) -> WorkerMessage | WorkerLost:
        if not req.inbox.empty():  # no timer needed; still yield once, so concurrent streams interleave
            await asyncio.sleep(0)
            return req.inbox.get_nowait()
        try:
            return await asyncio.wait_for(req.inbox.get(), timeout=max(deadline - time.monotonic(), 0.001))
        except TimeoutError as exc:
            req.phase = RequestPhase.FAILED
            raise GenerationFailed(f"request timed out after {deadline - req.arrival:.0f} s") from exc

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` as a task kept referenced (in ``_background``) until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
