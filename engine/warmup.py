"""Warm a worker's engine up before it reports ready: throw-away requests through the real ``EngineCore``.

Why: Triton specialises a kernel on its integer arguments (divisibility by 16, equality to 1), so each
new step shape — a prefill chunk at the token budget, a chunk continuing a prompt whose KV is already
cached, decode batches of new sizes, a prompt chunk beside running decodes (chunked prefill) — compiles a
new kernel variant the first time it is met: without a warm-up, a fresh worker on an H200 stalls ~2 s on
its first users. vLLM likewise runs a dummy/profile run and captures CUDA graphs
at start-up (``gpu_model_runner.profile_run`` / ``capture_model``); this module does the analogue by
driving greedy, ``ignore_eos`` requests with seeded random prompt token ids through
``Scheduler.schedule`` → ``ModelRunner.execute`` → ``EngineCore.commit``, the very path serving uses.

Waves (each drained before the next; every size capped by ``max_model_len``, ``max_num_seqs`` and the
KV blocks): 0. the cuDNN attention plans of every length a fresh prompt can take
(``ModelRunner.warm_attention_plans``: cuDNN builds one per length at its first use, 65-106 ms on an
H200); 1. one prompt of ``max_num_batched_tokens`` tokens (a pure prefill chunk at the budget);
2. a prompt of 1.5x the budget (two chunks, the second attending to KV already cached), when chunked
prefill is on and ``max_model_len`` allows; 2b. a prompt whose last chunk is 16 tokens after at least
``WarmupConfig.long_context_tokens`` cached ones (a launch of few programs over a long KV: the split-KV
variant of the paged prefill attention, engine/ops/paged_prefill.py), when chunked prefill is on and the
prompt fits ``max_model_len`` and the KV blocks; 3. for each size ``b`` of
``WarmupConfig.decode_batch_sizes``, ``b`` short prompts then decode-only steps of batch ``b``; 4. mixed
steps: short requests decoding while a budget-sized prompt is chunked beside them. A prefill-only engine
(prefill worker) ends every request at its first token (FINISHED_PREFILLED, released here at once), so
its waves give prefill steps of one or several prompts; a decode worker's engine (not prefill-only)
accepts ordinary requests, and it runs prefill itself when it recomputes a preempted request, so the same
waves suit it.

``probe_prefill`` (run after the warm-up, or alone when it is off) times a few throw-away prompts of one
size through the same path and returns the fastest: the prefill rate a worker reports before it has
served (protocol/prefill_rate.py), so a gateway judges its queue from the first request on.

Afterwards the engine is as before: no request held, every KV block free, and no warm-up block in the
prefix cache (prefix caching is switched off on the ``BlockManager`` while warming and restored after).
The worker's counters and heartbeat load are built after warm-up, so nothing reports warm-up traffic.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from engine.engine_core import EngineCore
    from engine.scheduler import SchedulerOutput

log = logging.getLogger("pdserve.warmup")

WARMUP_MODES = ("auto", "on", "off")
SHORT_PROMPT_TOKENS = 24  # longest "short" prompt of the decode and mixed waves (tokens)
SHORT_CHUNK_TOKENS = 16  # wave 2b's last chunk (tokens)
# prompt tokens of a probe on a CPU. The embedded model on 2 quiet cores: 128 tokens 0.6k tokens/s (0.2 s),
# 512 tokens 0.8k (0.6 s), 2048 tokens 0.6k (3.4 s): 512 is near the rate of a step of batched short
# prompts and lets a prompt of up to 4x that count in full (gateway/admission.py TRUSTED_SPAN) at a
# start-up cost below a second. On CUDA the probe is a budget-sized prompt
CPU_PROBE_TOKENS = 512
# prompts a probe times on CUDA, keeping the fastest: the first may pay one-time costs (a kernel compiled,
# an attention plan built) when the warm-up is off; a CPU has none of those and times one
CUDA_PROBE_REPEATS = 2


class WarmupTimeout(RuntimeError):
    """Internal: the warm-up passed ``WarmupConfig.max_seconds``; its requests are aborted."""


@dataclass(frozen=True)
class WarmupConfig:
    """What to warm up and for how long.

    Attributes:
        decode_batch_sizes: batch sizes (sequences) of the decode-only waves, each capped at
            ``max_num_seqs`` and at what the KV blocks hold; the smallest and largest also give the
            running-decode counts of the mixed wave.
        num_output_tokens: output tokens of each decode-wave request (>= 2, so decode steps happen).
        max_seconds: wall-clock bound (seconds), checked before each step (a step already running
            finishes); past it the remaining requests are aborted, the engine is left clean and
            ``WarmupReport.completed`` is False (logged at WARNING as ``warmup_cut``).
        seed: seed of the random prompt token ids.
        long_context_tokens: cached tokens (at least; rounded up to whole budget chunks) before wave
            2b's 16-token chunk; 2048 is where ``prefill_kv_splits`` may first cut the KV in two slices of
            1024 positions. 0: no wave 2b.

    Raises:
        ValueError: a value out of range (the message names the field).
    """

    decode_batch_sizes: tuple[int, ...] = (1, 2, 3, 4, 8, 16, 32, 64)
    num_output_tokens: int = 4
    max_seconds: float = 60.0
    seed: int = 0
    long_context_tokens: int = 2048

    def __post_init__(self) -> None:
        if not self.decode_batch_sizes or any(b < 1 for b in self.decode_batch_sizes):
            raise ValueError(f"decode_batch_sizes must be non-empty and >= 1, got {self.decode_batch_sizes}")
        if self.num_output_tokens < 2:
            raise ValueError(f"num_output_tokens must be >= 2 (a decode step), got {self.num_output_tokens}")
        if not self.max_seconds > 0:
            raise ValueError(f"max_seconds must be > 0 seconds, got {self.max_seconds}")
        if self.long_context_tokens < 0:
            raise ValueError(f"long_context_tokens must be >= 0 (0: off), got {self.long_context_tokens}")


@dataclass(frozen=True)
class StepShape:
    """One warm-up step: decodes (query length 1), prefill chunks, tokens, and whether a prefill chunk
    started after KV already computed (``chunk_after_kv``: a later chunk of chunked prefill)."""

    num_decodes: int
    num_prefills: int
    num_batched_tokens: int
    chunk_after_kv: bool


@dataclass(frozen=True)
class WarmupReport:
    """Outcome: ``seconds`` of wall time, ``completed`` False when cut by ``max_seconds``, the requests
    added and the shape of every step run."""

    seconds: float
    completed: bool
    num_requests: int
    steps: tuple[StepShape, ...] = field(default=())


def should_warm_up(mode: str, device_type: str) -> bool:
    """Whether a worker warms up: ``on``/``off`` as said; ``auto`` only on CUDA.

    On a CPU there is nothing to compile (the ``torch`` backend runs SDPA; Triton on CPU runs only under
    its interpreter), while the waves cost far too much there: with SmolLM2 and the default 2048-token
    budget on the shared 2-core machine the first wave alone took over 60 s. So ``auto`` skips on CPU
    (CI's live-system tests start CPU workers and add nothing); tests use tiny models with ``on``.

    Raises:
        ValueError: ``mode`` not one of ``auto``, ``on``, ``off``.
    """
    if mode not in WARMUP_MODES:
        raise ValueError(f"engine warm-up mode must be one of {WARMUP_MODES}, got {mode!r}")
    return mode == "on" or (mode == "auto" and device_type == "cuda")


def warmup(core: EngineCore, config: WarmupConfig | None = None) -> WarmupReport:
    """Run the warm-up waves (module docstring) through ``core``; logs ``warmup_done seconds=...``.

    Raises:
        RuntimeError: ``core`` is not idle (requests held or KV blocks in use; nothing is run), or the
            engine made no progress. Any error from a step propagates; in every case the warm-up's
            requests are aborted first, so the engine holds nothing.
    """
    config = config or WarmupConfig()
    bm = core.block_manager
    if core.has_unfinished() or bm.num_free_blocks != bm.num_blocks:
        raise RuntimeError(f"warm-up needs an idle engine: {bm.num_blocks - bm.num_free_blocks} KV blocks "
                           f"in use, unfinished requests: {core.has_unfinished()}")
    run = _Run(core, config)
    start = time.monotonic()
    completed = True
    with _prefix_caching_off(core):
        try:
            run.all_waves()
        except WarmupTimeout:
            completed = False
        finally:
            run.abort_all()
    seconds = time.monotonic() - start
    log.log(logging.INFO if completed else logging.WARNING, "warmup_done" if completed else "warmup_cut",
            extra={"seconds": round(seconds, 3), "steps": len(run.steps), "requests": run.num_added})
    return WarmupReport(seconds, completed, run.num_added, tuple(run.steps))


@dataclass(frozen=True)
class PrefillProbe:
    """The fastest of ``probe_prefill``'s prompts: ``tokens`` prompt tokens computed in ``seconds``, ending
    at ``ended`` (``time.monotonic()`` seconds)."""

    tokens: int
    seconds: float
    ended: float


def probe_prefill(core: EngineCore, repeats: int | None = None) -> PrefillProbe | None:
    """Time ``repeats`` greedy one-token requests of one random prompt size through ``core`` (each drained
    before the next, timed from its ``add_request``; prefix caching off) and return the fastest, or None
    when no prompt fits ``max_model_len`` (a warning, ``prefill_probe_skipped``). ``repeats`` defaults to
    ``CUDA_PROBE_REPEATS`` on CUDA, 1 elsewhere. The size: ``max_num_batched_tokens`` on CUDA (one full
    prefill chunk, the shape the warm-up compiled), at most ``CPU_PROBE_TOKENS`` elsewhere; capped by
    ``max_model_len`` and the KV blocks.

    Raises:
        RuntimeError: ``core`` is not idle (nothing is run), a step made no progress, or the probe ran past
            ``WarmupConfig.max_seconds`` (``WarmupTimeout``). Any error from a step propagates; the
            probe's requests are aborted first, so the engine holds nothing.
    """
    bm = core.block_manager
    if core.has_unfinished() or bm.num_free_blocks != bm.num_blocks:
        raise RuntimeError("the prefill probe needs an idle engine")
    cuda = core.runner.device.type == "cuda"
    run = _Run(core, WarmupConfig())
    size = run.budget if cuda else min(CPU_PROBE_TOKENS, run.budget)
    size = min(size, run.longest, bm.num_blocks * bm.block_size - 1)
    if size < 1:
        log.warning("prefill_probe_skipped: no prompt fits (max_model_len %d, KV pool %d blocks of %d "
                    "tokens); no prefill rate until the first request", core.max_model_len, bm.num_blocks,
                    bm.block_size)
        return None
    best: PrefillProbe | None = None
    with _prefix_caching_off(core):
        try:
            for _ in range(repeats if repeats is not None else CUDA_PROBE_REPEATS if cuda else 1):
                run.add(size, 1)
                (seq,) = run.live.values()
                run.drain()
                ended = time.monotonic()
                if best is None or ended - seq.arrival_time < best.seconds:
                    best = PrefillProbe(size, ended - seq.arrival_time, ended)
        finally:
            run.abort_all()
    return best


@contextmanager
def _prefix_caching_off(core: EngineCore) -> Iterator[None]:
    """Warm-up blocks never enter the prefix cache (random prompts would only evict real entries)."""
    bm = core.block_manager
    saved = bm.enable_prefix_caching
    bm.enable_prefix_caching = False
    try:
        yield
    finally:
        bm.enable_prefix_caching = saved


class _Run:
    """State of one warm-up: the requests it added and the steps it ran."""

    def __init__(self, core: EngineCore, config: WarmupConfig) -> None:
        self.core, self.config = core, config
        self.rng = random.Random(config.seed)
        self.deadline = time.monotonic() + config.max_seconds
        self.live: dict[str, Sequence] = {}
        self.steps: list[StepShape] = []
        self.num_added = 0
        sched = core.scheduler
        self.budget = sched.config.max_num_batched_tokens
        self.max_seqs = sched.config.max_num_seqs
        self.prefill_only = sched.prefill_only
        self.chunked = sched.config.enable_chunked_prefill
        self.longest = core.max_model_len - config.num_output_tokens - 1  # prompt tokens that fit
        self.short = max(1, min(SHORT_PROMPT_TOKENS, self.longest))

    def all_waves(self) -> None:
        """Waves 1-4 (and 2b) of the module docstring, each drained before the next."""
        if self.longest < 1:
            return
        self.core.runner.warm_attention_plans(min(self.budget, self.core.max_model_len))
        self.add(min(self.budget, self.longest), 1)
        self.drain()
        two_chunks = self.budget + self.budget // 2 + 1
        if self.chunked and two_chunks <= self.longest:
            self.add(two_chunks, 1)
            self.drain()
        context = -(-self.config.long_context_tokens // self.budget) * self.budget  # whole chunks
        short_tail = context + SHORT_CHUNK_TOKENS
        bm = self.core.block_manager
        if (self.chunked and self.config.long_context_tokens and short_tail <= self.longest
                and -(-(short_tail + 1) // bm.block_size) <= bm.num_blocks):
            self.add(short_tail, 1)
            self.drain()
        sizes = sorted({self.fit_batch(b) for b in self.config.decode_batch_sizes})
        for b in sizes:  # prompts short enough that all b prefill in one step, then decode together
            for _ in range(b):
                self.add(self.rng.randint(1, max(1, min(self.short, self.budget // b))),
                         self.config.num_output_tokens)
            self.drain()
        for d in sorted({sizes[0], sizes[-1]}):
            self.mixed(min(d, self.max_seqs - 1, self.budget - 1))

    def fit_batch(self, b: int) -> int:
        """``b`` capped at ``max_num_seqs``, the token budget and the short requests the KV blocks hold."""
        bs = self.core.block_manager.block_size
        per_seq = -(-(self.short + self.config.num_output_tokens) // bs)
        return max(1, min(b, self.max_seqs, self.budget, self.core.block_manager.num_blocks // per_seq))

    def mixed(self, num_decodes: int) -> None:
        """``num_decodes`` running requests decode while a budget-sized prompt is chunked beside them."""
        if num_decodes < 1:
            return
        long_len = min(self.budget, self.longest)
        steps_for_long = -(-long_len // max(1, self.budget - num_decodes)) + 1
        out = min(self.config.num_output_tokens + steps_for_long, self.core.max_model_len - self.short - 1)
        for _ in range(num_decodes):
            self.add(self.rng.randint(1, self.short), max(1, out))
        if not self.prefill_only:  # let them reach decoding first; a prefill-only engine batches prefills
            while any(s.num_output_tokens == 0 and not s.is_finished for s in self.live.values()):
                self.step()
        self.add(long_len, 1)
        self.drain()

    def add(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Queue one greedy ``ignore_eos`` request of random prompt token ids."""
        rid = f"warmup-{self.num_added}"
        vocab = self.core.runner.vocab_size
        prompt = [self.rng.randrange(vocab) for _ in range(num_prompt_tokens)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                seed=self.config.seed)
        self.live[rid] = self.core.add_request(rid, prompt, params)
        self.num_added += 1

    def drain(self) -> None:
        """Step until every warm-up request finished (prefilled ones are released)."""
        while self.live:
            self.step()

    def step(self) -> None:
        """One engine step (as ``EngineCore.step``), recording its shape.

        Raises:
            WarmupTimeout: past the deadline. RuntimeError: nothing schedulable while requests wait.
        """
        if time.monotonic() > self.deadline:
            raise WarmupTimeout(f"warm-up passed {self.config.max_seconds} s")
        output = self.core.scheduler.schedule()
        if output.is_empty:
            raise RuntimeError(f"warm-up made no progress with {len(self.live)} request(s) left")
        self.steps.append(_shape(output))
        self.core.commit(output, self.core.runner.execute(output))
        for rid, seq in list(self.live.items()):
            if seq.status is SequenceStatus.FINISHED_PREFILLED:
                self.core.scheduler.release(seq)
            if seq.is_finished:
                del self.live[rid]

    def abort_all(self) -> None:
        """Abort whatever is left (after a time-out or an error): blocks freed, nothing held."""
        for rid in list(self.live):
            self.core.abort_request(rid)
        self.live.clear()


def _shape(output: SchedulerOutput) -> StepShape:
    """The ``StepShape`` of a scheduled step (read before ``commit`` moves ``num_computed_tokens``)."""
    prefills = output.scheduled[output.num_decodes:]
    return StepShape(output.num_decodes, len(prefills), output.num_batched_tokens,
                     any(s.seq.num_computed_tokens > 0 for s in prefills))
