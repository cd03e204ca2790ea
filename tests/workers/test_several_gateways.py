"""A worker serving two gateways: each request's messages go to the gateway that sent it (one
``OutputBatch`` per gateway and phase), messages naming no request go to both, and losing one gateway
(connection dropped, restarted, its address gone from DNS) drops exactly its requests, blocks freed, while
the other gateway's go on. Ends with the leak check."""

from __future__ import annotations

import asyncio
import logging

import pytest

from protocol.messages import (
    AbortRequest,
    ColocatedRequest,
    KVEvents,
    Message,
    NextToken,
    OutputBatch,
    PrefillRequest,
    RegisterAck,
    RequestFailed,
    RequestFinished,
    ReserveKV,
    WorkerShutdown,
)
from tests.workers.helpers import (
    assert_clean,
    close,
    colocated_worker,
    decode_worker,
    of_type,
    prefill_worker,
    wire,
)
from workers.control_client import RegistrationError
from workers.gateway_links import DNS_MISSES_TO_DROP, GatewayLinks
from workers.loop import WorkerLoop
from workers.ownership import BROADCAST, NO_OWNER, RequestOwners, route

A, B = "inproc://pdserve-test-gateway-a", "inproc://pdserve-test-gateway-b"
TWO = f"{A},{B}"
PROMPT = list(range(50, 63))  # 13 tokens
NO_SENDER = 1


def _accept(worker: WorkerLoop, key: str, gateway_epoch: int = 7) -> None:
    worker.sessions.accepted_by(RegisterAck(worker_id=worker.worker_id, epoch=worker.epoch, accepted=True,
                                   gateway_epoch=gateway_epoch), key)


def _capture(worker: WorkerLoop) -> dict[str, list[Message]]:
    """Replace each link's send by a recorder: gateway key → frames sent to it."""
    sent: dict[str, list[Message]] = {key: [] for key in worker.sessions.gateways.links}
    for key, link in worker.sessions.gateways.links.items():
        def record(msg: Message, key: str = key) -> bool:
            sent[key].append(msg)
            return True
        link.client.try_send = record  # type: ignore[method-assign]
    return sent


def _phase(worker: WorkerLoop) -> None:
    worker.run_once()
    worker.flush()


def _items(frames: list[Message]) -> list[Message]:
    """The per-request messages of ``frames`` (``OutputBatch`` unpacked) and the other frames, in order,
    without the prefix-cache ``KVEvents`` every flush may add (``_kv_events`` picks those)."""
    out: list[Message] = []
    for f in frames:
        if not isinstance(f, KVEvents):
            out.extend(f.messages if isinstance(f, OutputBatch) else [f])
    return out


def _kv_events(frames: list[Message]) -> list[KVEvents]:
    return [f for f in frames if isinstance(f, KVEvents)]


def _colo_req(rid: str, max_tokens: int) -> ColocatedRequest:
    return ColocatedRequest(request_id=rid, prompt_token_ids=PROMPT,
                            sampling=wire(max_tokens, ignore_eos=True))


def test_route_sends_owned_messages_to_their_owner_and_the_rest_to_all() -> None:
    owners = RequestOwners()
    owners.record("r1", A)
    assert owners.record("r1", B) == A  # the first gateway keeps it
    tok = NextToken(request_id="r1", worker_id="w", token_id=3)
    stray = NextToken(request_id="nobody", worker_id="w", token_id=4)
    bye = WorkerShutdown(worker_id="w", epoch=1)
    assert [owners.tag(m) for m in (tok, stray, bye)] == [A, NO_OWNER, BROADCAST]
    routed = route([(tok, owners.tag(tok)), (bye, BROADCAST), (stray, NO_OWNER)], [A, B])
    assert routed == {A: [tok, bye], B: [bye]}
    assert route([(tok, A)], [B]) == {}  # its gateway no longer accepts the worker: dropped
    owners.prune(["other"])
    assert owners.owner("r1") is None and len(owners) == 0


def test_each_gateway_gets_only_its_requests_in_one_batch_per_phase(model_dir) -> None:
    colo = colocated_worker(model_dir, gateway_control=TWO)
    try:
        _accept(colo, A)
        _accept(colo, B)
        sent = _capture(colo)
        colo.deliver(_colo_req("a1", 4), A)
        colo.deliver(_colo_req("b1", 3), B)
        colo.deliver(_colo_req("b2", 5), B)
        colo.emit(WorkerShutdown(worker_id=colo.worker_id, epoch=colo.epoch))  # names no request: to both
        phases = 0
        while colo.request_ids() or phases == 0:
            before = {k: len(v) for k, v in sent.items()}
            _phase(colo)
            phases += 1
            assert phases < 50
            for key, frames in sent.items():  # at most one OutputBatch per gateway and phase
                assert sum(isinstance(f, OutputBatch) for f in frames[before[key]:]) <= 1
        got = {key: _items(frames) for key, frames in sent.items()}
        assert {m.request_id for m in got[A] if hasattr(m, "request_id")} == {"a1"}
        assert {m.request_id for m in got[B] if hasattr(m, "request_id")} == {"b1", "b2"}
        assert len(of_type(got[A], WorkerShutdown)) == len(of_type(got[B], WorkerShutdown)) == 1
        # the prefix-cache changes name no request: both gateways get the same ones, starting with a snapshot
        events = _kv_events(sent[A])
        assert events and events == _kv_events(sent[B]) and events[0].snapshot
        assert [e.seq_no for e in events] == list(range(1, len(events) + 1))
        finished = {m.request_id: m.num_output_tokens for m in [*got[A], *got[B]]
                    if isinstance(m, RequestFinished)}
        assert finished == {"a1": 4, "b1": 3, "b2": 5}
        assert all(batch.worker_id == "c0" for frames in sent.values() for batch in frames
                   if isinstance(batch, OutputBatch))
        assert_clean(colo)
    finally:
        close(colo)


def test_losing_a_gateway_drops_only_its_requests(model_dir) -> None:
    colo = colocated_worker(model_dir, gateway_control=TWO)
    try:
        _accept(colo, A)
        _accept(colo, B)
        sent = _capture(colo)
        colo.deliver(_colo_req("a1", 50), A)
        colo.deliver(_colo_req("a2", 50), A)
        colo.deliver(_colo_req("b1", 6), B)
        _phase(colo)
        _phase(colo)
        assert sorted(colo.request_ids()) == ["a1", "a2", "b1"]
        bm = colo.core.block_manager
        held_by_all = bm.num_blocks - bm.num_free_blocks
        sent_to_a = len(sent[A])
        colo.sessions.lose(colo.sessions.gateways.links[A], "test: connection dropped")
        assert colo.health.registered  # B still accepts it
        _phase(colo)
        assert colo.request_ids() == ["b1"]
        assert bm.num_blocks - bm.num_free_blocks < held_by_all  # a1's and a2's blocks are back
        colo.deliver(AbortRequest(request_id="b1"), A)  # a gateway cannot abort another's request
        while colo.request_ids():
            _phase(colo)
        assert len(sent[A]) == sent_to_a  # nothing more went to the lost gateway
        [done] = of_type(_items(sent[B]), RequestFinished)
        assert (done.request_id, done.num_output_tokens) == ("b1", 6)
        assert_clean(colo)
    finally:
        close(colo)


def test_a_gateway_lost_but_alive_hears_that_its_requests_were_dropped(model_dir) -> None:
    """A connection that dropped (or a send queue that filled) while the gateway lived on: the worker drops
    that gateway's requests, and once the same incarnation accepts it again it fails each one back
    (RequestFailed) instead of leaving the gateway waiting for tokens; another gateway's request is
    untouched, and a new incarnation is told nothing."""
    colo = colocated_worker(model_dir, gateway_control=TWO)
    try:
        _accept(colo, A)
        _accept(colo, B)
        sent = _capture(colo)
        colo.deliver(_colo_req("a1", 50), A)
        colo.deliver(_colo_req("b1", 6), B)
        _phase(colo)
        colo.sessions.lose(colo.sessions.gateways.links[A], "test: connection dropped")
        _phase(colo)
        assert colo.request_ids() == ["b1"]
        assert not [m for m in _items(sent[A]) if isinstance(m, RequestFailed)]  # A cannot be told yet
        _accept(colo, A)  # the same incarnation (gateway_epoch 7) is back
        _phase(colo)
        failed = [m for m in _items(sent[A]) if isinstance(m, RequestFailed)]
        assert [m.request_id for m in failed] == ["a1"] and "dropped" in failed[0].error
        assert not [m for m in _items(sent[B]) if isinstance(m, RequestFailed)]
        colo.sessions.lose(colo.sessions.gateways.links[A], "test: connection dropped again")
        _phase(colo)
        _accept(colo, A, gateway_epoch=8)  # a new incarnation never knew a1: nothing to fail back
        _phase(colo)
        assert len([m for m in _items(sent[A]) if isinstance(m, RequestFailed)]) == 1
        while colo.request_ids():
            _phase(colo)
        assert_clean(colo)
    finally:
        close(colo)


def test_a_restarted_gateway_drops_only_its_own_requests(model_dir) -> None:
    colo = colocated_worker(model_dir, gateway_control=TWO)
    try:
        _accept(colo, A, 11)
        _accept(colo, B, 21)
        _capture(colo)
        colo.deliver(_colo_req("a1", 40), A)
        colo.deliver(_colo_req("b1", 40), B)
        _phase(colo)
        _accept(colo, A, 11)  # the same incarnation again (a ReRegister answer): nothing dropped
        _phase(colo)
        assert sorted(colo.request_ids()) == ["a1", "b1"]
        _accept(colo, B, 22)  # B restarted at the same address
        colo.deliver(_colo_req("b2", 2), B)  # after the new incarnation accepted the worker: kept
        _phase(colo)
        assert sorted(colo.request_ids()) == ["a1", "b2"]
        colo.deliver(AbortRequest(request_id="a1"), A)
        while colo.request_ids():
            _phase(colo)
        assert_clean(colo)
    finally:
        close(colo)


def test_decode_frees_the_lost_gateways_reservation_and_keeps_the_others(model_dir) -> None:
    decode = decode_worker(model_dir, gateway_control=TWO, num_blocks=12)
    try:
        _accept(decode, A)
        _accept(decode, B)
        sent = _capture(decode)
        for rid, key in (("ra", A), ("rb", B)):
            decode.deliver(ReserveKV(request_id=rid, prompt_token_ids=PROMPT, sampling=wire(4),
                                     prefill_worker_id="p0", prefill_sender_epoch=NO_SENDER), key)
        _phase(decode)
        assert [m.request_id for m in _items(sent[A])] == ["ra"]  # each KVReserved to its own gateway
        assert [m.request_id for m in _items(sent[B])] == ["rb"]
        assert decode.core.block_manager.num_free_blocks == 12 - 2 * 4  # 13 tokens in blocks of 4
        decode.sessions.lose(decode.sessions.gateways.links[B], "test: connection dropped")
        _phase(decode)
        assert decode.request_ids() == ["ra"]
        assert decode.core.block_manager.num_free_blocks == 12 - 4
        decode.deliver(AbortRequest(request_id="ra"), A)
        _phase(decode)
        assert_clean(decode)
    finally:
        close(decode)


def test_prefill_drops_the_lost_gateways_queued_request_and_answers_the_other(model_dir) -> None:
    prefill = prefill_worker(model_dir, gateway_control=TWO)
    try:
        _accept(prefill, A)
        _accept(prefill, B)
        sent = _capture(prefill)
        prefill.deliver(PrefillRequest(request_id="pa", prompt_token_ids=PROMPT, sampling=wire(1)), A)
        prefill.deliver(PrefillRequest(request_id="pb", prompt_token_ids=PROMPT, sampling=wire(1)), B)
        # behind pa: pa is A's
        prefill.sessions.lose(prefill.sessions.gateways.links[A], "test: its address left DNS")
        _phase(prefill)
        while prefill.request_ids():
            _phase(prefill)
        assert _items(sent[A]) == []
        assert [m.request_id for m in _items(sent[B])] == ["pb"]
        assert_clean(prefill)
    finally:
        close(prefill)


def test_a_request_id_taken_by_another_gateway_is_refused_to_the_newcomer_only(model_dir) -> None:
    colo = colocated_worker(model_dir, gateway_control=TWO)
    try:
        _accept(colo, A)
        _accept(colo, B)
        sent = _capture(colo)
        colo.deliver(_colo_req("same", 3), A)
        colo.deliver(_colo_req("same", 3), B)
        _phase(colo)
        while colo.request_ids():
            _phase(colo)
        [failed] = of_type(_items(sent[B]), RequestFailed)
        assert failed.request_id == "same" and "another gateway" in failed.error
        [done] = of_type(_items(sent[A]), RequestFinished)
        assert done.num_output_tokens == 3
        assert_clean(colo)
    finally:
        close(colo)


def test_a_gateway_gone_from_dns_is_lost_and_a_new_one_registered(model_dir) -> None:
    colo = colocated_worker(model_dir, gateway_control=TWO)
    old = colo.sessions.gateways
    answers = {"gw.svc": ["10.0.0.1", "10.0.0.2"]}
    colo.sessions.gateways = GatewayLinks("tcp://gw.svc:7100", None, resolve=lambda host: answers[host])
    old.close()
    first, second = "tcp://10.0.0.1:7100", "tcp://10.0.0.2:7100"

    async def scenario() -> None:
        _accept(colo, first)
        _accept(colo, second)
        _capture(colo)  # these addresses are never connected: record what is sent instead
        colo.deliver(_colo_req("r1", 40), first)
        colo.deliver(_colo_req("r2", 40), second)
        _phase(colo)
        answers["gw.svc"] = ["10.0.0.2", "10.0.0.3"]
        colo.sessions.update_gateways(colo.sessions.gateways.lookup())
        assert list(colo.sessions.gateways.links) == [second, "tcp://10.0.0.3:7100"]
        links = colo.sessions.gateways.links.values()
        assert all(len(link.tasks) == 2 for link in links if link.key != second)
        _phase(colo)
        assert colo.request_ids() == ["r2"]
        for link in colo.sessions.gateways.links.values():
            for task in link.tasks:
                task.cancel()

    try:
        asyncio.run(scenario())
        colo.deliver(AbortRequest(request_id="r2"), second)
        _phase(colo)
        assert_clean(colo)
    finally:
        close(colo)


def test_a_connected_gateway_survives_a_lookup_that_misses_it(model_dir) -> None:
    """One empty DNS answer (a Service's endpoints flapping) does not drop a gateway whose connection is
    up, nor its requests; DNS_MISSES_TO_DROP answers in a row without it do."""
    colo = colocated_worker(model_dir, gateway_control=TWO)
    old = colo.sessions.gateways
    answers: dict[str, list[str]] = {"gw.svc": ["10.0.0.1"]}
    colo.sessions.gateways = GatewayLinks("tcp://gw.svc:7100", None, resolve=lambda host: answers[host])
    old.close()
    first = "tcp://10.0.0.1:7100"

    async def scenario() -> None:
        _accept(colo, first)
        _capture(colo)
        colo.sessions.gateways.links[first].connected = True  # as the monitor reports a live connection
        colo.deliver(_colo_req("r1", 40), first)
        _phase(colo)
        answers["gw.svc"] = []
        for _ in range(DNS_MISSES_TO_DROP - 1):
            colo.sessions.update_gateways(colo.sessions.gateways.lookup())
            assert list(colo.sessions.gateways.links) == [first]
            _phase(colo)
            assert colo.request_ids() == ["r1"]
        answers["gw.svc"] = ["10.0.0.1"]  # back: the count starts again
        colo.sessions.update_gateways(colo.sessions.gateways.lookup())
        answers["gw.svc"] = []
        for _ in range(DNS_MISSES_TO_DROP - 1):
            colo.sessions.update_gateways(colo.sessions.gateways.lookup())
        assert list(colo.sessions.gateways.links) == [first]
        # the DNS_MISSES_TO_DROP-th miss in a row
        colo.sessions.update_gateways(colo.sessions.gateways.lookup())
        assert list(colo.sessions.gateways.links) == []
        _phase(colo)
        assert colo.request_ids() == []

    try:
        asyncio.run(scenario())
        assert_clean(colo)
    finally:
        close(colo)


def test_start_up_needs_one_gateway_to_accept(model_dir) -> None:
    colo = colocated_worker(model_dir, gateway_control=TWO)
    try:
        a, b = colo.sessions.gateways.links[A], colo.sessions.gateways.links[B]
        with pytest.raises(RegistrationError, match="no RegisterAck from any gateway"):
            asyncio.run(colo.sessions.wait_registered(0.05))
        a.refused = "stale epoch"
        _accept(colo, B)
        asyncio.run(colo.sessions.wait_registered(0.05))  # one of two accepted: serving starts
        assert colo.health.registered
        b.accepted, b.refused = False, "model mismatch"
        with pytest.raises(RegistrationError, match=r"refused.*stale epoch.*model mismatch"):
            # every gateway refused: no waiting for the deadline
            asyncio.run(colo.sessions.wait_registered(5))
    finally:
        close(colo)


def test_a_gateway_that_stops_taking_messages_is_lost(model_dir) -> None:
    colo = colocated_worker(model_dir, gateway_control=TWO)
    try:
        _accept(colo, A)
        _accept(colo, B)
        sent = _capture(colo)
        colo.sessions.gateways.links[A].client.try_send = lambda msg: False  # type: ignore[method-assign]
        colo.deliver(_colo_req("a1", 30), A)
        colo.deliver(_colo_req("b1", 4), B)
        _phase(colo)  # a1's first token cannot be sent: A is lost
        assert not colo.sessions.gateways.links[A].accepted and colo.sessions.gateways.links[B].accepted
        _phase(colo)
        assert colo.request_ids() == ["b1"]
        while colo.request_ids():
            _phase(colo)
        [done] = of_type(_items(sent[B]), RequestFinished)
        assert (done.request_id, done.num_output_tokens) == ("b1", 4)
        assert_clean(colo)
    finally:
        close(colo)


def test_a_pool_named_in_the_ack_is_served_as_given_gateways_are(model_dir) -> None:
    """A worker given one process of a ``pdserve gateway --workers 3`` pool: its ``RegisterAck`` names the
    other processes' control ports, and the worker adds a link for each, on the host it reached the first
    at, starts it (receive and monitor tasks, registered once connected) and serves it as any gateway. A
    discovered process naming the pool again adds nothing; a DNS refresh keeps them."""
    first = "tcp://127.0.0.1:46100"
    colo = colocated_worker(model_dir, gateway_control=first)
    siblings = ["tcp://127.0.0.1:46101", "tcp://127.0.0.1:46102"]

    async def scenario() -> None:
        colo.sessions.accepted_by(RegisterAck(worker_id=colo.worker_id, epoch=colo.epoch, accepted=True,
                                              gateway_epoch=7, sibling_ports=(46101, 46102)), first)
        links = colo.sessions.gateways.links
        assert list(links) == [first, *siblings]
        assert all(len(links[key].tasks) == 2 for key in siblings)
        assert not any(links[key].accepted for key in siblings)  # registered with, not yet accepted
        colo.sessions.accepted_by(RegisterAck(worker_id=colo.worker_id, epoch=colo.epoch, accepted=True,
                                              gateway_epoch=8, sibling_ports=(46100, 46102, 46103)),
                                  siblings[0])
        assert list(links) == [first, *siblings]  # a discovered process's list is not followed
        _accept(colo, siblings[1], gateway_epoch=9)
        sent = _capture(colo)
        colo.deliver(_colo_req("s1", 2), siblings[1])
        for _ in range(3):
            _phase(colo)
        assert [m.request_id for m in of_type(_items(sent[siblings[1]]), RequestFinished)] == ["s1"]
        assert of_type(_items(sent[first]), RequestFinished) == []
        colo.sessions.update_gateways(colo.sessions.gateways.lookup())
        assert list(links) == [first, *siblings]
        for link in links.values():
            for task in link.tasks:
                task.cancel()

    try:
        asyncio.run(scenario())
        assert_clean(colo)
    finally:
        close(colo)


def test_a_pool_leaves_with_the_address_it_was_found_through() -> None:
    """Discovered processes are kept like resolved addresses: while the address they were found through
    resolves they stay (a dead process's link waits for it to come back), and once that address left DNS
    the next lookup drops them too. An IPv6 address keeps its brackets; a port out of range is skipped."""
    answers = {"gw.svc": ["10.0.0.1", "fd00::2"]}
    links = GatewayLinks("tcp://gw.svc:7100", None, resolve=lambda host: answers[host])
    try:
        v4, v6 = "tcp://10.0.0.1:7100", "tcp://[fd00::2]:7100"
        assert [link.key for link in links.discover(v4, (7101, 0))] == ["tcp://10.0.0.1:7101"]
        assert [link.key for link in links.discover(v6, (7101,))] == ["tcp://[fd00::2]:7101"]
        assert links.discover("tcp://10.0.0.1:7101", (7100, 7102)) == []  # not a given address
        assert list(links.links) == [v4, v6, "tcp://10.0.0.1:7101", "tcp://[fd00::2]:7101"]
        assert links.refresh(links.lookup()) == ([], [])
        answers["gw.svc"] = ["fd00::2"]
        _, removed = links.refresh(links.lookup())  # v4 not connected: gone at once
        assert [link.key for link in removed] == [v4]
        links.close_link(removed[0])
        _, removed = links.refresh(links.lookup())  # its pool with it
        assert [link.key for link in removed] == ["tcp://10.0.0.1:7101"]
        links.close_link(removed[0])
        assert list(links.links) == [v6, "tcp://[fd00::2]:7101"]
    finally:
        links.close()


def test_a_pool_behind_a_port_mapping_is_not_followed(caplog: pytest.LogCaptureFixture) -> None:
    """The gateway says it is bound to 7100 but the worker reached it at 17100 (docker ``-p 17100:7100``,
    a Service's port): the siblings' bind ports mean nothing at that host, so none is dialled, and a
    warning names the gateway; reached at its own port, the siblings are followed."""
    links = GatewayLinks("tcp://10.0.0.1:17100,tcp://10.0.0.2:7100", None)
    try:
        with caplog.at_level(logging.WARNING, logger="pdserve.worker.control"):
            assert links.discover("tcp://10.0.0.1:17100", (7101,), own_port=7100) == []
        [warning] = [r for r in caplog.records if r.getMessage() == "gateway_pool_not_followed"]
        assert warning.gateway == "tcp://10.0.0.1:17100"  # type: ignore[attr-defined]
        assert [link.key for link in links.discover("tcp://10.0.0.2:7100", (7101,), own_port=7100)] == [
            "tcp://10.0.0.2:7101"]
        assert list(links.links) == ["tcp://10.0.0.1:17100", "tcp://10.0.0.2:7100", "tcp://10.0.0.2:7101"]
    finally:
        links.close()
