"""``--tensor-parallel-size``: every role takes N > 1 (prefill and decode workers run a KV endpoint on
each rank: tests/system/test_tp_disagg_live.py); a colocated worker over two CPU ranks (gloo) serves a
request, and when a rank dies the step's requests fail and the worker stops (it deregisters on the way
out)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from protocol.messages import ColocatedRequest, RequestFailed, RequestFinished
from protocol.settings import WorkerSettings
from tests.workers.helpers import BLOCK_SIZE, close, of_type, pump, settings, wire
from workers.colocated import ColocatedWorker
from workers.setup import engine_config_from_settings


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_every_role_takes_more_than_one_rank(role):
    s = WorkerSettings(role=role, tensor_parallel_size=2, insecure_control_plane=True)
    assert engine_config_from_settings(s).parallel.tensor_parallel_size == 2


def test_settings_reach_the_engine_config():
    s = WorkerSettings(role="colocated", tensor_parallel_size=4, insecure_control_plane=True)
    assert engine_config_from_settings(s).parallel.tensor_parallel_size == 4
    for bad in (0, 65):  # at most 64 ranks: the most a KV reservation may name (protocol/messages.py)
        with pytest.raises(ValueError, match=rf"--tensor-parallel-size: must be in \[1, 64\], got {bad}"):
            WorkerSettings(role="colocated", tensor_parallel_size=bad, insecure_control_plane=True)


def test_colocated_two_ranks_serve_then_a_lost_rank_stops_the_worker(model_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks spin against each other on a 2-core machine otherwise
    core = EngineCore(EngineConfig(
        ModelConfig(str(model_dir), load_format="dummy", dtype="float32", device="cpu",
                    attention_backend="torch"),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=32), SchedulerConfig(max_num_seqs=4),
        ParallelConfig(tensor_parallel_size=2, timeout_s=30)))
    worker = ColocatedWorker(settings("colocated", "c0", model_dir), core, str(model_dir))
    stops: list[bool] = []
    worker.request_stop = lambda: stops.append(True)  # type: ignore[method-assign]
    try:
        msgs: list[Any] = []
        worker.deliver(ColocatedRequest(request_id="r", prompt_token_ids=[5, 6, 7, 8], sampling=wire(3)))
        pump([worker], lambda: bool(of_type(msgs, RequestFinished)), timeout=60, sink=msgs)
        assert of_type(msgs, RequestFinished)[0].num_output_tokens == 3 and not stops
        assert core.ranks is not None
        core.ranks.followers[0].kill()
        core.ranks.followers[0].join(10)
        worker.deliver(ColocatedRequest(request_id="s", prompt_token_ids=[5, 6, 7], sampling=wire(3)))
        pump([worker], lambda: bool(of_type(msgs, RequestFailed, "s")), timeout=60, sink=msgs)
        assert stops, "the worker kept serving without its second rank"
        core.block_manager.check_no_leaks()
    finally:
        close(worker)  # its control socket: an open one blocks the zmq context's term at exit
        core.close()
        torch.set_num_threads(threads)


class _Ranks:
    def __init__(self, lost: list[str]) -> None:
        self.lost = lost

    def dead_followers(self) -> list[str]:
        return self.lost


def test_an_unreachable_rank_endpoint_stops_the_worker_only_when_a_rank_died(model_dir, monkeypatch):
    # a dead rank's KV endpoint answers no command: the poll that asks it must end the worker cleanly
    # (deregistering), not kill the loop; while every rank lives the error is a bug and propagates
    from tests.workers.helpers import prefill_worker

    worker = prefill_worker(model_dir)
    stops: list[bool] = []
    worker.request_stop = lambda: stops.append(True)  # type: ignore[method-assign]

    def unreachable() -> None:
        raise TimeoutError("tensor parallel rank 1: no answer to status within 10000 ms")
    monkeypatch.setattr(worker, "poll", unreachable)
    try:
        monkeypatch.setattr(worker.core, "ranks", _Ranks([]))
        with pytest.raises(TimeoutError):
            worker.run_once()
        assert not stops
        monkeypatch.setattr(worker.core, "ranks", _Ranks(["pdserve-tp-rank1 (exit code -9)"]))
        worker.run_once()
        assert stops == [True]
    finally:
        monkeypatch.setattr(worker.core, "ranks", None)
        close(worker)
