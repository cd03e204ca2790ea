"""Decode-side prefix reuse between real prefill and decode workers over the loopback KV transport: a
second turn whose prompt extends the first's (first prompt + its output + new tokens) takes the leading
blocks from the decode worker's prefix cache, the prefill worker sends only the blocks after them
(``KVHandle.num_cached_blocks``), they land bit-exact, and the greedy output equals a colocated worker's
and a fresh system's; an identical request sent again equals the first; a request aborted while it
shares cached blocks leaves them to the other holder. Every test ends with the leak check."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from kvtransfer import KVHandle
from protocol.messages import (
    AbortRequest,
    ColocatedRequest,
    DecodeRequest,
    FirstToken,
    KVReserved,
    NextToken,
    PrefillRequest,
    RequestFailed,
    RequestFinished,
    ReserveKV,
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
    settings,
    wire,
)
from workers.metrics import LABELS
from workers.setup import decode_handle, encode_handle, engine_config_from_settings

FIRST = list(range(20, 31))  # 11 tokens: 2 full blocks of 4 and 3 tokens
SAMPLING = wire(5, ignore_eos=True)  # greedy, 5 tokens


class SendSpy:
    """Records, for each ``KVSender.add_request`` of a prefill worker, the handle, the source blocks given
    and the request's whole block table at that moment."""

    def __init__(self, prefill: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[KVHandle, list[int], list[int]]] = []
        real = prefill.sender.add_request

        def add_request(handle: KVHandle, block_ids: list[int]) -> None:
            table = list(prefill.seqs[handle.request_id].block_table)
            self.calls.append((handle, list(block_ids), table))
            real(handle, block_ids)
        monkeypatch.setattr(prefill.sender, "add_request", add_request)


def _turn(prefill: Any, decode: Any, rid: str, prompt: list[int]) -> tuple[list[int], KVHandle]:
    """One disaggregated request to the end; returns its tokens and the decode worker's handle."""
    [res] = of_type(run(decode, ReserveKV(request_id=rid, prompt_token_ids=prompt, sampling=SAMPLING,
                                          prefill_worker_id="p0", prefill_sender_epoch=prefill.sender.epoch)),
                    KVReserved)
    prefill.deliver(PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=SAMPLING,
                                   kv_handle=res.kv_handle))
    out: list[Any] = []
    pump([prefill], lambda: bool(of_type(out, FirstToken, rid)), sink=out)  # one step, or one per grid chunk
    [first] = of_type(out, FirstToken, rid)
    decode.deliver(DecodeRequest(request_id=rid, first_token_id=first.token_id))
    msgs: list[Any] = []
    pump([prefill, decode], lambda: bool(of_type(msgs, RequestFinished, rid)) and not prefill.busy(),
         sink=msgs)
    assert of_type(msgs, RequestFailed) == []
    tokens = [first.token_id] + [m.token_id for m in of_type(msgs, NextToken, rid)]
    return tokens, decode_handle(res.kv_handle)


def _colocated(colo: Any, rid: str, prompt: list[int]) -> list[int]:
    out = run(colo, ColocatedRequest(request_id=rid, prompt_token_ids=prompt, sampling=SAMPLING))
    pump([colo], lambda: bool(of_type(out, RequestFinished, rid)), sink=out)
    return [of_type(out, FirstToken, rid)[0].token_id] + [m.token_id for m in of_type(out, NextToken, rid)]


def _counter(worker: Any, name: str) -> float:
    value = worker.metrics.registry.get_sample_value(name, dict(zip(LABELS, worker.metrics.label_values,
                                                                    strict=True)))
    assert value is not None, name
    return value


def _assert_landed_bit_exact(prefill: Any, decode: Any, src: list[int], dst: list[int], first_pos: int,
                             num_tokens: int) -> None:
    """Token positions ``first_pos .. num_tokens - 1`` of the prompt: the same K and V bits, every layer,
    in the prefill worker's blocks ``src`` and the decode worker's ``dst`` (both in token order from the
    block holding ``first_pos``)."""
    pkv, dkv = prefill.core.runner.kv_cache.kv_buffer, decode.core.runner.kv_cache.kv_buffer
    start = first_pos // BLOCK_SIZE
    for pos in range(first_pos, num_tokens):
        i, off = pos // BLOCK_SIZE - start, pos % BLOCK_SIZE
        assert torch.equal(pkv[:, :, src[i], off], dkv[:, :, dst[i], off]), f"position {pos}"


def test_second_turn_sends_only_the_suffix_bit_exact_and_answers_as_colocated_and_fresh(
        model_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    prefill, decode, colo = prefill_worker(model_dir), decode_worker(model_dir), colocated_worker(model_dir)
    fresh_p, fresh_d = prefill_worker(model_dir), decode_worker(model_dir)
    fresh_d.settings = dataclasses.replace(fresh_d.settings, decode_prefix_reuse=False)
    spy = SendSpy(prefill, monkeypatch)
    bpb = prefill.core.runner.kv_cache.bytes_per_block
    try:
        tokens1, h1 = _turn(prefill, decode, "t1", FIRST)
        assert h1.num_cached_blocks == 0 and len(h1.block_ids) == 3 and prefill.kv_sent_bytes == 3 * bpb
        assert tokens1 == _colocated(colo, "c1", FIRST)
        # turn 2: the first turn's prompt and output, then 6 new tokens (22 tokens, 6 blocks). The decode
        # worker computed the KV of 15 of turn 1's 16 tokens (not the last one sampled): 3 full blocks
        second = FIRST + tokens1 + list(range(100, 106))
        sent_before = prefill.kv_sent_bytes
        tokens2, h2 = _turn(prefill, decode, "t2", second)
        assert h2.num_cached_blocks == 3 and len(h2.block_ids) == 3
        handle, src, table = spy.calls[-1]
        assert handle == h2 and src == table[3:] and len(table) == 6  # the sender got the suffix only
        assert prefill.kv_sent_bytes - sent_before == 3 * bpb  # KV bytes of turn 2 == the suffix's
        _assert_landed_bit_exact(prefill, decode, table[3:], list(h2.block_ids), 12, len(second))
        assert _counter(decode, "pdserve_worker_kv_received_blocks_total") == 6
        assert _counter(decode, "pdserve_worker_kv_received_bytes_total") == 6 * bpb
        assert _counter(decode, "pdserve_worker_kv_reused_blocks_total") == 3
        fresh_tokens, fresh_h = _turn(fresh_p, fresh_d, "f2", second)  # a fresh system, no reuse
        assert fresh_h.num_cached_blocks == 0 and fresh_p.kv_sent_bytes == 6 * bpb
        assert tokens2 == _colocated(colo, "c2", second) == fresh_tokens
        # the same request again: every full block but the last prompt token's is reused
        tokens3, h3 = _turn(prefill, decode, "t3", second)
        assert h3.num_cached_blocks == 5 and len(h3.block_ids) == 1 and tokens3 == tokens2
        assert _colocated(colo, "c3", second) == tokens2
        assert _counter(decode, "pdserve_worker_kv_reused_blocks_total") == 8
        assert_clean(prefill, decode, colo, fresh_p, fresh_d)
    finally:
        for w in (prefill, decode, colo, fresh_p, fresh_d):
            close(w)


def test_without_reuse_the_whole_prompt_is_sent(model_dir: Any) -> None:
    prefill, decode = prefill_worker(model_dir), decode_worker(model_dir)
    decode.settings = dataclasses.replace(decode.settings, decode_prefix_reuse=False)
    try:
        tokens1, _ = _turn(prefill, decode, "t1", FIRST)
        _, h = _turn(prefill, decode, "t2", FIRST + tokens1)
        assert h.num_cached_blocks == 0 and len(h.block_ids) == 4
        assert _counter(decode, "pdserve_worker_kv_reused_blocks_total") == 0
        assert_clean(prefill, decode)
    finally:
        close(prefill)
        close(decode)


def test_decode_prefix_reuse_off_means_no_prefix_cache_on_a_decode_worker(model_dir: Any) -> None:
    on = settings("decode", "d0", model_dir)
    assert on.decode_prefix_reuse and engine_config_from_settings(on).cache.enable_prefix_caching
    off = dataclasses.replace(on, decode_prefix_reuse=False)
    assert not engine_config_from_settings(off).cache.enable_prefix_caching
    prefill = dataclasses.replace(off, role="prefill")  # the decode flag never changes another role
    assert engine_config_from_settings(prefill).cache.enable_prefix_caching


def test_abort_of_a_request_sharing_cached_blocks_leaves_them_to_the_other(model_dir: Any) -> None:
    prefill, decode, colo = prefill_worker(model_dir), decode_worker(model_dir), colocated_worker(model_dir)
    try:
        tokens1, _ = _turn(prefill, decode, "t1", FIRST)
        second = FIRST + tokens1 + [7, 8]
        reserve = [ReserveKV(request_id=rid, prompt_token_ids=second, sampling=SAMPLING,
                             prefill_worker_id="p0", prefill_sender_epoch=prefill.sender.epoch)
                   for rid in ("a", "b")]
        reserved = of_type(run(decode, *reserve), KVReserved)
        handles = {m.request_id: decode_handle(m.kv_handle) for m in reserved}
        assert handles["a"].num_cached_blocks == handles["b"].num_cached_blocks == 3
        shared = decode.in_flight["a"].block_table[:3]
        assert decode.in_flight["b"].block_table[:3] == shared
        assert run(decode, AbortRequest(request_id="a")) == []  # no sender claimed it: freed at once
        assert "a" not in decode.in_flight and "a" not in decode.fenced
        blocks = decode.core.block_manager._blocks
        assert [blocks[i].ref_count for i in shared] == [1, 1, 1]  # b's references only
        req = PrefillRequest(request_id="b", prompt_token_ids=second, sampling=SAMPLING,
                             kv_handle=encode_handle(handles["b"]))
        [first] = of_type(run(prefill, req), FirstToken)
        decode.deliver(DecodeRequest(request_id="b", first_token_id=first.token_id))
        msgs: list[Any] = []
        pump([prefill, decode], lambda: bool(of_type(msgs, RequestFinished, "b")) and not prefill.busy(),
             sink=msgs)
        tokens = [first.token_id] + [m.token_id for m in of_type(msgs, NextToken, "b")]
        _colocated(colo, "c1", FIRST)  # the same history on the colocated worker
        assert tokens == _colocated(colo, "c2", second)
        assert_clean(prefill, decode, colo)
    finally:
        for w in (prefill, decode, colo):
            close(w)



def test_abort_while_the_suffix_is_in_flight_fences_only_its_own_blocks(model_dir: Any) -> None:
    """The fence holds the blocks a transfer may still write (the suffix) until the sender stopped; the
    cached prefix blocks it shares were never the transfer's: the abort only drops its references, and a
    later request reuses them."""
    from kvtransfer import TransferStatus
    from kvtransfer import wire as km
    from tests.kvtransfer.helpers import FakeSender

    prefill, decode = prefill_worker(model_dir), decode_worker(model_dir)
    sender = FakeSender(decode.receiver.address, kv_like=decode.core.runner.kv_cache.kv_buffer, model="tiny")
    try:
        tokens1, _ = _turn(prefill, decode, "t1", FIRST)
        second = FIRST + tokens1 + [7, 8]
        [res] = of_type(run(decode, ReserveKV(request_id="a", prompt_token_ids=second, sampling=SAMPLING,
                                              prefill_worker_id="p0", prefill_sender_epoch=1)), KVReserved)
        h = decode_handle(res.kv_handle)
        assert h.num_cached_blocks == 3
        cached, suffix = decode.in_flight["a"].block_table[:3], list(h.block_ids)
        sender.claim("a", h.epoch)
        assert decode.receiver.status("a") is TransferStatus.TRANSFERRING
        assert run(decode, AbortRequest(request_id="a")) == []
        pump([decode], lambda: bool([m for m in sender.drain() if isinstance(m, km.Abort)]))
        assert "a" in decode.fenced and not decode.receiver.releasable("a")
        blocks = decode.core.block_manager._blocks
        assert [blocks[i].ref_count for i in cached + suffix] == [1] * (3 + len(suffix))  # all held: fenced
        assert decode.fenced_blocks() == len(suffix)  # reported: the blocks awaiting KV, not the prefix
        sender.send(km.Stopped("a", True))
        pump([decode], lambda: not decode.fenced)
        assert decode.fenced_blocks() == 0
        assert all(blocks[i].ref_count == 0 for i in cached + suffix)
        assert all(blocks[i].block_hash is not None for i in cached)  # still cached
        assert all(blocks[i].block_hash is None for i in suffix)  # never landed: never cached
        _, h2 = _turn(prefill, decode, "b", second)
        assert h2.num_cached_blocks == 3 and h2.block_ids[0] not in cached
        assert_clean(prefill, decode)
    finally:
        sender.close()
        close(prefill)
        close(decode)


def _grid_pair(model_dir: Any, grid: int, reuse: bool = True) -> tuple[Any, Any]:
    """A prefill and a decode worker on the prefill grid ``grid`` (tokens), as ``prefill_worker`` /
    ``decode_worker`` build them otherwise."""
    from decode_worker.worker import DecodeWorker
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.engine_core import EngineCore
    from kvtransfer import get_transfer_backend
    from prefill_worker.worker import PrefillWorker
    from tests.workers.helpers import transfer_config

    def core(prefill_only: bool) -> EngineCore:
        return EngineCore(EngineConfig(
            ModelConfig(str(model_dir), load_format="dummy", dtype="float32", device="cpu",
                        attention_backend="torch"),
            CacheConfig(block_size=BLOCK_SIZE, num_blocks=32),
            SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, prefill_grid=grid)),
            prefill_only=prefill_only)

    pc, dc = core(True), core(False)
    sender = get_transfer_backend("loopback").sender(transfer_config("p0"), pc.runner.kv_cache.kv_buffer)
    receiver = get_transfer_backend("loopback").receiver(transfer_config("d0"), dc.runner.kv_cache.kv_buffer)
    p_settings = dataclasses.replace(settings("prefill", "p0", model_dir), prefill_grid=grid)
    d_settings = dataclasses.replace(settings("decode", "d0", model_dir), prefill_grid=grid,
                                     decode_prefix_reuse=reuse)
    return (PrefillWorker(p_settings, pc, str(model_dir), sender=sender),
            DecodeWorker(d_settings, dc, str(model_dir), receiver=receiver))


def _prompt_kv(decode: Any, prompt: list[int]) -> torch.Tensor:
    """The decode worker's K and V of every position of ``prompt`` but the last (the prefix cache's blocks
    for it: ``[num_layers, 2, positions, kv_heads, head_dim]``)."""
    from engine.sampling_params import SamplingParams
    from engine.sequence import Sequence

    bm, kv = decode.core.block_manager, decode.core.runner.kv_cache.kv_buffer
    probe = Sequence("probe", prompt, SamplingParams(max_tokens=1), 0.0, (2,))
    num = bm.allocate_prefix(probe)
    try:
        return torch.cat([kv[:, :, b] for b in probe.block_table], dim=2)[:, :, :num]
    finally:
        bm.free(probe)


def test_on_the_prefill_grid_the_reused_prefix_holds_the_bits_a_fresh_system_computes(model_dir: Any) -> None:
    """With ``--prefill-grid`` a decode worker caches only the whole grid chunks a prefill worker computed,
    so the KV it reuses is bit for bit the KV a fresh system receives for the same prompt (here: every
    position of turn 2 that both hold in whole cached blocks), and so are the tokens."""
    prefill, decode = _grid_pair(model_dir, grid=8)
    fresh_p, fresh_d = _grid_pair(model_dir, grid=8, reuse=False)
    try:
        tokens1, _ = _turn(prefill, decode, "t1", FIRST)
        second = FIRST + tokens1 + list(range(100, 106))  # 22 tokens
        tokens2, h2 = _turn(prefill, decode, "t2", second)
        assert h2.num_cached_blocks == 2  # the whole grid chunk [0, 8) of turn 1, not [8, 16)
        fresh_tokens, fresh_h = _turn(fresh_p, fresh_d, "f2", second)
        assert fresh_h.num_cached_blocks == 0 and tokens2 == fresh_tokens
        reused, fresh = _prompt_kv(decode, second), _prompt_kv(fresh_d, second)
        assert reused.shape[2] == fresh.shape[2] == 16  # both cached [0, 16): the grid chunks of turn 2
        assert torch.equal(reused, fresh)
        assert_clean(prefill, decode, fresh_p, fresh_d)
    finally:
        for w in (prefill, decode, fresh_p, fresh_d):
            close(w)
