"""EngineCore: a scheduler, a block manager and a model runner driven one step at a time.

``add_request`` validates and queues a request (a random seed is drawn for a request without one, so
its sampling is reproducible from then on — e.g. on a decode worker that continues it); ``step`` runs
one continuous-batching step and reports the tokens sampled in it.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from dataclasses import dataclass

import msgspec

from engine.async_step import LaunchedStep
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.kv_host_tier import HostTierStats, KVHostTier, host_tier_blocks
from engine.model_runner import ModelRunner
from engine.models.registry import resolve_model
from engine.prompt_logprobs import PromptTokenLogprob
from engine.sampler import SampleResult, samples_on_device
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.structured_output import StructuredOutputs
from engine.tp_executor import RankHookFactory, RankSetup, TensorParallelRanks

logger = logging.getLogger(__name__)

FINISH_REASONS: dict[SequenceStatus, str] = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_PREFILLED: "prefilled",
    SequenceStatus.FINISHED_FAILED: "error",
}


class StepOutput(msgspec.Struct, frozen=True):
    """One token sampled for one request in one step.

    ``logprob`` / ``top_logprobs``: raw model logprobs (see ``engine.sampler``), None unless requested.
    ``finish_reason``: None while running, else ``"stop"`` (eos / stop token id), ``"length"``
    (max_tokens or max_model_len), ``"prefilled"`` (prefill-only engine) or ``"error"``: the request's
    grammar rejected ``token_id`` (``error`` says so; the token is no output: send nothing of it).
    ``prompt_logprobs``: on a request's first output token when it asked for them
    (``SamplingParams.prompt_logprobs``): the entries of prompt tokens ``1 .. n - 1``
    (``engine.prompt_logprobs``); else None.
    """

    request_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[PromptTokenLogprob] | None = None
    error: str | None = None


@dataclass
class StepCounts:
    """How an engine's steps ran since it started: ``synchronous`` steps (forward, sampling and the wait
    for their tokens in one call), ``launched`` steps enqueued by asynchronous scheduling, of which
    ``ahead`` were launched before the previous step's tokens reached the host (engine/async_step.py)."""

    synchronous: int = 0
    launched: int = 0
    ahead: int = 0


class EngineCore:
    """Scheduler + ``ModelRunner`` of one worker (or of the offline ``LLM``).

    Args:
        engine_config: model, cache and scheduler configs.
        prefill_only: prefill-worker mode (sequences end FINISHED_PREFILLED and keep their blocks).
        rank_hook: built on each other tensor parallel rank (``engine.tp_executor.RankHook``).
        rank_setup: called first on each other tensor parallel rank (``engine.tp_executor.RankSetup``).

    With ``engine_config.parallel.distributed`` this process is tensor parallel rank 0 and the other ranks
    run in processes of ``engine.tp_executor.TensorParallelRanks`` (``ranks``) until ``close``; steps then
    never launch ahead (asynchronous scheduling is a single-rank path).

    Raises:
        ValueError / FileNotFoundError: from model loading or KV cache sizing.
    """

    def __init__(self, engine_config: EngineConfig, *, prefill_only: bool = False,
                 rank_hook: RankHookFactory | None = None, rank_setup: RankSetup | None = None) -> None:
        self.config = engine_config
        distributed = engine_config.parallel.distributed
        self.ranks = (TensorParallelRanks(engine_config, rank_hook=rank_hook, rank_setup=rank_setup)
                      if distributed else None)
        try:
            self.runner = ModelRunner(engine_config, self.ranks.tp if self.ranks is not None else None)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise
        cache = engine_config.cache
        grid_blocks = max(1, engine_config.scheduler.prefill_grid // cache.block_size)
        self.block_manager = BlockManager(self.runner.kv_cache.num_blocks, cache.block_size,
                                          cache.enable_prefix_caching, prefix_grid_blocks=grid_blocks)
        self.host_tier: KVHostTier | None = None
        if cache.host_kv_bytes:
            if self.ranks is not None:
                self.ranks.close()
                raise ValueError("a host KV tier (host_kv_bytes) runs on one rank only: tensor parallel "
                                 "ranks would each need their own copies")
            pool = self.runner.kv_cache
            # one step's worth of blocks to evict is saved ahead, while they are still cached
            step_blocks = -(-engine_config.scheduler.max_num_batched_tokens // cache.block_size)
            self.host_tier = KVHostTier(pool, host_tier_blocks(cache.host_kv_bytes, pool.bytes_per_block),
                                        presave_blocks=step_blocks)
            self.block_manager.host_tier = self.host_tier
            self.runner.before_forward = self.host_tier.before_forward
        self.scheduler = Scheduler(engine_config.scheduler, cache, self.block_manager,
                                   prefill_only=prefill_only, max_model_len=self.runner.max_model_len)
        self.eos_token_ids = eos_ids(self.runner.hf_config)
        self.structured_outputs = StructuredOutputs(resolve_model(engine_config.model.model),
                                                    self.runner.vocab_size, self.eos_token_ids)
        self.step_request_ids: list[str] = []
        self.async_scheduling = engine_config.scheduler.async_scheduling  # may be switched between steps
        if self.async_scheduling and self.runner.decode_graphs is None:
            logger.debug("async_scheduling inactive: it needs the decode CUDA graphs (CUDA, the triton "
                         "attention backend, no enforce_eager)")
        self._ahead: LaunchedStep | None = None  # launched by the last step, applied by the next
        self._unread: list[LaunchedStep] = []  # launched, tokens maybe not read yet (waited for on errors)
        self.step_counts = StepCounts()

    @property
    def max_model_len(self) -> int:
        """Tokens per sequence (prompt + output), capped by the KV cache capacity."""
        return self.scheduler.max_model_len

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise ``ValueError`` naming the problem for an empty prompt, an id outside
        ``[0, vocab_size)`` or a prompt of ``max_model_len`` tokens or more."""
        if not prompt_token_ids:
            raise ValueError("prompt is empty: it needs at least one token")
        vocab = self.runner.vocab_size
        # C-level passes (the types present, then min and max) on the common all-valid prompt; the
        # per-token scan only to name the bad ids
        if (not all(issubclass(t, int) for t in set(map(type, prompt_token_ids)))
                or min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab):
            bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
            raise ValueError(f"prompt token ids {bad[:5]} outside [0, vocab_size={vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens does not fit max_model_len="
                             f"{self.max_model_len} tokens (room for at least one output token needed)")

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    arrival_time: float | None = None) -> Sequence:
        """Validate and queue one request; returns its ``Sequence`` (seed filled in if it had none).

        Raises:
            ValueError: bad prompt (see ``validate_prompt``), a duplicate ``request_id`` or a
                ``structured_output`` that does not compile (see ``attach_grammar``); nothing queued.
        """
        self.validate_prompt(prompt_token_ids)
        if sampling_params.seed is None:
            sampling_params = sampling_params.with_seed(secrets.randbits(63))
        seq = Sequence(request_id, list(prompt_token_ids), sampling_params,
                       time.monotonic() if arrival_time is None else arrival_time, self.eos_token_ids)
        self.attach_grammar(seq)
        self.scheduler.add(seq)
        return seq

    def attach_grammar(self, seq: Sequence) -> None:
        """Give ``seq`` the matcher of its ``structured_output`` (compiled once per distinct spec), advanced
        over the output of an earlier attempt that ends its prompt (``output_offset``); nothing for a
        sequence without one.

        Raises:
            StructuredOutputError (a ValueError): the spec does not compile, or the grammar rejects those
                earlier output tokens.
        """
        spec = seq.sampling_params.structured_output
        if spec is not None and seq.grammar is None:
            state = self.structured_outputs.state(spec)
            state.sync(seq.generated_token_ids)
            seq.grammar = state

    def abort_request(self, request_id: str) -> None:
        """Abort a request in any state (its blocks are freed); unknown ids are ignored. A step launched
        ahead (asynchronous scheduling) whose rows have all ended then is waited for and dropped."""
        self.scheduler.abort(request_id)
        if self._ahead is not None and not _running_rows(self._ahead):
            self._drop_ahead()

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        """Schedule, run the model, sample and update: one continuous-batching step.

        With ``async_scheduling`` (from ``SchedulerConfig``; a benchmark may switch it between steps) a
        decode-only step through the decode graphs whose rows sample on the device (greedy or seeded, with
        or without a grammar, no logprobs or penalties) also launches the next step
        (``Scheduler.next_decode_step``) before reading its own tokens, and the next call applies that one
        (engine/async_step.py). ``step_request_ids`` names the requests of the step(s) this call ran (for a
        caller failing them after an exception).

        Returns:
            One ``StepOutput`` per token sampled in this step (none for pure prefill-chunk steps).
        """
        self._unread = [self._ahead] if self._ahead is not None else []
        try:
            launched = self._take_ahead()
            if launched is None:
                output = self.scheduler.schedule()
                self.step_request_ids = [s.seq.request_id for s in output.scheduled]
                if output.is_empty:
                    return []
                if not self._launchable(output):
                    self.step_counts.synchronous += 1
                    return self.commit(output, self.runner.execute(output))
                launched = self._launch(output, None)
            return self._apply(launched)
        except BaseException:
            for unread in self._unread:  # may still run on the device: the caller frees their blocks next
                with contextlib.suppress(Exception):
                    unread.wait()
            self._unread, self._ahead, self.block_manager.before_free = [], None, None
            raise

    def host_tier_stats(self) -> HostTierStats | None:
        """The host tier's counters (``KVHostTier.stats``), None without a tier."""
        return self.host_tier.stats if self.host_tier is not None else None

    def _launch(self, output: SchedulerOutput, feed: LaunchedStep | None) -> LaunchedStep:
        launched = self.runner.launch(output, feed)
        self.step_counts.launched += 1
        self.step_counts.ahead += feed is not None
        self._unread.append(launched)
        return launched

    def _take_ahead(self) -> LaunchedStep | None:
        """The step launched ahead by the last call, unless none of its sequences still runs."""
        launched = self._ahead
        if launched is None:
            return None
        self.step_request_ids = _running_rows(launched)
        if self.step_request_ids:
            self._ahead = None
            return launched
        self._drop_ahead()  # all finished or aborted since: nothing to apply
        return None

    def _drop_ahead(self) -> None:
        """Wait for the step launched ahead, then forget it (its rows have all ended)."""
        if self._ahead is not None:
            self._ahead.wait()
        self._ahead, self.block_manager.before_free = None, None

    def _apply(self, launched: LaunchedStep) -> list[StepOutput]:
        """Launch the step after ``launched`` when certain, then read and apply ``launched``'s tokens
        (its rows of sequences no longer running are dropped); while the next step is in flight, every
        ``BlockManager.free`` first waits for it."""
        output = launched.output
        nxt = self.scheduler.next_decode_step(output) if self._launchable(output) else None
        ahead = self._launch(nxt, launched) if nxt is not None else None
        tokens = launched.token_ids()
        self.block_manager.before_free = ahead.wait if ahead is not None else None
        self._ahead = ahead
        running = SequenceStatus.RUNNING
        live = [(s, t) for s, t in zip(output.scheduled, tokens, strict=True) if s.seq.status is running]
        if len(live) != len(output.scheduled):
            output = SchedulerOutput(tuple(s for s, _ in live), len(live))
        outs = self.commit(output, {s.seq.request_id: SampleResult(t) for s, t in live})
        if ahead is not None and not _running_rows(ahead):  # every row ended in this commit
            self._drop_ahead()
        return outs

    def _launchable(self, output: SchedulerOutput) -> bool:
        """True when async scheduling may launch ``output`` or the step after it: a decode-only step
        through the decode graphs whose rows all sample on the device (``samples_on_device`` with the
        outputs the host has now, which the sampler's ``min_tokens`` mask reads)."""
        graphs = self.runner.decode_graphs
        n = len(output.scheduled)
        if not self.async_scheduling or graphs is None or not graphs.fits(n) or self.runner.tp.has_followers:
            return False
        return output.num_decodes == n and all(
            s.samples and s.num_scheduled_tokens == 1
            and samples_on_device(s.seq.sampling_params, s.seq.num_output_tokens)
            for s in output.scheduled)

    def commit(self, output: SchedulerOutput, results: dict[str, SampleResult]) -> list[StepOutput]:
        """Apply a step's sampled tokens to the scheduler (append, stop checks, free finished) and turn
        them into ``StepOutput``s, in ``output.scheduled`` order (aborted sequences skipped)."""
        self.scheduler.update(output, {rid: r.token_id for rid, r in results.items()})
        outs = []
        running, aborted = SequenceStatus.RUNNING, SequenceStatus.FINISHED_ABORTED
        for s in output.scheduled:
            seq = s.seq
            r = results.get(seq.request_id)
            status = seq.status
            if r is None or status is aborted:
                continue
            reason = None if status is running else FINISH_REASONS.get(status)
            prompt = seq.prompt_logprobs if seq.num_output_tokens == 1 else None
            outs.append(StepOutput(seq.request_id, r.token_id, r.logprob, r.top_logprobs, reason, prompt,
                                   seq.error))
        return outs

    def close(self) -> None:
        """End the other tensor parallel ranks and leave the process group (no-op with one rank)."""
        if self.ranks is not None:
            self.ranks.close()

    def check_no_leaks(self) -> None:
        """Raise ``AssertionError`` if any KV block is still referenced or a request is still held."""
        self.block_manager.check_no_leaks()
        assert not self.scheduler.has_unfinished(), "requests still unfinished"
        assert self._ahead is None, "a step launched ahead is still held"


def _running_rows(launched: LaunchedStep) -> list[str]:
    """Request ids of the launched step's rows whose sequence still runs."""
    return [s.seq.request_id for s in launched.output.scheduled if s.seq.status is SequenceStatus.RUNNING]


def eos_ids(hf_config: object) -> tuple[int, ...]:
    """The model's eos token ids: its config's ``eos_token_id`` (an int, or a list of ints: generation
    ends at any of them, e.g. GLM-4.5's three), in the config's order; ``()`` when it has none.

    Raises:
        ValueError: ``eos_token_id`` is neither None, an int nor a list of ints (naming the value).
    """
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    ids = [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                     for t in ids):
        raise ValueError(f"config eos_token_id {eos!r} is not an int or a list of ints >= 0")
    return tuple(dict.fromkeys(int(t) for t in ids))
