"""vLLM-v1-style unified scheduler: one token budget per step, decodes first, then prefills (no torch).

Life of a request: ``add`` → WAITING → (prefix hit, blocks) RUNNING → prefill chunks → decodes →
FINISHED_*. Out of blocks, the latest-arrived running sequence is preempted by recompute (blocks freed,
front of WAITING, recomputes prompt + output so far). Prefill worker (``prefill_only=True``): the step
sampling the first token makes it FINISHED_PREFILLED, blocks kept until :meth:`Scheduler.release`.
Decode worker: ``add_waiting_for_kv`` reserves blocks (WAITING_FOR_KV); ``kv_landed`` makes it RUNNING.
"""

from __future__ import annotations

import time
from collections import deque

from engine.block_manager import BlockManager
from engine.config import CacheConfig, SchedulerConfig
from engine.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus, check_stop

__all__ = ["ScheduledSeq", "Scheduler", "SchedulerOutput"]


def _arrival(seq: Sequence) -> float:
    return seq.arrival_time


class Scheduler:
    """Chooses each step's tokens under ``max_num_batched_tokens`` / ``max_num_seqs`` and the free blocks.

    ``max_model_len`` (tokens) defaults to the cache capacity ``num_blocks * block_size`` and is capped
    by it, so a single sequence always fits and preemption always makes progress. ``num_preemptions``
    counts preemptions since start (monotonic; read by the worker's metrics).

    With ``SchedulerConfig.prefill_grid`` (C > 0) every sequence's step covers at most the rest of the grid
    chunk ``[kC, (k+1)C)`` holding its next token, whole or not at all (a chunk that does not fit the
    budget left waits; it fits an empty step); ``Sequence.cacheable_tokens`` advances over each whole
    chunk a prefill step computed, so only those enter the prefix cache; ``block_manager`` must round hits
    to C (``prefix_grid_blocks = C // block_size``).

    Raises:
        ValueError: ``block_size`` differs from the block manager's, or a grid the block manager does
            not round hits to.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        block_manager: BlockManager,
        *,
        prefill_only: bool = False,
        max_model_len: int | None = None,
    ) -> None:
        if block_manager.block_size != cache_config.block_size:
            raise ValueError(f"block_size mismatch: cache_config {cache_config.block_size}, "
                             f"block_manager {block_manager.block_size}")
        self.config = scheduler_config
        self.block_manager = block_manager
        self.prefill_only = prefill_only
        capacity = block_manager.num_blocks * block_manager.block_size
        self.max_model_len = min(max_model_len or capacity, capacity)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._requests: dict[str, Sequence] = {}  # every sequence not yet fully released
        self.num_preemptions = 0
        self.grid = scheduler_config.prefill_grid
        if self.grid % block_manager.block_size or block_manager.prefix_grid_blocks != max(
                1, self.grid // block_manager.block_size):
            raise ValueError(f"prefill_grid={self.grid} tokens needs a BlockManager with block_size dividing "
                             f"it and prefix_grid_blocks={max(1, self.grid // block_manager.block_size)}, "
                             f"got block_size={block_manager.block_size}, "
                             f"prefix_grid_blocks={block_manager.prefix_grid_blocks}")

    def _grid_chunk(self, computed: int, total: int) -> int:
        """Tokens of the prefill grid chunk holding position ``computed`` still to compute (up to the
        chunk's end or ``total``): a decode's 1, a prefill chunk's up to ``prefill_grid``."""
        end = (computed // self.grid + 1) * self.grid
        return min(total, end) - computed

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence for prefill.

        Raises:
            ValueError: duplicate request id, status not WAITING, prompt ≥ ``max_model_len`` tokens
                (includes: longer than the whole KV cache), or — without chunked prefill — a prompt
                larger than ``max_num_batched_tokens`` (it could never be scheduled). Nothing is queued.
        """
        self._validate_new(seq)
        if not self.config.enable_chunked_prefill and seq.num_tokens > self.config.max_num_batched_tokens:
            raise ValueError(
                f"request {seq.request_id!r}: prompt of {seq.num_tokens} tokens exceeds "
                f"max_num_batched_tokens={self.config.max_num_batched_tokens} and chunked prefill is off"
            )
        self._requests[seq.request_id] = seq
        self.waiting.append(seq)

    def add_waiting_for_kv(self, seq: Sequence, *, reuse_prefix: bool = False) -> bool:
        """Decode side: reserve blocks for ``seq``'s prompt while its KV is sent from a prefill worker.

        With ``reuse_prefix`` the prompt's leading full blocks already in the prefix cache are taken first
        (``BlockManager.allocate_prefix``: never the block of the last prompt token, rounded down to the
        prefill grid; ref + 1 each, shared with any sequence holding them) and ``seq.num_cached_tokens``
        says how many tokens they hold: only the blocks after them (``block_table[num_cached_tokens //
        block_size:]``) await KV. Those are one contiguous run of blocks if one is free (one transfer per
        request-layer), else any free blocks. Needs as many free blocks as the whole prompt has (cached
        ones count as free), so a reservation never fails half-way. Returns False (nothing reserved,
        ``seq`` untouched) when too few blocks are free now.

        Raises:
            ValueError: as :meth:`add` for bad or over-long sequences.
        """
        self._validate_new(seq)
        num_blocks = -(-seq.num_prompt_tokens // self.block_manager.block_size)
        if self.block_manager.num_free_blocks < num_blocks:
            return False
        cached = self.block_manager.allocate_prefix(seq) if reuse_prefix else 0
        run = self.block_manager.allocate_contiguous(num_blocks - len(seq.block_table))
        if run is not None:
            seq.block_table.extend(run)
        else:
            self.block_manager.allocate(seq, seq.num_prompt_tokens)
        seq.num_cached_tokens = cached
        self.block_manager.wait_host_copies()  # the KV transfer writes the blocks outside any forward
        seq.status = SequenceStatus.WAITING_FOR_KV
        self._requests[seq.request_id] = seq
        return True

    def kv_landed(self, request_id: str, first_token: int) -> Sequence:
        """Decode side: the prompt's KV arrived and the prefill sampled ``first_token``.

        Marks the prompt computed, appends the token and moves the sequence to running (the next step
        decodes it), or finishes it at once if that token already ends it (FINISHED_FAILED with ``error``
        set when its grammar rejects that token). Returns the sequence.

        Raises: KeyError (unknown ``request_id``), ValueError (not WAITING_FOR_KV).
        """
        seq = self._get(request_id)
        if seq.status is not SequenceStatus.WAITING_FOR_KV:
            raise ValueError(f"kv_landed for {request_id!r} in status {seq.status.name}, not WAITING_FOR_KV")
        seq.num_computed_tokens = seq.num_prompt_tokens
        if self.grid:  # the prefill worker's whole grid chunks (paired workers run the same grid)
            seq.cacheable_tokens = seq.num_prompt_tokens - seq.num_prompt_tokens % self.grid
        seq.append_token(first_token)
        self.block_manager.cache_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        status = self._stop_status(seq)
        if status is not None:
            self._finish(seq, status)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        """Abort in any state: blocks freed, status FINISHED_ABORTED. Returns None for unknown ids.

        Decode side: call only once no transfer can still write the sequence's blocks.
        """
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seq

    def release(self, request: str | Sequence) -> None:
        """Prefill side: free a FINISHED_PREFILLED sequence's blocks once its KV was sent.

        Raises: KeyError (unknown request), ValueError (not FINISHED_PREFILLED).
        """
        seq = self._get(request if isinstance(request, str) else request.request_id)
        if seq.status is not SequenceStatus.FINISHED_PREFILLED:
            raise ValueError(f"release of {seq.request_id!r} in status {seq.status.name}")
        self.block_manager.free(seq)
        del self._requests[seq.request_id]

    def has_unfinished(self) -> bool:
        """True while any sequence is waiting, waiting for KV, or running."""
        return any(not s.is_finished for s in self._requests.values())

    def get(self, request_id: str) -> Sequence | None:
        """The held sequence with this id (unfinished or FINISHED_PREFILLED), else None."""
        return self._requests.get(request_id)

    @property
    def num_waiting_for_kv(self) -> int:
        """Sequences with blocks reserved and KV in flight."""
        return sum(s.status is SequenceStatus.WAITING_FOR_KV for s in self._requests.values())

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens: running sequences (arrival order), then waiting ones if no preemption."""
        budget = self.config.max_num_batched_tokens
        scheduled, preempted, budget = self._schedule_running(budget)
        if not preempted:
            scheduled.extend(self._admit_waiting(budget))
        decodes = [s for s in scheduled if s.num_scheduled_tokens == 1 and s.samples]
        if len(decodes) == len(scheduled):
            return SchedulerOutput(tuple(scheduled), len(scheduled), tuple(preempted))
        prefills = [s for s in scheduled if not (s.num_scheduled_tokens == 1 and s.samples)]
        return SchedulerOutput(tuple(decodes + prefills), len(decodes), tuple(preempted))

    def _schedule_running(self, budget: int) -> tuple[list[ScheduledSeq], list[str], int]:
        """Running sequences in arrival order under ``budget`` tokens, preempting the latest arrivals when
        blocks run out. A sequence whose block table already covers its new tokens (most decode steps)
        costs no block-manager call. Returns (scheduled, preempted ids, budget left)."""
        self.running.sort(key=_arrival)
        scheduled: list[ScheduledSeq] = []
        preempted: list[str] = []
        bm, bs = self.block_manager, self.block_manager.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            computed, total = seq.num_computed_tokens, len(seq.token_ids)
            num_new = min(total - computed, budget)
            if self.grid:
                num_new = self._grid_chunk(computed, total)
                if num_new > budget:  # a grid chunk runs whole: this one waits for a later step
                    i += 1
                    continue
            if computed + num_new > len(seq.block_table) * bs:
                while not bm.can_allocate(seq, num_new):
                    victim = self.running[-1]  # latest arrival not yet scheduled (or seq itself)
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    break
                bm.allocate(seq, num_new)
            scheduled.append(ScheduledSeq(seq, num_new, computed + num_new == total))
            budget -= num_new
            i += 1
        return scheduled, preempted, budget

    def _admit_waiting(self, budget: int) -> list[ScheduledSeq]:
        admitted: list[ScheduledSeq] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # prompt logprobs need the logits of every prompt position: no prefix-cache hit skips them
            cached = 0 if seq.needs_prompt_logprobs else self.block_manager.allocate_prefix(seq)
            seq.num_computed_tokens = seq.num_cached_tokens = cached
            num_new = seq.num_tokens - cached
            recompute = seq.status is SequenceStatus.PREEMPTED  # may exceed the budget: always chunked
            if self.grid:
                num_new = self._grid_chunk(cached, seq.num_tokens)
                seq.cacheable_tokens = cached
            elif num_new > budget and (self.config.enable_chunked_prefill or recompute):
                num_new = budget
            if num_new > budget or not self.block_manager.can_allocate(seq, num_new):
                self.block_manager.free(seq)  # undo the prefix hit; try again next step
                seq.num_computed_tokens = seq.num_cached_tokens = 0
                break
            self.waiting.popleft()
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(self._take(seq, num_new))
            budget -= num_new
        return admitted

    def _take(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        self.block_manager.allocate(seq, num_new)
        samples = seq.num_computed_tokens + num_new == seq.num_tokens
        return ScheduledSeq(seq, num_new, samples)

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Sequence]:
        """Apply a finished step: advance ``num_computed_tokens``, append sampled tokens, stop checks.

        ``sampled`` maps request id → token id for every entry with ``samples=True``. Sequences aborted
        since :meth:`schedule` are skipped. Returns sequences that finished (or, in prefill-only mode,
        became FINISHED_PREFILLED) in this step; finished ones have their blocks freed. A sequence whose
        grammar rejects its token ends FINISHED_FAILED with ``error`` set (the prefill-only mode leaves
        that check to its caller, which holds the blocks while their KV may still be read).

        Raises:
            KeyError: a sampling sequence has no token in ``sampled`` (checked before any change).
        """
        running = SequenceStatus.RUNNING
        live = [s for s in output.scheduled if s.seq.status is running]
        missing = [s.seq.request_id for s in live if s.samples and s.seq.request_id not in sampled]
        if missing:
            raise KeyError(f"no sampled token for request(s) {missing}")
        done: list[Sequence] = []
        cache_full_blocks = self.block_manager.cache_full_blocks
        grid = self.grid
        for s in live:
            seq = s.seq
            if (grid and s.num_scheduled_tokens == grid and seq.num_computed_tokens % grid == 0
                    and seq.cacheable_tokens == seq.num_computed_tokens):
                seq.cacheable_tokens += grid  # a whole grid chunk after reusable ones: reusable too
            seq.num_computed_tokens += s.num_scheduled_tokens
            if s.samples:
                seq.append_token(sampled[seq.request_id])
            cache_full_blocks(seq)
            if not s.samples:
                continue
            status = SequenceStatus.FINISHED_PREFILLED if self.prefill_only else self._stop_status(seq)
            if status is not None:
                self._finish(seq, status)
                done.append(seq)
        return done

    def _stop_status(self, seq: Sequence) -> SequenceStatus | None:
        """``check_stop`` of a sequence that just sampled; FINISHED_FAILED (``seq.error`` says why) when
        its grammar rejects the token or failed before (``GrammarState.error``: a token rejected while
        the next step was launched, or a bitmask fill that raised), which then ends that sequence alone."""
        try:
            return check_stop(seq, self.max_model_len)
        except ValueError as exc:  # StructuredOutputError: the only error check_stop raises
            seq.error = f"the request's structured output failed: {exc}"
            return SequenceStatus.FINISHED_FAILED

    def next_decode_step(self, output: SchedulerOutput) -> SchedulerOutput | None:
        """The step :meth:`schedule` will return once decode-only ``output`` (not yet :meth:`update`-d) is
        applied, if certain now, else None (asynchronous scheduling, engine/async_step.py). Certain when
        nothing waits, ``output`` holds every running sequence as a sampling decode, each stays below
        ``max_tokens`` and ``max_model_len`` after ``update`` (a stop token may still end one: ``EngineCore``
        drops its row), and the block each next token needs is allocated now from free ones (as that
        schedule would; None rather than preempt)."""
        n = len(output.scheduled)
        if self.waiting or not n or n != len(self.running) or output.num_decodes != n:
            return None
        limit, running = self.max_model_len, SequenceStatus.RUNNING
        if any(s.seq.status is not running or s.num_scheduled_tokens != 1 or not s.samples
               or s.seq.num_computed_tokens + 2 >= limit
               or s.seq.num_output_tokens + 1 >= s.seq.sampling_params.max_tokens for s in output.scheduled):
            return None
        bm = self.block_manager
        for s in output.scheduled:  # room for the tokens known after update: num_computed_tokens + 2
            if not bm.can_allocate(s.seq, 2):
                return None
            bm.allocate(s.seq, 2)
        return SchedulerOutput(tuple(ScheduledSeq(s.seq, 1, True) for s in output.scheduled), n)

    def _validate_new(self, seq: Sequence) -> None:
        if seq.request_id in self._requests:
            raise ValueError(f"request id {seq.request_id!r} is already in the scheduler")
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"request {seq.request_id!r} is not a fresh WAITING sequence: {seq!r}")
        if seq.num_tokens >= self.max_model_len:
            raise ValueError(
                f"request {seq.request_id!r}: prompt of {seq.num_tokens} tokens does not fit: "
                f"max_model_len={self.max_model_len} tokens (KV cache holds "
                f"{self.block_manager.num_blocks * self.block_manager.block_size})"
            )

    def _get(self, request_id: str) -> Sequence:
        seq = self._requests.get(request_id)
        if seq is None:
            raise KeyError(f"unknown request id {request_id!r}")
        return seq

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        if self.grid:
            seq.cacheable_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq in self.running:
            self.running.remove(seq)
        seq.status = status
        if status is not SequenceStatus.FINISHED_PREFILLED:
            self.block_manager.free(seq)
            self._requests.pop(seq.request_id, None)

