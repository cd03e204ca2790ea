"""The decode worker with asynchronous scheduling (engine/async_step.py): the real ``DecodeWorker`` over an
engine with uncaptured decode graphs (triton backend, Triton interpreter on CPU) and ``async_scheduling``
on, fed by a real prefill worker over the loopback KV transport.

Three requests are admitted at different steps (their KV lands and ``DecodeRequest`` arrives while a
decode step is launched ahead), one is aborted by the gateway while a launched step still holds its row;
every token equals the same run with async scheduling off, nothing is streamed for the aborted request
after the abort, and the worker's leak check passes (no launched step left either).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from decode_worker.worker import DecodeWorker
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.cuda_graphs import DecodeCudaGraphs
from engine.engine_core import EngineCore
from kvtransfer import TransferStatus, get_transfer_backend
from protocol.messages import (
    AbortRequest,
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
    of_type,
    prefill_worker,
    pump,
    run,
    settings,
    transfer_config,
    wire,
)

PROMPTS = {"r0": list(range(20, 27)), "r1": list(range(30, 35)), "r2": list(range(40, 49))}
MAX_TOKENS = {"r0": 8, "r1": 8, "r2": 5}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: the shared 2-core machine runs tiny steps far faster so."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def graph_decode_worker(model_dir: Path, async_scheduling: bool) -> DecodeWorker:
    """A decode worker whose engine (dummy weights, as the prefill worker's) runs decode-only steps
    through uncaptured decode graphs, launching ahead when ``async_scheduling``."""
    core = EngineCore(EngineConfig(
        ModelConfig(str(model_dir), load_format="dummy", dtype="float32", device="cpu",
                    attention_backend="triton"),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=32),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, async_scheduling=async_scheduling)))
    r = core.runner
    r.decode_graphs = DecodeCudaGraphs(r.net, r.kv_cache, r.backend, 4, r.max_model_len)
    receiver = get_transfer_backend("loopback").receiver(transfer_config("d0"), r.kv_cache.kv_buffer)
    return DecodeWorker(settings("decode", "d0", model_dir), core, str(model_dir), receiver=receiver)


class Scenario:
    """Drives a prefill and a decode worker; records every message the decode worker emits."""

    def __init__(self, model_dir: Path, async_scheduling: bool) -> None:
        self.prefill = prefill_worker(model_dir)
        self.decode = graph_decode_worker(model_dir, async_scheduling)
        self.msgs: list[Any] = []
        self.first: dict[str, int] = {}
        self.launches = {"first": 0, "ahead": 0}
        launch = self.decode.core.runner.launch

        def counting(output: Any, feed: Any = None) -> Any:
            self.launches["ahead" if feed is not None else "first"] += 1
            return launch(output, feed)

        self.decode.core.runner.launch = counting  # type: ignore[method-assign]

    def step(self, *msgs: Any) -> None:
        self.msgs.extend(run(self.decode, *msgs))

    def reserve_all(self) -> dict[str, bytes]:
        for rid, prompt in PROMPTS.items():
            self.step(ReserveKV(request_id=rid, prompt_token_ids=prompt, sampling=wire(MAX_TOKENS[rid],
                                ignore_eos=True), prefill_worker_id="p0",
                                prefill_sender_epoch=self.prefill.sender.epoch))
        return {m.request_id: m.kv_handle for m in of_type(self.msgs, KVReserved)}

    def land(self, rid: str, handle: bytes) -> None:
        """Prefill ``rid`` (its KV is written into the decode worker's blocks), wait until every layer
        landed, then hand the decode worker its first token (admitted at the next phase)."""
        req = PrefillRequest(request_id=rid, prompt_token_ids=PROMPTS[rid],
                             sampling=wire(MAX_TOKENS[rid], ignore_eos=True), kv_handle=handle)
        [first] = of_type(run(self.prefill, req), FirstToken)
        pump([self.prefill], lambda: not self.prefill.busy())
        assert self.decode.receiver.wait(rid, 10.0) is TransferStatus.DONE
        self.first[rid] = first.token_id
        self.decode.deliver(DecodeRequest(request_id=rid, first_token_id=first.token_id))

    def decoded(self, rid: str) -> list[int]:
        return [m.token_id for m in of_type(self.msgs, NextToken, rid)]

    def until(self, cond: Any) -> None:
        for _ in range(30):
            if cond():
                return
            self.step()
        raise AssertionError("condition not reached in 30 phases")

    def close(self) -> None:
        close(self.prefill)
        close(self.decode)


def drive(model_dir: Path, async_scheduling: bool) -> tuple[dict[str, list[int]], dict[str, int], list[str]]:
    """r0 lands first, r1 two phases later, r2 two phases after; r1 is aborted after 3 decode tokens.
    Returns each request's tokens (first + decoded), the launch counts, and the rows of the step
    launched ahead when the abort came."""
    sc = Scenario(model_dir, async_scheduling)
    try:
        handles = sc.reserve_all()
        for rid in ("r0", "r1"):
            sc.land(rid, handles[rid])
            sc.step()
            sc.step()
        sc.land("r2", handles["r2"])
        sc.until(lambda: len(sc.decoded("r1")) >= 3)
        ahead = sc.decode.core._ahead
        held = [s.seq.request_id for s in ahead.output.scheduled] if ahead is not None else []
        sc.step(AbortRequest(request_id="r1"))
        after_abort = len(sc.msgs)
        sc.until(lambda: len(of_type(sc.msgs, RequestFinished)) == 2)
        assert not [m for m in sc.msgs[after_abort:] if getattr(m, "request_id", None) == "r1"]
        assert not of_type(sc.msgs, RequestFailed)
        finished = {m.request_id: (m.finish_reason, m.num_output_tokens)
                    for m in of_type(sc.msgs, RequestFinished)}
        assert finished == {"r0": ("length", 8), "r2": ("length", 5)}
        assert_clean(sc.prefill, sc.decode)
        assert sc.decode.core._ahead is None and sc.decode.core.block_manager.before_free is None
        tokens = {rid: [sc.first[rid], *sc.decoded(rid)] for rid in PROMPTS}
        return tokens, sc.launches, held
    finally:
        sc.close()


def test_decode_worker_async_scheduling_same_tokens_as_sync(model_dir: Path) -> None:
    tokens, launches, held = drive(model_dir, True)
    ref, ref_launches, _ = drive(model_dir, False)
    assert tokens == ref
    assert [len(tokens[r]) for r in PROMPTS] == [8, 4, 5]  # r1: first token + 3 before the abort
    assert ref_launches == {"first": 0, "ahead": 0}
    assert launches["first"] >= 3 and launches["ahead"] >= 3  # each admission broke the run-ahead
    assert "r1" in held  # the abort came while a launched step still held r1's row
