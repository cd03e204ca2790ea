"""Dead means dead at once: a worker the control socket cannot reach leaves routing on the first failed
send (not after the heartbeat timeout), ``/ready`` and ``/v1/status`` say which, why and when, and it is
back once it registers again. A slow worker (a send that would block) stays. Incompatible pairs are
named in the status view and in the log."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import openai
import pytest

from engine.sampling_params import SamplingParams
from gateway.control_socket import SendOutcome
from gateway.metrics import GatewayMetrics
from gateway.request_state import GenerationInput
from gateway.service import GatewayService
from gateway.status import readiness
from kvtransfer.compat import KVCompat
from protocol.messages import AbortRequest, KVReserved, Message, PrefillRequest, RegisterWorker, WorkerLoad
from protocol.settings import GatewaySettings
from tests.gateway.conftest import MSGS, Cluster, read_record, wait_until


class _Control:
    """A control socket whose sends end as ``outcome[identity]`` (SENT by default)."""

    def __init__(self) -> None:
        self.outcome: dict[bytes, SendOutcome] = {}
        self.sent: list[tuple[bytes, Message]] = []

    async def send(self, identity: bytes, msg: Message) -> bool:
        return await self.send_outcome(identity, msg) is SendOutcome.SENT

    async def send_outcome(self, identity: bytes, msg: Message) -> SendOutcome:
        self.sent.append((identity, msg))
        return self.outcome.get(identity, SendOutcome.SENT)


def _register(wid: str, role: str, epoch: int = 1, block_size: int = 16) -> RegisterWorker:
    compat = KVCompat(dtype="float32", block_size=block_size, transfer_backend="loopback")
    return RegisterWorker(role=role, worker_id=wid, epoch=epoch, model="m", model_path="",  # type: ignore[arg-type]
                          compat=compat, transfer_address=f"tcp://127.0.0.1:1{epoch}/{wid}",
                          load=WorkerLoad(num_total_blocks=64, num_free_blocks=64))


def _service() -> tuple[GatewayService, _Control]:
    svc = GatewayService(GatewaySettings(heartbeat_timeout=60.0, insecure_control_plane=True),
                         GatewayMetrics(), text=object())  # type: ignore[arg-type]
    control = _Control()
    svc.control = control  # type: ignore[assignment]
    return svc, control


async def test_failed_send_drops_the_worker_at_once_and_reregistration_brings_it_back() -> None:
    svc, control = _service()
    for wid, role in (("p1", "prefill"), ("d1", "decode")):
        await svc.on_control_message(f"{wid}-a".encode(), _register(wid, role))
    assert readiness(svc.registry).ready
    control.outcome[b"p1-a"] = SendOutcome.UNREACHABLE
    before = time.time()
    assert not await svc.send(b"p1-a", AbortRequest(request_id="r1"))
    assert svc.registry.get("p1") is None  # out of routing at once, long before the 60 s timeout
    body = readiness(svc.registry)
    assert not body.ready and "p1" in body.reason and "unreachable" in body.reason
    [lost] = body.dropped
    assert (lost.worker_id, lost.role, lost.epoch) == ("p1", "prefill", 1)
    assert "unreachable" in lost.reason and before <= lost.at <= time.time()
    assert [w.worker_id for w in body.workers] == ["d1"]
    # the replacement, on a new connection with a new epoch, is usable as soon as it registered
    await svc.on_control_message(b"p1-b", _register("p1", "prefill", epoch=2))
    body = readiness(svc.registry)
    assert body.ready and body.dropped == [] and [(w.worker_id, w.epoch) for w in body.workers] == [
        ("d1", 1), ("p1", 2)]


async def test_a_slow_worker_is_not_dropped(caplog: pytest.LogCaptureFixture) -> None:
    """A send that would block leaves the worker in routing and is logged naming the worker and the
    message (not the zmq routing identity's raw bytes)."""
    svc, control = _service()
    await svc.on_control_message(b"d1-a", _register("d1", "decode"))
    control.outcome[b"d1-a"] = SendOutcome.BUSY
    with caplog.at_level(logging.WARNING, logger="pdserve.gateway"):
        assert not await svc.send(b"d1-a", AbortRequest(request_id="r1"))
    assert svc.registry.get("d1") is not None and readiness(svc.registry).dropped == []
    [busy] = [r for r in caplog.records if r.getMessage() == "control_send_busy"]
    assert (busy.worker_id, busy.msg_type) == ("d1", "AbortRequest")  # type: ignore[attr-defined]


async def test_a_failed_send_of_a_request_fails_it_and_routes_the_next_elsewhere() -> None:
    """The request whose PrefillRequest cannot reach p1 is retried on p2 (p1 left routing); the next ones
    go to p2."""
    svc, control = _service()
    for wid, role in (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode")):
        await svc.on_control_message(f"{wid}-a".encode(), _register(wid, role))
    control.outcome[b"p1-a"] = SendOutcome.UNREACHABLE
    routed = []
    for k in range(3):
        rid = f"r{k}"
        inp = GenerationInput(rid, list(range(40)), SamplingParams(max_tokens=4))
        req = await svc.orchestrator.submit(inp)
        assert req.route.prefill is not None
        routed.append(req.route.prefill.worker_id)
        await svc.on_control_message(b"d1-a", KVReserved(request_id=rid, worker_id="d1", kv_handle=b"h"))
        if k == 0:
            with pytest.raises(TimeoutError):  # the retry waits for workers that are not there
                await asyncio.wait_for(svc.orchestrator.next_output(req), 0.3)
            assert req.route.prefill is not None and req.route.prefill.worker_id == "p2"
            assert req.retries == 1
        svc.orchestrator.release(req)
    assert routed == ["p1", "p2", "p2"]
    # (the others' PrefillRequest waits for next_output)
    assert [i for i, m in control.sent if isinstance(m, PrefillRequest)] == [b"p1-a"]
    await asyncio.sleep(0)  # let the background aborts run


async def test_incompatible_pair_named_in_status_and_log(caplog: pytest.LogCaptureFixture) -> None:
    svc, _ = _service()
    with caplog.at_level(logging.WARNING, logger="pdserve.gateway"):
        await svc.on_control_message(b"p", _register("p1", "prefill", block_size=16))
        await svc.on_control_message(b"d", _register("d1", "decode", block_size=32))
    body = readiness(svc.registry)
    assert not body.ready and "block_size 16 != 32" in body.reason
    assert [(p.prefill, p.decode, p.usable, p.reason) for p in body.pairs] == [
        ("p1", "d1", False, "p1 / d1: block_size 16 != 32")]
    logged = [r for r in caplog.records if r.getMessage() == "pair_refused"]
    assert [(r.prefill, r.decode, r.reason) for r in logged] == [  # type: ignore[attr-defined]
        ("p1", "d1", "p1 / d1: block_size 16 != 32")]


async def test_stale_registration_is_listed_as_refused() -> None:
    svc, _ = _service()
    await svc.on_control_message(b"d1-b", _register("d1", "decode", epoch=2))
    await svc.on_control_message(b"d1-a", _register("d1", "decode", epoch=1))  # an old incarnation
    body = readiness(svc.registry)
    [refused] = body.refused
    assert (refused.worker_id, refused.epoch) == ("d1", 1)
    assert "stale epoch 1 < registered 2" in refused.reason
    assert [(w.worker_id, w.epoch) for w in body.workers] == [("d1", 2)]


# ---- with processes: a gateway and fake workers, kill -9 ---------------------------------------------

def _status(c: Cluster) -> dict:
    return httpx.get(c.base + "/v1/status", timeout=5).json()


@pytest.mark.slow
def test_killed_worker_leaves_routing_before_the_heartbeat_timeout(make_cluster) -> None:
    """A worker killed with SIGKILL: its connection drops, the gateway's probe cannot reach it, so it is
    out of routing (and named by /ready) long before the 30 s heartbeat timeout; requests go to the
    other prefill worker; its restart (new epoch, same id) is routed to again."""
    c = make_cluster(heartbeat_timeout=30)
    c.start_worker("prefill", "p1", epoch=1)
    rec2 = c.start_worker("prefill", "p2", epoch=1)
    c.start_worker("decode", "d1")
    start = time.monotonic()
    c.workers["p1"].kill()
    wait_until(lambda: [d["worker_id"] for d in _status(c)["dropped"]] == ["p1"], 5, "p1 dropped")
    assert time.monotonic() - start < 5
    ready = httpx.get(c.base + "/ready", timeout=5)
    assert ready.status_code == 200
    assert set(ready.json()) == {"ready", "reason"} and "p1" in ready.json()["reason"]
    body = _status(c)
    assert "p1" in body["reason"] and "unreachable" in body["dropped"][0]["reason"]
    assert sorted(w["worker_id"] for w in body["workers"]) == ["d1", "p2"]
    for _ in range(5):
        r = c.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=3)  # type: ignore[arg-type]
        assert r.choices[0].message.content
    assert sum(1 for m in read_record(rec2) if m["type"] == "PrefillRequest") == 5
    c.start_worker("prefill", "p1", epoch=2)
    body = _status(c)
    assert body["dropped"] == [] and {(w["worker_id"], w["epoch"]) for w in body["workers"]} >= {("p1", 2)}
    c.assert_no_leaks(("d1",))


@pytest.mark.slow
def test_incompatible_pair_named_by_ready_status_and_log(make_cluster) -> None:
    c = make_cluster()
    c.start_worker("prefill", "p1", block_size=16)
    c.start_worker("decode", "d1", block_size=32)
    ready = httpx.get(c.base + "/ready", timeout=5)
    assert ready.status_code == 503 and "block_size 16 != 32" in ready.json()["reason"]
    assert ready.json() == {"ready": False, "reason": _status(c)["reason"]}  # the verdict only
    assert sorted(w["worker_id"] for w in _status(c)["workers"]) == ["d1", "p1"]
    assert _status(c)["pairs"] == [{"prefill": "p1", "decode": "d1", "usable": False,
                                    "reason": "p1 / d1: block_size 16 != 32", "path": None}]
    wait_until(lambda: "pair_refused" in (c.tmp / "gateway.log").read_text(), 5, "pair_refused logged")


@pytest.mark.slow
def test_tensor_parallel_pairs_by_head_mapping(make_cluster) -> None:
    """Workers of different tensor parallel shapes: a pair whose KV heads map is usable (P TP=2 / D TP=1
    over a one-sided backend); one that cannot be mapped (the same shapes over a two-sided backend, which
    writes whole blocks only) is refused with the mismatch, both shapes named, in /ready's 503 and in the
    chat request's 503."""
    c = make_cluster()
    c.start_worker("prefill", "p1", tensor_parallel_size=2, total_kv_heads=4, transfer_backend="ucx")
    c.start_worker("decode", "d1", tensor_parallel_size=1, total_kv_heads=4, transfer_backend="ucx")
    ready = httpx.get(c.base + "/ready", timeout=5)
    want = ("p1 / d1: transfer_backend 'ucx' writes whole blocks only, which the tensor parallel shapes do "
            "not share (prefill tp_size 2 heads [(0, 2), (2, 2)], decode tp_size 1 heads [(0, 4)]): "
            "use one of ['nixl', 'loopback']")
    assert ready.status_code == 503 and want in ready.json()["reason"]
    assert _status(c)["pairs"] == [{"prefill": "p1", "decode": "d1", "usable": False, "reason": want,
                                    "path": None}]
    with pytest.raises(openai.APIStatusError) as err:
        c.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=3)  # type: ignore[arg-type]
    assert err.value.status_code == 503
    assert "transfer_backend 'ucx' writes whole blocks only" in err.value.message
    c.start_worker("prefill", "p2", tensor_parallel_size=2, total_kv_heads=4)  # loopback: one-sided
    c.start_worker("decode", "d2", tensor_parallel_size=1, total_kv_heads=4)
    wait_until(lambda: httpx.get(c.base + "/ready", timeout=5).status_code == 200, 5, "/ready 200")
    usable = {(p["prefill"], p["decode"]) for p in _status(c)["pairs"] if p["usable"]}
    assert usable == {("p2", "d2")}
    r = c.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=3)  # type: ignore[arg-type]
    assert r.choices[0].message.content


async def test_status_shows_the_blocks_a_decode_worker_holds_for_dropped_requests() -> None:
    """A heartbeat's ``kv_fenced_blocks`` reaches ``/v1/status``: blocks in use while nothing runs (the
    requests of a dead prefill worker, held until their KV deadline) are explained there."""
    svc, _ = _service()
    for wid, role in (("p1", "prefill"), ("d1", "decode")):
        await svc.on_control_message(f"{wid}-a".encode(), _register(wid, role))
    load = WorkerLoad(num_total_blocks=64, num_free_blocks=50, kv_fenced_blocks=14)
    assert svc.registry.touch("d1", 1, load)
    workers = {w.worker_id: w for w in readiness(svc.registry).workers}
    d1 = workers["d1"]
    assert (d1.kv_fenced_blocks, d1.num_free_blocks, d1.num_running) == (14, 50, 0)
    assert workers["p1"].kv_fenced_blocks == 0


async def test_a_send_to_a_gone_connection_logs_no_raw_identity(caplog: pytest.LogCaptureFixture) -> None:
    """The real control socket: a send to an identity with no connection is UNREACHABLE and leaves the
    report to its caller (which names the worker: ``worker_gone``); no warning shows zmq's identity
    bytes."""
    from gateway.control_socket import ControlSocket

    control = ControlSocket("tcp://127.0.0.1:0")
    try:
        with caplog.at_level(logging.DEBUG):
            outcome = await control.send_outcome(b"\x00k\x8bEg", AbortRequest(request_id="r1"))
    finally:
        control.close()
    assert outcome is SendOutcome.UNREACHABLE
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [r for r in caplog.records if "\\x" in r.getMessage()]
