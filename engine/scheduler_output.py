"""What one scheduler step hands to the model runner: ``ScheduledSeq`` and ``SchedulerOutput`` (no torch).

Re-exported by ``engine.scheduler``, where they are made.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sequence import Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step.

    ``num_scheduled_tokens`` tokens start at ``seq.num_computed_tokens`` (read it before ``update``).
    ``samples`` is True when this step reaches the end of the known tokens, so the runner must sample a
    token for it (False for a non-final prefill chunk, whose logits are discarded).
    """

    seq: Sequence
    num_scheduled_tokens: int
    samples: bool


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step computes; handed to the model runner and then back to :meth:`Scheduler.update`.

    ``scheduled``: decodes first (query length 1, as ``AttentionMetadata`` expects), then prefills.
    ``num_decodes``: how many leading entries are decodes, so the runner need not re-derive it.
    ``preempted``: request ids whose KV was dropped this step; workers with per-request device state
    (e.g. sampler penalties, KV transfers) must reset it, and they recompute later.
    """

    scheduled: tuple[ScheduledSeq, ...]
    num_decodes: int
    preempted: tuple[str, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        """Total tokens in this step (≤ ``max_num_batched_tokens``)."""
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """True when nothing is scheduled (skip the forward pass)."""
        return not self.scheduled
