"""A restarted gateway (a ``RegisterAck`` with another ``gateway_epoch``) makes a worker drop every request
the previous gateway gave it, queued, running or waiting for KV, so their KV blocks come back at once:
nobody is left to stream them to or to abort them. Requests received after the new gateway accepted the
worker are kept. Ends with the leak check."""

from __future__ import annotations

from protocol.messages import ColocatedRequest, PrefillRequest, RegisterAck, ReserveKV
from tests.workers.helpers import (
    assert_clean,
    close,
    colocated_worker,
    decode_worker,
    of_type,
    prefill_worker,
    run,
    wire,
)

PROMPT = list(range(50, 63))  # 13 tokens

NO_SENDER = 1  # the KV sender epoch named in ReserveKV: these decode workers are unfenced


def _ack(worker, gateway_epoch: int) -> RegisterAck:
    return RegisterAck(worker_id=worker.worker_id, epoch=worker.epoch, accepted=True,
                       gateway_epoch=gateway_epoch)


def _req(rid: str, max_tokens: int) -> ColocatedRequest:
    return ColocatedRequest(request_id=rid, prompt_token_ids=PROMPT,
                            sampling=wire(max_tokens, ignore_eos=True))


def test_colocated_drops_the_old_gateways_requests_and_keeps_the_new_ones(model_dir):
    colo = colocated_worker(model_dir)
    try:
        colo.sessions.accepted_by(_ack(colo, 111))
        for rid in ("a", "b"):
            colo.deliver(_req(rid, 50))
        run(colo)
        assert sorted(colo.request_ids()) == ["a", "b"]
        assert colo.core.block_manager.num_free_blocks < colo.core.block_manager.num_blocks
        # the same gateway again (a ReRegister answer): nothing dropped
        colo.sessions.accepted_by(_ack(colo, 111))
        run(colo)
        assert sorted(colo.request_ids()) == ["a", "b"]
        colo.sessions.accepted_by(_ack(colo, 222))  # restarted gateway
        colo.deliver(_req("c", 2))
        run(colo)
        assert colo.request_ids() == ["c"]  # a and b dropped with their blocks; c came after the marker
        assert colo.sessions.gateways.links[colo.sessions.gateways.default_key].gateway_epoch == 222
        while colo.request_ids():
            run(colo)
        assert_clean(colo)
    finally:
        close(colo)


def test_decode_drops_a_reservation_whose_gateway_restarted(model_dir):
    decode = decode_worker(model_dir, num_blocks=8)
    try:
        decode.sessions.accepted_by(_ack(decode, 5))
        out = run(decode, ReserveKV(request_id="r", prompt_token_ids=PROMPT, sampling=wire(4),
                                    prefill_worker_id="p0", prefill_sender_epoch=NO_SENDER))
        assert of_type(out, type(out[0]), "r") and decode.request_ids() == ["r"]
        assert decode.core.block_manager.num_free_blocks == 4  # 13 tokens in blocks of 4
        decode.sessions.accepted_by(_ack(decode, 6))
        run(decode)
        assert decode.request_ids() == []
        assert_clean(decode)  # no sender claimed the blocks: freed at once
    finally:
        close(decode)


def test_prefill_drops_queued_requests_of_the_old_gateway(model_dir):
    prefill = prefill_worker(model_dir)
    try:
        prefill.sessions.accepted_by(_ack(prefill, 9))
        prefill.deliver(PrefillRequest(request_id="q", prompt_token_ids=PROMPT, sampling=wire(1)))
        prefill.sessions.accepted_by(_ack(prefill, 10))  # the marker goes behind q: q is the old gateway's
        assert run(prefill) == []  # q dropped before it was scheduled: no FirstToken for anybody
        assert prefill.request_ids() == []
        assert_clean(prefill)
    finally:
        close(prefill)


def test_first_registration_drops_nothing(model_dir):
    colo = colocated_worker(model_dir)
    try:
        colo.deliver(_req("a", 3))
        colo.sessions.accepted_by(_ack(colo, 77))  # no gateway seen before: nothing to compare with
        run(colo)
        assert colo.request_ids() == ["a"]
        while colo.request_ids():
            run(colo)
        assert_clean(colo)
    finally:
        close(colo)
