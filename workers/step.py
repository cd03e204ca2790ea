"""One engine step with a per-step attention ``layer_hook`` (the prefill worker streams KV from it).

Same sequence as ``EngineCore.step`` (schedule → ``ModelRunner.execute`` → ``Scheduler.update``; without a
hook factory it is ``EngineCore.step`` itself, asynchronous scheduling included), with two additions a
worker needs: the ``SchedulerOutput`` is shown to ``layer_hook_for`` before the forward
pass (so a hook can send each layer of the requests whose last prompt chunk runs in this step), and a
failing forward pass raises ``StepFailed`` naming the requests it carried.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from engine.engine_core import EngineCore, StepOutput

LayerHook = Callable[[int], None]
LayerHookFactory = Callable[[SchedulerOutput], LayerHook | None]


class StepFailed(RuntimeError):
    """The model step raised; ``request_ids`` were scheduled in it and must be failed by the caller."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        self.request_ids = request_ids
        super().__init__(f"engine step failed ({type(cause).__name__}: {cause}) for {len(request_ids)} "
                         f"request(s)")


def run_step(core: EngineCore, layer_hook_for: LayerHookFactory | None = None,
             rank_note_for: Callable[[], bytes] | None = None) -> list[StepOutput]:
    """Run one continuous-batching step of ``core``.

    Args:
        core: the worker's engine.
        layer_hook_for: called with the step's ``SchedulerOutput`` before the forward pass; the hook it
            returns (or None) becomes ``AttentionMetadata.layer_hook`` (called with each layer index
            after that layer's K/V is stored in the ``KVCachePool``).

    Returns:
        One ``StepOutput`` per token sampled (``finish_reason`` ``"prefilled"`` in prefill-only mode).

    Raises:
        StepFailed: the hook factory, the forward pass or sampling raised (nothing was updated); without
            a hook factory, anything ``EngineCore.step`` raised.

    ``rank_note_for`` (with ``layer_hook_for`` only): called right after it; its bytes become the step's
    ``StepBatch.rank_note`` for the other tensor parallel ranks (``ModelRunner.execute``).
    """
    if layer_hook_for is None:  # EngineCore.step (with asynchronous scheduling when configured)
        try:
            return core.step()
        except Exception as exc:
            raise StepFailed(core.step_request_ids, exc) from exc
    output = core.scheduler.schedule()
    if output.is_empty:
        return []
    try:
        hook = layer_hook_for(output) if layer_hook_for is not None else None
        note = rank_note_for() if rank_note_for is not None else b""
        results = core.runner.execute(output, hook, rank_note=note)
    except Exception as exc:
        raise StepFailed([s.seq.request_id for s in output.scheduled], exc) from exc
    return core.commit(output, results)
