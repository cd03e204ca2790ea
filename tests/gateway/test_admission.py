"""Admission control (gateway/admission.py) through the orchestrator, without processes: a registry with
prefill ``p1`` and decode workers, loads set by hand (as heartbeats set them), a clock moved by hand.
429s carry Retry-After and are counted by reason; a prompt no worker can hold is a 400. Each test ends
with nothing in flight."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from engine.block_hash import block_hashes
from engine.sampling_params import SamplingParams
from gateway.admission import Admission
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.orchestrator import Orchestrator
from gateway.prefix_index import PrefixIndex
from gateway.registry import WorkerRegistry
from gateway.request_state import GatewayRequest, GenerationInput
from gateway.router import Router
from kvtransfer.compat import KVCompat
from protocol.messages import FirstToken, KVEvents, KVReserved, Message, RegisterWorker, ReserveKV, WorkerLoad
from protocol.settings import GatewaySettings

COMPAT = KVCompat(dtype="float32", block_size=4, transfer_backend="loopback")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Setup:
    def __init__(self, budget_s: float = 2.0, decode_free: tuple[int, ...] = (100,),
                 total: int = 100, first: str = "prefill") -> None:
        """``first``: the role of ``p1``, the first-token worker (``colocated``: no decode workers)."""
        self.registry = WorkerRegistry(heartbeat_timeout=60.0)
        pool = WorkerLoad(num_free_blocks=total, num_total_blocks=total)
        self.registry.register(RegisterWorker(role=first, worker_id="p1", epoch=1, model="m",
                                              model_path="", compat=COMPAT, load=pool), b"p1")
        if first == "colocated":
            decode_free = ()
        for i, free in enumerate(decode_free):
            wid = f"d{i + 1}"
            self.registry.register(RegisterWorker(role="decode", worker_id=wid, epoch=1, model="m",
                                                  model_path="", compat=COMPAT,
                                                  load=WorkerLoad(num_free_blocks=free,
                                                                  num_total_blocks=total)),
                                   wid.encode())
        self.sent: list[tuple[bytes, Message]] = []
        self.clock, self.metrics = Clock(), GatewayMetrics()
        self.admission = Admission(self.registry, budget_s, self.metrics, self.clock)
        self.prefix_index = PrefixIndex()
        self.orch = Orchestrator(Router(self.registry, self.prefix_index), self.metrics, self.send,
                                 max_queue=64, request_timeout=5.0, admission=self.admission)

    async def send(self, identity: bytes, msg: Message) -> bool:
        self.sent.append((identity, msg))
        return True

    def refused(self, reason: str) -> float:
        return self.metrics.admission_refused.labels(reason)._value.get()

    def heartbeat(self, worker_id: str, free: int, total: int = 100) -> None:
        assert self.registry.touch(worker_id, 1, WorkerLoad(num_free_blocks=free, num_total_blocks=total))


def gen(rid: str, num_tokens: int) -> GenerationInput:
    return GenerationInput(rid, list(range(3, 3 + num_tokens)), SamplingParams(max_tokens=4))


async def test_prefill_queue_longer_than_the_budget_is_a_429_with_retry_after() -> None:
    s = Setup(budget_s=3.3, decode_free=(1000,), total=1000)
    first = await s.orch.submit_all("a", [gen("a", 100)])
    many = [await s.orch.submit_all(f"q{i}", [gen(f"q{i}", 100)]) for i in range(5)]  # no rate yet: admitted
    s.clock.now += 1.0  # "a" took 1 s: 100 tokens/s
    await s.orch.on_worker_message(b"p1", FirstToken(request_id="a", worker_id="p1", token_id=7))
    assert s.admission.rates["p1"].tokens_per_s() == pytest.approx(100.0)
    s.orch.release(first[0])
    s.clock.now += 0.5
    await s.orch.on_worker_message(b"p1", FirstToken(request_id="q0", worker_id="p1", token_id=7))
    assert s.admission.rates["p1"].tokens_per_s() == pytest.approx(195 / 1.45)  # (.95·100+100) / (.95·1+.5)
    s.orch.release(many[0][0])
    await s.orch.submit_all("ok", [gen("ok", 100)])  # 400 tokens ahead at 134.5 tokens/s: 3.0 s
    with pytest.raises(APIError) as refused:
        await s.orch.submit_all("late", [gen("late", 100)])  # 500 ahead: 3.7 s > 3.3 s
    assert refused.value.status == 429 and refused.value.code == "overloaded"
    assert refused.value.headers["Retry-After"] == "1" and "admission budget 3.3 s" in refused.value.message
    assert s.refused("prefill_queue") == 1 and "late" not in s.orch.requests
    assert not [m for _, m in s.sent if getattr(m, "request_id", None) == "late"]  # nothing went out
    for rid in list(s.orch.requests):
        s.orch.release(s.orch.requests[rid])
    await s.orch.submit_all("later", [gen("later", 100)])  # the queue drained: admitted again
    s.orch.release(s.orch.requests["later"])
    assert not s.orch.requests and not s.admission._routed


@pytest.mark.parametrize("first", ["prefill", "colocated"])
async def test_the_queue_counts_the_tokens_a_prompt_will_compute_as_the_rate_does(first: str) -> None:
    """The rate is measured in computed tokens (the prompt minus the prefix hit), so the queue ahead is
    counted in the tokens each queued prompt is expected to compute: the prompt minus the prefix p1's KV
    events report cached. Counting whole prompts refused a burst of prompts served from the cache as
    overload (seen on an H200: 29 of 256 repeated 1000-token prompts refused, "31 s queued", while
    their TTFT was 0.3 s)."""
    s = Setup(budget_s=2.0, decode_free=(1000,), total=1000, first=first)
    prompt = gen("a", 100).prompt_token_ids
    (a,) = await s.orch.submit_all("a", [gen("a", 100)])
    s.clock.now += 1.0  # 100 tokens computed in 1 s
    await s.orch.on_worker_message(b"p1", FirstToken(request_id="a", worker_id="p1", token_id=7))
    s.orch.release(a)
    s.prefix_index.apply(KVEvents(worker_id="p1", epoch=1, seq_no=1, stored=block_hashes(prompt, 4),
                                  snapshot=True))
    for i in range(40):  # the prompt again and again: 4 tokens computed each (a hit of 96), 0.2 s each
        (h,) = await s.orch.submit_all(f"h{i}", [gen(f"h{i}", 100)])
        s.clock.now += 0.2
        await s.orch.on_worker_message(b"p1", FirstToken(request_id=f"h{i}", worker_id="p1", token_id=7,
                                                        num_cached_tokens=96))
        s.orch.release(h)
        if first == "prefill":
            s.heartbeat("d1", 1000, 1000)  # the decode worker freed the request's blocks
    rate = s.admission.rates["p1"].tokens_per_s()
    assert rate is not None and 20.0 < rate < 25.0  # computed tokens per busy second
    burst = [(await s.orch.submit_all(f"b{i}", [gen(f"b{i}", 100)]))[0] for i in range(10)]
    assert s.admission.queued_tokens("p1") == 40  # 10 hits: 1.6-2.0 s of work, all admitted
    # a prompt p1 has not seen counts (up to 4x the largest measured, 51 tokens): admitted behind 40
    # tokens, then the next waits too long
    other = [GenerationInput(f"n{i}", list(range(500 + 100 * i, 600 + 100 * i)), SamplingParams(max_tokens=4))
             for i in range(2)]
    burst += await s.orch.submit_all("n0", [other[0]])
    assert s.admission.queued_tokens("p1") == 140
    with pytest.raises(APIError) as refused:
        await s.orch.submit_all("n1", [other[1]])
    assert refused.value.status == 429 and s.refused("prefill_queue") == 1
    for req in burst:
        s.orch.release(req)
    assert not s.orch.requests and not s.admission._routed


async def test_a_rate_measured_on_short_prompts_does_not_refuse_long_ones() -> None:
    """After a few 4-token prompts (fixed cost: 0.05 s each, a "rate" of 80 tokens/s), long prompts on
    an idle worker are admitted (each counts as at most 4x the 4 tokens measured, not as 1208 tokens at
    80 tokens/s: 15 s > 5 s); once one long prompt has been measured the queue is judged in full."""
    s = Setup(budget_s=5.0, decode_free=(2000,), total=2000)
    for i in range(4):
        (short,) = await s.orch.submit_all(f"s{i}", [gen(f"s{i}", 4)])
        s.clock.now += 0.05
        await s.orch.on_worker_message(b"p1", FirstToken(request_id=f"s{i}", worker_id="p1", token_id=7))
        s.orch.release(short)
        s.heartbeat("d1", 2000, 2000)
    assert s.admission.rates["p1"].tokens_per_s() == pytest.approx(80.0)
    long = [(await s.orch.submit_all(f"l{i}", [gen(f"l{i}", 1208)]))[0] for i in range(4)]
    assert s.refused("prefill_queue") == 0 and s.admission.queued_tokens("p1") == 4 * 1208
    s.clock.now += 2.4  # the first long prompt computed in 2.4 s
    await s.orch.on_worker_message(b"p1", FirstToken(request_id="l0", worker_id="p1", token_id=7))
    rate = s.admission.rates["p1"].tokens_per_s()
    assert rate is not None and 450 < rate < 500
    with pytest.raises(APIError) as refused:  # 3 x 1208 tokens ahead at ~470 tokens/s: ~7.7 s > 5 s
        await s.orch.submit_all("l4", [gen("l4", 1208)])
    assert refused.value.status == 429 and s.refused("prefill_queue") == 1
    for req in long:
        s.orch.release(req)
    assert not s.orch.requests and not s.admission._routed


async def test_one_long_queued_prompt_does_not_switch_the_queue_check_off() -> None:
    """A queued prompt longer than the rate was measured on counts 4x the largest measured; the prompts
    behind it that the rate knows are judged in full, and refused past the budget."""
    s = Setup(budget_s=5.0, decode_free=(4000,), total=4000)
    for i in range(2):  # 400 tokens in 0.4 s: 1000 tokens/s
        (r,) = await s.orch.submit_all(f"m{i}", [gen(f"m{i}", 400)])
        s.clock.now += 0.4
        await s.orch.on_worker_message(b"p1", FirstToken(request_id=f"m{i}", worker_id="p1", token_id=7))
        s.orch.release(r)
        s.heartbeat("d1", 4000, 4000)
    admitted = [(await s.orch.submit_all("long", [gen("long", 2000)]))[0]]  # counts 1600 tokens
    with pytest.raises(APIError) as refused:
        for i in range(20):
            admitted += await s.orch.submit_all(f"q{i}", [gen(f"q{i}", 400)])
    assert refused.value.status == 429 and len(admitted) == 1 + 9  # 1600 + 9 x 400 = 5.2 s ahead of the 10th
    for req in admitted:
        s.orch.release(req)
    assert not s.orch.requests and not s.admission._routed


async def test_no_free_decode_blocks_is_an_immediate_429_until_a_heartbeat_frees_some() -> None:
    s = Setup(decode_free=(5,))
    await s.orch.submit_all("a", [gen("a", 12)])  # 3 of 5 blocks
    with pytest.raises(APIError) as refused:
        await s.orch.submit_all("b", [gen("b", 12)])  # 2 left (reserved since the heartbeat): no
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
    assert refused.value.code == "kv_full" and s.refused("kv_blocks") == 1
    assert [type(m).__name__ for _, m in s.sent] == ["ReserveKV"]
    s.heartbeat("d1", free=5)  # a newer heartbeat counts the reservation itself
    await s.orch.submit_all("b", [gen("b", 20)])
    for rid in list(s.orch.requests):
        s.orch.release(s.orch.requests[rid])


async def test_another_compatible_decode_worker_with_free_blocks_is_chosen() -> None:
    s = Setup(decode_free=(1, 50))
    s.heartbeat("d2", free=50)
    s.registry.get("d2").requests.update({"x1", "x2"})  # d2 looks busier: the router picks d1 first
    [req] = await s.orch.submit_all("a", [gen("a", 12)])
    assert req.route.decode is not None and req.route.decode.worker_id == "d2"
    assert isinstance(s.sent[0][1], ReserveKV) and s.sent[0][0] == b"d2"
    s.registry.get("d2").requests -= {"x1", "x2"}
    s.orch.release(req)


async def test_a_prompt_larger_than_any_pool_is_a_400_not_a_429() -> None:
    s = Setup(decode_free=(8,), total=8)
    with pytest.raises(APIError) as refused:
        await s.orch.submit_all("a", [gen("a", 40)])  # 10 blocks of 4 > 8 in all
    assert refused.value.status == 400 and refused.value.code == "prompt_too_long"
    assert s.refused("prompt_too_long") == 1 and not s.sent and not s.orch.requests


def test_admission_budget_is_validated_with_the_flag_named() -> None:
    with pytest.raises(ValueError, match="--admission-budget"):
        GatewaySettings(admission_budget=-1.0, insecure_control_plane=True)
    assert GatewaySettings(insecure_control_plane=True).admission_budget == 30.0
    zero = GatewaySettings(admission_budget=0, insecure_control_plane=True)
    assert zero.admission_budget == 0  # 0: no queue check


async def test_reserve_kv_names_the_prefill_workers_tensor_parallel_size() -> None:
    # a decode worker must know how many prefill ranks write into it: it admits each rank's sender and
    # expects one transfer per rank pair
    s = Setup()
    two_ranks = msgspec.structs.replace(COMPAT, num_kv_heads=1, total_kv_heads=2, tp_size=2,
                                        rank_kv_heads=((0, 1), (1, 1)))
    one_rank = msgspec.structs.replace(COMPAT, num_kv_heads=2, total_kv_heads=2, rank_kv_heads=((0, 2),))
    for role, wid, compat in (("prefill", "p1", two_ranks), ("decode", "d1", one_rank)):
        s.registry.register(RegisterWorker(role=role, worker_id=wid, epoch=2, model="m", model_path="",
                                           compat=compat, kv_sender_epoch=77 if role == "prefill" else 0,
                                           load=WorkerLoad(num_free_blocks=100, num_total_blocks=100)),
                            wid.encode())
    [req] = await s.orch.submit_all("a", [gen("a", 12)])
    reserve = s.sent[0][1]
    assert isinstance(reserve, ReserveKV)
    assert (reserve.prefill_worker_id, reserve.prefill_sender_epoch, reserve.prefill_tp_size) == ("p1", 77, 2)
    s.orch.release(req)


def reported_rate(tokens_per_s: float, largest: int, free: int = 1000) -> WorkerLoad:
    """A first-token worker's heartbeat load carrying its own prefill rate."""
    return WorkerLoad(num_free_blocks=free, num_total_blocks=1000, prefill_tokens_per_s=tokens_per_s,
                      prefill_largest_tokens=largest)


@pytest.mark.parametrize("first", ["prefill", "colocated"])
async def test_a_fresh_gateway_judges_the_queue_by_the_rate_the_worker_reports(first: str) -> None:
    """A gateway process that has not seen a first token from p1 (just started, restarted, one of several)
    takes p1's heartbeat rate: a burst past the budget gets 429s from the first request on, with a
    Retry-After from the estimate; no rate reported at all still admits."""
    s = Setup(budget_s=2.0, decode_free=(1000,), total=1000, first=first)
    assert s.registry.touch("p1", 1, reported_rate(100.0, 100))
    for i in range(3):
        await s.orch.submit_all(f"b{i}", [gen(f"b{i}", 100)])
    assert s.admission.queued_tokens("p1") == 300  # 0, 1.0 and 2.0 s ahead: each within the budget
    with pytest.raises(APIError) as refused:
        await s.orch.submit_all("late", [gen("late", 100)])  # 300 tokens ahead at 100/s: 3 s > 2 s
    assert refused.value.status == 429 and refused.value.code == "overloaded"
    assert "about 3 s of prompts" in refused.value.message and refused.value.headers["Retry-After"] == "1"
    # a prompt 8x longer than the rate knows counts 4x the largest measured (400 tokens): 10 s queued
    for rid in ("b1", "b2"):
        s.orch.release(s.orch.requests[rid])
    def long_prompt(rid: str) -> GenerationInput:
        return GenerationInput(rid, list(range(3, 803)), SamplingParams(max_tokens=4))

    await s.orch.submit_all("big", [long_prompt("big")])  # behind b0's 100 tokens: 1 s
    with pytest.raises(APIError) as far:
        await s.orch.submit_all("big2", [long_prompt("big2")])
    assert far.value.headers["Retry-After"] == "3"  # 100 + 400 tokens ahead = 5 s, 3 s past the budget
    assert s.refused("prefill_queue") == 2
    for rid in list(s.orch.requests):
        s.orch.release(s.orch.requests[rid])
    assert s.registry.touch("p1", 1, WorkerLoad(num_free_blocks=1000, num_total_blocks=1000))  # no rate
    many = [(await s.orch.submit_all(f"n{i}", [gen(f"n{i}", 100)]))[0] for i in range(10)]
    assert len(many) == 10 and s.refused("prefill_queue") == 2
    for req in many:
        s.orch.release(req)
    assert not s.orch.requests and not s.admission._routed


async def test_the_rate_the_worker_reports_comes_before_the_gateways_own_measurement() -> None:
    """The worker's rate (every prompt it computed, whichever gateway sent it) judges even after this
    gateway measured p1 itself: one slow first answer (hops, a first transfer) does not replace it. This
    gateway's own measurement judges a worker that reports none."""
    s = Setup(budget_s=2.0, decode_free=(1000,), total=1000)
    (a,) = await s.orch.submit_all("a", [gen("a", 100)])
    s.clock.now += 1.0  # 100 tokens in 1 s, as seen from here
    await s.orch.on_worker_message(b"p1", FirstToken(request_id="a", worker_id="p1", token_id=7))
    s.orch.release(a)
    p1 = s.registry.get("p1")
    assert p1 is not None and s.admission.rate(p1) == (pytest.approx(100.0), pytest.approx(100.0))
    burst = [(await s.orch.submit_all(f"b{i}", [gen(f"b{i}", 100)]))[0] for i in range(3)]
    with pytest.raises(APIError):  # 300 tokens ahead at 100 tokens/s
        await s.orch.submit_all("late", [gen("late", 100)])
    assert s.registry.touch("p1", 1, reported_rate(1000.0, 100))  # the worker's own: 10x faster
    assert s.admission.rate(p1) == (1000.0, 100.0)
    # at 1000 tokens/s the next 18 wait 0.3 .. 2.0 s behind b0-b2 and each other: admitted; then 2.1 s
    burst += [(await s.orch.submit_all(f"c{i}", [gen(f"c{i}", 100)]))[0] for i in range(18)]
    with pytest.raises(APIError) as refused:
        await s.orch.submit_all("c18", [gen("c18", 100)])
    assert "about 2 s of prompts" in refused.value.message and s.refused("prefill_queue") == 2
    for req in burst:
        s.orch.release(req)
    assert not s.orch.requests and not s.admission._routed


@pytest.mark.parametrize("first", ["prefill", "colocated"])
async def test_the_backlog_the_worker_reports_counts_other_gateways_requests(first: str) -> None:
    """p1's heartbeat backlog holds requests other gateways sent it: this gateway adds what it routed
    since that heartbeat and judges the larger of that and its own queue, so gateways of one fleet judge
    one queue; a later heartbeat that counts this gateway's requests itself does not count them twice."""
    s = Setup(budget_s=2.0, decode_free=(1000,), total=1000, first=first)

    def heartbeat(backlog: int) -> None:
        assert s.registry.touch("p1", 1, WorkerLoad(num_free_blocks=1000, num_total_blocks=1000,
                                                    prefill_tokens_per_s=100.0, prefill_largest_tokens=100,
                                                    prefill_backlog_tokens=backlog))

    heartbeat(150)  # 1.5 s of another gateway's prompts
    (a,) = await s.orch.submit_all("a", [gen("a", 100)])  # 150 ahead: 1.5 s
    with pytest.raises(APIError) as refused:
        await s.orch.submit_all("b", [gen("b", 100)])  # 150 + a's 100 routed since: 2.5 s
    assert "about 2 s of prompts" in refused.value.message and refused.value.headers["Retry-After"] == "1"
    waiting = await sent_to_p1(s, a)
    heartbeat(250)  # p1 now holds a too: counted once
    with pytest.raises(APIError):
        await s.orch.submit_all("c", [gen("c", 100)])  # max(100 own, 250 + 0): 2.5 s
    heartbeat(100)  # the other gateway's requests got their first tokens; a is still queued
    (d,) = await s.orch.submit_all("d", [gen("d", 100)])  # max(100, 100 + 0): 1 s
    (e,) = await s.orch.submit_all("e", [gen("e", 100)])  # max(200 own, 100 + d's 100): 2 s
    with pytest.raises(APIError):
        await s.orch.submit_all("f", [gen("f", 100)])  # max(300 own, 100 + 200 since): 3 s
    assert s.refused("prefill_queue") == 3
    waiting.cancel()
    for req in (a, d, e):
        s.orch.release(req)
    assert not s.orch.requests and not s.admission._routed


async def sent_to_p1(s: Setup, req: GatewayRequest) -> asyncio.Task[object]:
    """Drive ``req`` until its first message to p1 went out (a disaggregated request: after d1's
    ``KVReserved``); returns the task reading its outputs (cancel it when done)."""
    reading: asyncio.Task[object] = asyncio.create_task(s.orch.next_output(req))
    if req.route.kind == "disaggregated":
        await s.orch.on_worker_message(b"d1", KVReserved(request_id=req.request_id, worker_id="d1",
                                                         kv_handle=b"h"))
    for _ in range(100):
        if any(i == b"p1" and getattr(m, "request_id", None) == req.request_id for i, m in s.sent):
            return reading
        await asyncio.sleep(0.01)
    raise AssertionError(f"{req.request_id} never went to p1")


@pytest.mark.parametrize("first", ["prefill", "colocated"])
async def test_the_request_carries_the_prefix_the_gateway_expects_cached(first: str) -> None:
    """``expected_cached_tokens`` of the first message to p1 is the prefix its KV events report cached
    (in tokens), which p1 counts in its backlog until it schedules the request."""
    s = Setup(budget_s=0.0, decode_free=(1000,), total=1000, first=first)
    prompt = gen("a", 100).prompt_token_ids
    s.prefix_index.apply(KVEvents(worker_id="p1", epoch=1, seq_no=1, stored=block_hashes(prompt, 4)[:10],
                                  snapshot=True))
    (a,) = await s.orch.submit_all("a", [gen("a", 100)])
    waiting = await sent_to_p1(s, a)  # disaggregated: the PrefillRequest follows d1's KVReserved
    sent = [m for identity, m in s.sent if identity == b"p1" and getattr(m, "request_id", None) == "a"]
    assert [m.expected_cached_tokens for m in sent] == [40]  # 10 blocks of 4 tokens
    waiting.cancel()
    s.orch.release(a)


@pytest.mark.parametrize("first", ["prefill", "colocated"])
async def test_a_request_for_prompt_logprobs_counts_its_whole_prompt(first: str) -> None:
    """A worker computes every prompt token of a request that asks for prompt logprobs (its scheduler
    reuses no prefix for it): such a request queues, and is announced to the worker, with nothing
    expected cached, though p1's KV events report a prefix."""
    s = Setup(budget_s=0.0, decode_free=(1000,), total=1000, first=first)
    prompt = gen("a", 100).prompt_token_ids
    s.prefix_index.apply(KVEvents(worker_id="p1", epoch=1, seq_no=1, stored=block_hashes(prompt, 4)[:10],
                                  snapshot=True))
    (a,) = await s.orch.submit_all("a", [GenerationInput("a", prompt, SamplingParams(max_tokens=4,
                                                                                      prompt_logprobs=0))])
    assert s.admission.queued_tokens("p1") == 100 and a.route.prefix_blocks == 0
    waiting = await sent_to_p1(s, a)
    sent = [m for identity, m in s.sent if identity == b"p1" and getattr(m, "request_id", None) == "a"]
    assert [m.expected_cached_tokens for m in sent] == [0]
    (b,) = await s.orch.submit_all("b", [gen("b", 100)])  # the same prompt without: 40 tokens cached
    assert s.admission.queued_tokens("p1") == 100 + 60
    waiting.cancel()
    s.orch.release(a)
    s.orch.release(b)
    assert not s.admission._routed


def test_a_rate_observation_not_counted_moves_only_the_last_first_token() -> None:
    """``PrefillRate.observe(count=False)``: the busy time of the next request starts at this first token,
    the sums and the largest prompt stay; the very first observation counts whatever ``count`` says."""
    from protocol.prefill_rate import PrefillRate

    rate = PrefillRate()
    rate.observe(100, 0.0, 1.0, count=False)  # nothing measured yet: counted
    assert (rate.tokens, rate.seconds, rate.largest, rate.tokens_per_s()) == (100, 1.0, 100, 100.0)
    rate.observe(500, 5.0, 10.0, count=False)  # a lone request: not counted
    assert (rate.tokens, rate.seconds, rate.largest, rate.last_first_token) == (100, 1.0, 100, 10.0)
    rate.observe(50, 9.0, 10.5)  # queued behind the last one: busy from 10.0, not from its arrival
    assert rate.tokens == pytest.approx(95 + 50) and rate.seconds == pytest.approx(0.95 + 0.5)


async def test_a_request_not_yet_sent_to_the_worker_counts_beside_its_backlog() -> None:
    """A disaggregated request waits for its decode worker's KVReserved before its PrefillRequest goes
    out: a p1 heartbeat meanwhile cannot hold it, so this gateway still adds it to p1's backlog."""
    s = Setup(budget_s=2.0, decode_free=(1000,), total=1000)

    def heartbeat(backlog: int) -> None:
        assert s.registry.touch("p1", 1, WorkerLoad(num_free_blocks=1000, num_total_blocks=1000,
                                                    prefill_tokens_per_s=100.0, prefill_largest_tokens=100,
                                                    prefill_backlog_tokens=backlog))

    heartbeat(50)
    await s.orch.submit_all("a", [gen("a", 100)])  # ReserveKV to d1; PrefillRequest not sent yet
    heartbeat(50)  # a newer heartbeat: a is not in p1's backlog
    await s.orch.submit_all("b", [gen("b", 100)])  # max(100 own, 50 + a's 100 unsent): 1.5 s
    with pytest.raises(APIError):
        await s.orch.submit_all("c", [gen("c", 100)])  # max(200, 50 + 200): 2.5 s
    for rid in list(s.orch.requests):
        s.orch.release(s.orch.requests[rid])
    assert not s.orch.requests and not s.admission._routed


async def test_retry_after_is_the_wait_past_the_budget_capped() -> None:
    """An ``overloaded`` 429's Retry-After is the estimated wait past the budget, in whole seconds, at
    least 1 and at most ``RETRY_AFTER_CAP_S`` (a backlog of 1000 s at the reported rate is not a
    Retry-After of 998 s)."""
    from gateway.admission import RETRY_AFTER_CAP_S

    s = Setup(budget_s=2.0, decode_free=(1000,), total=1000)
    backlog = msgspec.structs.replace(reported_rate(100.0, 100), prefill_backlog_tokens=100_000)
    assert s.registry.touch("p1", 1, backlog)
    with pytest.raises(APIError) as refused:
        await s.orch.submit_all("late", [gen("late", 100)])  # 100000 tokens ahead at 100/s: 1000 s
    assert refused.value.code == "overloaded" and "about 1000 s of prompts" in refused.value.message
    assert refused.value.headers["Retry-After"] == str(RETRY_AFTER_CAP_S) == "60"
    assert s.registry.touch("p1", 1, msgspec.structs.replace(backlog, prefill_backlog_tokens=350))
    with pytest.raises(APIError) as soon:
        await s.orch.submit_all("soon", [gen("soon", 100)])  # 3.5 s ahead: 1.5 s past the budget
    assert soon.value.headers["Retry-After"] == "2"
    assert s.refused("prefill_queue") == 2 and not s.orch.requests
