"""Per-request state inside a worker: token ids, KV progress and status (no torch)."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from engine.block_hash import ROOT_HASH, block_hashes
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.prompt_logprobs import PromptTokenLogprob
    from engine.structured_output import GrammarState


class SequenceStatus(enum.Enum):
    """Lifecycle of a :class:`Sequence` in a worker's scheduler."""

    WAITING = "waiting"                      # queued for prefill, holds no blocks
    WAITING_FOR_KV = "waiting_for_kv"        # decode worker: blocks reserved, KV in flight from prefill
    RUNNING = "running"                      # scheduled each step (prefill chunks, then decode)
    PREEMPTED = "preempted"                  # blocks taken back; will recompute prompt + output so far
    FINISHED_STOPPED = "finished_stopped"    # eos or a stop token id
    FINISHED_LENGTH = "finished_length"      # max_tokens or max_model_len reached
    FINISHED_ABORTED = "finished_aborted"    # aborted by the client / gateway
    FINISHED_PREFILLED = "finished_prefilled"  # prefill worker: prompt done, first token sampled, blocks held
    FINISHED_FAILED = "finished_failed"      # its grammar rejected its sampled token (``Sequence.error``)

    @property
    def is_finished(self) -> bool:
        """True for every ``FINISHED_*`` status."""
        return self.value.startswith("finished")


class Sequence:
    """One request's tokens and KV bookkeeping.

    ``token_ids`` is prompt + output; ``num_computed_tokens`` counts tokens whose KV is in the cache;
    ``block_table[i]`` is the block holding tokens ``[i*block_size, (i+1)*block_size)``;
    ``num_cached_tokens`` is the prefix-cache hit (tokens) at the last admission.
    ``first_scheduled_time``: ``time.monotonic()`` (s) when the scheduler first admitted it from WAITING
    (None until then; kept across preemption), the end of its queue time.
    ``block_table`` only grows by appending while the sequence holds its blocks; freeing replaces it by a
    new empty list (the decode graphs' static inputs rely on this to re-send only changed rows).
    ``hashed_blocks``: ``(n, hash of block n-1)``: the leading ``n`` blocks whose prefix hashes
    ``BlockManager.cache_full_blocks`` registered; ``(0, 0)``: none (0 is ``engine.block_hash.ROOT_HASH``).
    The hashes themselves come from :meth:`full_block_hashes`, which computes each block's once.
    ``cacheable_tokens``: the leading tokens whose KV may be registered in the prefix cache (None: every
    computed token); the scheduler's prefill grid (``SchedulerConfig.prefill_grid``) sets it to the end of
    the last whole grid chunk a prefill step computed.
    ``grammar``: the matcher of ``sampling_params.structured_output`` (set by the engine that admits the
    sequence; None without one).
    ``prompt_logprobs``: with ``sampling_params.prompt_logprobs`` set, the entries of prompt tokens
    ``1 .. len`` computed so far (entry ``i`` for token ``i + 1``; filled by the model runner as the
    prompt's chunks run; complete at ``num_prompt_tokens - 1`` entries); None when not requested.
    ``error``: why the sequence ended FINISHED_FAILED (None otherwise).
    ``eos_token_ids``: the model's eos ids (any of them ends the generation unless ``ignore_eos``; ``()``:
    none).

    Raises:
        ValueError: empty prompt or negative token ids.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must not be empty")
        if min(prompt_token_ids) < 0:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must be >= 0")
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.eos_token_ids = eos_token_ids
        self.token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.hashed_blocks: tuple[int, int] = (0, 0)  # (0, engine.block_hash.ROOT_HASH)
        self._chain: list[int] = []  # full_block_hashes' kept chain
        self._chain_key: tuple[list[int], int] | None = None  # (the token list, block size) it hashes
        self.cacheable_tokens: int | None = None
        self.status = SequenceStatus.WAITING
        self.first_scheduled_time: float | None = None
        self.grammar: GrammarState | None = None
        self.error: str | None = None
        self.prompt_logprobs: list[PromptTokenLogprob] | None = (
            [] if sampling_params.prompt_logprobs is not None else None)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids (a copy)."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens known so far."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled so far."""
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        """True once the status is any ``FINISHED_*``."""
        return self.status.is_finished

    @property
    def is_prefill(self) -> bool:
        """True while more than one token is left to compute (so this step is not a plain decode)."""
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def generation_start(self) -> int:
        """Index in ``token_ids`` of this generation's first output token: the prompt's last
        ``sampling_params.output_offset`` tokens are output of an earlier attempt continued here."""
        return max(self.num_prompt_tokens - self.sampling_params.output_offset, 0)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while prompt logprobs were requested, some are still to compute and the prompt's
        positions still run here (so no prefix-cache hit may skip them). A sequence whose prompt KV came
        from elsewhere (a decode worker's) computes none."""
        done, last = self.prompt_logprobs, self.num_prompt_tokens - 1
        return done is not None and len(done) < last and self.num_computed_tokens < last

    @property
    def generated_token_ids(self) -> list[int]:
        """This generation's output so far: the prompt's last ``sampling_params.output_offset`` tokens
        (output of an earlier attempt continued here) then the output tokens sampled here (a copy)."""
        return self.token_ids[self.generation_start:]

    def full_block_hashes(self, block_size: int, num_blocks: int) -> list[int]:
        """The chained prefix-cache hashes (``engine.block_hash.block_hashes``) of the first ``num_blocks``
        full ``block_size``-token blocks of ``token_ids``, as a new list of ``num_blocks`` ints.

        Each block is hashed once per sequence: the chain is kept and only extended (from its last hash)
        when more blocks are asked for, which is exact because ``token_ids`` only grows
        (:meth:`append_token`) and a full block's tokens never change. The kept chain is dropped and
        recomputed when ``token_ids`` is a different list object or ``block_size`` differs from the last
        call's.

        Raises:
            ValueError: ``num_blocks`` < 0 or more than the full blocks ``token_ids`` holds, or
                ``block_size`` < 1.
        """
        if block_size < 1 or not 0 <= num_blocks <= len(self.token_ids) // block_size:
            raise ValueError(f"request {self.request_id!r}: {num_blocks} full blocks of {block_size} tokens "
                             f"asked, {len(self.token_ids)} tokens known")
        key = self._chain_key
        if key is None or key[0] is not self.token_ids or key[1] != block_size:
            self._chain, self._chain_key = [], (self.token_ids, block_size)
        chain = self._chain
        have = len(chain)
        if have < num_blocks:
            chain += block_hashes(self.token_ids[have * block_size : num_blocks * block_size], block_size,
                                  chain[-1] if chain else ROOT_HASH)
        return chain[:num_blocks]

    def keep_block_hashes(self, block_size: int, hashes: list[int]) -> None:
        """Keep ``hashes`` as the chain of the first ``len(hashes)`` full ``block_size``-token blocks, for
        :meth:`full_block_hashes` to extend, unless the kept chain already covers them. The caller vouches
        that they are those blocks' ``block_hashes`` (e.g. the hashes of prefix-cache hits, found by
        their tokens and parent).

        Raises:
            ValueError: more hashes than full blocks in ``token_ids``, or ``block_size`` < 1.
        """
        if block_size < 1 or len(hashes) > len(self.token_ids) // block_size:
            raise ValueError(f"request {self.request_id!r}: {len(hashes)} hashes of {block_size}-token "
                             f"blocks given, {len(self.token_ids)} tokens known")
        key = self._chain_key
        if key is None or key[0] is not self.token_ids or key[1] != block_size:
            self._chain, self._chain_key = [], (self.token_ids, block_size)
        if len(hashes) > len(self._chain):
            self._chain = list(hashes)

    def append_token(self, token_id: int) -> None:
        """Append one sampled output token (its KV is computed in the next step)."""
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )


def check_stop(seq: Sequence, max_model_len: int) -> SequenceStatus | None:
    """Finish status implied by ``seq``'s last output token, or None to continue.

    an eos id (unless ``ignore_eos``) and ``stop_token_ids`` stop only once ``min_tokens`` outputs exist;
    ``max_tokens`` output tokens or ``max_model_len`` total tokens finish with FINISHED_LENGTH. A sequence
    with a ``grammar`` first advances its matcher over the new token and stops once the grammar has
    terminated (complete, and its eos accepted), ``ignore_eos`` or not.

    Raises:
        StructuredOutputError (a ValueError): the grammar rejects the token, or its matcher failed
            before (``GrammarState.error``).
    """
    params = seq.sampling_params
    outputs = seq.output_token_ids
    num_outputs = len(outputs)
    if seq.grammar is not None:
        seq.grammar.sync(seq.token_ids, start=seq.generation_start)  # no copy of the output
        if seq.grammar.is_terminated():
            return SequenceStatus.FINISHED_STOPPED
    if num_outputs >= params.min_tokens:
        last = outputs[-1]
        if not params.ignore_eos and last in seq.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED
    if num_outputs >= params.max_tokens or len(seq.token_ids) >= max_model_len:
        return SequenceStatus.FINISHED_LENGTH
    return None
