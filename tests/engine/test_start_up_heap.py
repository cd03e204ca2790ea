"""The start-up heap is frozen out of the garbage collector's way (protocol/heap.py) in a worker, once
its engine is built and before it serves, and in a gateway process once it has started: a full
collection while serving then scans only what serving allocated."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import workers.boot
from engine.engine_core import EngineCore
from protocol.heap import freeze_start_up_heap
from protocol.settings import WorkerSettings
from tests.engine.test_warmup import make_core
from tests.gateway.inprocess import inprocess_gateway


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Start unfrozen (other tests may have frozen this process) and leave unfrozen."""
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.mark.usefixtures("unfrozen")
def test_freeze_moves_what_is_alive_out_of_full_collections() -> None:
    assert gc.get_freeze_count() == 0
    kept = [[i] for i in range(100_000)]  # tracked objects alive at start-up
    t0 = time.perf_counter()
    gc.collect()
    before = time.perf_counter() - t0
    count = freeze_start_up_heap()
    # A frozen object that dies leaves the permanent generation (another test's thread may drop one
    # between the freeze and this line), so the count can only be bounded, not matched.
    assert len(kept) <= gc.get_freeze_count() <= count
    t0 = time.perf_counter()
    gc.collect()
    after = time.perf_counter() - t0
    assert after < before  # 100k fewer objects to walk (and the test process's torch)
    assert kept[-1] == [99_999]


class _Worker:
    """What ``serve_worker``'s factory builds: records the freeze count when it starts serving."""

    fatal: str | None = None

    def __init__(self) -> None:
        self.frozen_at_run = -1

    def seed_prefill_rate(self, tokens: int, seconds: float, ended: float) -> None:
        """The start-up probe's result (a colocated worker's): not what this test looks at."""

    async def run(self) -> None:
        self.frozen_at_run = gc.get_freeze_count()


@pytest.mark.usefixtures("unfrozen")
def test_worker_freezes_before_it_serves(tiny_dummy_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    core = make_core(tiny_dummy_dir)
    monkeypatch.setattr(workers.boot, "build_core", lambda settings, prefill_only=False:
                        (core, str(tiny_dummy_dir)))
    built: list[_Worker] = []

    def factory(settings: WorkerSettings, c: EngineCore, path: str) -> _Worker:
        assert c is core and gc.get_freeze_count() == 0  # frozen after the worker is built, not before
        built.append(_Worker())
        return built[-1]

    settings = WorkerSettings(role="colocated", model=str(tiny_dummy_dir), worker_id="w",
                              insecure_control_plane=True)
    assert workers.boot.serve_worker(settings, factory) == 0  # type: ignore[arg-type]
    assert built[0].frozen_at_run > 0


@pytest.mark.usefixtures("unfrozen")
def test_gateway_freezes_once_started() -> None:
    assert gc.get_freeze_count() == 0
    with inprocess_gateway("served-model") as base:
        assert httpx.get(base + "/health", timeout=5).status_code == 200
        assert gc.get_freeze_count() > 0


@pytest.mark.usefixtures("unfrozen")
def test_tensor_parallel_follower_freezes_before_its_step_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks 1..N-1 do not go through ``serve_worker``: ``run_follower`` builds its shard's attention
    plans (up to the token budget, capped by ``max_model_len``) and freezes its own heap once its shard is
    built, before the first broadcast step is read."""
    import types

    import engine.tp_executor as tp_executor
    from engine.step_batch import StepBatch

    frozen_at_first_read: list[int] = []
    warmed: list[int] = []

    class _Runner:
        max_model_len = 1500

        def __init__(self, config: object, tp: object) -> None:
            assert gc.get_freeze_count() == 0  # not frozen before the shard is built

        def warm_attention_plans(self, max_tokens: int) -> int:
            warmed.append(max_tokens)
            return 0

    class _Tp:
        def broadcast_bytes(self, payload: None) -> bytes:
            frozen_at_first_read.append(gc.get_freeze_count())
            return StepBatch.stop_message().encode()

    monkeypatch.setattr(tp_executor, "ModelRunner", _Runner)
    config = types.SimpleNamespace(scheduler=types.SimpleNamespace(max_num_batched_tokens=2048))
    assert tp_executor.run_follower(config, _Tp()) == 0  # type: ignore[arg-type]
    assert len(frozen_at_first_read) == 1 and frozen_at_first_read[0] > 0
    assert warmed == [1500]
