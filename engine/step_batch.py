"""``StepBatch``: what the model forward of one step reads, as plain lists: the typed message rank 0
broadcasts to the other tensor parallel ranks (msgpack through ``msgspec``), which run the same forward.

Only the forward's inputs travel (the scheduled tokens, their positions and block tables, which rows
sample); sampling, grammars and the scheduler stay on rank 0, so the other ranks hold no ``Sequence``.
"""

from __future__ import annotations

import msgspec

from engine.scheduler_output import SchedulerOutput


class StepBatch(msgspec.Struct, frozen=True, array_like=True):
    """One step's forward inputs, one entry per scheduled sequence (decodes first).

    Attributes:
        token_ids: the scheduled tokens of each sequence (``num_scheduled_tokens`` ids, from position
            ``starts[i]``).
        starts: each sequence's ``num_computed_tokens`` before the step (the first scheduled position).
        block_tables: each sequence's ``block_table`` (on rank 0, the ``Sequence``'s own list).
        samples: whether each sequence samples (its last scheduled token's logits are computed).
        prompt_rows: packed row indices whose logits are computed too, after the sampling rows' (prompt
            logprobs: rank 0 turns them into logprobs; every rank computes them for the LM head's
            collectives).
        stop: True for the message that ends the other ranks' step loop (every other field empty).
        rank_note: opaque bytes from rank 0's caller to the other ranks' ``RankHook``
            (``engine.tp_executor``), e.g. which transfers' layers to stream this step; ``b""``: none.
    """

    token_ids: list[list[int]]
    starts: list[int]
    block_tables: list[list[int]]
    samples: list[bool]
    prompt_rows: list[int] = []
    stop: bool = False
    rank_note: bytes = b""

    @staticmethod
    def from_output(output: SchedulerOutput, prompt_rows: list[int] | None = None,
                    rank_note: bytes = b"") -> StepBatch:
        """The forward inputs of ``output`` (read before ``Scheduler.update``), with the extra logit rows
        ``prompt_rows`` and the other ranks' ``rank_note``."""
        token_ids, starts, tables, samples = [], [], [], []
        for s in output.scheduled:
            seq = s.seq
            start = seq.num_computed_tokens
            token_ids.append(seq.token_ids[start:start + s.num_scheduled_tokens])
            starts.append(start)
            tables.append(seq.block_table)
            samples.append(s.samples)
        return StepBatch(token_ids, starts, tables, samples, list(prompt_rows or []), rank_note=rank_note)

    @staticmethod
    def stop_message() -> StepBatch:
        """The message that ends the other ranks' loop."""
        return StepBatch([], [], [], [], stop=True)

    @property
    def is_decode_only(self) -> bool:
        """True when every sequence schedules exactly one token."""
        return all(len(t) == 1 for t in self.token_ids)

    def encode(self) -> bytes:
        """msgpack bytes of this message."""
        return _ENCODER.encode(self)

    @staticmethod
    def decode(payload: bytes) -> StepBatch:
        """The message of ``encode``'s bytes.

        Raises:
            msgspec.ValidationError / msgspec.DecodeError: not a ``StepBatch``.
        """
        return _DECODER.decode(payload)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StepBatch)
