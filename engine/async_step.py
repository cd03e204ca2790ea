"""Asynchronous scheduling of decode steps: launch step N+1 before the host has step N's tokens.

A decode step through a CUDA graph leaves the GPU idle while the host waits for the step's token ids,
applies them (``Scheduler.update``), schedules the next step and fills its inputs: 0.3–0.5 ms of an
≈ 4.8 ms batch-1 step of an 8B model on an H200 (docs/benchmarks/engine.md). With asynchronous
scheduling (vLLM's ``--async-scheduling`` does the same; here for decode-only batches whose rows are all
``samples_on_device``: greedy or seeded sampling, no logprobs or penalties) the engine enqueues step N+1
right after step N, feeding step N's sampled tokens to step N+1's ``input_ids`` on the device, and does
step N's host work while step N+1 runs.

Rows with a ``structured_output`` run ahead too. Step N+1's bitmask depends on step N's token, which
reaches the host only after step N's sampling; but the bitmask is read only by step N+1's sampling, after
its forward. So ``launch_decode`` enqueues step N+1's forward first, then (``grammar``) the host waits for
step N's tokens (their copy precedes that forward on the stream), advances each matcher over them and
fills the bitmask while the forward runs, copies it to the device on a side stream
(``engine.structured_output.BitmaskBuffers``) and enqueues the sampling behind that copy. The device
idles only when the host's matcher work outlasts a forward.

``LaunchedStep`` is one such enqueued step: its ``SchedulerOutput``, the sampled token ids on the device
(int64 ``[n]``), their asynchronous copy to pinned host memory and a CUDA event after it. The engine keeps
at most two alive (the one whose tokens it reads, and the one launched ahead of it); ``TokenBuffers``
alternates two host buffers between them. Block lifetime: a launched step writes the KV of each of its
sequences' tokens; ``EngineCore`` makes ``BlockManager.free`` wait for the newest launched step first
(``BlockManager.before_free``), so no block is reused (by another sequence, or by a KV transfer landing
in it) while a step in flight may still write it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.cuda_graphs import DecodeCudaGraphs
from engine.ops.argmax import argmax_rows
from engine.sampler import GrammarMask, Sampler, SamplingRow
from engine.scheduler_output import SchedulerOutput


class TokenBuffers:
    """Two host buffers of int64 ``[max_batch]`` (pinned on CUDA), each with a CUDA event (None off
    CUDA), used in turn by launched steps."""

    def __init__(self, max_batch: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self._bufs = [torch.zeros(max_batch, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._turn = 0

    def next(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The buffer and event whose previous user (two launches ago) has been read."""
        self._turn ^= 1
        return self._bufs[self._turn], self._events[self._turn]


@dataclass
class LaunchedStep:
    """A decode step enqueued on the device: ``output``'s rows sampled greedily into ``tokens``.

    ``tokens``: int64 ``[n]`` on the device (``n = len(output.scheduled)``); ``host``: its copy (int64
    ``[n]``, written asynchronously on CUDA); ``event``: recorded after that copy (None off CUDA, where
    everything already ran).
    """

    output: SchedulerOutput
    tokens: torch.Tensor
    host: torch.Tensor
    event: torch.cuda.Event | None

    def wait(self) -> None:
        """Block until the step's work on the device (forward, argmax, copy) is done."""
        if self.event is not None:
            self.event.synchronize()

    def token_ids(self) -> list[int]:
        """The sampled token ids, one per scheduled sequence (waits for the step)."""
        self.wait()
        ids: list[int] = self.host.tolist()
        return ids


def launch_decode(graphs: DecodeCudaGraphs, output: SchedulerOutput, feed: LaunchedStep | None,
                  buffers: TokenBuffers, rows: Sequence[SamplingRow] | None = None,
                  grammar: Callable[[], GrammarMask | None] | None = None) -> LaunchedStep:
    """Enqueue a decode-only step (graph replay or, uncaptured, the static-buffer forward) and its
    sampling; returns without waiting for the device, except where ``grammar`` waits.

    Args:
        graphs: the runner's ``DecodeCudaGraphs``.
        output: decode-only, every row ``samples``; with ``feed``, the same sequences in the same order
            as ``feed.output``, each one token further (``Scheduler.next_decode_step``).
        feed: the step launched before this one, not yet applied to the scheduler: its device tokens
            become this step's ``input_ids``, and positions are one past the sequences'
            ``num_computed_tokens``.
        buffers: where the host copy of the token ids goes.
        rows: one ``SamplingRow`` per scheduled sequence, all ``samples_on_device``
            (``Sampler.sample_tokens``); None when every row is plain greedy (one argmax).
        grammar: called after the forward is enqueued and before the sampling: the bitmask of the rows
            with a grammar (filled on the host while the device runs the forward; it may wait for
            ``feed``'s tokens, whose copy precedes this forward on the stream), or None.

    Raises:
        ValueError: from ``DecodeCudaGraphs.run`` (no bucket, bad positions or block tables), or a
            ``feed`` / ``rows`` whose row count differs from ``output``'s, or ``grammar`` without ``rows``.
    """
    seqs = [s.seq for s in output.scheduled]
    tables = [seq.block_table for seq in seqs]
    if rows is not None and len(rows) != len(seqs):
        raise ValueError(f"{len(rows)} sampling rows for {len(seqs)} sequences")
    if grammar is not None and rows is None:
        raise ValueError("a grammar mask needs the sampling rows")
    if feed is None:
        positions = [seq.num_computed_tokens for seq in seqs]
        logits = graphs.run([seq.token_ids[p] for seq, p in zip(seqs, positions, strict=True)],
                            positions, tables)
    else:
        if len(feed.output.scheduled) != len(seqs):
            raise ValueError(f"feed step has {len(feed.output.scheduled)} rows, this step {len(seqs)}")
        logits = graphs.run([0] * len(seqs), [seq.num_computed_tokens + 1 for seq in seqs], tables,
                            device_token_ids=feed.tokens)
    if rows is None:
        tokens = argmax_rows(logits)
    else:
        mask = grammar() if grammar is not None else None
        tokens = Sampler.sample_tokens(logits, rows, grammar_mask=mask)
    buf, event = buffers.next()
    host = buf[: len(seqs)]
    host.copy_(tokens, non_blocking=event is not None)
    if event is not None:
        event.record()
    return LaunchedStep(output, tokens, host, event)


__all__ = ["LaunchedStep", "TokenBuffers", "launch_decode"]
