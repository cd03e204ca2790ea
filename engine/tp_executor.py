"""Tensor parallel ranks of one engine: rank 0 in the calling process (it runs the scheduler), ranks
``1..N-1`` in processes started here, each running ``run_follower``.

Each step rank 0's ``ModelRunner.compute_logits`` broadcasts the step's ``StepBatch`` (msgpack over the
gloo CPU group, ``engine.distributed``) and every rank runs the same forward; the forward's all-reduces
and all-gathers go over the device group (NCCL on CUDA, gloo on the CPU). Only rank 0 samples.

A caller that needs per-rank work (a KV endpoint over each rank's own ``kv_buffer`` shard) passes a
``RankHookFactory``: a picklable callable (a module-level function, or a ``functools.partial`` of one) that
each rank ``1..N-1`` calls once with its ``ModelRunner`` and ``TensorParallel``; the ``RankHook`` it builds
gives each step's layer hook (called after each layer's K/V is stored on that rank, as rank 0's), reading
the step's ``StepBatch.rank_note``, and is closed when the rank's loop ends. ``RankSetup``: a picklable
callable each rank ``1..N-1`` calls first, with no arguments (a spawned process inherits none of rank 0's
set-up: the worker passes its log configuration, so the ranks' lines have the worker's format).

Failure: a rank that dies makes the others' next collective fail (at the latest after
``ParallelConfig.timeout_s``), so rank 0's step raises and the engine ends; a follower whose rank 0 is
gone exits the same way. ``TensorParallelRanks.close`` sends the stop message, joins the followers with a
deadline, kills any still alive and destroys the process group.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.distributed import TensorParallel, init_tensor_parallel, loopback_init_method, rank_device
from engine.model_runner import ModelRunner
from engine.models.loader import resolve_device
from engine.models.registry import read_model_config, resolve_model, tensor_parallel_problem
from engine.step_batch import StepBatch

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0  # how long close() waits for each follower to exit after the stop message


class RankHook(Protocol):
    """Per-rank work of a rank ``> 0`` (module docstring)."""

    def layer_hook_for(self, batch: StepBatch) -> Callable[[int], None] | None:
        """The layer hook of this step's forward (None: none), from ``batch`` (``rank_note``)."""
        ...

    def close(self) -> None:
        """Release what the hook holds (the rank's loop ended, normally or not)."""
        ...


RankHookFactory = Callable[[ModelRunner, TensorParallel], RankHook]
RankSetup = Callable[[], None]


class RankRefused(Exception):
    """A follower rank could not build its ``ModelRunner`` shard (the message says why)."""


def run_follower(engine_config: EngineConfig, tp: TensorParallel,
                 rank_hook: RankHookFactory | None = None) -> int:
    """Rank ``tp.rank > 0``'s loop: build its ``ModelRunner`` shard (and ``rank_hook``'s hook over it),
    build its attention plans (``ModelRunner.warm_attention_plans``), then freeze the start-up heap
    (``gc.freeze``, as a worker's rank 0 does) and run each broadcast ``StepBatch``'s forward, with the
    hook's layer hook, until the stop message. Returns the number of steps run.

    Raises:
        RankRefused: building the shard was refused (a ``ValueError`` or ``FileNotFoundError`` of
            ``ModelRunner``: a model or setting rank 0 refuses as well).
        RuntimeError / DistBackendError: rank 0 failed or went silent past the group's timeout.
        What the hook raises (the rank ends; rank 0's next collective fails).
    """
    try:
        runner = ModelRunner(engine_config, tp)
    except (ValueError, FileNotFoundError) as exc:
        raise RankRefused(str(exc)) from exc
    # the attention plans rank 0's warm-up builds for itself (engine/warmup.py), built here for this shard
    runner.warm_attention_plans(min(engine_config.scheduler.max_num_batched_tokens, runner.max_model_len))
    hook = rank_hook(runner, tp) if rank_hook is not None else None
    # the shard and the hook live as long as the rank: out of full collections, which would stall this
    # rank's next collective and with it every rank (as protocol/heap.py does for rank 0's worker)
    gc.collect()
    gc.freeze()
    steps = 0
    try:
        while True:
            batch = StepBatch.decode(tp.broadcast_bytes(None))
            if batch.stop:
                return steps
            with runner.on_device():
                runner.batch_logits(batch, hook.layer_hook_for(batch) if hook is not None else None)
            steps += 1
    finally:
        if hook is not None:
            hook.close()


def _quiet_progress_bars() -> None:
    """No Hugging Face progress bar in this process: ``HF_HUB_DISABLE_PROGRESS_BARS=1`` for one imported
    later, ``disable_progress_bar`` for transformers if imported already (its weight-loading bar follows
    huggingface_hub's setting as it was when transformers was imported)."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "transformers.utils.logging" in sys.modules:
        sys.modules["transformers.utils.logging"].disable_progress_bar()


def _follower_main(engine_config: EngineConfig, rank: int, init_method: str, threads: int,
                   rank_hook: RankHookFactory | None = None, rank_setup: RankSetup | None = None) -> None:
    """Process entry of rank ``rank``: ``rank_setup``, join the group, run ``run_follower``, leave the
    group. A refusal to build the shard (``RankRefused``) is logged in one line and ends the process with
    exit code 1, without a traceback. SIGINT is ignored: a terminal's Ctrl-C reaches the whole process
    group, and rank 0 decides when its followers stop (its worker drains first)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if rank_setup is not None:
        rank_setup()
    _quiet_progress_bars()  # rank 0 draws the worker's one "Loading weights" bar
    torch.set_num_threads(threads)
    size = engine_config.parallel.tensor_parallel_size
    device = rank_device(resolve_device(engine_config.model.device), TensorParallel(rank=rank, size=size))
    tp = init_tensor_parallel(rank, size, init_method, device, engine_config.parallel.timeout_s)
    try:
        run_follower(engine_config, tp, rank_hook)
    except RankRefused as exc:  # rank 0 refuses the same and says so: one line here, no traceback
        logger.error("tensor parallel rank %d: cannot start: %s", rank, exc)
        raise SystemExit(1) from None
    finally:
        tp.close()


class TensorParallelRanks:
    """Starts ranks ``1..N-1`` and joins rank 0 (this process) to them.

    Args:
        engine_config: the engine's config (``parallel.distributed`` must be True).
        init_method: rank 0's store address; default a free loopback port (all ranks on this host).
        rank_hook: built on every rank ``1..N-1`` (``RankHookFactory``; module docstring).
        rank_setup: called first on every rank ``1..N-1`` (``RankSetup``; module docstring).

    Attributes:
        tp: rank 0's ``TensorParallel`` (give it to ``ModelRunner``).

    Raises:
        ValueError: ``parallel.distributed`` is False, a model the ranks cannot split
            (``registry.tensor_parallel_problem``, before any rank starts) or one the loader refuses, or
            ``torch.distributed`` is already initialised in this process.
        FileNotFoundError: the model or its ``config.json`` is not there.
        RuntimeError / DistNetworkError: the ranks did not all join within ``parallel.timeout_s``
            (the started processes are killed first).
    """

    def __init__(self, engine_config: EngineConfig, init_method: str | None = None,
                 rank_hook: RankHookFactory | None = None, rank_setup: RankSetup | None = None) -> None:
        parallel = engine_config.parallel
        if not parallel.distributed:
            raise ValueError("TensorParallelRanks needs tensor_parallel_size > 1 or force_distributed")
        # a model the ranks cannot split is refused here, from its config.json, before any rank starts
        # (each would otherwise load the config and fail on its own)
        raw = read_model_config(resolve_model(engine_config.model.model), engine_config.model.quantization)
        if (why := tensor_parallel_problem(raw, parallel.tensor_parallel_size)) is not None:
            raise ValueError(why)
        init_method = init_method or loopback_init_method()
        ctx = mp.get_context("spawn")
        self.followers: list[BaseProcess] = []
        threads = torch.get_num_threads()
        try:
            for rank in range(1, parallel.tensor_parallel_size):
                proc = ctx.Process(target=_follower_main,
                                   args=(engine_config, rank, init_method, threads, rank_hook, rank_setup),
                                   name=f"pdserve-tp-rank{rank}", daemon=True)
                proc.start()
                self.followers.append(proc)
            size = parallel.tensor_parallel_size
            place = TensorParallel(rank=0, size=size)
            device = rank_device(resolve_device(engine_config.model.device), place)
            self.tp = init_tensor_parallel(0, size, init_method, device, parallel.timeout_s)
        except BaseException:
            self._kill()
            raise
        self._closed = False

    def dead_followers(self) -> list[str]:
        """Names and exit codes of followers no longer alive (empty while all run)."""
        return [f"{p.name} (exit code {p.exitcode})" for p in self.followers if not p.is_alive()]

    def close(self) -> None:
        """Stop the followers (stop message, then join with ``JOIN_TIMEOUT_S`` each, then kill) and
        destroy rank 0's process group. Idempotent; never raises for a follower already gone."""
        if self._closed:
            return
        self._closed = True
        if self.followers and not self.dead_followers():
            try:
                self.tp.broadcast_bytes(StepBatch.stop_message().encode())
            except Exception as exc:  # a follower died meanwhile: it is killed below
                logger.warning("tensor parallel stop message failed: %s", exc)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for proc in self.followers:
            proc.join(max(deadline - time.monotonic(), 0.0))
        self._kill()
        self.tp.close()

    def _kill(self) -> None:
        for proc in self.followers:
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
