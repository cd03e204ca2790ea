"""A prefill engine of two tensor parallel ranks (CPU, gloo) streams its KV over NIXL from each rank's own
process: rank 0's sender here, rank 1's in its follower process (workers.rank_kv, started by the engine's
rank hook and driven through its command socket), each writing its KV-head slice into a decode receiver of
one rank. What lands equals the KV a one-rank engine computes for the same prompt; every rank's endpoint
ends with nothing held."""

from __future__ import annotations

import functools

import msgspec
import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from kvtransfer import TransferStatus, get_transfer_backend
from kvtransfer.head_map import rank_kv_heads
from kvtransfer.ranked import RankedReceive, RankedSend
from kvtransfer.types import TransferConfig
from tests.engine.test_tensor_parallel import _save
from tests.kvtransfer.helpers import need_nixl, sender_settled
from workers.rank_kv import RankKVSpec, RankNote, RemoteEndpoint, command_address, rank_config, rank_kv_hook

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(180)]
WAIT = 30.0
PROMPT = [5, 17, 3, 99, 42, 7, 11]
BS = 4


@pytest.fixture
def one_thread():
    """One intra-op torch thread (the shared 2-core machine; tests/engine/conftest.py says why)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def engine_config(path: str, tp: int) -> EngineConfig:
    return EngineConfig(ModelConfig(path, dtype="float32", device="cpu", attention_backend="torch"),
                        CacheConfig(block_size=BS, num_blocks=32), SchedulerConfig(),
                        ParallelConfig(tensor_parallel_size=tp, timeout_s=120))


def reference_kv(path: str) -> torch.Tensor:
    """[layers, 2, len(PROMPT), kv_heads, head_dim]: the prompt's K/V from a one-rank engine."""
    core = EngineCore(engine_config(path, 1), prefill_only=True)
    try:
        core.add_request("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
        output = core.scheduler.schedule()
        seq = output.scheduled[0].seq
        core.commit(output, core.runner.execute(output))
        kv = core.runner.kv_cache.kv_buffer[:, :, list(seq.block_table)]
        return kv.flatten(2, 3)[:, :, :len(PROMPT)].clone()
    finally:
        core.close()


def test_two_prefill_ranks_write_their_heads_into_one_decode_rank(tmp_path):
    need_nixl()
    _save("LlamaForCausalLM", tmp_path / "m", 253, 2)
    path = str(tmp_path / "m")
    want = reference_kv(path)
    transfer = TransferConfig(worker_id="p", model_id="m", backend="nixl", tp_size=2, total_kv_heads=2,
                              timeout_s=WAIT)
    spec = RankKVSpec("prefill", transfer, str(tmp_path))
    hook_factory = functools.partial(rank_kv_hook, spec)
    core = EngineCore(engine_config(path, 2), prefill_only=True, rank_hook=hook_factory)
    nixl = get_transfer_backend("nixl")
    local = nixl.sender(rank_config(transfer, 0), core.runner.kv_cache.kv_buffer)
    remote = RemoteEndpoint(command_address(spec, 1), 1, timeout_s=WAIT)
    layers, _, _, _, _, dim = core.runner.kv_cache.kv_buffer.shape
    rx = nixl.receiver(TransferConfig(worker_id="d", model_id="m", backend="nixl", total_kv_heads=2,
                                      timeout_s=WAIT), torch.zeros(layers, 2, 16, BS, 2, dim))
    recv = RankedReceive([rx], rank_kv_heads(2, 1))
    try:
        core.add_request("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
        output = core.scheduler.schedule()
        seq = output.scheduled[0].seq
        dst_ids = [9, 10]
        handles = recv.expect("a", dst_ids, rank_kv_heads(2, 2))
        pairs = RankedSend([local, remote]).add_request(handles, list(seq.block_table))
        assert sorted(rank for rank, _ in pairs) == [0, 1]
        mine = [rid for rank, rid in pairs if rank == 0]

        def hook(layer: int) -> None:
            for rid in mine:
                local.send_layer(rid, layer)
        note = msgspec.msgpack.encode(RankNote(sends=pairs))
        core.commit(output, core.runner.execute(output, hook, rank_note=note))
        assert recv.wait("a", WAIT) is TransferStatus.DONE, recv.reason("a")
        got = rx.kv_buffer[:, :, dst_ids].flatten(2, 3)[:, :, :len(PROMPT)]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert rx.wait_until(lambda: recv.releasable("a"), WAIT)
        recv.release("a")
        for rank, rid in pairs:
            if rank == 0:
                assert local.wait_until(lambda rid=rid: sender_settled(local, rid), WAIT)
                local.release(rid)
            else:
                remote.release_settled(rid, WAIT)
        core.block_manager.free(seq)
        recv.check_no_leaks()
        local.check_no_leaks()
        remote.check_no_leaks()
        assert remote.pending() == []
        core.check_no_leaks()
    finally:
        remote.close()
        rx.close()
        local.close()
        core.close()


def drain(core: EngineCore) -> list[int]:
    """Step `core` until nothing is unfinished; the tokens sampled, in order."""
    tokens: list[int] = []
    for _ in range(50):
        if not core.scheduler.has_unfinished():
            return tokens
        tokens += [o.token_id for o in core.step()]
    raise AssertionError("engine did not finish within 50 steps")


def test_one_prefill_rank_writes_both_decode_ranks_which_then_decode(tmp_path):
    """P TP=1 -> D TP=2: one sender writes each decode rank's heads (rank 0's receiver here, rank 1's in
    its follower process); the decode engine of two ranks then continues greedily from the landed KV and
    samples what one rank computing everything samples."""
    import time

    from engine.sequence import Sequence

    need_nixl()
    _save("LlamaForCausalLM", tmp_path / "m", 253, 2)
    path = str(tmp_path / "m")
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    whole = EngineCore(engine_config(path, 1))
    try:
        whole.add_request("a", PROMPT, greedy)
        want = drain(whole)
    finally:
        whole.close()
    prefill = EngineCore(engine_config(path, 1), prefill_only=True)
    transfer = TransferConfig(worker_id="d", model_id="m", backend="nixl", tp_size=2, total_kv_heads=2,
                              timeout_s=WAIT)
    spec = RankKVSpec("decode", transfer, str(tmp_path))
    core = EngineCore(engine_config(path, 2), rank_hook=functools.partial(rank_kv_hook, spec))
    nixl = get_transfer_backend("nixl")
    tx = nixl.sender(TransferConfig(worker_id="p", model_id="m", backend="nixl", total_kv_heads=2,
                                    timeout_s=WAIT), prefill.runner.kv_cache.kv_buffer)
    local = nixl.receiver(rank_config(transfer, 0), core.runner.kv_cache.kv_buffer)
    remote = RemoteEndpoint(command_address(spec, 1), 1, timeout_s=WAIT)
    recv = RankedReceive([local, remote], rank_kv_heads(2, 2))
    try:
        prefill.add_request("a", PROMPT, greedy)
        output = prefill.scheduler.schedule()
        src = prefill.scheduler.get("a")
        assert src is not None
        first = [o.token_id for o in prefill.commit(output, prefill.runner.execute(output))]
        seq = Sequence("a", list(PROMPT), greedy, time.monotonic(), core.eos_token_ids)
        assert core.scheduler.add_waiting_for_kv(seq)
        handles = recv.expect("a", list(seq.block_table), rank_kv_heads(2, 1))
        pairs = RankedSend([tx]).add_request(handles, list(src.block_table))
        assert sorted(h.heads.dst_rank for h in handles.handles) == [0, 1]
        for _, rid in pairs:
            tx.send_layers(rid)
        assert recv.wait("a", WAIT) is TransferStatus.DONE, recv.reason("a")
        assert local.wait_until(lambda: recv.releasable("a"), WAIT)
        recv.release("a")
        for _, rid in pairs:
            assert tx.wait_until(lambda rid=rid: sender_settled(tx, rid), WAIT)
            tx.release(rid)
        core.scheduler.kv_landed("a", first[0])
        assert first + drain(core) == want
        prefill.block_manager.free(src)
        recv.check_no_leaks()
        tx.check_no_leaks()
        remote.check_no_leaks()
        core.check_no_leaks()
    finally:
        remote.close()
        local.close()
        tx.close()
        core.close()
        prefill.close()
