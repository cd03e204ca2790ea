"""Worker registry (epochs, heartbeats, death) and routing (load, prefix, pairing, conditional disagg)."""

from __future__ import annotations

import pytest

from gateway.prefix_index import PrefixIndex, block_hashes
from gateway.registry import WorkerRegistry, pairing_mismatch
from gateway.router import NoWorkerError, Router
from gateway.status import readiness
from kvtransfer.compat import KVCompat
from protocol.messages import KVEvents, RegisterWorker, WorkerLoad


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def reg(wid: str, role: str, epoch: int = 1, block_size: int = 4, dtype: str = "bfloat16",
        running: int = 0, free: int = 100) -> RegisterWorker:
    return RegisterWorker(role=role, worker_id=wid, epoch=epoch, model="m", model_path="",  # type: ignore[arg-type]
                          compat=KVCompat(model_id="m", dtype=dtype, block_size=block_size),
                          load=WorkerLoad(num_running=running, num_free_blocks=free, num_total_blocks=100))


def make(*workers: RegisterWorker, threshold: int = 0, local: bool = False) -> tuple[WorkerRegistry, Router]:
    registry = WorkerRegistry(heartbeat_timeout=5.0, clock=Clock())
    for w in workers:
        assert registry.register(w, w.worker_id.encode()) == (None, "")
    return registry, Router(registry, PrefixIndex(), threshold, local)


def test_epochs_replace_and_refuse_stale() -> None:
    registry, _ = make(reg("d", "decode", epoch=5))
    old, reason = registry.register(reg("d", "decode", epoch=4), b"x")
    assert old is None and "stale epoch 4" in reason
    assert registry.get("d").info.epoch == 5  # type: ignore[union-attr]
    old, reason = registry.register(reg("d", "decode", epoch=6), b"y")
    assert reason == "" and old is not None and old.info.epoch == 5
    assert registry.get("d").identity == b"y"  # type: ignore[union-attr]
    assert registry.touch("d", 5) is None  # heartbeats of the old epoch are ignored


def test_same_epoch_registration_is_idempotent() -> None:
    """A worker answering several queued ReRegister messages registers the same epoch repeatedly:
    the first is a registration, the rest only refresh it (no refusal, no failed requests)."""
    registry, _ = make(reg("d", "decode", epoch=5))
    registry.get("d").requests.add("r1")  # type: ignore[union-attr]
    old, reason = registry.register(reg("d", "decode", epoch=5), b"z")
    assert (old, reason) == (None, "")
    entry = registry.get("d")
    assert entry is not None and entry.identity == b"z" and entry.requests == {"r1"}


def test_dead_after_heartbeat_timeout() -> None:
    clock = Clock()
    registry = WorkerRegistry(heartbeat_timeout=5.0, clock=clock)
    registry.register(reg("a", "decode"), b"a")
    registry.register(reg("b", "decode"), b"b")
    clock.now += 4.0
    assert registry.touch("a", 1, WorkerLoad(num_running=3)) is not None
    clock.now += 2.0  # b silent for 6 s, a for 2 s
    dead = registry.reap()
    assert [e.worker_id for e in dead] == ["b"]
    assert [e.worker_id for e in registry.live()] == ["a"]
    assert registry.get("a").load.num_running == 3  # type: ignore[union-attr]


def test_pairing_mismatch_names_each_field() -> None:
    msg = pairing_mismatch(reg("p", "prefill", block_size=16), reg("d", "decode", block_size=32,
                                                                   dtype="float16"))
    assert msg is not None and "block_size 16 != 32" in msg and "dtype 'bfloat16' != 'float16'" in msg
    assert pairing_mismatch(reg("p", "prefill"), reg("d", "decode")) is None


def test_workers_on_different_prefill_grids_are_not_paired() -> None:
    import msgspec

    on_grid = KVCompat(model_id="m", dtype="bfloat16", block_size=4, prefill_grid=512)
    grid = msgspec.structs.replace(reg("d", "decode"), compat=on_grid)
    assert pairing_mismatch(reg("p", "prefill"), grid) == "p / d: prefill_grid 0 != 512"


def tp_record(tp_size: int, total: int, backend: str = "nixl") -> KVCompat:
    """Rank 0's pairing record of a worker splitting `total` KV heads over `tp_size` ranks."""
    from kvtransfer.head_map import rank_kv_heads

    placement = rank_kv_heads(total, tp_size)
    heads = placement[0][1]
    return KVCompat(model_id="m", dtype="bfloat16", block_size=4, num_layers=2, num_kv_heads=heads,
                    head_dim=8, block_strides=(4 * heads * 8, heads * 8, 8, 1), tp_size=tp_size,
                    total_kv_heads=total, rank_kv_heads=placement, transfer_backend=backend)


def test_tensor_parallel_shapes_pair_when_their_heads_map() -> None:
    import msgspec

    def pair(p: KVCompat, d: KVCompat) -> str | None:
        return pairing_mismatch(msgspec.structs.replace(reg("p", "prefill"), compat=p),
                                msgspec.structs.replace(reg("d", "decode"), compat=d))

    for p, d in ((2, 1), (1, 2), (2, 2)):
        assert pair(tp_record(p, 4), tp_record(d, 4)) is None
    msg = pair(tp_record(2, 4, "ucx"), tp_record(1, 4, "ucx"))
    assert msg is not None and msg.startswith("p / d: transfer_backend 'ucx' writes whole blocks only")
    assert "prefill tp_size 2 heads [(0, 2), (2, 2)], decode tp_size 1 heads [(0, 4)]" in msg
    _, router = make(msgspec.structs.replace(reg("p", "prefill"), compat=tp_record(2, 4, "ucx")),
                     msgspec.structs.replace(reg("d", "decode"), compat=tp_record(1, 4, "ucx")))
    with pytest.raises(NoWorkerError, match="transfer_backend 'ucx' writes whole blocks only"):
        router.route([1, 2, 3], max_tokens=5)


def test_least_loaded_decode_and_compatible_pair_only() -> None:
    _, router = make(reg("p", "prefill"), reg("d1", "decode", running=5), reg("d2", "decode", running=1),
                     reg("d3", "decode", running=0, block_size=8))
    route = router.route(list(range(10)), max_tokens=8)
    assert route.kind == "disaggregated"
    assert route.prefill.worker_id == "p"  # type: ignore[union-attr]
    assert route.decode is not None
    assert route.decode.worker_id == "d2"  # d3 is idle but incompatible


def test_incompatible_only_raises_with_reason() -> None:
    _, router = make(reg("p", "prefill"), reg("d", "decode", block_size=8))
    with pytest.raises(NoWorkerError, match="block_size 4 != 8"):
        router.route([1, 2, 3], max_tokens=5)


def test_prefix_affinity_among_least_loaded() -> None:
    registry, router = make(reg("p1", "prefill"), reg("p2", "prefill"), reg("d", "decode"))
    prompt = list(range(40))
    router.prefix_index.apply(KVEvents(worker_id="p2", epoch=1, seq_no=1, snapshot=True,
                                       stored=block_hashes(prompt[:32], 4)))
    route = router.route(prompt, max_tokens=4)
    assert route.prefill.worker_id == "p2" and route.prefix_blocks == 8  # type: ignore[union-attr]
    assert route.prompt_blocks == 10
    # p2 far more loaded than p1: load wins over the cached prefix
    registry.touch("p2", 1, WorkerLoad(num_running=10))
    assert router.route(prompt, max_tokens=4).prefill.worker_id == "p1"  # type: ignore[union-attr]


def test_colocated_workers_are_chosen_by_cached_prefix_among_least_loaded() -> None:
    registry, router = make(reg("c1", "colocated"), reg("c2", "colocated"))
    prompt = list(range(40))
    router.prefix_index.apply(KVEvents(worker_id="c2", epoch=1, seq_no=1, snapshot=True,
                                       stored=block_hashes(prompt[:32], 4)))
    route = router.route(prompt, max_tokens=4)
    assert route.kind == "colocated" and route.colocated.worker_id == "c2"  # type: ignore[union-attr]
    assert (route.prefix_blocks, route.prompt_blocks) == (8, 10)
    other = list(range(100, 140))  # cached nowhere: the less loaded worker, then pending on it
    registry.touch("c2", 1, WorkerLoad(num_running=1))
    first = router.route(other, max_tokens=4)
    assert first.colocated.worker_id == "c1" and first.prefix_blocks == 0  # type: ignore[union-attr]
    registry.touch("c1", 1, WorkerLoad(num_running=2))  # c1 busier now, within the slack: pending wins
    assert router.route(other, max_tokens=4).colocated.worker_id == "c1"  # type: ignore[union-attr]
    registry.touch("c2", 1, WorkerLoad(num_running=10))  # far more loaded: load wins over the prefix
    assert router.route(prompt, max_tokens=4).colocated.worker_id == "c1"  # type: ignore[union-attr]


def test_max_tokens_one_is_prefill_only() -> None:
    _, router = make(reg("p", "prefill"), reg("d", "decode"))
    route = router.route([1, 2, 3], max_tokens=1)
    assert route.kind == "prefill_only" and route.decode is None


def test_conditional_disaggregation_and_fallback() -> None:
    _, router = make(reg("p", "prefill"), reg("d", "decode"), reg("c", "colocated"), threshold=8)
    assert router.route([1] * 7, 4).kind == "colocated"
    assert router.route([1] * 8, 4).kind == "disaggregated"
    _, strict = make(reg("d", "decode"), reg("c", "colocated"))
    with pytest.raises(NoWorkerError, match="no live prefill worker"):
        strict.route([1] * 20, 4)
    _, lenient = make(reg("d", "decode"), reg("c", "colocated"), local=True)
    route = lenient.route([1] * 20, 4)
    assert route.kind == "colocated" and route.fallback
    _, coloc_only = make(reg("c", "colocated"))
    route = coloc_only.route([1] * 20, 4)
    assert route.kind == "colocated" and not route.fallback


def test_no_workers_raises() -> None:
    _, router = make()
    with pytest.raises(NoWorkerError, match=r"^no live worker$"):
        router.route([1], 4)
    _, router = make(reg("c", "colocated"))
    with pytest.raises(NoWorkerError, match=r"^no live worker besides c$"):
        router.route([1], 4, exclude=frozenset({"c"}))


def test_readiness_names_an_empty_fleet_without_speaking_of_pairs() -> None:
    """An empty fleet (or one whose colocated worker was dropped) is "no live worker"; the pair wording
    is kept for a fleet with prefill or decode workers."""
    registry, _ = make()
    assert readiness(registry).reason == ("no live worker (neither a colocated worker nor a prefill and a "
                                          "decode worker)")
    registry, _ = make(reg("c", "colocated"))
    assert readiness(registry).reason == "colocated worker live"
    dropped = registry.remove("c", 1)
    assert dropped is not None
    registry.record_dropped(dropped, "worker shut down")
    view = readiness(registry)
    assert not view.ready and view.reason.startswith("no live worker (neither")
    assert "dropped: c (colocated) worker shut down" in view.reason
    registry, _ = make(reg("p", "prefill"))
    assert readiness(registry).reason == "no compatible prefill+decode pair (1 prefill, 0 decode)"


def test_block_hashes_chain_and_validation() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2
    assert a[1] != b[1]  # same second block, different prefix → different hash
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1], 0)


def test_decode_prefix_affinity_among_least_loaded() -> None:
    registry, router = make(reg("p", "prefill"), reg("d1", "decode", free=90), reg("d2", "decode", free=50))
    prompt = list(range(40))  # 10 full blocks of 4
    assert router.route(prompt, max_tokens=4).decode.worker_id == "d1"  # type: ignore[union-attr]
    router.prefix_index = PrefixIndex()  # forget what was routed (pending entries)
    router.prefix_index.apply(KVEvents(worker_id="d2", epoch=1, seq_no=1, snapshot=True,
                                       stored=block_hashes(prompt, 4)))
    route = router.route(prompt, max_tokens=4)
    # all 10 reported, 9 usable: the block holding the prompt's last token is always sent
    assert route.decode.worker_id == "d2" and route.decode_prefix_blocks == 9  # type: ignore[union-attr]
    assert route.prefix_blocks == 0 and route.prompt_blocks == 10
    registry.touch("d2", 1, WorkerLoad(num_running=2, num_free_blocks=50))  # within the slack of 2: kept
    assert router.route(prompt, max_tokens=4).decode.worker_id == "d2"  # type: ignore[union-attr]
    registry.touch("d2", 1, WorkerLoad(num_running=10, num_free_blocks=50))  # load wins over the prefix
    route = router.route(prompt, max_tokens=4)
    assert route.decode.worker_id == "d1" and route.decode_prefix_blocks == 0  # type: ignore[union-attr]


def test_decode_routed_prefix_counts_as_pending_and_grid_rounds_the_hit() -> None:
    import msgspec

    grid = KVCompat(model_id="m", dtype="bfloat16", block_size=4, prefill_grid=16)
    p, d1, d2 = (msgspec.structs.replace(reg(w, role), compat=grid)
                 for w, role in (("p", "prefill"), ("d1", "decode"), ("d2", "decode")))
    _, router = make(p, d1, d2)
    prompt = list(range(40))
    first = router.route(prompt, max_tokens=4).decode
    assert first is not None and first.worker_id == "d1"  # equal load and free blocks: by worker id
    assert router.prefix_index.match("d1", block_hashes(prompt, 4)).pending == 10
    router.prefix_index.apply(KVEvents(worker_id="d2", epoch=1, seq_no=1, snapshot=True,
                                       stored=block_hashes(prompt[:28], 4)))
    route = router.route(prompt, max_tokens=4)  # d2's 7 reported blocks beat d1's pending ones
    assert route.decode.worker_id == "d2"  # type: ignore[union-attr]
    assert route.decode_prefix_blocks == 4  # 7 reported, whole 4-block grid chunks only


def _drain(registry: WorkerRegistry, wid: str) -> None:
    entry = registry.get(wid)
    assert entry is not None
    assert registry.touch(wid, entry.info.epoch, WorkerLoad(num_total_blocks=100, num_free_blocks=100,
                                                             draining=True)) is entry


def test_a_draining_worker_gets_no_new_request_and_stops_counting_for_ready() -> None:
    """A worker whose heartbeat says ``draining`` (asked to stop, finishing what it holds) stays
    registered, with its requests, but is routed nothing new; ``/ready`` and ``/v1/status`` say so."""
    registry, router = make(reg("p", "prefill"), reg("d1", "decode", running=0),
                            reg("d2", "decode", running=9))
    assert router.route([1, 2, 3], 8).decode.worker_id == "d1"  # type: ignore[union-attr]
    registry.get("d1").requests.add("held")  # type: ignore[union-attr]
    _drain(registry, "d1")
    for _ in range(3):  # the busier one, the only one left
        assert router.route([1, 2, 3], 8).decode.worker_id == "d2"  # type: ignore[union-attr]
    assert [e.worker_id for e in registry.live("decode")] == ["d1", "d2"]  # still registered
    assert [e.worker_id for e in registry.routable("decode")] == ["d2"]
    assert registry.get("d1").requests == {"held"}  # type: ignore[union-attr]
    status = readiness(registry)
    assert status.ready and [w.draining for w in status.workers] == [False, True, False]
    [pair_d1] = [p for p in status.pairs if p.decode == "d1"]
    assert not pair_d1.usable and "d1 draining" in pair_d1.reason
    _drain(registry, "d2")
    with pytest.raises(NoWorkerError, match=r"no live decode worker \(d1, d2 draining: stopping\)"):
        router.route([1, 2, 3], 8)
    status = readiness(registry)
    assert not status.ready and "d1 / d2" not in status.reason and "d1 draining" in status.reason
    _drain(registry, "p")
    with pytest.raises(NoWorkerError, match=r"no live worker \(d1, d2, p draining: stopping\)"):
        router.route([1, 2, 3], 8)
    status = readiness(registry)
    assert not status.ready and status.reason.startswith("no worker takes requests: p, d1, d2 draining")
