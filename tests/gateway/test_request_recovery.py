"""Retries and migrations in the gateway's request state machine (gateway/orchestrator.py), without
processes: a registry with one prefill worker ``p1`` and two decode workers ``d1`` (chosen first) and
``d2``, worker messages put in by hand, a send that records what the gateway sends. Each test ends with
the leak check: nothing in flight, no worker holding a request.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.sampling_params import SamplingParams
from gateway.metrics import GatewayMetrics
from gateway.orchestrator import Orchestrator
from gateway.prefix_index import PrefixIndex
from gateway.registry import WorkerRegistry
from gateway.request_state import GatewayRequest, GenerationFailed, GenerationInput
from gateway.router import Router
from protocol.messages import (
    AbortRequest,
    DecodeRequest,
    FirstToken,
    KVReserved,
    NextToken,
    PrefillRequest,
    RegisterWorker,
    RequestFailed,
    RequestFinished,
    ReserveKV,
)
from tests.gateway.test_orchestrator import COMPAT, Recorder, assert_clean

PROMPT = [1, 2, 3, 4, 5]
REPLY = [7, 8, 9, 10, 11, 12]


def make(max_retries: int = 2, max_migrations: int = 1, decodes: tuple[str, ...] = ("d1", "d2"),
         prefills: tuple[str, ...] = ("p1",),
         ) -> tuple[Orchestrator, Recorder, WorkerRegistry, GatewayMetrics]:
    registry = WorkerRegistry(heartbeat_timeout=5.0)
    for role, wid in (*(("prefill", p) for p in prefills), *(("decode", d) for d in decodes)):
        registry.register(RegisterWorker(role=role, worker_id=wid, epoch=1, model="m", model_path="",
                                         compat=COMPAT), wid.encode())
    rec, metrics = Recorder(), GatewayMetrics()
    orch = Orchestrator(Router(registry, PrefixIndex()), metrics, rec.send, max_queue=4, request_timeout=2.0,
                        max_retries=max_retries, max_migrations=max_migrations)
    return orch, rec, registry, metrics


def counter(metrics: GatewayMetrics, name: str, cause: str) -> float:
    family = {"retries": metrics.retries, "migrations": metrics.migrations}[name]
    return next((s.value for s in family.collect()[0].samples
                 if s.name.endswith("_total") and s.labels["cause"] == cause), 0.0)


async def serve_from(orch: Orchestrator, rec: Recorder, req: GatewayRequest, decode: str, pos: int,
                     max_tokens: int) -> list[int]:
    """Play a healthy ``decode`` + p1 from output position ``pos`` to ``max_tokens`` (ending, as a worker
    does, with ``RequestFinished``); the tokens counted."""
    sent = dict((type(m).__name__, m) for _, m in rec.sent)
    rid = req.request_id
    assert isinstance(sent["ReserveKV"], ReserveKV) and sent["ReserveKV"].request_id == rid
    wid = decode.encode()
    await orch.on_worker_message(wid, KVReserved(request_id=rid, worker_id=decode, kv_handle=b"kv"))
    await orch.on_worker_message(b"p1", FirstToken(request_id=rid, worker_id="p1", token_id=REPLY[pos]))
    for tok in REPLY[pos + 1:max_tokens]:
        await orch.on_worker_message(wid, NextToken(request_id=rid, worker_id=decode, token_id=tok))
    end = RequestFinished(request_id=rid, worker_id=decode, finish_reason="length",
                          num_prompt_tokens=len(PROMPT) + pos, num_output_tokens=max_tokens - pos)
    await orch.on_worker_message(wid, end)
    out = []
    while True:
        o = await orch.next_output(req)
        assert o.token_id is not None
        out.append(o.token_id)
        if o.finish_reason is not None:
            orch.finish(req, o.finish_reason)
            return out


async def test_failure_before_first_token_is_retried_on_the_other_decode() -> None:
    orch, rec, registry, metrics = make()
    req = await orch.submit(GenerationInput("r", PROMPT, SamplingParams(max_tokens=4)))
    assert rec.take() == [(b"d1", "ReserveKV")]
    await orch.on_worker_message(b"d1", RequestFailed(request_id="r", worker_id="d1",
                                                      error="no free KV blocks"))
    task = asyncio.create_task(orch.next_output(req))
    await asyncio.sleep(0.01)
    assert req.request_id == "r~1" and req.retries == 1 and req.failed_workers == {"d1"}
    sent = rec.sent[:]
    assert sorted((i, type(m).__name__, m.request_id) for i, m in sent) == [  # type: ignore[attr-defined]
        (b"d1", "AbortRequest", "r"), (b"d2", "ReserveKV", "r~1")]
    reserve = next(m for _, m in sent if isinstance(m, ReserveKV))
    assert isinstance(reserve, ReserveKV) and reserve.prompt_token_ids == PROMPT
    assert reserve.sampling.max_tokens == 4
    task.cancel()
    assert await serve_from(orch, rec, req, "d2", 0, 4) == REPLY[:4]
    assert counter(metrics, "retries", "failed") == 1
    # a late message of the failed attempt is answered with an abort, never counted
    rec.take()
    await orch.on_worker_message(b"d1", NextToken(request_id="r", worker_id="d1", token_id=99))
    assert rec.take() == [(b"d1", "AbortRequest")]
    orch.release(req)
    await asyncio.sleep(0.01)
    assert_clean(orch, registry)


async def test_retries_are_bounded_then_503_without_another_pair() -> None:
    orch, rec, registry, metrics = make(max_retries=0)
    req = await orch.submit(GenerationInput("r", PROMPT, SamplingParams(max_tokens=4)))
    await orch.on_worker_message(b"d1", RequestFailed(request_id="r", worker_id="d1", error="boom"))
    with pytest.raises(GenerationFailed, match="no retry: --max-retries 0") as err:
        await orch.next_output(req)
    assert err.value.status == 502 and counter(metrics, "retries", "failed") == 0
    orch.release(req)
    await asyncio.sleep(0.01)
    assert (b"d1", "AbortRequest") in rec.take()
    assert_clean(orch, registry)
    orch, rec, registry, _ = make(decodes=("d1",))
    req = await orch.submit(GenerationInput("r", PROMPT, SamplingParams(max_tokens=4)))
    entry = registry.remove("d1")
    assert entry is not None
    orch.worker_lost(entry, "gone")
    with pytest.raises(GenerationFailed, match="no other worker") as err:
        await orch.next_output(req)
    assert err.value.status == 503 and err.value.api_error().headers["Retry-After"] == "1"
    orch.release(req)
    await asyncio.sleep(0.01)
    assert_clean(orch, registry)


async def decoding_on_d1(orch: Orchestrator, rec: Recorder, req: GatewayRequest, k: int) -> list[int]:
    """Serve ``k`` tokens of the request from p1 + d1; returns them."""
    await orch.on_worker_message(b"d1", KVReserved(request_id="r", worker_id="d1", kv_handle=b"kv"))
    await orch.on_worker_message(b"p1", FirstToken(request_id="r", worker_id="p1", token_id=REPLY[0]))
    for tok in REPLY[1:k]:
        await orch.on_worker_message(b"d1", NextToken(request_id="r", worker_id="d1", token_id=tok))
    got = [(await orch.next_output(req)).token_id for _ in range(k)]
    assert [type(m).__name__ for _, m in rec.sent] == ["ReserveKV", "PrefillRequest", "DecodeRequest"]
    rec.take()
    return [t for t in got if t is not None]


@pytest.mark.parametrize("cause", ["lost", "failed"])
async def test_decode_failing_mid_stream_migrates_with_the_streamed_tokens(cause: str) -> None:
    orch, rec, registry, metrics = make()
    req = await orch.submit(GenerationInput("r", PROMPT, SamplingParams(max_tokens=6, min_tokens=4,
                                                                         temperature=0)))
    got = await decoding_on_d1(orch, rec, req, 3)
    if cause == "lost":
        entry = registry.remove("d1")
        assert entry is not None
        orch.worker_lost(entry, "killed")
    else:
        await orch.on_worker_message(b"d1", RequestFailed(request_id="r", worker_id="d1", error="boom"))
    task = asyncio.create_task(orch.next_output(req))
    await asyncio.sleep(0.01)
    sent = rec.sent[:]
    assert sorted((i, type(m).__name__) for i, m in sent) == [(b"d1", "AbortRequest"), (b"d2", "ReserveKV")]
    reserve = next(m for _, m in sent if isinstance(m, ReserveKV))
    assert reserve.request_id == "r~1" and reserve.prompt_token_ids == PROMPT + REPLY[:3]
    s = reserve.sampling
    assert (s.max_tokens, s.min_tokens, s.output_offset, s.temperature) == (3, 1, 3, 0)
    abort = next(m for _, m in sent if isinstance(m, AbortRequest))
    assert abort.request_id == "r"
    task.cancel()
    got += await serve_from(orch, rec, req, "d2", 3, 6)
    assert got == REPLY and len(req.token_times) == 6  # no gap, no repeat; usage stays the client's
    assert req.migrations == 1 and counter(metrics, "migrations", cause) == 1
    assert counter(metrics, "retries", cause) == 0
    prefill = next(m for _, m in rec.sent if isinstance(m, PrefillRequest))
    decode = next(m for _, m in rec.sent if isinstance(m, DecodeRequest))
    assert prefill.prompt_token_ids == PROMPT + REPLY[:3] and decode.first_token_id == REPLY[3]
    orch.release(req)
    await asyncio.sleep(0.01)
    assert_clean(orch, registry)


@pytest.mark.parametrize("max_migrations", [0, 1])
async def test_migrations_are_bounded(max_migrations: int) -> None:
    orch, rec, registry, metrics = make(max_migrations=max_migrations, decodes=("d1", "d2", "d3"))
    sampling = SamplingParams(max_tokens=6, temperature=0.8, seed=3)
    req = await orch.submit(GenerationInput("r", PROMPT, sampling))
    await decoding_on_d1(orch, rec, req, 2)
    await orch.on_worker_message(b"d1", RequestFailed(request_id="r", worker_id="d1", error="boom"))
    if max_migrations:  # the first migration goes to d2 (seeded: output_offset carries the position)
        task = asyncio.create_task(orch.next_output(req))
        await asyncio.sleep(0.01)
        task.cancel()
        reserve = next(m for _, m in rec.sent if isinstance(m, ReserveKV))
        assert (reserve.sampling.seed, reserve.sampling.output_offset) == (3, 2)
        rec.take()
        await orch.on_worker_message(b"d2", RequestFailed(request_id="r~1", worker_id="d2", error="boom"))
    refused = f"failed: boom \\(no migration: --max-migrations {max_migrations}"
    with pytest.raises(GenerationFailed, match=refused) as err:
        await orch.next_output(req)
    assert err.value.status == 502 and counter(metrics, "migrations", "failed") == max_migrations
    orch.release(req)
    await asyncio.sleep(0.01)
    assert rec.take() == [(b"d2" if max_migrations else b"d1", "AbortRequest")]
    assert_clean(orch, registry)


async def test_unreachable_decode_is_retried() -> None:
    orch, rec, registry, metrics = make()

    async def send(identity: bytes, msg: object) -> bool:
        rec.sent.append((identity, msg))  # type: ignore[arg-type]
        return identity != b"d1"

    orch._send = send
    req = await orch.submit(GenerationInput("r", PROMPT, SamplingParams(max_tokens=3)))
    task = asyncio.create_task(orch.next_output(req))
    await asyncio.sleep(0.01)
    assert req.request_id == "r~1" and counter(metrics, "retries", "unreachable") == 1
    task.cancel()
    assert await serve_from(orch, rec, req, "d2", 0, 3) == REPLY[:3]
    orch.release(req)
    await asyncio.sleep(0.01)
    assert_clean(orch, registry)


async def test_a_retried_attempt_queues_once_in_admission() -> None:
    """The attempt a worker failed leaves the admission queue (else the estimate grew with every retry
    until it refused everything) and the new attempt takes its place: it queues on its prefill worker,
    its blocks count against its new decode worker, and its FirstToken measures the prefill rate (a
    retry not counted made the queue look shorter than it was)."""
    from gateway.admission import Admission

    orch, rec, registry, metrics = make()
    orch.admission = Admission(registry, 30.0, metrics)
    req = await orch.submit(GenerationInput("r", PROMPT, SamplingParams(max_tokens=4)))
    assert orch.admission.queued_tokens("p1") == len(PROMPT)
    d2 = registry.get("d2")
    assert d2 is not None and orch.admission.free_blocks(d2) == 0
    rec.take()
    await orch.on_worker_message(b"d1", RequestFailed(request_id="r", worker_id="d1", error="gone"))
    with pytest.raises(asyncio.TimeoutError):  # the retry went out; no worker answers it here
        await asyncio.wait_for(orch.next_output(req), 0.2)
    assert req.request_id == "r~1" and req.route.decode is d2
    assert orch.admission.queued_tokens("p1") == len(PROMPT)  # the new attempt only
    blocks = -(-len(PROMPT) // COMPAT.block_size)
    assert orch.admission.free_blocks(d2) == -blocks  # routed to d2 since its last heartbeat
    await orch.on_worker_message(b"p1", FirstToken(request_id="r~1", worker_id="p1", token_id=7))
    assert orch.admission.queued_tokens("p1") == 0 and "p1" in orch.admission.rates
    orch.release(req)
    await asyncio.sleep(0)
    assert orch.admission.queued_tokens("p1") == 0 and not orch.admission._routed


@pytest.mark.parametrize("emitted", [0, 2])
async def test_grammar_rejection_is_not_recovered(emitted: int) -> None:
    """``RequestFailed`` of kind ``structured_output`` (the request's grammar rejected the model's token)
    before any token or after ``emitted`` tokens: ``GenerationFailed`` 400 naming the request's field, no
    retry or migration, no other worker asked; the rest of the request's holders get ``AbortRequest``."""
    orch, rec, registry, metrics = make()
    req = await orch.submit(GenerationInput("r", PROMPT, SamplingParams(max_tokens=6),
                                            structured_param="response_format"))
    if emitted:
        assert await decoding_on_d1(orch, rec, req, emitted) == REPLY[:emitted]
    else:  # the prefill worker's first token is rejected
        await orch.on_worker_message(b"d1", KVReserved(request_id="r", worker_id="d1", kv_handle=b"kv"))
    failer = b"d1" if emitted else b"p1"
    await orch.on_worker_message(failer, RequestFailed(request_id="r", worker_id=failer.decode(),
                                                       error="grammar rejected token 9",
                                                       kind="structured_output"))
    with pytest.raises(GenerationFailed, match=r"^grammar rejected token 9") as err:
        await orch.next_output(req)
    assert (err.value.status, err.value.param, err.value.code) == (400, "response_format",
                                                                    "structured_output_failed")
    body = err.value.api_error().body()
    assert (body.error.type, body.error.param, body.error.code) == (
        "invalid_request_error", "response_format", "structured_output_failed")
    assert req.request_id == "r" and req.retries == 0 and req.migrations == 0 and not req.failed_workers
    assert counter(metrics, "retries", "failed") == 0 and counter(metrics, "migrations", "failed") == 0
    assert rec.take() == ([] if emitted else [(b"d1", "ReserveKV"), (b"p1", "PrefillRequest")])
    orch.release(req)
    await asyncio.sleep(0.01)
    # before the first token d1 still holds the reserved KV: it gets the abort; the failing worker does not
    assert rec.take() == ([] if emitted else [(b"d1", "AbortRequest")])
    assert_clean(orch, registry)


async def test_prefill_lost_while_the_decode_reserves_is_retried_at_once() -> None:
    """A prefill worker lost before its PrefillRequest went out: the request is routed again at once
    (not after d1's reservation, to a worker that is gone), d1's reservation for the old attempt is
    aborted, and p1 gets no abort for a request it never received."""
    orch, rec, registry, metrics = make(decodes=("d1",), prefills=("p1", "p2"))
    req = await orch.submit(GenerationInput("r", PROMPT, SamplingParams(max_tokens=2)))
    [(_, reserve)] = rec.sent
    assert isinstance(reserve, ReserveKV) and reserve.prefill_worker_id == "p1"
    rec.take()
    p1 = registry.remove("p1")
    assert p1 is not None and p1.unsent == {"r"}
    orch.worker_lost(p1, "heartbeat timeout")
    task = asyncio.create_task(orch.next_output(req))
    await asyncio.sleep(0.01)
    sent = [(ident, m) for ident, m in rec.sent]
    rec.take()
    assert [(ident, type(m).__name__, m.request_id) for ident, m in sent] == [
        (b"d1", "ReserveKV", req.request_id), (b"d1", "AbortRequest", "r")]
    assert isinstance(sent[0][1], ReserveKV) and sent[0][1].prefill_worker_id == "p2"
    assert counter(metrics, "retries", "lost") == 1.0
    rid = req.request_id
    await orch.on_worker_message(b"d1", KVReserved(request_id=rid, worker_id="d1", kv_handle=b"kv"))
    await orch.on_worker_message(b"p2", FirstToken(request_id=rid, worker_id="p2", token_id=REPLY[0]))
    await orch.on_worker_message(b"d1", NextToken(request_id=rid, worker_id="d1", token_id=REPLY[1]))
    await orch.on_worker_message(b"d1", RequestFinished(request_id=rid, worker_id="d1",
                                                        finish_reason="length", num_prompt_tokens=len(PROMPT),
                                                        num_output_tokens=2))
    first = await task
    second = await orch.next_output(req)
    assert (first.token_id, second.token_id, second.finish_reason) == (REPLY[0], REPLY[1], "length")
    assert rec.take() == [(b"p2", "PrefillRequest"), (b"d1", "DecodeRequest")]
    orch.finish(req, "length")
    orch.release(req)
    await asyncio.sleep(0)
    assert_clean(orch, registry)
