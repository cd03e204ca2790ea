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
     delta: the worker's ``stop`` / ``length``, or a stop string)  (FINISHED). The worker's reason comes
     with a ``FirstToken`` that ends the request or in the ``RequestFinished`` after the last
     ``NextToken``; the ``max_tokens``-th ``NextToken`` waits for it and goes out with it (the engine
     checks stop and eos tokens before the length, so an eos that is the ``max_tokens``-th token is
     ``stop``). A worker failed or lost once every token is counted ends the request with ``length``,
     unrecovered. A worker's abort or ``--request-timeout`` raise ``GenerationFailed``    (FAILED)
  6. ``release`` (always, by whoever submitted): ``AbortRequest`` to every worker still holding state,
     TTFT/ITL/TPOT/E2E metrics if FINISHED.

Recovery (``_recover``): when a worker of the request fails it (``RequestFailed`` of kind ``worker``), is
lost, or cannot be reached (``WorkerLost``), the request is routed again, leaving out every worker that
failed it, as a new attempt with a fresh worker request id (late messages of the old attempt are then
answered with ``AbortRequest``); every holder of the old attempt, the failed worker included, gets
``AbortRequest``. A ``RequestFailed`` of kind ``structured_output`` (the request's grammar rejected the
model's token) or a ``RequestRejected`` is the request's own and not recovered: ``GenerationFailed``
with 400.
  * no output token counted yet: a retry of the same prompt (at most ``max_retries``, counted in
    ``pdserve_request_retries_total{cause}``);
  * ``k`` tokens counted: a migration (at most ``max_migrations``, ``pdserve_request_migrations_total``):
    the prompt plus the ``k`` tokens become the new prompt, ``max_tokens`` / ``min_tokens`` shrink by
    ``k`` and ``SamplingParams.output_offset`` grows by ``k``: the new attempt's first token is output
    position ``k``, whose seeded draw hashes ``(seed, k)`` as on the failed worker (engine/sampler.py)
    and whose presence/frequency penalties count the ``k`` tokens as output. The stream sees one
    continuing token sequence; a greedy or seeded stream the same tokens as an unbroken run (up to
    float rounding of the logits).
The request fails (``GenerationFailed``) when recovery is not allowed (502) or no other worker can take
it (503); a timeout fails it with 504; a gateway that stops serving what it has in flight (the end of
its drain, ``stop_requests``) fails each with 503, code ``gateway_stopping``.

Holding rules: a worker holds a request from the message sent to it until it says it is done
(``RequestFinished`` / ``RequestFailed``; P after ``FirstToken``), it is lost, or the request ends with
``length`` (workers stop at ``max_tokens`` too: no abort needed). A stop string ends the request early
and its holders get ``AbortRequest``. A message for a released or unknown request is answered with
``AbortRequest`` (``RequestFinished`` / ``RequestFailed`` need no answer). Tokens are counted here (at
most ``max_tokens``; their arrival times feed the metrics); the text is made by the stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace
from typing import Any

import msgspec

from engine.sampling_params import SamplingParams
from gateway.admission import Admission
from gateway.errors import bad_request, queue_full, unavailable
from gateway.metrics import GatewayMetrics
from gateway.registry import WorkerEntry
from gateway.request_state import (
    Attempt,
    FailureCause,
    GatewayRequest,
    GatewayStopping,
    GenerationFailed,
    GenerationInput,
    InboxItem,
    RequestPhase,
    TokenLogprob,
    TokenOutput,
    WorkerLost,
    WorkerMessage,
)
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
    RequestRejected,
    ReserveKV,
    TopLogprob,
)

log = logging.getLogger("pdserve.gateway")
RECENT_IDS = 1 << 16  # released worker request ids remembered, so a reused X-Request-Id gets a new one
Send = Callable[[bytes, Message], Coroutine[Any, Any, bool]]  # (worker's zmq identity, message) → delivered?


class Orchestrator:
    """The live requests of one gateway and their transitions. ``send`` delivers a control message to a
    worker; ``max_queue`` bounds the requests in flight; ``request_timeout`` (seconds) bounds each;
    ``max_retries`` / ``max_migrations`` bound each request's recoveries before / after its first output
    token (see the module docstring)."""

    def __init__(self, router: Router, metrics: GatewayMetrics, send: Send, max_queue: int,
                 request_timeout: float, admission: Admission | None = None, max_retries: int = 2,
                 max_migrations: int = 1) -> None:
        self.router, self.registry, self.metrics = router, router.registry, metrics
        self._send, self.max_queue, self.request_timeout = send, max_queue, request_timeout
        self.admission = admission  # None: every routed request is admitted (gateway/admission.py)
        self.max_retries, self.max_migrations = max_retries, max_migrations
        self.requests: dict[str, GatewayRequest] = {}
        self.stopping: str | None = None  # why this gateway serves nothing more (``stop_requests``)
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
            APIError: 400 (a request with the same X-Request-Id is still in flight, or a prompt no worker
                can hold), 429 (queue full, counting all choices, or refused by admission control) or 503
                (no worker can serve, or the gateway stops: ``stop_requests`` ran, code
                ``gateway_stopping``).
        """
        if self.stopping is not None:
            raise unavailable(self.stopping, code="gateway_stopping")
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
            APIError: 429 when ``max_queue`` requests are in flight; 400/429 from admission control.
            NoWorkerError: no live worker can serve it (→ 503).
        """
        if len(self.requests) >= self.max_queue:
            raise queue_full()
        route = self.router.route(inp.prompt_token_ids, inp.sampling.max_tokens)
        route = _computed_prefix(route, inp.sampling)
        if self.admission is not None:
            route = self.admission.admit(inp.request_id, len(inp.prompt_token_ids), route)
        req = GatewayRequest(inp, route)
        self.requests[inp.request_id] = req
        self.metrics.in_flight.set(len(self.requests))
        await self._dispatch(req)
        log_event(log, "request_routed", request_id=inp.request_id, kind=route.kind,
                  prompt_tokens=len(inp.prompt_token_ids), fallback=route.fallback,
                  workers=",".join(w.worker_id for w in (route.prefill, route.decode, route.colocated) if w))
        return req

    async def _dispatch(self, req: GatewayRequest) -> None:
        """Send the current attempt's first message to its route (step 1)."""
        route, att = req.route, req.attempt
        self.metrics.routes.labels(route.kind).inc()
        if route.prompt_blocks:
            self.metrics.prefix_prompt_blocks.inc(route.prompt_blocks)
            self.metrics.prefix_cached_blocks.inc(route.prefix_blocks)
            self.metrics.decode_prefix_cached_blocks.inc(route.decode_prefix_blocks)
        if route.fallback:
            self.metrics.fallbacks.inc()
        if route.kind == "disaggregated":
            assert route.decode is not None and route.prefill is not None
            req.phase = RequestPhase.RESERVING_KV
            route.prefill.unsent.add(att.request_id)  # its load from now, not from the PrefillRequest
            await self._hold_and_send(req, route.decode, ReserveKV(
                request_id=att.request_id, prompt_token_ids=att.prompt_token_ids, sampling=att.sampling,
                prefill_worker_id=route.prefill.worker_id,
                prefill_sender_epoch=route.prefill.info.kv_sender_epoch,
                prefill_tp_size=route.prefill.info.compat.tp_size))
        elif route.kind == "prefill_only":
            assert route.prefill is not None
            req.phase = RequestPhase.PREFILLING
            await self._hold_and_send(req, route.prefill, PrefillRequest(
                request_id=att.request_id, prompt_token_ids=att.prompt_token_ids, sampling=att.sampling,
                expected_cached_tokens=route.prefix_tokens()))
        else:
            assert route.colocated is not None
            req.phase = RequestPhase.PREFILLING
            await self._hold_and_send(req, route.colocated, ColocatedRequest(
                request_id=att.request_id, prompt_token_ids=att.prompt_token_ids, sampling=att.sampling,
                expected_cached_tokens=route.prefix_tokens()))

    # ---- messages from workers --------------------------------------------------------------------
    async def on_worker_message(self, identity: bytes, msg: WorkerMessage) -> None:
        """Queue a worker's message for its request; answer ``AbortRequest`` when the request is unknown
        (released, or never here), except to ``RequestFinished`` / ``RequestFailed``."""
        req = self.requests.get(msg.request_id)
        if req is not None:
            if isinstance(msg, FirstToken) and self.admission is not None:
                self.admission.first_token(msg)
            req.inbox.put_nowait(msg)
        elif not isinstance(msg, RequestFinished | RequestFailed | RequestRejected):
            await self._send(identity, AbortRequest(request_id=msg.request_id, reason="unknown request"))

    def worker_lost(self, entry: WorkerEntry, reason: str) -> None:
        """``entry``'s worker is gone (dead, left, replaced): each of its requests gets ``WorkerLost``, and
        the worker itself an ``AbortRequest`` for each (a stalled, not dead, worker frees them); a request
        routed to it that it has not received yet (``unsent``) gets ``WorkerLost`` only, and is routed
        again at once instead of after its decode worker's reservation."""
        for request_id in list(entry.unsent):
            req = self.requests.get(request_id)
            if req is not None:
                req.inbox.put_nowait(WorkerLost(request_id, entry.worker_id, reason))
        entry.unsent.clear()
        for request_id in list(entry.requests):
            req = self.requests.get(request_id)
            if req is not None:
                req.holders.pop(entry.worker_id, None)
                req.inbox.put_nowait(WorkerLost(request_id, entry.worker_id, reason))
        for request_id in entry.requests:
            self._spawn(self._send(entry.identity, AbortRequest(
                request_id=request_id, reason=f"worker declared lost: {reason}")))
        entry.requests.clear()

    # ---- 2-5. one request's progress ---------------------------------------------------------------
    async def next_output(self, req: GatewayRequest) -> TokenOutput:
        """Apply the request's worker messages until one yields an output (steps 2-5).

        A worker failure is recovered here when it can be (``_recover``): the caller only sees the
        output tokens continue.

        Raises:
            GenerationFailed: a worker failed or was lost and the request could not be routed again,
                ``--request-timeout`` passed, or the gateway stops serving it (``stop_requests``, 503).
        """
        deadline = req.arrival + self.request_timeout
        last: TokenOutput | None = None  # the max_tokens-th token, waiting for the worker's verdict on it
        while True:
            msg = await self._next_message(req, deadline)
            if isinstance(msg, GatewayStopping):
                req.phase = RequestPhase.FAILED
                raise GenerationFailed(msg.reason, 503, code="gateway_stopping")
            if msg.request_id != req.request_id:
                continue  # an earlier attempt's message, queued before it was given up
            if isinstance(msg, NextToken):
                out = self._count(req, msg.token_id, msg.logprob, msg.top_logprobs, None)
                if not self._all_counted(req):
                    return out
                last = out  # its RequestFinished follows (in the same frame): stop or length
                continue
            if isinstance(msg, FirstToken):
                if req.num_cached_tokens is None:  # a migrated attempt's prompt is not the client's
                    req.num_cached_tokens = msg.num_cached_tokens
                    req.prompt_logprobs = msg.prompt_logprobs
                await self._on_first_token(req, msg)
                out = self._count(req, msg.token_id, msg.logprob, msg.top_logprobs, msg.finish_reason)
                if out.finish_reason is None and self._all_counted(req):
                    # not from a pdserve worker: a first token that ends the request says why
                    return replace(out, finish_reason="length")
                return out
            if isinstance(msg, KVReserved):
                prefill = req.route.prefill
                assert prefill is not None
                prefill.unsent.discard(req.request_id)
                req.phase = RequestPhase.PREFILLING
                att = req.attempt
                await self._hold_and_send(req, prefill, PrefillRequest(
                    request_id=att.request_id, prompt_token_ids=att.prompt_token_ids,
                    sampling=att.sampling, kv_handle=msg.kv_handle, decode_worker_id=msg.worker_id,
                    expected_cached_tokens=req.route.prefix_tokens()))
            elif isinstance(msg, RequestFinished):
                self._drop_holder(req, msg.worker_id)
                return self._ended(last, msg.finish_reason)
            elif isinstance(msg, RequestFailed) and msg.kind == "structured_output":
                # the request's own grammar rejected the model's token: any worker would fail it alike
                self._drop_holder(req, msg.worker_id)
                req.phase = RequestPhase.FAILED
                log_event(log, "request_not_recovered", logging.WARNING, request_id=req.request_id,
                          worker_id=msg.worker_id, cause="failed", kind="structured_output",
                          reason=msg.error)
                raise GenerationFailed(msg.error, 400,
                                       req.inp.structured_param or "structured_output",
                                       "structured_output_failed")
            elif isinstance(msg, (RequestFailed, WorkerLost)) and self._all_counted(req):
                self._drop_holder(req, msg.worker_id)
                if msg.worker_id != self._producer(req):
                    continue  # a prefill worker's late KV-send failure: the verdict is not its to give
                # every token is in, only the producing worker's verdict on the last one is missing:
                # nothing to recover, and with no "stop" from it the request was cut at max_tokens
                return self._ended(last, "length")
            elif isinstance(msg, RequestFailed):
                why = f"worker {msg.worker_id} failed: {msg.error}"
                await self._recover(req, msg.worker_id, "failed", why)
            elif isinstance(msg, RequestRejected):  # the request's fault: no retry elsewhere
                self._drop_holder(req, msg.worker_id)
                req.phase = RequestPhase.FAILED
                raise GenerationFailed(msg.error, 400, req.inp.structured_param or msg.param)
            else:
                why = f"worker {msg.worker_id} lost: {msg.reason}"
                await self._recover(req, msg.worker_id, msg.cause, why)

    async def _recover(self, req: GatewayRequest, worker_id: str, cause: FailureCause, message: str) -> None:
        """Route the request again after ``worker_id`` failed its current attempt (``cause``; ``message``
        says how): a retry before the first output token, a migration after it (module docstring).

        Raises:
            GenerationFailed: 502 when the request may not be recovered (its retries or migrations
                spent), 503 when no other worker can take it.
        """
        emitted = len(req.output_ids)
        kind = "migration" if emitted else "retry"
        if emitted:
            refusal = None if req.migrations < self.max_migrations else (
                f"--max-migrations {self.max_migrations} reached")
        else:
            refusal = None if req.retries < self.max_retries else f"--max-retries {self.max_retries} reached"
        if refusal is not None:
            req.phase = RequestPhase.FAILED
            log_event(log, "request_not_recovered", logging.WARNING, request_id=req.request_id,
                      worker_id=worker_id, cause=cause, kind=kind, reason=refusal)
            raise GenerationFailed(f"{message} (no {kind}: {refusal})")
        req.failed_workers.add(worker_id)
        sampling = req.inp.sampling
        if emitted:
            sampling = msgspec.structs.replace(sampling, max_tokens=sampling.max_tokens - emitted,
                                               min_tokens=max(0, sampling.min_tokens - emitted),
                                               output_offset=sampling.output_offset + emitted,
                                               prompt_logprobs=None)  # received with the first token
        prompt = req.inp.prompt_token_ids + req.output_ids
        try:
            route = _computed_prefix(self.router.route(prompt, sampling.max_tokens,
                                                       frozenset(req.failed_workers)), sampling)
        except NoWorkerError as exc:
            req.phase = RequestPhase.FAILED
            log_event(log, "request_not_recovered", logging.WARNING, request_id=req.request_id,
                      worker_id=worker_id, cause=cause, kind=kind, reason=str(exc))
            raise GenerationFailed(f"{message}; no other worker can take the request over: {exc}",
                                   503) from exc
        old_id = req.request_id
        self._retire_attempt(req)
        new_id = self.worker_request_id(self.client_request_id(old_id))
        req.attempt, req.route = Attempt(new_id, prompt, sampling), route
        self.requests[new_id] = req
        if self.admission is not None:  # admitted once: the new attempt queues, and is not judged again
            self.admission.record(new_id, len(prompt), route)
        if emitted:
            req.migrations += 1
            self.metrics.migrations.labels(cause).inc()
        else:
            req.retries += 1
            self.metrics.retries.labels(cause).inc()
        log_event(log, f"request_{kind}", logging.WARNING, request_id=new_id, previous_id=old_id,
                  worker_id=worker_id, cause=cause, error=message, emitted_tokens=emitted, kind=route.kind)
        await self._dispatch(req)

    def _retire_attempt(self, req: GatewayRequest) -> None:
        """Give up the current attempt: its id leaves the live requests (late messages get
        ``AbortRequest``), every holder gets ``AbortRequest`` (in a background task)."""
        old_id = req.request_id
        self.requests.pop(old_id, None)
        self._unroute(req)
        if self.admission is not None:
            self.admission.forget(old_id)
        self._remember_released(old_id)
        for worker_id, identity in list(req.holders.items()):
            self._drop_holder(req, worker_id)
            self._spawn(self._send(identity, AbortRequest(request_id=old_id, reason="request rerouted")))
            log_event(log, "abort_sent", request_id=old_id, worker_id=worker_id)

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
    def stop_requests(self, reason: str) -> int:
        """Fail every request in flight with ``reason`` (``GatewayStopping``: 503 before any output, an
        error event after it; the workers are told to drop each as its handler releases it), and every
        request submitted from now on (``submit_all``: 503, code ``gateway_stopping``). Returns how many
        were in flight."""
        self.stopping = reason
        for req in self.requests.values():
            req.inbox.put_nowait(GatewayStopping(reason))
        return len(self.requests)

    def release(self, req: GatewayRequest) -> None:
        """End the request now (idempotent); aborts go out in a background task, so this is safe inside
        a cancelled scope."""
        if self.requests.pop(req.request_id, None) is None:
            return
        self._unroute(req)
        if self.admission is not None:
            self.admission.forget(req.request_id)
        self._remember_released(req.request_id)
        self._spawn(self._abort_holders(req))

    @staticmethod
    def _unroute(req: GatewayRequest) -> None:
        """The current attempt no longer waits to reach its prefill worker (given up or released)."""
        if req.route.prefill is not None:
            req.route.prefill.unsent.discard(req.request_id)

    def _remember_released(self, request_id: str) -> None:
        self.released[request_id] = None
        while len(self.released) > RECENT_IDS:
            self.released.popitem(last=False)

    async def _abort_holders(self, req: GatewayRequest) -> None:
        self.metrics.in_flight.set(len(self.requests))
        # a finished request still held ended at a stop string ("length" and the workers' own ends drop
        # their holders at ``finish`` / ``RequestFinished``)
        stop_string = req.phase is RequestPhase.FINISHED
        for worker_id, identity in list(req.holders.items()):
            await self._send(identity, AbortRequest(request_id=req.request_id, stop_string=stop_string))
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
            req.inbox.put_nowait(WorkerLost(req.request_id, worker.worker_id, "worker unreachable",
                                            "unreachable"))

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
        if req.route.kind != "disaggregated" or decode is None or msg.finish_reason is not None:
            return
        if not await self._send(decode.identity, DecodeRequest(request_id=req.request_id,
                                                               first_token_id=msg.token_id,
                                                               num_cached_tokens=msg.num_cached_tokens)):
            req.inbox.put_nowait(WorkerLost(req.request_id, decode.worker_id, "worker unreachable",
                                            "unreachable"))

    @staticmethod
    def _count(req: GatewayRequest, token_id: int, logprob: float | None, top: list[TopLogprob] | None,
               worker_reason: FinishReason | None) -> TokenOutput:
        """Count one output token (its arrival time) with ``worker_reason``, the finish reason it comes
        with. The ``max_tokens``-th token ends the request, but its reason is the worker's, which checks
        stop and eos tokens before the length: ``stop`` when that token is a stop token, else ``length``.
        A ``NextToken`` carries no reason: the worker's ``RequestFinished`` that follows it brings it
        (``next_output`` waits for it before returning that token)."""
        req.token_times.append(time.monotonic())
        req.output_ids.append(token_id)
        entry = None if logprob is None else TokenLogprob(
            token_id, logprob, () if top is None else tuple((t.token_id, t.logprob) for t in top))
        return TokenOutput(token_id, entry, worker_reason)

    @staticmethod
    def _ended(last: TokenOutput | None, reason: FinishReason) -> TokenOutput:
        """The end with ``reason``: on ``last`` (the ``max_tokens``-th token, when it waited for the
        worker's verdict), else an end without a token."""
        return TokenOutput(None, None, reason) if last is None else replace(last, finish_reason=reason)

    @staticmethod
    def _producer(req: GatewayRequest) -> str | None:
        """The id of the worker whose tokens the request counts now: its decode worker, else its
        colocated one, else its prefill worker (a one-token request); None before routing."""
        route = req.route
        entry = route.decode or route.colocated or route.prefill
        return None if entry is None else entry.worker_id

    @staticmethod
    def _all_counted(req: GatewayRequest) -> bool:
        """``max_tokens`` output tokens are counted: the request ends with the next worker message."""
        return len(req.output_ids) >= req.inp.sampling.max_tokens

    @staticmethod
    def has_message(req: GatewayRequest) -> bool:
        """True when a worker message for ``req`` is queued: ``next_output`` starts without waiting (when
        that message is the ``max_tokens``-th token it then waits for the worker's verdict, which a worker
        sends in the same frame)."""
        return not req.inbox.empty()

    @staticmethod
    async def _next_message(req: GatewayRequest, deadline: float) -> InboxItem:
        if not req.inbox.empty():  # no timer, no suspension: the queue holds only what was received
            return req.inbox.get_nowait()
        # asyncio.timeout, not asyncio.wait_for: on Python 3.11 wait_for returns the message when the
        # caller is cancelled in the same loop iteration as the message arrives, swallowing the
        # cancellation (a disconnected client's request then ran on to max_tokens with no abort).
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.001)):
                return await req.inbox.get()
        except TimeoutError as exc:
            req.phase = RequestPhase.FAILED
            raise GenerationFailed(f"request timed out after {deadline - req.arrival:.0f} s", 504) from exc

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` as a task kept referenced (in ``_background``) until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _computed_prefix(route: Route, sampling: SamplingParams) -> Route:
    """``route`` with no prefix counted cached on its first-token worker when ``sampling`` asks for prompt
    logprobs: that worker then computes every prompt token (the scheduler does not reuse a prefix for
    them), so its queue, its backlog (``expected_cached_tokens``) and the prefix metrics count none."""
    if sampling.prompt_logprobs is None or not route.prefix_blocks:
        return route
    return replace(route, prefix_blocks=0)
