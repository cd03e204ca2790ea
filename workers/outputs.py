"""Engine step outputs → control-plane messages (``FirstToken``, ``NextToken``, ``RequestFinished``), and
the frames a worker phase sends (``batch_outputs``: its per-request messages in one ``OutputBatch``).

Shared by the colocated and decode workers: an output is the request's first token when the sequence
holds exactly one output token after the step; its finish reason (``stop`` / ``length``) ends it. An
output whose grammar rejected its token (``StepOutput.error``) becomes ``RequestFailed`` alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from protocol.messages import (
    FinishReason,
    FirstToken,
    KVReserved,
    Message,
    NextToken,
    OutputBatch,
    OutputMessage,
    PromptLogprob,
    RequestFailed,
    RequestFinished,
    RequestRejected,
    TopLogprob,
)

if TYPE_CHECKING:
    from engine.engine_core import StepOutput
    from engine.sequence import Sequence
    from workers.metrics import WorkerMetrics


def top_logprobs_of(out: StepOutput) -> list[TopLogprob] | None:
    """The top-N alternatives of ``out`` as wire structs, or None when the request asked for none."""
    if out.top_logprobs is None:
        return None
    return [TopLogprob(t, lp) for t, lp in out.top_logprobs]


def prompt_logprobs_of(out: StepOutput) -> list[PromptLogprob] | None:
    """The prompt logprob entries ``out`` carries (its request's first token) as wire structs, or None."""
    if out.prompt_logprobs is None:
        return None
    return [PromptLogprob(e.logprob, e.rank, [TopLogprob(t, lp) for t, lp in e.top])
            for e in out.prompt_logprobs]


def finish_reason(out: StepOutput) -> FinishReason | None:
    """``stop`` / ``length`` when ``out`` ended its request, else None (``prefilled`` → None)."""
    if out.finish_reason == "stop":
        return "stop"
    if out.finish_reason == "length":
        return "length"
    return None


def token_messages(worker_id: str, seq: Sequence, out: StepOutput, metrics: WorkerMetrics | None = None,
                   now: float = 0.0) -> list[Message]:
    """Messages for one sampled token of ``seq`` (``out.token_id`` is already appended to it).

    The first output token becomes a ``FirstToken``, each later one a ``NextToken``; a finished
    request is followed by ``RequestFinished`` with its prompt/output token counts; a token its grammar
    rejected (``out.error``) gives ``RequestFailed`` only. ``metrics`` (with ``now``, ``time.monotonic()``
    s) hears of the first token and of the end.
    """
    rid, reason = out.request_id, finish_reason(out)
    if out.error is not None:  # the token is no output: the request ends here (its blocks are freed)
        return [RequestFailed(request_id=rid, worker_id=worker_id, error=out.error,
                              kind="structured_output")]
    msgs: list[Message] = []
    if seq.num_output_tokens == 1:
        msgs.append(FirstToken(request_id=rid, worker_id=worker_id, token_id=out.token_id,
                               logprob=out.logprob, top_logprobs=top_logprobs_of(out),
                               num_cached_tokens=seq.num_cached_tokens, finish_reason=reason,
                               prompt_logprobs=prompt_logprobs_of(out)))
        if metrics is not None:
            metrics.first_token(seq, now)
    else:
        msgs.append(NextToken(request_id=rid, worker_id=worker_id, token_id=out.token_id,
                              logprob=out.logprob, top_logprobs=top_logprobs_of(out)))
    if reason is not None:
        msgs.append(RequestFinished(request_id=rid, worker_id=worker_id, finish_reason=reason,
                                    num_prompt_tokens=seq.num_prompt_tokens,
                                    num_output_tokens=seq.num_output_tokens))
        if metrics is not None:
            metrics.finished(seq, reason, now)
    return msgs


def stream_outputs(worker_id: str, seqs: dict[str, Sequence], outs: list[StepOutput],
                   emit: Callable[[Message], None], metrics: WorkerMetrics | None = None) -> None:
    """Emit the messages of every output whose request is in ``seqs`` (request id → ``Sequence``), and
    forget requests that finished (the scheduler already freed their blocks). Decode and colocated
    workers stream their steps this way; ``metrics`` hears of each first token, each end and the step."""
    now = time.monotonic()
    sampled = len(outs)
    for out in outs:
        seq = seqs.get(out.request_id)
        if seq is None:
            sampled -= 1
            continue
        for msg in token_messages(worker_id, seq, out, metrics, now):
            emit(msg)
        if seq.is_finished:
            del seqs[out.request_id]
    if metrics is not None:
        metrics.step(sampled, now)


def batch_outputs(worker_id: str, msgs: list[Message]) -> list[Message]:
    """The frames of one phase's messages: every per-request message (``OutputMessage``) goes into one
    ``OutputBatch`` (their order kept), placed where the first of them was; the other messages (canary
    answers) stay as they are. No per-request message: ``msgs`` unchanged."""
    outputs: list[OutputMessage] = []
    frames: list[Message] = []
    at = -1  # where the batch goes in ``frames``
    for msg in msgs:
        if isinstance(msg, FirstToken | NextToken | RequestFinished | RequestFailed | RequestRejected
                      | KVReserved):
            at = len(frames) if at < 0 else at
            outputs.append(msg)
        else:
            frames.append(msg)
    if outputs:
        frames.insert(at, OutputBatch(worker_id=worker_id, messages=outputs))
    return frames
