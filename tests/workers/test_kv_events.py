"""Workers publish their prefix-cache changes (``WorkerLoop.kv_events``): a snapshot after an accepted
registration and on ``KVSnapshotRequest``, then one numbered delta per flush with the blocks a step
stored; every role (prefill, decode after the KV landed, colocated). A fresh gateway router fed only by
these events sends the prompt to the worker holding its prefix. Ends with the leak check."""

from __future__ import annotations

import asyncio

import msgspec

from gateway.prefix_index import PrefixIndex, block_hashes
from gateway.registry import WorkerRegistry
from gateway.router import Router
from protocol.messages import (
    ColocatedRequest,
    DecodeRequest,
    FirstToken,
    KVEvents,
    KVReserved,
    KVSnapshotRequest,
    PrefillRequest,
    RegisterAck,
    RequestFinished,
    ReserveKV,
    encode,
)
from tests.workers.helpers import (
    BLOCK_SIZE,
    assert_clean,
    close,
    colocated_worker,
    decode_worker,
    of_type,
    prefill_worker,
    pump,
    run,
    wire,
)
from workers.loop import WorkerLoop

PROMPT = list(range(30, 43))  # 13 tokens: 3 full blocks of 4 and one token


def _accept(w: WorkerLoop) -> None:
    w.sessions.accepted_by(RegisterAck(worker_id=w.worker_id, epoch=w.epoch, accepted=True, gateway_epoch=7))


def test_prefill_events_feed_a_fresh_router_that_picks_the_worker_holding_the_prefix(model_dir):
    prefill, decode = prefill_worker(model_dir), decode_worker(model_dir)
    try:
        _accept(prefill)
        snap = prefill.kv_events()
        assert snap == KVEvents(worker_id="p0", epoch=prefill.epoch, seq_no=1, snapshot=True)
        assert prefill.kv_events() is None  # nothing changed since
        sampling = wire(3, ignore_eos=True)
        [res] = of_type(run(decode, ReserveKV(request_id="r", prompt_token_ids=PROMPT, sampling=sampling,
                                              prefill_worker_id="p0",
                                              prefill_sender_epoch=prefill.sender.epoch)), KVReserved)
        msgs = run(prefill, PrefillRequest(request_id="r", prompt_token_ids=PROMPT, sampling=sampling,
                                           kv_handle=res.kv_handle, decode_worker_id="d0"))
        pump([prefill], lambda: bool(of_type(msgs, FirstToken)), sink=msgs)
        [first] = of_type(msgs, FirstToken)
        chain = block_hashes(PROMPT, BLOCK_SIZE)
        delta = prefill.kv_events()
        assert delta == KVEvents(worker_id="p0", epoch=prefill.epoch, seq_no=2, stored=chain)
        # the decode worker publishes the prompt's blocks once the KV landed and it decodes
        pump([prefill, decode], lambda: not prefill.sending)
        out = run(decode, DecodeRequest(request_id="r", first_token_id=first.token_id))
        pump([decode], lambda: bool(of_type(out, RequestFinished)), sink=out)
        decoded = decode.kv_events()
        assert decoded is not None and decoded.seq_no == 1 and not decoded.snapshot
        assert decoded.stored[:3] == chain

        # a gateway that saw nothing but these events: p0 holds the prefix, p1 (empty) is as loaded
        registry = WorkerRegistry(heartbeat_timeout=60.0)
        registry.register(msgspec.structs.replace(prefill.registration(), worker_id="p1"), b"p1")
        registry.register(prefill.registration(), b"p0")
        registry.register(decode.registration(), b"d0")
        router = Router(registry, PrefixIndex())
        for events in (snap, delta, KVEvents(worker_id="p1", epoch=prefill.epoch, seq_no=1, snapshot=True)):
            assert router.prefix_index.apply(events) in ("snapshot", "delta")
        route = router.route([*PROMPT, 99, 98, 97], max_tokens=4)
        assert route.prefill is not None and route.prefill.worker_id == "p0"
        assert (route.prefix_blocks, route.prompt_blocks) == (3, 4)

        # a snapshot on request holds the same blocks, with the next number
        prefill.want_kv_snapshot()
        again = prefill.kv_events()
        assert again is not None and again.snapshot and again.seq_no == 3
        assert sorted(again.stored) == sorted(chain)
        assert_clean(prefill, decode)
    finally:
        close(prefill)
        close(decode)


def test_colocated_worker_publishes_stored_and_evicted_blocks(model_dir):
    colo = colocated_worker(model_dir, num_blocks=8)
    try:
        msgs = run(colo, ColocatedRequest(request_id="a", prompt_token_ids=PROMPT,
                                          sampling=wire(2, ignore_eos=True)))
        pump([colo], lambda: bool(of_type(msgs, RequestFinished)), sink=msgs)
        stored = colo.kv_events()
        assert stored is not None and stored.seq_no == 1 and stored.removed == []
        assert stored.stored[:3] == block_hashes(PROMPT, BLOCK_SIZE)
        other = list(range(100, 129))  # 29 tokens: 8 blocks, every block of the pool: the cached ones go
        msgs = run(colo, ColocatedRequest(request_id="b", prompt_token_ids=other,
                                          sampling=wire(2, ignore_eos=True)))
        pump([colo], lambda: bool(of_type(msgs, RequestFinished)), sink=msgs)
        changed = colo.kv_events()
        assert changed is not None and changed.seq_no == 2
        assert sorted(changed.removed) == sorted(stored.stored)
        assert changed.stored[:7] == block_hashes(other, BLOCK_SIZE)
        assert_clean(colo)
    finally:
        close(colo)


def test_a_snapshot_request_from_the_gateway_makes_the_next_events_a_snapshot(model_dir):
    colo = colocated_worker(model_dir)
    try:
        msgs = run(colo, ColocatedRequest(request_id="a", prompt_token_ids=PROMPT,
                                          sampling=wire(1, ignore_eos=True)))
        pump([colo], lambda: bool(of_type(msgs, RequestFinished)), sink=msgs)
        frames = [encode(KVSnapshotRequest(worker_id="c0", epoch=colo.epoch))]

        async def recv_frame() -> bytes:
            if frames:
                return frames.pop()
            await asyncio.Event().wait()  # nothing more from this gateway
            raise AssertionError("unreachable")

        async def deliver() -> None:
            colo._wake = asyncio.Event()
            link = next(iter(colo.sessions.gateways.links.values()))
            link.client.recv_frame = recv_frame  # type: ignore[method-assign]
            task = asyncio.create_task(colo.sessions._recv_loop(link))
            await asyncio.wait_for(colo._wake.wait(), 5.0)
            task.cancel()

        asyncio.run(deliver())
        snap = colo.kv_events()
        assert snap is not None and snap.snapshot and snap.seq_no == 1
        assert sorted(snap.stored) == sorted(colo.core.block_manager.cached_hashes())
        assert set(block_hashes(PROMPT, BLOCK_SIZE)) <= set(snap.stored)
        assert colo.kv_events() is None
        assert_clean(colo)
    finally:
        close(colo)
