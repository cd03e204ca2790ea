"""The gateway's request state machine (gateway/orchestrator.py) without processes: a registry with one
prefill worker ``p1`` and one decode worker ``d1``, worker messages put in by hand, a send that records
what the gateway sends. Each test ends with the leak check: nothing in flight, no worker holding a request.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.sampling_params import SamplingParams
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.orchestrator import Orchestrator
from gateway.prefix_index import PrefixIndex
from gateway.registry import WorkerRegistry
from gateway.request_state import (
    GatewayRequest,
    GenerationFailed,
    GenerationInput,
    RequestPhase,
    TokenLogprob,
)
from gateway.router import Router
from kvtransfer.compat import KVCompat
from protocol.messages import (
    AbortRequest,
    DecodeRequest,
    FirstToken,
    KVReserved,
    Message,
    NextToken,
    PrefillRequest,
    RegisterWorker,
    RequestFailed,
    RequestFinished,
    ReserveKV,
    TopLogprob,
)

COMPAT = KVCompat(dtype="float32", block_size=4, transfer_backend="loopback")
P1_SENDER_EPOCH = 7001  # p1's KV sender epoch, from its registration


class Recorder:
    """Stands in for the control socket: ``(worker zmq identity, message)`` of every send."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Message]] = []

    async def send(self, identity: bytes, msg: Message) -> bool:
        self.sent.append((identity, msg))
        return True

    def take(self) -> list[tuple[bytes, str]]:
        out = [(identity, type(msg).__name__) for identity, msg in self.sent]
        self.sent.clear()
        return out


@pytest.fixture
def setup() -> tuple[Orchestrator, Recorder, WorkerRegistry, GatewayMetrics]:
    registry = WorkerRegistry(heartbeat_timeout=5.0)
    for role, wid in (("prefill", "p1"), ("decode", "d1")):
        registry.register(RegisterWorker(role=role, worker_id=wid, epoch=1, model="m", model_path="",
                                         compat=COMPAT, kv_sender_epoch=P1_SENDER_EPOCH if role == "prefill"
                                         else 0), wid.encode())
    rec, metrics = Recorder(), GatewayMetrics()
    orch = Orchestrator(Router(registry, PrefixIndex()), metrics, rec.send, max_queue=4, request_timeout=0.5)
    return orch, rec, registry, metrics


def generation(rid: str = "r", max_tokens: int = 3, **sampling: object) -> GenerationInput:
    return GenerationInput(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens, **sampling))  # type: ignore[arg-type]


async def to_decoding(orch: Orchestrator, rec: Recorder, req: GatewayRequest) -> None:
    """Steps 1-3: ReserveKV out, KVReserved in → PrefillRequest out, FirstToken in → DecodeRequest out."""
    assert rec.take() == [(b"d1", "ReserveKV")] and req.phase is RequestPhase.RESERVING_KV
    await orch.on_worker_message(b"d1", KVReserved(request_id="r", worker_id="d1", kv_handle=b"kv"))
    await orch.on_worker_message(b"p1", FirstToken(request_id="r", worker_id="p1", token_id=7, logprob=-0.5,
                                                    top_logprobs=[TopLogprob(7, -0.5), TopLogprob(8, -1.5)]))
    out = await orch.next_output(req)
    want = TokenLogprob(7, -0.5, ((7, -0.5), (8, -1.5)))
    assert (out.token_id, out.logprob, out.finish_reason) == (7, want, None)
    sent = rec.sent[:]
    assert rec.take() == [(b"p1", "PrefillRequest"), (b"d1", "DecodeRequest")]
    prefill, decode = sent[0][1], sent[1][1]
    assert isinstance(prefill, PrefillRequest) and prefill.kv_handle == b"kv"
    assert prefill.decode_worker_id == "d1"
    assert isinstance(decode, DecodeRequest) and decode.first_token_id == 7
    assert req.phase is RequestPhase.DECODING and set(req.holders) == {"d1"}  # prefill is done


def assert_clean(orch: Orchestrator, registry: WorkerRegistry) -> None:
    assert not orch.requests
    assert all(not w.requests and not w.unsent for w in registry.live())


async def test_disaggregated_to_max_tokens_needs_no_abort(setup) -> None:
    orch, rec, registry, metrics = setup
    req = await orch.submit(generation())
    reserve = rec.sent[0][1]
    assert isinstance(reserve, ReserveKV) and reserve.prefill_worker_id == "p1"
    assert reserve.prefill_sender_epoch == P1_SENDER_EPOCH  # the decode worker admits only this incarnation
    await to_decoding(orch, rec, req)
    for tok in (8, 9):
        await orch.on_worker_message(b"d1", NextToken(request_id="r", worker_id="d1", token_id=tok))
    await orch.on_worker_message(b"d1", RequestFinished(request_id="r", worker_id="d1",
                                                        finish_reason="length", num_prompt_tokens=5,
                                                        num_output_tokens=3))
    assert [(o.token_id, o.finish_reason) for o in [await orch.next_output(req) for _ in range(2)]] == [
        (8, None), (9, "length")]  # the reason of the max_tokens-th token is the worker's
    orch.finish(req, "length")
    assert req.phase is RequestPhase.FINISHED and req.holders == {}  # d1 stops at max_tokens by itself
    orch.release(req)
    await asyncio.sleep(0)
    assert rec.take() == [] and len(req.token_times) == 3
    count = next(s.value for s in metrics.ttft.collect()[0].samples if s.name == "pdserve_ttft_seconds_count")
    assert count == 1
    assert_clean(orch, registry)


async def test_reserve_names_the_kv_sender_epoch_of_the_prefill_workers_latest_registration(setup) -> None:
    """A restarted prefill worker registers a new epoch with a new KV sender epoch: the next ReserveKV
    names that one, so the decode worker refuses the Hellos of the old incarnation from then on."""
    orch, rec, registry, _ = setup
    restarted = RegisterWorker(role="prefill", worker_id="p1", epoch=2, model="m", model_path="",
                               compat=COMPAT,
                               kv_sender_epoch=P1_SENDER_EPOCH + 1)
    old, _ = registry.register(restarted, b"p1-new")
    assert old is not None and old.info.kv_sender_epoch == P1_SENDER_EPOCH
    req = await orch.submit(generation())
    [(ident, reserve)] = rec.sent
    assert ident == b"d1" and isinstance(reserve, ReserveKV)
    assert (reserve.prefill_worker_id, reserve.prefill_sender_epoch) == ("p1", P1_SENDER_EPOCH + 1)
    rec.take()
    orch.release(req)  # the client went away: the decode worker's reservation is aborted
    await asyncio.sleep(0)
    [(_, abort)] = rec.sent
    assert rec.take() == [(b"d1", "AbortRequest")]
    assert isinstance(abort, AbortRequest) and not abort.stop_string  # an abort, not a stop
    assert_clean(orch, registry)


async def test_stop_string_aborts_the_decode_worker(setup) -> None:
    orch, rec, registry, _ = setup
    req = await orch.submit(generation(max_tokens=10))
    await to_decoding(orch, rec, req)
    orch.finish(req, "stop")  # the stream matched a stop string
    orch.release(req)
    await asyncio.sleep(0)
    [(_, abort)] = rec.sent
    assert rec.take() == [(b"d1", "AbortRequest")]
    assert isinstance(abort, AbortRequest) and abort.stop_string  # d1 counts it finished (stop)
    assert_clean(orch, registry)


async def test_an_eos_that_is_the_max_tokens_th_token_is_a_stop(setup) -> None:
    orch, rec, registry, _ = setup
    req = await orch.submit(generation())  # max_tokens 3
    await to_decoding(orch, rec, req)
    await orch.on_worker_message(b"d1", NextToken(request_id="r", worker_id="d1", token_id=8))
    await orch.on_worker_message(b"d1", NextToken(request_id="r", worker_id="d1", token_id=2))  # an eos
    await orch.on_worker_message(b"d1", RequestFinished(request_id="r", worker_id="d1", finish_reason="stop",
                                                        num_prompt_tokens=5, num_output_tokens=3))
    outs = [await orch.next_output(req) for _ in range(2)]
    assert [(o.token_id, o.finish_reason) for o in outs] == [(8, None), (2, "stop")]
    assert req.holders == {}  # d1 said it is done
    orch.finish(req, "stop")
    orch.release(req)
    await asyncio.sleep(0)
    assert rec.take() == [] and len(req.token_times) == 3
    assert_clean(orch, registry)


@pytest.mark.parametrize(("reason", "want"), [("stop", "stop"), ("length", "length"),
                                              (None, "length")])  # None: no pdserve worker sends it
async def test_max_tokens_one_takes_the_workers_reason(setup, reason: str | None, want: str) -> None:
    orch, rec, registry, _ = setup
    req = await orch.submit(generation(max_tokens=1))
    rec.take()
    await orch.on_worker_message(b"p1", FirstToken(request_id="r", worker_id="p1", token_id=2,
                                                    finish_reason=reason))  # type: ignore[arg-type]
    out = await orch.next_output(req)
    assert (out.token_id, out.finish_reason) == (2, want)
    orch.finish(req, out.finish_reason)
    orch.release(req)
    await asyncio.sleep(0)
    assert rec.take() == []
    assert_clean(orch, registry)


@pytest.mark.parametrize("failure", ["failed", "lost"])
async def test_a_worker_gone_after_the_last_token_ends_the_request_at_length(setup, failure: str) -> None:
    orch, rec, registry, _ = setup
    req = await orch.submit(generation())  # max_tokens 3
    await to_decoding(orch, rec, req)
    for tok in (8, 9):
        await orch.on_worker_message(b"d1", NextToken(request_id="r", worker_id="d1", token_id=tok))
    if failure == "failed":
        await orch.on_worker_message(b"d1", RequestFailed(request_id="r", worker_id="d1", error="boom"))
    else:
        entry = registry.remove("d1")
        assert entry is not None
        orch.worker_lost(entry, "gone")
    outs = [await orch.next_output(req) for _ in range(2)]
    assert [(o.token_id, o.finish_reason) for o in outs] == [(8, None), (9, "length")]
    assert req.migrations == 0 and req.holders == {}  # every token is in: nothing to migrate
    orch.finish(req, "length")
    orch.release(req)
    await asyncio.sleep(0.01)
    assert [name for _, name in rec.take()] == ([] if failure == "failed" else ["AbortRequest"])
    assert_clean(orch, registry)


async def test_a_prefill_workers_late_failure_does_not_decide_the_last_tokens_reason(setup) -> None:
    """The prefill worker reports a failed KV send after its first token: once every token is counted that
    is not the decode worker's verdict, whose RequestFinished (stop) still decides."""
    orch, rec, registry, _ = setup
    req = await orch.submit(generation())  # max_tokens 3
    await to_decoding(orch, rec, req)
    for tok in (8, 2):
        await orch.on_worker_message(b"d1", NextToken(request_id="r", worker_id="d1", token_id=tok))
    await orch.on_worker_message(b"p1", RequestFailed(request_id="r", worker_id="p1", error="KV send failed"))
    await orch.on_worker_message(b"d1", RequestFinished(request_id="r", worker_id="d1", finish_reason="stop",
                                                        num_prompt_tokens=5, num_output_tokens=3))
    outs = [await orch.next_output(req) for _ in range(2)]
    assert [(o.token_id, o.finish_reason) for o in outs] == [(8, None), (2, "stop")]
    assert req.holders == {}
    orch.finish(req, "stop")
    orch.release(req)
    await asyncio.sleep(0)
    assert rec.take() == []
    assert_clean(orch, registry)


async def test_max_tokens_one_is_prefill_only(setup) -> None:
    orch, rec, registry, _ = setup
    req = await orch.submit(generation(max_tokens=1))
    sent = rec.sent[0][1]
    assert isinstance(sent, PrefillRequest) and sent.kv_handle is None
    assert req.phase is RequestPhase.PREFILLING
    rec.take()
    await orch.on_worker_message(b"p1", FirstToken(request_id="r", worker_id="p1", token_id=7,
                                                    finish_reason="length"))
    out = await orch.next_output(req)
    assert (out.token_id, out.finish_reason) == (7, "length") and rec.take() == []  # no DecodeRequest
    orch.finish(req, "length")
    orch.release(req)
    await asyncio.sleep(0)
    assert rec.take() == []
    assert_clean(orch, registry)


async def test_worker_finish_without_token(setup) -> None:
    orch, rec, registry, _ = setup
    req = await orch.submit(generation(max_tokens=10))
    await to_decoding(orch, rec, req)
    await orch.on_worker_message(b"d1", RequestFinished(request_id="r", worker_id="d1", finish_reason="stop",
                                                        num_prompt_tokens=5, num_output_tokens=1))
    out = await orch.next_output(req)
    assert (out.token_id, out.finish_reason) == (None, "stop") and req.holders == {}
    orch.finish(req, "stop")
    orch.release(req)
    await asyncio.sleep(0)
    assert rec.take() == []
    assert_clean(orch, registry)


# failure → (GenerationFailed message, its HTTP status, what is sent after it: the failed or lost worker
# is told to drop the request (a lost one may only have stalled); after a timeout d1 still holds it and
# release aborts it). With no other decode worker, a failure or loss cannot be recovered: 503.
ABORT_D1 = [(b"d1", "AbortRequest")]
FAILURES = {"failed": ("worker d1 failed: boom", 503, ABORT_D1),
            "lost": ("worker d1 lost: gone", 503, ABORT_D1),
            "aborted": ("the worker aborted the request", 502, []), "timeout": ("timed out", 504, ABORT_D1)}


@pytest.mark.parametrize("failure", sorted(FAILURES))
async def test_failures_raise_and_release_aborts_the_rest(setup, failure: str) -> None:
    orch, rec, registry, _ = setup
    req = await orch.submit(generation(max_tokens=10))
    await to_decoding(orch, rec, req)
    if failure == "failed":
        await orch.on_worker_message(b"d1", RequestFailed(request_id="r", worker_id="d1", error="boom"))
    elif failure == "lost":
        entry = registry.remove("d1")
        assert entry is not None
        orch.worker_lost(entry, "gone")
    elif failure == "aborted":
        await orch.on_worker_message(b"d1", RequestFinished(request_id="r", worker_id="d1",
                                                            finish_reason="abort", num_prompt_tokens=5,
                                                            num_output_tokens=1))
    message, status, then_sent = FAILURES[failure]
    with pytest.raises(GenerationFailed, match=message) as err:
        out = await orch.next_output(req)
        assert out.finish_reason == "abort"  # only a worker's abort gets this far
        orch.finish(req, "abort")
    assert err.value.status == status and err.value.api_error().status == status
    assert req.phase is RequestPhase.FAILED
    orch.release(req)
    await asyncio.sleep(0.01)
    assert rec.take() == then_sent
    assert_clean(orch, registry)


async def test_messages_for_unknown_requests(setup) -> None:
    orch, rec, _, _ = setup
    await orch.on_worker_message(b"d1", NextToken(request_id="gone", worker_id="d1", token_id=1))
    await orch.on_worker_message(b"d1", RequestFinished(request_id="gone", worker_id="d1",
                                                        finish_reason="stop", num_prompt_tokens=1,
                                                        num_output_tokens=1))
    await orch.on_worker_message(b"d1", RequestFailed(request_id="gone", worker_id="d1", error="x"))
    sent = rec.sent[:]
    assert rec.take() == [(b"d1", "AbortRequest")]
    assert isinstance(sent[0][1], AbortRequest) and sent[0][1].reason == "unknown request"


async def test_queue_full_and_duplicate_ids(setup) -> None:
    orch, _, registry, _ = setup
    reqs = await orch.submit_all("a", [generation(f"a-{i}") for i in range(3)])
    assert [r.request_id for r in reqs] == ["a-0", "a-1", "a-2"]
    with pytest.raises(APIError, match="already in flight") as dup:
        await orch.submit_all("a", [generation("a-1")])
    with pytest.raises(APIError, match="Too many requests") as full:
        await orch.submit_all("b", [generation("b-0"), generation("b-1")])
    assert (dup.value.status, full.value.status) == (400, 429) and len(orch.requests) == 3
    for r in reqs:
        orch.release(r)
    await asyncio.sleep(0.01)
    assert_clean(orch, registry)


@pytest.mark.parametrize("arriving", [1, 5])
async def test_cancel_as_a_token_arrives_ends_the_wait(setup, arriving: int) -> None:
    """The client disconnects (its handler task is cancelled) in the same loop iteration as tokens
    arrive: the wait ends with the cancellation, not with a token, and release aborts the decode worker.
    Swallowing the cancellation would let the request run on to max_tokens for nobody."""
    orch, rec, registry, _ = setup
    req = await orch.submit(generation(max_tokens=100))
    await to_decoding(orch, rec, req)
    waiter = asyncio.get_running_loop().create_task(orch.next_output(req))
    await asyncio.sleep(0)  # the task now waits on the request's inbox
    for tok in range(arriving):
        await orch.on_worker_message(b"d1", NextToken(request_id="r", worker_id="d1", token_id=10 + tok))
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert req.inbox.qsize() == arriving  # nothing was taken by the cancelled wait
    orch.release(req)
    await asyncio.sleep(0)
    assert rec.take() == [(b"d1", "AbortRequest")]
    assert_clean(orch, registry)


async def test_requests_arriving_together_spread_over_the_prefill_workers(setup) -> None:
    """Each request counts against its prefill worker from routing on, not from the PrefillRequest sent
    once the decode worker has reserved KV: while d1 reserves, the next prompt goes to the idle p2."""
    orch, rec, registry, _ = setup
    registry.register(RegisterWorker(role="prefill", worker_id="p2", epoch=1, model="m", model_path="",
                                     compat=COMPAT), b"p2")
    reqs = [await orch.submit(GenerationInput(f"r{i}", [10 * i + j for j in range(1, 6)],
                                              SamplingParams(max_tokens=3))) for i in range(4)]
    chosen = [m.prefill_worker_id for _, m in rec.sent if isinstance(m, ReserveKV)]
    assert chosen == ["p1", "p2", "p1", "p2"]
    p1, p2 = registry.get("p1"), registry.get("p2")
    assert p1 is not None and p2 is not None
    assert (p1.unsent, p2.unsent) == ({"r0", "r2"}, {"r1", "r3"}) and p1.load_score() == 2
    rec.take()
    await orch.on_worker_message(b"d1", KVReserved(request_id="r0", worker_id="d1", kv_handle=b"kv"))
    task = asyncio.create_task(orch.next_output(reqs[0]))
    await asyncio.sleep(0.01)
    assert rec.take() == [(b"p1", "PrefillRequest")]  # r0 moves from routed to held on p1
    assert p1.unsent == {"r2"} and p1.requests == {"r0"} and p1.load_score() == 2
    task.cancel()
    for req in reqs:
        orch.release(req)
    await asyncio.sleep(0.01)
    assert_clean(orch, registry)


async def test_stop_requests_fails_those_in_flight_and_refuses_new_ones(setup) -> None:
    """The end of a drain (gateway/server.py): a decoding request and one still reserving KV each fail
    with the reason (503, code ``gateway_stopping``) and their workers are told to drop them; a request
    submitted afterwards (its handler was still reading its body) is refused the same way, not run."""
    orch, rec, registry, _ = setup
    req = await orch.submit(generation())
    await to_decoding(orch, rec, req)
    waiting = await orch.submit(generation("w"))
    assert rec.take() == [(b"d1", "ReserveKV")]
    assert orch.stop_requests("the gateway is shutting down (test)") == 2
    for r in (req, waiting):
        with pytest.raises(GenerationFailed) as info:
            await orch.next_output(r)
        err = info.value.api_error()
        assert (err.status, err.code) == (503, "gateway_stopping")
        assert err.message == "the gateway is shutting down (test)"
        assert r.phase is RequestPhase.FAILED
        orch.release(r)
    await asyncio.sleep(0)
    assert sorted(rec.take()) == [(b"d1", "AbortRequest"), (b"d1", "AbortRequest")]
    with pytest.raises(APIError) as refused:
        await orch.submit_all("late", [generation("late")])
    assert (refused.value.status, refused.value.code) == (503, "gateway_stopping")
    assert int(refused.value.headers["Retry-After"]) >= 1
    assert rec.take() == []
    assert_clean(orch, registry)
