"""The KV fence between real prefill and decode workers (loopback transport, fenced decode worker as in
``decode_worker.worker.make_receiver``): a prefill worker registers its KV sender's epoch; a decode worker
answers the KV Hello of a prefill worker only for the (worker id, epoch) its gateway named in the
``ReserveKV``. After a prefill worker restarts (same id, new KV sender epoch) a request named with the new
registration is served; the old incarnation, still alive, cannot send KV any more (refused and counted).
Every test ends with the leak check."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from decode_worker.worker import DecodeWorker
from kvtransfer import TransferStatus, get_transfer_backend
from protocol.messages import (
    AbortRequest,
    DecodeRequest,
    FirstToken,
    KVReserved,
    PrefillRequest,
    RequestFailed,
    RequestFinished,
    ReserveKV,
)
from tests.workers.helpers import (
    assert_clean,
    close,
    make_core,
    of_type,
    prefill_worker,
    pump,
    run,
    settings,
    transfer_config,
    wire,
)

PROMPT = list(range(20, 29))  # 9 tokens


def fenced_decode_worker(model_dir: Path) -> DecodeWorker:
    core = make_core(model_dir)
    config = dataclasses.replace(transfer_config("d0"), fence_senders=True)
    receiver = get_transfer_backend("loopback").receiver(config, core.runner.kv_cache.kv_buffer)
    return DecodeWorker(settings("decode", "d0", model_dir), core, str(model_dir), receiver=receiver)


def _serve(prefill, decode, rid: str, sender_epoch: int) -> list:
    """The gateway's steps for one request (ReserveKV naming ``sender_epoch``, PrefillRequest,
    DecodeRequest) until the decode or prefill worker ends it; every message emitted."""
    sampling = wire(3, ignore_eos=True)
    [res] = of_type(run(decode, ReserveKV(request_id=rid, prompt_token_ids=PROMPT, sampling=sampling,
                                          prefill_worker_id="p0", prefill_sender_epoch=sender_epoch)),
                    KVReserved)
    msgs = run(prefill, PrefillRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=sampling,
                                       kv_handle=res.kv_handle, decode_worker_id="d0"))
    pump([prefill], lambda: bool(of_type(msgs, FirstToken, rid) or of_type(msgs, RequestFailed, rid)),
         sink=msgs)
    firsts = of_type(msgs, FirstToken, rid)
    if firsts:
        msgs += run(decode, DecodeRequest(request_id=rid, first_token_id=firsts[0].token_id))
    def ended() -> bool:
        return bool(of_type(msgs, RequestFinished, rid) or of_type(msgs, RequestFailed, rid))
    pump([prefill, decode], ended, sink=msgs)
    return msgs


def test_restarted_prefill_worker_serves_once_registered_and_the_old_incarnation_is_fenced(
        model_dir: Path) -> None:
    decode, old = fenced_decode_worker(model_dir), prefill_worker(model_dir)
    new = None
    try:
        reg = old.registration()
        assert reg.kv_sender_epoch == old.sender.epoch != 0  # what the gateway names in ReserveKV
        assert decode.registration().kv_sender_epoch == 0  # no KV sender
        [done] = of_type(_serve(old, decode, "a", reg.kv_sender_epoch), RequestFinished)
        assert done.num_output_tokens == 3 and decode.receiver.refused_handshakes() == 0

        new = prefill_worker(model_dir)  # p0 restarted: same id, a new KV sender epoch
        new_epoch = new.registration().kv_sender_epoch
        assert new_epoch == new.sender.epoch != reg.kv_sender_epoch
        [done] = of_type(_serve(new, decode, "b", new_epoch), RequestFinished)
        assert done.num_output_tokens == 3

        # the old incarnation, still alive, given a request whose KV the gateway named the new one for
        msgs = _serve(old, decode, "c", new_epoch)
        [failed] = of_type(msgs, RequestFailed, "c")
        assert "not the incarnation its gateway named" in failed.error, failed.error
        assert not of_type(msgs, RequestFinished, "c")
        assert decode.receiver.refused_handshakes() >= 1  # counted (kind unnamed_sender_epoch)
        assert decode.receiver.status("c") is TransferStatus.PENDING  # nothing of it landed
        run(decode, AbortRequest(request_id="c"))  # what the gateway does with the failed request
        assert_clean(old, new, decode)
    finally:
        for w in (old, new, decode):
            if w is not None:
                close(w)
