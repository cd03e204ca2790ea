"""The KV data path of each prefill/decode pair, as the gateway sees it (gateway/canary.py): the pairing
canary's round trip (reserve on decode, send on prefill, result), the path in the status view, the log and
``pdserve_kv_path_gbps``, the path the workers' placements allow and a canary far below its floor as a
warning (``pdserve_kv_path_slow``), a wedged path out of routing by the deadline and back after a later
canary lands, a canary the prefill worker skipped for want of blocks; with fake worker processes, a wedged
pair named by /v1/status."""

from __future__ import annotations

import logging

import httpx
import msgspec
import pytest

from gateway.canary import PATH_FLOOR_GBPS, CanaryTracker, expected_path
from gateway.metrics import GatewayMetrics
from gateway.prefix_index import PrefixIndex
from gateway.registry import WorkerRegistry
from gateway.router import NoWorkerError, Router
from gateway.status import readiness
from kvtransfer.compat import KVCompat
from protocol.messages import (
    AbortRequest,
    KVCanaryReserve,
    KVCanaryReserved,
    KVCanaryResult,
    KVCanarySend,
    KVPlacement,
    Message,
    RegisterWorker,
    WorkerLoad,
)
from tests.gateway.conftest import wait_until

TIMEOUT = 2.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


ONE_HOST_CPU = KVPlacement(host="boot-a", device="cpu")

P1_SENDER_EPOCH = 5150  # p1's KV sender epoch, from its registration


def _register(wid: str, role: str, placement: KVPlacement = ONE_HOST_CPU) -> RegisterWorker:
    compat = KVCompat(dtype="float32", block_size=16, transfer_backend="loopback")
    return RegisterWorker(role=role, worker_id=wid, epoch=1, model="m", model_path="",  # type: ignore[arg-type]
                          compat=compat, load=WorkerLoad(num_total_blocks=64, num_free_blocks=64),
                          placement=placement, kv_sender_epoch=P1_SENDER_EPOCH if role == "prefill" else 0)


class Setup:
    def __init__(self, period: float = 0.0, prefill: KVPlacement = ONE_HOST_CPU,
                 decode: KVPlacement = ONE_HOST_CPU) -> None:
        self.clock, self.sent = Clock(), []
        self.registry = WorkerRegistry(60.0, clock=self.clock)
        for wid, role, placement in (("p1", "prefill", prefill), ("d1", "decode", decode)):
            self.registry.register(_register(wid, role, placement), wid.encode())
        self.metrics = GatewayMetrics()
        self.canaries = CanaryTracker(self.registry, self.metrics, self.send, TIMEOUT, period,
                                      num_bytes=8 << 20, clock=self.clock)
        self.router = Router(self.registry, PrefixIndex(), blocked=self.canaries.blocked)

    async def send(self, identity: bytes, msg: Message) -> bool:
        self.sent.append((identity, msg))
        return True

    def take(self, cls: type) -> list:
        out = [(i, m) for i, m in self.sent if isinstance(m, cls)]
        self.sent = [(i, m) for i, m in self.sent if not isinstance(m, cls)]
        return out

    async def land(self, seconds: float = 0.001, num_bytes: int = 1 << 20,
                   transport: str = "loopback", wire_seconds: float = 0.0) -> str:
        """Answer the canary in flight as the workers would; returns its id."""
        [(ident, reserve)] = self.take(KVCanaryReserve)
        assert ident == b"d1" and reserve.prefill_worker_id == "p1" and reserve.timeout_s == TIMEOUT
        assert reserve.prefill_sender_epoch == P1_SENDER_EPOCH  # the fence: only this incarnation of p1
        assert reserve.num_bytes == 8 << 20
        await self.canaries.on_reserved(KVCanaryReserved(canary_id=reserve.canary_id, worker_id="d1",
                                                         kv_handle=b"handle"))
        [(ident, send)] = self.take(KVCanarySend)
        assert ident == b"p1" and send.kv_handle == b"handle"
        await self.canaries.on_result(KVCanaryResult(canary_id=send.canary_id, worker_id="p1", ok=True,
                                                     num_bytes=num_bytes, seconds=seconds,
                                                     transport=transport, wire_seconds=wire_seconds))
        return str(send.canary_id)

    def gauge(self, transport: str) -> float | None:
        return self.metrics.registry.get_sample_value(
            "pdserve_kv_path_gbps", {"prefill": "p1", "decode": "d1", "transport": transport})

    def slow(self) -> float | None:
        return self.metrics.registry.get_sample_value("pdserve_kv_path_slow",
                                                      {"prefill": "p1", "decode": "d1"})


async def test_pairing_canary_measures_the_path(caplog: pytest.LogCaptureFixture) -> None:
    s = Setup()
    with caplog.at_level(logging.INFO, logger="pdserve.gateway"):
        await s.canaries.tick()
        await s.land(seconds=0.5, num_bytes=4_000_000)  # the first one pays for the handshake
        assert readiness(s.registry, s.canaries).pairs[0].path is None
        await s.canaries.tick()  # ... and the next, sent at once, measures the path
        await s.land(seconds=0.002, num_bytes=4_000_000)
    [pair] = readiness(s.registry, s.canaries).pairs
    assert pair.usable and pair.path is not None
    assert (pair.path.transport, pair.path.gbps, pair.path.num_bytes, pair.path.warning) == (
        "loopback", 2.0, 4_000_000, "")
    assert (pair.path.expected, pair.path.floor_gbps) == ("shm", PATH_FLOOR_GBPS["shm"])
    assert s.gauge("loopback") == 2.0 and s.slow() == 0.0
    [rec] = [r for r in caplog.records if r.getMessage() == "kv_path_measured"]
    assert (rec.transport, rec.gbps, rec.levelno) == ("loopback", 2.0, logging.INFO)  # type: ignore[attr-defined]
    s.clock.now += 1000
    await s.canaries.tick()
    assert s.take(KVCanaryReserve) == []  # period 0: only at pairing


def test_expected_path_follows_the_placements() -> None:
    gpu_a, gpu_b = KVPlacement(host="a", device="cuda"), KVPlacement(host="b", device="cuda")
    rdma_a, rdma_b = KVPlacement(host="a", device="cuda", rdma=True), KVPlacement(host="b", device="cuda",
                                                                                  rdma=True)
    cpu_a, cpu_b = KVPlacement(host="a", device="cpu"), KVPlacement(host="b", device="cpu")
    unknown = KVPlacement(host="", device="cuda")
    cases = [(gpu_a, gpu_a, "cuda_ipc"), (rdma_a, rdma_b, "rdma"), (gpu_a, rdma_b, "tcp"),
             (gpu_a, gpu_b, "tcp"), (cpu_a, cpu_a, "shm"), (cpu_a, cpu_b, "tcp"), (gpu_a, cpu_a, "shm"),
             (unknown, unknown, "tcp")]
    assert [expected_path(p, d).name for p, d, _ in cases] == [name for _, _, name in cases]
    assert all(expected_path(p, d).floor_gbps == PATH_FLOOR_GBPS[name] for p, d, name in cases)
    # each floor is above the next slower path's: TCP where CUDA IPC was expected is always reported
    floors = [PATH_FLOOR_GBPS[name] for name in ("cuda_ipc", "rdma", "shm", "tcp")]
    assert floors == sorted(floors, reverse=True) and len(set(floors)) == 4


async def test_tcp_speed_where_cuda_ipc_was_expected_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    gpu = KVPlacement(host="boot-a", device="cuda")
    s = Setup(prefill=gpu, decode=gpu)
    with caplog.at_level(logging.INFO, logger="pdserve.gateway"):
        await s.canaries.tick()
        await s.land(transport="nixl")
        await s.canaries.tick()
        await s.land(seconds=0.008, num_bytes=16_000_000, transport="nixl")  # 2 GB/s: a TCP speed
    [pair] = readiness(s.registry, s.canaries).pairs
    assert pair.usable and pair.path is not None and pair.path.expected == "cuda_ipc"
    assert "far below" in pair.path.warning and "cuda_ipc" in pair.path.warning
    assert s.slow() == 1.0
    [rec] = [r for r in caplog.records if r.getMessage() == "kv_path_measured"]
    assert rec.levelno == logging.WARNING and "cuda_ipc" in rec.warning  # type: ignore[attr-defined]
    s.canaries.pairs[("p1", "d1")].next_at = 0.0  # period 0: measured again only by hand here
    await s.canaries.tick()
    # 10 ms end to end (control round trips), of which 0.4 ms on the wire: 40 GB/s, the path is fixed
    await s.land(seconds=0.01, num_bytes=16_000_000, transport="nixl", wire_seconds=0.0004)
    [pair] = readiness(s.registry, s.canaries).pairs
    assert pair.path is not None and pair.path.warning == "" and s.slow() == 0.0
    assert (pair.path.gbps, pair.path.seconds, pair.path.wire_seconds) == (40.0, 0.01, 0.0004)


async def test_periodic_canary_waits_for_idle_workers_and_a_loaded_warning_says_so() -> None:
    """A due periodic canary waits while either worker reports requests (they share the path), at most one
    further period; a slow reading taken under load is still a warning, naming the load."""
    gpu = KVPlacement(host="boot-a", device="cuda")
    s = Setup(period=30.0, prefill=gpu, decode=gpu)
    for _ in range(2):  # the pairing canaries: measured while idle
        await s.canaries.tick()
        await s.land(seconds=0.001, num_bytes=40_000_000, transport="nixl")  # 40 GB/s
    assert s.slow() == 0.0
    busy, idle = WorkerLoad(num_running=3, num_total_blocks=64), WorkerLoad(num_total_blocks=64)
    s.registry.touch("d1", 1, busy)
    s.clock.now += 30  # due, but d1 runs 3 requests: postponed
    await s.canaries.tick()
    assert s.take(KVCanaryReserve) == []
    s.registry.touch("d1", 1, idle)  # idle now: measured at once
    await s.canaries.tick()
    await s.land(seconds=0.001, num_bytes=40_000_000, transport="nixl")
    s.registry.touch("d1", 1, busy)
    s.registry.touch("p1", 1, WorkerLoad(num_waiting=2, num_total_blocks=64))
    s.clock.now += 59.9  # due 29.9 s ago, busy all along: still waiting
    await s.canaries.tick()
    assert s.take(KVCanaryReserve) == []
    s.clock.now += 0.2  # a further period has passed: measured under load
    await s.canaries.tick()
    await s.land(seconds=0.004, num_bytes=16_000_000, transport="nixl")  # 4 GB/s
    [pair] = readiness(s.registry, s.canaries).pairs
    assert pair.path is not None and s.slow() == 1.0
    assert pair.path.warning.endswith("(measured under load: 5 requests on the two workers)")


async def test_canary_skipped_by_the_prefill_worker_leaves_the_pair_usable() -> None:
    s = Setup()
    await s.canaries.tick()
    await s.land()
    await s.canaries.tick()
    [(_, reserve)] = s.take(KVCanaryReserve)
    await s.canaries.on_reserved(KVCanaryReserved(canary_id=reserve.canary_id, worker_id="d1",
                                                  kv_handle=b"handle"))
    [(_, send)] = s.take(KVCanarySend)
    await s.canaries.on_result(KVCanaryResult(canary_id=send.canary_id, worker_id="p1", ok=False, num_bytes=0,
                                        seconds=0.0, transport="loopback", skipped=True,
                                        error="no 8 free KV blocks for the canary"))
    [pair] = readiness(s.registry, s.canaries).pairs
    assert pair.usable and pair.path is None
    [(ident, abort)] = s.take(AbortRequest)  # the decode worker's blocks are freed at once
    assert ident == b"d1" and abort.request_id == send.canary_id
    s.clock.now += TIMEOUT + 0.01  # tried again after the timeout
    await s.canaries.tick()
    assert len(s.take(KVCanaryReserve)) == 1


async def test_wedged_path_leaves_routing_at_the_deadline_and_comes_back() -> None:
    s = Setup(period=30.0)
    await s.canaries.tick()
    [(_, reserve)] = s.take(KVCanaryReserve)
    await s.canaries.on_reserved(KVCanaryReserved(canary_id=reserve.canary_id, worker_id="d1",
                                                  kv_handle=b"handle"))
    s.take(KVCanarySend)  # ... and the transfer never lands
    s.clock.now += TIMEOUT - 0.01
    await s.canaries.tick()
    assert s.router.route(list(range(8)), 4).prefill is not None  # still usable before the deadline
    s.clock.now += 0.02
    await s.canaries.tick()
    aborts = s.take(AbortRequest)
    assert sorted(i for i, _ in aborts) == [b"d1", b"p1"]
    assert {m.request_id for _, m in aborts} == {reserve.canary_id}
    body = readiness(s.registry, s.canaries)
    assert not body.ready and "did not land within 2 s" in body.reason
    assert not body.pairs[0].usable and "did not land" in body.pairs[0].reason
    with pytest.raises(NoWorkerError, match="did not land"):
        s.router.route(list(range(8)), 4)
    # a late result of the expired canary changes nothing
    await s.canaries.on_result(KVCanaryResult(canary_id=reserve.canary_id, worker_id="p1", ok=True,
                                        num_bytes=1, seconds=1.0, transport="loopback"))
    assert not readiness(s.registry, s.canaries).ready
    s.clock.now += TIMEOUT  # an unusable pair is tried again every timeout
    await s.canaries.tick()
    await s.land()
    assert readiness(s.registry, s.canaries).ready
    assert readiness(s.registry, s.canaries).pairs[0].path is None  # that one warmed the path up
    await s.canaries.tick()
    await s.land()
    assert readiness(s.registry, s.canaries).pairs[0].path is not None
    s.clock.now += 29
    await s.canaries.tick()
    assert s.take(KVCanaryReserve) == []
    s.clock.now += 1  # period 30 s
    await s.canaries.tick()
    await s.land()
    assert s.router.route(list(range(8)), 4).decode is not None


async def test_failed_canary_takes_the_pair_out_and_a_gone_worker_drops_its_series() -> None:
    s = Setup()
    for _ in range(2):
        await s.canaries.tick()
        await s.land()
    assert s.gauge("loopback") is not None
    s.clock.now += 1
    # a new incarnation of the decode worker: a new pair, a new canary; the old series goes
    s.registry.register(msgspec.structs.replace(_register("d1", "decode"), epoch=2), b"d1")
    await s.canaries.tick()
    assert s.gauge("loopback") is None
    [(_, reserve)] = s.take(KVCanaryReserve)
    await s.canaries.on_reserved(KVCanaryReserved(canary_id=reserve.canary_id, worker_id="d1",
                                                  kv_handle=b"h"))
    [(_, send)] = s.take(KVCanarySend)
    await s.canaries.on_result(KVCanaryResult(canary_id=send.canary_id, worker_id="p1", ok=False, num_bytes=0,
                                        seconds=0.0, transport="loopback", error="failed: peer lost"))
    body = readiness(s.registry, s.canaries)
    assert not body.ready and "KV canary failed: failed: peer lost" in body.pairs[0].reason


async def test_no_free_block_for_the_canary_changes_nothing() -> None:
    s = Setup()
    await s.canaries.tick()
    [(_, reserve)] = s.take(KVCanaryReserve)
    await s.canaries.on_reserved(KVCanaryReserved(canary_id=reserve.canary_id, worker_id="d1",
                                                  kv_handle=None, error="no free KV block"))
    assert s.take(KVCanarySend) == [] and readiness(s.registry, s.canaries).ready


@pytest.mark.slow
def test_fake_workers_pairing_canary_and_a_wedged_pair(make_cluster) -> None:
    """Through the gateway process: the pairing canary of fake workers shows in /v1/status and
    /metrics; a pair whose decode worker never answers canaries is out of routing within the deadline."""
    c = make_cluster(kv_canary_timeout=1)
    c.start_worker("prefill", "p1", canary_bytes=2_000_000, canary_seconds=0.01)
    c.start_worker("decode", "d1")
    wait_until(lambda: httpx.get(c.base + "/v1/status", timeout=5).json()["pairs"][0]["path"] is not None,
               5, "the pairing canary")
    [pair] = httpx.get(c.base + "/v1/status", timeout=5).json()["pairs"]
    assert pair["usable"] and pair["path"]["transport"] == "fake" and pair["path"]["gbps"] > 0
    assert c.metric("pdserve_kv_path_gbps", prefill="p1", decode="d1", transport="fake") > 0
    c.start_worker("decode", "d2", canary_wedged=1)

    def pairs() -> dict[tuple[str, str], dict]:
        body = httpx.get(c.base + "/v1/status", timeout=5).json()
        return {(p["prefill"], p["decode"]): p for p in body["pairs"]}

    wait_until(lambda: "did not land" in pairs().get(("p1", "d2"), {}).get("reason", ""), 5,
               "the wedged pair named")
    assert pairs()[("p1", "d1")]["usable"] and not pairs()[("p1", "d2")]["usable"]
    assert httpx.get(c.base + "/ready", timeout=5).status_code == 200  # p1/d1 still serves


async def test_no_canary_starts_on_a_draining_worker() -> None:
    """A worker that drains (asked to stop) is sent no new canary, pairing or periodic, that would hold
    up its stop; the canary of a pair whose workers drain no more starts again."""
    s = Setup(period=60.0)
    assert s.registry.touch("d1", 1, WorkerLoad(num_total_blocks=64, num_free_blocks=64, draining=True))
    await s.canaries.tick()
    assert s.take(KVCanaryReserve) == []  # the pairing canary waits
    assert s.registry.touch("d1", 1, WorkerLoad(num_total_blocks=64, num_free_blocks=64))
    s.canaries.pairs[("p1", "d1")].next_at = 0.0
    await s.canaries.tick()
    await s.land()
    s.clock.now += 1000  # the periodic canary is due
    assert s.registry.touch("p1", 1, WorkerLoad(num_total_blocks=64, num_free_blocks=64, draining=True))
    await s.canaries.tick()
    assert s.take(KVCanaryReserve) == []
