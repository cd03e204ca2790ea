"""The gateway's prefix index fed by the workers' KV events: snapshots and deltas, gaps in their numbers
(state unknown, a snapshot asked once per interval), epochs, pending entries of routed prompts (expiring,
ranked below reported blocks); two gateways fed the same events route a warmed prefix alike; the
service applies events of registered workers only, asks for a snapshot after a gap and forgets a worker
that leaves."""

from __future__ import annotations

from typing import cast

import pytest

from gateway.control_socket import SendOutcome
from gateway.metrics import GatewayMetrics
from gateway.prefix_index import PrefixIndex, PrefixMatch, block_hashes
from gateway.registry import WorkerRegistry
from gateway.router import Router
from gateway.service import GatewayService
from kvtransfer.compat import KVCompat
from protocol.messages import KVEvents, KVSnapshotRequest, Message, RegisterWorker, WorkerLoad, WorkerShutdown
from protocol.settings import GatewaySettings

BS = 4
PROMPT = list(range(100, 121))  # 5 full blocks and one token
CHAIN = block_hashes(PROMPT, BS)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ev(seq_no: int, stored: list[int] | None = None, removed: list[int] | None = None, snapshot: bool = False,
       worker_id: str = "p1", epoch: int = 1) -> KVEvents:
    return KVEvents(worker_id=worker_id, epoch=epoch, seq_no=seq_no, stored=stored or [],
                    removed=removed or [], snapshot=snapshot)


def test_snapshot_then_deltas_mirror_the_cache() -> None:
    index = PrefixIndex()
    assert index.match("p1", CHAIN) == PrefixMatch(0, 0) and not index.synced("p1")
    assert index.apply(ev(1, CHAIN[:2], snapshot=True)) == "snapshot"
    assert index.synced("p1") and index.match("p1", CHAIN) == PrefixMatch(2, 2)
    assert index.apply(ev(2, CHAIN[2:4])) == "delta"
    assert index.match("p1", CHAIN) == PrefixMatch(4, 4) and index.num_cached("p1") == 4
    assert index.apply(ev(3, removed=[CHAIN[1]])) == "delta"  # block 1 evicted: the match stops at it
    assert index.match("p1", CHAIN) == PrefixMatch(1, 1) and index.num_cached("p1") == 3
    assert index.apply(ev(4, snapshot=True)) == "snapshot"  # an empty snapshot: the cache is empty
    assert index.match("p1", CHAIN) == PrefixMatch(0, 0) and index.num_cached("p1") == 0


def test_a_gap_makes_the_state_unknown_until_a_snapshot() -> None:
    clock = Clock()
    index = PrefixIndex(resync_interval=1.0, clock=clock)
    assert index.apply(ev(1, CHAIN[:3], snapshot=True)) == "snapshot"
    assert index.apply(ev(3, [CHAIN[3]])) == "gap"  # seq_no 2 never came
    assert index.match("p1", CHAIN) == PrefixMatch(0, 0) and not index.synced("p1")
    assert index.apply(ev(4, [CHAIN[4]])) == "waiting"  # asked less than a second ago
    clock.now += 1.5
    assert index.apply(ev(5)) == "gap"  # no snapshot came within the interval: ask again
    assert index.apply(ev(6, CHAIN[:4], snapshot=True)) == "snapshot"
    assert index.match("p1", CHAIN) == PrefixMatch(4, 4)
    assert index.apply(ev(5, [CHAIN[4]])) == "stale"  # older than the snapshot: already in it
    assert index.apply(ev(7, [CHAIN[4]])) == "delta"
    assert index.match("p1", CHAIN).cached == 5


def test_deltas_before_any_snapshot_ask_for_one() -> None:
    """A gateway started after the worker sees a delta numbered past 1 and no snapshot yet."""
    index = PrefixIndex()
    assert index.apply(ev(9, CHAIN[:2])) == "gap"
    assert index.match("p1", CHAIN) == PrefixMatch(0, 0)


def test_a_new_epoch_replaces_the_old_state() -> None:
    index = PrefixIndex()
    index.apply(ev(1, CHAIN, snapshot=True))
    assert index.apply(ev(1, CHAIN[:1], snapshot=True, epoch=2)) == "snapshot"
    assert index.match("p1", CHAIN).cached == 1
    index.remove_worker("p1")
    assert index.match("p1", CHAIN) == PrefixMatch(0, 0) and index.num_cached("p1") == 0


def test_pending_entries_count_until_reported_or_expired() -> None:
    clock = Clock()
    index = PrefixIndex(pending_ttl=5.0, clock=clock)
    index.apply(ev(1, CHAIN[:1], snapshot=True))
    index.expect("p1", CHAIN)
    assert index.match("p1", CHAIN) == PrefixMatch(1, 5)
    index.apply(ev(2, CHAIN[1:3]))  # reported stored: no longer pending, now cached
    clock.now += 6.0  # the pending entries of blocks 3, 4 expired
    assert index.match("p1", CHAIN) == PrefixMatch(3, 3)
    index.expect("w-never-reports", CHAIN)  # a worker that sends no events: pending entries only
    assert index.match("w-never-reports", CHAIN) == PrefixMatch(0, 5)
    clock.now += 6.0
    assert index.match("w-never-reports", CHAIN) == PrefixMatch(0, 0)
    with pytest.raises(ValueError, match="pending_ttl"):
        PrefixIndex(pending_ttl=0)


def test_pending_entries_are_bounded() -> None:
    index = PrefixIndex(max_pending=3)
    index.expect("p1", CHAIN)  # 5 blocks: the 2 oldest dropped
    assert index.match("p1", CHAIN) == PrefixMatch(0, 0)
    assert index.match("p1", CHAIN[:2]) == PrefixMatch(0, 0)


def _reg(wid: str, role: str = "prefill", epoch: int = 1) -> RegisterWorker:
    return RegisterWorker(role=role, worker_id=wid, epoch=epoch, model="m", model_path="",  # type: ignore[arg-type]
                          compat=KVCompat(model_id="m", dtype="bfloat16", block_size=BS),
                          load=WorkerLoad(num_free_blocks=100, num_total_blocks=100))


def _router(order: list[str], clock: Clock) -> Router:
    registry = WorkerRegistry(heartbeat_timeout=5.0, clock=clock)
    for wid in order:
        registry.register(_reg(wid, "decode" if wid == "d" else "prefill"), wid.encode())
    return Router(registry, PrefixIndex(clock=clock))


def test_two_gateways_fed_the_same_events_route_a_warmed_prefix_alike() -> None:
    """Registered in different orders, each with its own routing history (pending entries), two gateways
    given the same KV events send a prompt whose prefix p2 reported to p2; and a third prompt, cached
    nowhere, to the same worker too (ties broken by worker id, not registration order)."""
    clock = Clock()
    a = _router(["p1", "p2", "p3", "d"], clock)
    b = _router(["d", "p3", "p2", "p1"], clock)
    early = a.route(PROMPT, 4)  # gateway a alone routed the prompt before any event: pending on p1
    assert early.prefill is not None and early.prefill.worker_id == "p1"
    assert a.prefix_index.match("p1", CHAIN) == PrefixMatch(0, 5)
    for gw in (a, b):
        gw.prefix_index.apply(ev(1, snapshot=True, worker_id="p1"))
        gw.prefix_index.apply(ev(1, CHAIN[:3], snapshot=True, worker_id="p2"))
        gw.prefix_index.apply(ev(1, snapshot=True, worker_id="p3"))
        gw.prefix_index.apply(ev(2, CHAIN[3:5], worker_id="p2"))
    ra, rb = a.route(PROMPT, 4), b.route(PROMPT, 4)
    assert ra.prefill is not None and rb.prefill is not None
    assert ra.prefill.worker_id == rb.prefill.worker_id == "p2"
    assert (ra.prefix_blocks, ra.prompt_blocks) == (rb.prefix_blocks, rb.prompt_blocks) == (5, 5)
    cold = list(range(900, 913))
    ca, cb = a.route(cold, 4), b.route(cold, 4)
    assert ca.prefill is not None and cb.prefill is not None
    assert ca.prefill.worker_id == cb.prefill.worker_id == "p1"


def test_reported_blocks_outrank_pending_ones() -> None:
    """p1 has 2 blocks reported; this gateway just routed the whole prompt to p3 (pending): the next
    request with the prompt goes to p3 only while nothing reported beats it."""
    clock = Clock()
    router = _router(["p1", "p3", "d"], clock)
    router.prefix_index.expect("p3", CHAIN)
    first = router.route(PROMPT, 4)
    assert first.prefill is not None and first.prefill.worker_id == "p3"  # pending 5 blocks vs nothing
    router.prefix_index.apply(ev(1, CHAIN[:2], snapshot=True, worker_id="p1"))
    second = router.route(PROMPT, 4)
    assert second.prefill is not None and second.prefill.worker_id == "p1" and second.prefix_blocks == 2


class _Control:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Message]] = []

    async def send(self, identity: bytes, msg: Message) -> bool:
        return await self.send_outcome(identity, msg) is SendOutcome.SENT

    async def send_outcome(self, identity: bytes, msg: Message) -> SendOutcome:
        self.sent.append((identity, msg))
        return SendOutcome.SENT


async def test_service_applies_events_of_registered_workers_and_asks_for_a_snapshot_after_a_gap() -> None:
    metrics = GatewayMetrics()
    svc = GatewayService(GatewaySettings(heartbeat_timeout=60.0, insecure_control_plane=True), metrics)
    control = _Control()
    svc.control = control  # type: ignore[assignment]
    index = svc.router.prefix_index
    await svc.on_control_message(b"p1", ev(1, CHAIN, snapshot=True))  # not registered: dropped
    assert index.num_cached("p1") == 0
    await svc.on_control_message(b"p1", _reg("p1", epoch=5))
    await svc.on_control_message(b"p1", ev(1, CHAIN, snapshot=True, epoch=4))  # another incarnation
    assert index.num_cached("p1") == 0
    await svc.on_control_message(b"p1", ev(1, CHAIN[:2], snapshot=True, epoch=5))
    await svc.on_control_message(b"p1", ev(2, CHAIN[2:3], epoch=5))
    assert index.num_cached("p1") == 3
    assert metrics.prefix_index_blocks.labels("p1", "prefill").get() == 3
    control.sent.clear()
    await svc.on_control_message(b"p1", ev(4, CHAIN[3:4], epoch=5))  # 3 lost
    asks = [(i, m) for i, m in control.sent if isinstance(m, KVSnapshotRequest)]
    assert asks == [(b"p1", KVSnapshotRequest(worker_id="p1", epoch=5))]
    assert index.num_cached("p1") == 0
    for kind, n in (("snapshot", 1), ("delta", 1), ("gap", 1)):
        assert metrics.kv_events.labels(kind)._value.get() == n
    await svc.on_control_message(b"p1", ev(5, CHAIN, snapshot=True, epoch=5))
    assert index.num_cached("p1") == 5
    await svc.on_control_message(b"p1", WorkerShutdown(worker_id="p1", epoch=5))
    assert index.num_cached("p1") == 0
    assert cast(list[object], next(iter(metrics.prefix_index_blocks.collect())).samples) == []


def test_a_hit_counts_only_what_the_worker_can_serve() -> None:
    """Never the block that holds the prompt's last token; whole grid chunks on a --prefill-grid worker."""
    from gateway.prefix_index import PrefixMatch
    from gateway.router import _usable

    assert _usable(PrefixMatch(4, 4), prompt_len=64, block_size=16, prefill_grid=0) == PrefixMatch(3, 3)
    assert _usable(PrefixMatch(4, 5), prompt_len=80, block_size=16, prefill_grid=0) == PrefixMatch(4, 4)
    assert _usable(PrefixMatch(7, 9), prompt_len=200, block_size=16, prefill_grid=64) == PrefixMatch(4, 8)
