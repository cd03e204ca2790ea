"""``pdserve colocated``: one process that prefills and decodes (plain ``EngineCore``, no KV transfer).

Used for short prompts under conditional disaggregation (gateway ``--disagg-threshold``) and as the
baseline the disaggregated path is compared with.

Queues and states of a request: ``ColocatedRequest`` → inbox → engine ``waiting`` (WAITING) → chunked
prefill → ``running`` (RUNNING) → FINISHED_STOPPED / FINISHED_LENGTH, or FINISHED_ABORTED on
``AbortRequest``. Out: ``FirstToken`` (TTFT), one ``NextToken`` per later token, ``RequestFinished``.
A request that cannot be served (bad params, prompt too long) gets ``RequestFailed``; others go on.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from protocol.messages import AbortRequest, ColocatedRequest, Message, Role
from workers.loop import WorkerLoop
from workers.outputs import stream_outputs
from workers.step import run_step

if TYPE_CHECKING:
    from engine.engine_core import EngineCore, StepOutput
    from engine.sequence import Sequence
    from protocol.settings import WorkerSettings


class ColocatedWorker(WorkerLoop):
    """Serves ``ColocatedRequest`` end to end; ``seqs`` maps request id → its live ``Sequence``."""

    role: Role = "colocated"

    def __init__(self, settings: WorkerSettings, core: EngineCore, model_path: str) -> None:
        super().__init__(settings, core, model_path)
        self.seqs: dict[str, Sequence] = {}

    def on_message(self, msg: Message) -> None:
        """``ColocatedRequest`` → queued; ``AbortRequest`` → aborted (unknown ids ignored).

        Raises:
            ValueError: bad prompt or duplicate id (the loop fails that request).
        """
        if isinstance(msg, ColocatedRequest):
            seq = self.seqs[msg.request_id] = self.core.add_request(msg.request_id, msg.prompt_token_ids,
                                                                    msg.sampling)
            self.expect_cached(seq, msg.expected_cached_tokens)
        elif isinstance(msg, AbortRequest):
            if msg.request_id in self.seqs:
                self.metrics.ended_by_gateway(self.seqs[msg.request_id], msg.stop_string, time.monotonic())
            self.drop(msg.request_id)

    def drop(self, request_id: str) -> None:
        """Abort the request in the engine (its blocks are freed)."""
        self.seqs.pop(request_id, None)
        self.core.abort_request(request_id)

    def request_ids(self) -> list[str]:
        """Requests queued or running."""
        return list(self.seqs)

    def awaiting_first_token(self) -> Iterable[Sequence]:
        """Requests held that have sampled no token yet (one pass over ``seqs`` per phase)."""
        return (seq for seq in self.seqs.values() if not seq.num_output_tokens)

    def step(self) -> list[StepOutput]:
        """One continuous-batching step (step thread)."""
        return run_step(self.core)

    def on_step(self, outs: list[StepOutput]) -> None:
        """Stream each sampled token; forget finished requests."""
        stream_outputs(self.worker_id, self.seqs, outs, self.emit, self.metrics)


def run(settings: WorkerSettings) -> int:
    """Entry point of ``pdserve colocated``; returns the exit status."""
    from workers.boot import serve_worker

    return serve_worker(settings, ColocatedWorker)
