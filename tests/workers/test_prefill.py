"""Prefill worker state machine (prefill_worker/worker.py), driven phase by phase with captured messages:
chunked prefill → FirstToken in the last chunk's step → layer-by-layer KV send → blocks held until the
transfer is terminal, then released into the prefix cache; failures, aborts in every state, eos and
max_tokens=1 shortcuts, bad requests. Every test ends with the leak check (blocks free, no transfer)."""

from __future__ import annotations

import pytest
import torch

from kvtransfer import TransferStatus
from kvtransfer import wire as km
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
    decode_worker,
    of_type,
    prefill_worker,
    pump,
    run,
    wire,
)
from workers.setup import decode_handle, encode_handle

PROMPT = list(range(10, 20))  # 10 tokens = 3 blocks of 4; chunks of 4 + 4 + 2 under a budget of 4


@pytest.fixture
def prefill(model_dir):
    w = prefill_worker(model_dir, max_num_batched_tokens=4)
    yield w
    close(w)




def _req(rid: str, handle: bytes | None, max_tokens: int = 4, prompt: list[int] = PROMPT) -> PrefillRequest:
    return PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=wire(max_tokens, ignore_eos=True),
                          kv_handle=handle, decode_worker_id=None if handle is None else "d")


def _serve_until(prefill, fake, cond, sink: list | None = None) -> list:
    return pump([prefill], lambda: (fake.serve(), cond())[1], sink=sink)


def test_kv_streamed_in_last_chunk_step_blocks_held_until_done_then_prefix_cached(model_dir, prefill,
                                                                                 monkeypatch):
    decode = decode_worker(model_dir)
    try:
        sampling = wire(3, ignore_eos=True)
        [res] = of_type(run(decode, ReserveKV(request_id="r", prompt_token_ids=PROMPT, sampling=sampling,
                                              prefill_worker_id="p0",
                                              prefill_sender_epoch=prefill.sender.epoch)), KVReserved)
        sent: list[tuple[str, int]] = []
        real_send = prefill.sender.send_layer

        def send_layer(rid: str, layer: int) -> None:
            sent.append((rid, layer))
            real_send(rid, layer)
        monkeypatch.setattr(prefill.sender, "send_layer", send_layer)
        prefill.deliver(PrefillRequest(request_id="r", prompt_token_ids=PROMPT, sampling=sampling,
                                       kv_handle=res.kv_handle, decode_worker_id="d0"))
        assert run(prefill) == [] and sent == []      # chunk 1 (4 tokens): nothing sampled or sent
        assert run(prefill) == [] and sent == []      # chunk 2
        [first] = run(prefill)                        # last chunk: first token and every layer
        assert isinstance(first, FirstToken) and first.request_id == "r" and first.finish_reason is None
        assert sent == [("r", 0), ("r", 1)]
        seq = prefill.sending["r"]
        src = list(seq.block_table)
        assert len(src) == 3 and prefill.core.block_manager.num_free_blocks == 32 - 3  # held while in flight
        pump([prefill, decode], lambda: not prefill.sending)
        assert prefill.core.block_manager.num_free_blocks == 32
        assert decode.receiver.status("r") is TransferStatus.DONE
        dst = list(decode_handle(res.kv_handle).block_ids)
        assert torch.equal(prefill.core.runner.kv_cache.kv_buffer[:, :, src],
                           decode.core.runner.kv_cache.kv_buffer[:, :, dst])
        msgs = run(decode, DecodeRequest(request_id="r", first_token_id=first.token_id))
        pump([decode], lambda: bool(of_type(msgs, RequestFinished)), sink=msgs)
        [fin] = of_type(msgs, RequestFinished)
        assert (fin.finish_reason, fin.num_prompt_tokens, fin.num_output_tokens) == ("length", 10, 3)
        # the released blocks stay in the prefix cache: two full blocks (8 tokens) hit
        [again] = run(prefill, _req("again", None, max_tokens=1))
        assert isinstance(again, FirstToken) and again.num_cached_tokens == 8
        assert again.token_id == first.token_id
        assert_clean(prefill, decode)
    finally:
        close(decode)


def test_max_tokens_one_without_handle_releases_at_once(prefill):
    prefill.deliver(_req("one", None, max_tokens=1))
    msgs: list = []
    pump([prefill], lambda: bool(of_type(msgs, FirstToken)), sink=msgs)
    [first] = msgs
    assert isinstance(first, FirstToken) and first.finish_reason == "length"
    assert not prefill.sending and prefill.sender.pending() == []
    assert prefill.core.block_manager.num_free_blocks == 32   # freed in the same phase
    assert_clean(prefill)


def test_handle_needs_max_tokens_above_one_or_none(prefill):
    [failed] = run(prefill, _req("x", None, max_tokens=5))
    assert isinstance(failed, RequestFailed) and "max_tokens=1" in failed.error
    assert_clean(prefill)


@pytest.mark.parametrize("cached, blocks", [(1, [3, 4, 5]), (-1, [3, 4, 5, 6]), (3, [])])
def test_handle_whose_cached_and_sent_blocks_do_not_make_the_prompt_is_refused(prefill, fake, cached, blocks):
    """10 tokens = 3 blocks: a handle's ``num_cached_blocks`` plus its ``block_ids`` must be exactly those."""
    import msgspec

    handle = msgspec.structs.replace(decode_handle(fake.handle("x", [3])), block_ids=tuple(blocks),
                                     num_cached_blocks=cached)
    [failed] = run(prefill, _req("x", encode_handle(handle)))
    assert isinstance(failed, RequestFailed) and f"after {cached} cached" in failed.error
    assert "need 3 in all" in failed.error
    assert_clean(prefill)


def test_transfer_failed_sends_request_failed_and_frees_blocks(prefill, fake):
    prefill.deliver(_req("r", fake.handle("r", [3, 4, 5])))
    _serve_until(prefill, fake, lambda: fake.layers.get("r") == {0, 1})
    assert prefill.sender.status("r") is TransferStatus.TRANSFERRING and "r" in prefill.sending
    fake.send(km.Fail("r", "checksum mismatch in layer 1"))
    msgs = _serve_until(prefill, fake, lambda: not prefill.sending)
    [failed] = of_type(msgs, RequestFailed, "r")
    assert "checksum mismatch" in failed.error
    assert fake.got_type(km.Stopped)[-1].aborted is False  # the sender confirmed it stopped writing
    assert_clean(prefill)


def test_terminal_transfer_frees_source_blocks_even_while_a_write_never_completes(prefill, fake,
                                                                                   monkeypatch):
    """Regression (seen in CI: a decode worker SIGKILLed mid-transfer): the sender kept reporting
    "layers in flight" for a write to the dead peer, and the prefill worker held the request's blocks for
    as long. Terminal means nothing more is gathered from them for the receiver (writes read staging), so
    the blocks are freed at once; the transfer itself is forgotten once the sender allows it."""
    prefill.deliver(_req("r", fake.handle("r", [3, 4, 5])))
    _serve_until(prefill, fake, lambda: fake.layers.get("r") == {0, 1})
    total = prefill.core.block_manager.num_blocks
    assert prefill.core.block_manager.num_free_blocks < total  # held while in flight
    real_status, real_release = prefill.sender.status, prefill.sender.release

    def stuck_release(rid: str) -> None:
        raise RuntimeError(f"request {rid!r} cannot be released: 4 layers in flight")
    monkeypatch.setattr(prefill.sender, "status", lambda rid: TransferStatus.FAILED)
    monkeypatch.setattr(prefill.sender, "release", stuck_release)
    prefill.poll()
    assert prefill.core.block_manager.num_free_blocks == total  # freed although the write is stuck
    assert prefill.sending == {"r": None}  # the transfer is still tracked
    monkeypatch.setattr(prefill.sender, "status", real_status)
    monkeypatch.setattr(prefill.sender, "release", real_release)
    fake.send(km.Fail("r", "peer lost"))
    _serve_until(prefill, fake, lambda: not prefill.sending)
    assert_clean(prefill)


def test_abort_before_scheduling_starts_nothing(prefill, fake):
    assert run(prefill, _req("r", fake.handle("r", [0, 1, 2])), AbortRequest(request_id="r")) == []
    assert run(prefill) == [] and prefill.sender.pending() == []
    fake.serve()
    assert fake.got == []
    assert_clean(prefill)


def test_abort_mid_chunked_prefill_sends_nothing(prefill, fake):
    assert run(prefill, _req("r", fake.handle("r", [0, 1, 2]))) == []  # first chunk ran
    assert prefill.core.block_manager.num_free_blocks == 31
    assert run(prefill, AbortRequest(request_id="r")) == []
    for _ in range(3):
        assert run(prefill) == []
    assert prefill.sender.pending() == []
    assert_clean(prefill)


def test_abort_while_transfer_in_flight_stops_sender_then_frees(prefill, fake):
    prefill.deliver(_req("r", fake.handle("r", [7, 8, 9])))
    msgs = _serve_until(prefill, fake, lambda: fake.layers.get("r") == {0, 1})
    assert len(of_type(msgs, FirstToken)) == 1
    src = list(prefill.sending["r"].block_table)
    assert torch.equal(fake.kv[:, :, [7, 8, 9]], prefill.core.runner.kv_cache.kv_buffer[:, :, src])
    assert run(prefill, AbortRequest(request_id="r")) == []
    msgs = _serve_until(prefill, fake, lambda: not prefill.sending)
    assert of_type(msgs, RequestFailed) == []  # our own abort is not a failure
    [stopped] = fake.got_type(km.Stopped)
    assert stopped.request_id == "r" and stopped.aborted
    assert_clean(prefill)


def test_first_token_eos_aborts_transfer_and_frees_blocks(prefill, fake, monkeypatch):
    [probe] = run(prefill, _req("probe", None, max_tokens=1, prompt=PROMPT[:3]))
    prefill.core.eos_token_ids = (probe.token_id,)  # make the greedy first token the model's eos
    aborted: list[str] = []
    real_abort = prefill.sender.abort

    def abort(rid: str) -> None:
        aborted.append(rid)
        real_abort(rid)
    monkeypatch.setattr(prefill.sender, "abort", abort)
    params = wire(8)  # eos not ignored
    prefill.deliver(PrefillRequest(request_id="r", prompt_token_ids=PROMPT[:3], sampling=params,
                                   kv_handle=fake.handle("r", [0]), decode_worker_id="d"))
    msgs: list = []
    _serve_until(prefill, fake, lambda: bool(of_type(msgs, FirstToken)) and not prefill.sending, msgs)
    [first] = of_type(msgs, FirstToken)
    assert first.token_id == probe.token_id and first.finish_reason == "stop"
    assert aborted == ["r"] and of_type(msgs, RequestFailed) == []
    assert_clean(prefill)


def test_bad_token_id_fails_only_that_request(prefill):
    msgs = run(prefill, _req("bad", None, max_tokens=1, prompt=[5, 256, 7]),
               _req("good", None, max_tokens=1, prompt=[5, 6, 7]))
    [failed] = of_type(msgs, RequestFailed)
    assert failed.request_id == "bad" and "vocab_size" in failed.error
    pump([prefill], lambda: bool(of_type(msgs, FirstToken)), sink=msgs)
    assert [m.request_id for m in of_type(msgs, FirstToken)] == ["good"]
    assert_clean(prefill)


def test_handle_of_another_request_is_refused(prefill, fake):
    # bug fix: the handle's request id was not checked; the transfer started under the other id and
    # leaked in the sender while the step failed on the unknown one
    [failed] = run(prefill, _req("r", fake.handle("other", [0, 1, 2])))
    assert isinstance(failed, RequestFailed) and "'other'" in failed.error
    assert prefill.sender.pending() == [] and run(prefill) == []
    assert_clean(prefill)


def test_step_failing_after_transfer_started_aborts_it(prefill, fake, monkeypatch):
    # bug fix: a forward pass failing after the hook had added the request to the sender left that
    # transfer tracked forever (and the decode side waiting for its deadline)
    real_execute = prefill.core.runner.execute

    def execute(output, layer_hook=None, rank_note=b""):
        if layer_hook is not None:
            layer_hook(0)
            raise RuntimeError("boom in layer 1")
        return real_execute(output, layer_hook, rank_note)

    monkeypatch.setattr(prefill.core.runner, "execute", execute)
    prefill.deliver(_req("r", fake.handle("r", [0, 1, 2])))
    msgs: list = []
    _serve_until(prefill, fake, lambda: bool(of_type(msgs, RequestFailed)) and not prefill.busy(), msgs)
    [failed] = of_type(msgs, RequestFailed, "r")
    assert "boom in layer 1" in failed.error and of_type(msgs, FirstToken) == []
    assert_clean(prefill)


def test_receiver_abort_releases_blocks_without_request_failed(prefill, fake):
    prefill.deliver(_req("r", fake.handle("r", [0, 1, 2])))
    _serve_until(prefill, fake, lambda: fake.layers.get("r") == {0, 1})
    fake.send(km.Abort("r"))  # the decode side gave the request up: not a prefill failure
    msgs = _serve_until(prefill, fake, lambda: not prefill.sending)
    assert of_type(msgs, RequestFailed) == []
    assert fake.got_type(km.Stopped)[-1].aborted
    assert_clean(prefill)
