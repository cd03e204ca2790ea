"""ModelRunner: one step's ``SchedulerOutput`` → packed tensors → model forward → sampled tokens.

All scheduled sequences are packed into one row (``input_ids [1, T]``, ``position_ids [1, T]``, decodes
first), attention goes through the paged backend (``engine.models.hf_attention``), and logits are
computed only for the rows that sample (the last scheduled token of each sampling sequence), plus, for a
sequence that asked for prompt logprobs, the rows of its prompt positions still to report; those become
``Sequence.prompt_logprobs`` entries (``engine.prompt_logprobs``, float32 in chunks of rows) in the
same step.

Decode-only steps (every scheduled sequence has query length 1, no ``layer_hook``) replay a CUDA graph
captured at start-up for the step's batch-size bucket (``engine.cuda_graphs``) when the model is on CUDA,
the backend is ``triton`` and ``ModelConfig.enforce_eager`` is off; prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import zlib
from collections.abc import Callable
from collections.abc import Sequence as Sequence_

import numpy as np
import torch

from engine.async_step import LaunchedStep, TokenBuffers, launch_decode
from engine.attention.backend import get_backend
from engine.attention.metadata import AttentionMetadata, build_attention_metadata
from engine.config import EngineConfig, kv_capacity_problem
from engine.cuda_graphs import DecodeCudaGraphs, mask_placeholder
from engine.distributed import TensorParallel, rank_device
from engine.host_copy import host_to_device
from engine.kv_cache import KVCachePool, check_kv_cache_dtype, resolve_cache_dtype
from engine.models.fused_model import PROJECTIONS, FusedCausalLM, unsupported_reason
from engine.models.hf_attention import BACKEND_KWARG, CACHE_KWARG, META_KWARG, install_paged_attention
from engine.models.loader import load_model, resolve_device
from engine.models.registry import max_model_len_problem
from engine.models.tensor_parallel import TensorParallelCausalLM, load_sharded_model, local_config
from engine.ops.cudnn_attention import warm_cudnn_plans
from engine.ops.cudnn_paged_prefill import warm_paged_prefill_graphs
from engine.ops.pdl import set_pdl
from engine.prompt_logprobs import prompt_token_logprobs
from engine.sampler import GrammarMask, Sampler, SampleResult, SamplingRow, is_plain_greedy
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.step_batch import StepBatch
from engine.structured_output import BitmaskBuffers, StructuredOutputError

logger = logging.getLogger(__name__)


class PromptRows:
    """The rows of one step's packed tokens whose logits give prompt logprobs: per sequence, its
    ``(seq, first row, number of rows)`` (row ``r`` predicts the token after it, a prompt token), and
    the packed ``targets`` (the prompt tokens predicted), in the same order."""

    def __init__(self) -> None:
        self.spans: list[tuple[Sequence, int, int]] = []
        self.rows: list[int] = []
        self.targets: list[int] = []

    def add(self, seq: Sequence, row: int, start: int, end: int) -> None:
        """Rows ``row ..`` hold positions ``[start, end)`` of ``seq``; keep those whose prompt logprob is
        still to report (positions ``len(seq.prompt_logprobs) .. num_prompt_tokens - 2``)."""
        done = seq.prompt_logprobs
        assert done is not None
        first, last = max(start, len(done)), min(end, seq.num_prompt_tokens - 1)
        if first >= last:
            return
        self.spans.append((seq, len(self.rows), last - first))
        self.rows.extend(range(row + first - start, row + last - start))
        self.targets.extend(seq.token_ids[first + 1:last + 1])


def fallback_seed(request_id: str) -> int:
    """Seed for a sequence whose params carry none: CRC-32 of its id (stable across workers).
    ``EngineCore.add_request`` normally fills in a random seed before this is ever needed."""
    return zlib.crc32(request_id.encode())


class ModelRunner:
    """Owns the model, the ``KVCachePool`` and the sampler of one engine.

    Attributes:
        model, hf_config: from ``load_model``; attention switched to the paged implementation.
        net: what a step calls: ``model`` itself, or a ``FusedCausalLM`` over its weights
            (``ModelConfig.fused_ops``).
        kv_cache: ``KVCachePool`` sized from ``engine_config.cache``.
        max_model_len: tokens per sequence (config value, else ``max_position_embeddings`` cut to the KV
            cache's capacity, ``num_blocks x block_size``: ``_fit_max_model_len``).
        vocab_size: rows of the LM head (logit width).
        decode_graphs: ``DecodeCudaGraphs`` captured at start-up, or None (CPU, ``enforce_eager``, or a
            backend other than ``triton``); setting it to None makes every step eager.
        before_forward: None, or called (no arguments, on the model's device) before each step's forward
            is enqueued: the host KV tier's wait for its copies (``KVHostTier.before_forward``).

    Tensor parallelism (``tp`` distributed, ``engine.models.tensor_parallel``): each rank loads its
    shard, runs ``TensorParallelCausalLM`` and holds its KV heads; the ranks agree on the smallest block
    count; rank 0 broadcasts each step's ``StepBatch`` before its forward and the other ranks run
    ``batch_logits`` on it (``engine.tp_executor``). ``tp`` None: ``TensorParallel.single()``.

    Raises:
        ValueError / FileNotFoundError: from loading, the backend choice or KV sizing; also when
            ``max_model_len`` exceeds the model's ``max_position_embeddings`` or the KV cache's capacity
            (``engine.config.kv_capacity_problem``), or when
            ``tensor_parallel_size`` differs from ``tp.size``.
        RuntimeError: from CUDA when graph capture fails (set ``enforce_eager`` to run without graphs).
    """

    def __init__(self, engine_config: EngineConfig, tp: TensorParallel | None = None) -> None:
        self.config = engine_config
        self.tp = tp if tp is not None else TensorParallel.single()
        wanted_tp = engine_config.parallel.tensor_parallel_size
        if wanted_tp != self.tp.size:
            raise ValueError(f"tensor_parallel_size={wanted_tp} but this process is one of {self.tp.size} "
                             "ranks: start the ranks with engine.tp_executor")
        if self.tp.distributed:
            device = rank_device(resolve_device(engine_config.model.device), self.tp)
            self.model, self.hf_config = load_sharded_model(engine_config.model, self.tp, device)
        else:
            self.model, self.hf_config = load_model(engine_config.model)
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if self.device.type == "cuda":
            # Triton launches and CUDA graph capture use the thread's current device, not the tensors':
            # a worker on cuda:1 would otherwise run its kernels on cuda:0, reading its KV over NVLink
            torch.cuda.set_device(self.device)
        set_pdl(engine_config.model.pdl)  # before any kernel compiles or graph is captured
        backend_name = engine_config.model.attention_backend
        fp8_kv = engine_config.cache.kv_cache_dtype == "fp8"
        if fp8_kv and backend_name == "auto" and self.device.type == "cuda":
            backend_name = "triton"  # auto's other CUDA choice, flash_attn, has no FP8 KV cache
        self.backend = get_backend(backend_name, self.device)
        install_paged_attention(self.model)
        cfg = self.hf_config
        limit = int(cfg.max_position_embeddings)
        wanted = engine_config.model.max_model_len
        if (too_long := max_model_len_problem(wanted, {"max_position_embeddings": limit})) is not None:
            raise ValueError(too_long)
        self.max_model_len = wanted or limit
        self.net = self._forward_model(engine_config.model.fused_ops)
        self.vocab_size = int(cfg.vocab_size)
        num_heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // num_heads
        cache = engine_config.cache
        num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or num_heads)
        if self.tp.distributed:
            num_kv_heads = int(local_config(cfg, self.tp.size).num_key_value_heads)
        cache_dtype = resolve_cache_dtype(cache.kv_cache_dtype, self.dtype)
        check_kv_cache_dtype(cache_dtype, self.dtype, self.backend.name, self.device)
        shape = (int(cfg.num_hidden_layers), cache.block_size, num_kv_heads, int(head_dim))
        num_blocks = cache.num_blocks
        if num_blocks is None:  # sized from memory (on every rank the smallest: they share block ids)
            num_blocks = KVCachePool.fit_num_blocks(*shape, cache_dtype, self.device,
                                                    memory_fraction=cache.memory_fraction,
                                                    cpu_kv_bytes=cache.cpu_kv_bytes)
            if self.tp.distributed:
                num_blocks = self.tp.min_int(num_blocks)
        self._fit_max_model_len(wanted, num_blocks, limit)  # before the cache is allocated
        self.backend.set_step_limits(engine_config.scheduler.max_num_batched_tokens, self.max_model_len)
        self.kv_cache = KVCachePool.from_memory(
            *shape, self.dtype, self.device,
            memory_fraction=cache.memory_fraction,
            cpu_kv_bytes=cache.cpu_kv_bytes,
            num_blocks=num_blocks,
            cache_dtype=cache_dtype,
        )
        self.sampler = Sampler()
        self._mask = mask_placeholder(self.device)
        self.decode_graphs: DecodeCudaGraphs | None = None
        self.before_forward: Callable[[], None] | None = None
        self._token_buffers: TokenBuffers | None = None  # host copies of launched steps' tokens
        self._bitmasks: BitmaskBuffers | None = None  # grammar bitmasks (first batch with a grammar)
        use_graphs = self.device.type == "cuda" and self.backend.name == "triton"
        if use_graphs and not engine_config.model.enforce_eager:
            self.decode_graphs = DecodeCudaGraphs(self.net, self.kv_cache, self.backend,
                                                  engine_config.scheduler.max_num_seqs, self.max_model_len)
            self.decode_graphs.capture()

    def _fit_max_model_len(self, wanted: int | None, num_blocks: int, limit: int) -> None:
        """Hold ``max_model_len`` to the KV cache's capacity (``num_blocks`` x ``block_size`` tokens: one
        sequence's KV must fit): an explicit ``max_model_len`` (``wanted``) beyond it is refused, naming the
        flags (``kv_capacity_problem``); the model's own limit (``max_position_embeddings``, taken when
        none was given) is cut to it, logged once at INFO (by rank 0).

        Raises:
            ValueError: ``wanted`` exceeds the capacity.
        """
        cache = self.config.cache
        sized_from = None if cache.num_blocks is not None else cache.memory_fraction
        if (why := kv_capacity_problem(wanted, num_blocks, cache.block_size, sized_from)) is not None:
            raise ValueError(why)
        capacity = num_blocks * cache.block_size
        if self.max_model_len > capacity:
            if self.tp.rank == 0:
                source = (f"--num-blocks {num_blocks}" if sized_from is None
                          else f"{num_blocks} blocks sized from --kv-memory-fraction {sized_from:g}")
                logger.info("max_model_len capped to %d tokens, the KV cache's capacity (%s x "
                            "--block-size %d), from the model's max_position_embeddings=%d: one sequence's "
                            "KV must fit the cache", capacity, source, cache.block_size, limit)
            self.max_model_len = capacity

    def warm_attention_plans(self, max_tokens: int) -> int:
        """Build the attention plans a fresh prompt of up to ``max_tokens`` tokens needs on this worker
        (``engine.ops.cudnn_attention.warm_cudnn_plans``: the triton backend's cuDNN path, this rank's
        heads) and the cuDNN paged prefill graphs of every sequence-count bucket
        (``engine.ops.cudnn_paged_prefill.warm_paged_prefill_graphs``); returns how many (0 where the paths
        are off: another backend, an FP8 cache, no Hopper GPU or no cuDNN frontend)."""
        if self.device.type != "cuda" or self.kv_cache.k_cache(0).dtype != self.dtype:
            return 0
        cfg = self.hf_config
        heads = int(cfg.num_attention_heads) // (self.tp.size if self.tp.distributed else 1)
        _, _, kv_heads, head_dim = self.kv_cache.k_cache(0).shape
        fresh = 0
        if getattr(self.backend, "cudnn_fresh_prefill", False):
            fresh = warm_cudnn_plans(heads, int(kv_heads), int(head_dim), self.dtype, self.device, max_tokens)
        if not getattr(self.backend, "cudnn_paged_prefill", False):
            return fresh
        probe = torch.empty((1, heads, int(head_dim)), dtype=self.dtype, device=self.device)
        scheduler = self.config.scheduler
        return fresh + warm_paged_prefill_graphs(probe, self.kv_cache.k_cache(0), scheduler.max_num_seqs,
                                                 scheduler.max_num_batched_tokens, self.max_model_len,
                                                 warn_missing=self.tp.rank == 0)

    def _forward_model(self, fused_ops: str) -> torch.nn.Module:
        """``FusedCausalLM`` when ``fused_ops`` asks for it (``auto``: on CUDA and a supported model), with
        Triton kernels when the attention backend is ``triton`` (and, on CUDA, every projection of a
        one-token step through ``engine.ops.gemv``: +3.5 % batch-1 decode on an H200,
        docs/benchmarks/engine.md); else the transformers model.

        Raises:
            ValueError: ``fused_ops="on"`` for a model ``FusedCausalLM`` does not support.
        """
        reason = unsupported_reason(self.model)
        if self.tp.distributed:
            if fused_ops == "off" or reason is not None:
                raise ValueError(f"tensor parallelism runs the fused forward: fused_ops={fused_ops!r}"
                                 + (f", {reason}" if reason else ""))
            use_triton = self.backend.name == "triton"
            return TensorParallelCausalLM(
                self.model, self.tp, int(self.hf_config.vocab_size), use_triton=use_triton,
                gemv_projections=PROJECTIONS if use_triton and self.device.type == "cuda" else (),
                max_positions=self.max_model_len)
        if fused_ops == "off" or (fused_ops == "auto" and (self.device.type != "cuda" or reason)):
            return self.model
        if reason is not None:
            raise ValueError(f"fused_ops=on: {reason}")
        use_triton = self.backend.name == "triton"
        gemv = PROJECTIONS if use_triton and self.device.type == "cuda" else ()
        return FusedCausalLM(self.model, use_triton=use_triton, gemv_projections=gemv,
                             max_positions=self.max_model_len)

    def _prepare_inputs(
        self, batch: StepBatch, layer_hook: Callable[[int], None] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Packed ``input_ids [1, T]``, ``position_ids [1, T]`` (int64), the indices ``[S_sample (+ P)]``
        of the rows to compute logits for (the sampling rows, then ``batch.prompt_rows``), and the step's
        ``AttentionMetadata``.

        Raises:
            ValueError: ``batch``'s per-sequence lists differ in length, or ``build_attention_metadata``
                refuses the step.
        """
        if not len(batch.token_ids) == len(batch.starts) == len(batch.samples):
            raise ValueError(f"step batch of {len(batch.token_ids)} token lists, {len(batch.starts)} starts, "
                             f"{len(batch.samples)} sample flags")
        lens = np.fromiter((len(t) for t in batch.token_ids), dtype=np.int64, count=len(batch.token_ids))
        ends = np.cumsum(lens)
        total = int(ends[-1]) if len(ends) else 0
        ids = np.fromiter(itertools.chain.from_iterable(batch.token_ids), dtype=np.int64, count=total)
        # row r of sequence i sits at position starts[i] + r - (ends[i] - lens[i])
        shift = np.asarray(batch.starts, dtype=np.int64) - (ends - lens)
        positions = np.arange(total, dtype=np.int64) + np.repeat(shift, lens)
        sample_rows = [int(end) - 1 for end, samples in zip(ends, batch.samples, strict=True) if samples]
        sample_rows.extend(batch.prompt_rows)  # their logits follow the sampling rows'
        meta = build_attention_metadata(
            batch.block_tables,
            batch.starts,
            [len(tokens) for tokens in batch.token_ids],
            self.kv_cache.block_size,
            device=self.device,
            layer_hook=layer_hook,
        )
        dev = self.device
        return (
            host_to_device(ids, torch.int64, dev)[None, :],
            host_to_device(positions, torch.int64, dev)[None, :],
            host_to_device(sample_rows, torch.int64, dev),
            meta,
        )

    @torch.inference_mode()
    def compute_logits(
        self, output: SchedulerOutput, layer_hook: Callable[[int], None] | None = None, rank_note: bytes = b""
    ) -> torch.Tensor:
        """Run the forward pass of one step, storing every scheduled token's K/V in ``kv_cache``.

        A sequence with prompt logprobs still to report (``Sequence.needs_prompt_logprobs``) gets the
        entries of this step's prompt positions appended to ``Sequence.prompt_logprobs``; their logits
        (``[P, vocab_size]`` in the model dtype, P at most the step's tokens) are turned into float32
        logprobs ``ROWS_PER_CHUNK`` rows at a time (``engine.prompt_logprobs``).

        Returns:
            ``[S_sample, vocab_size]`` logits in the model dtype, one row per ``samples=True`` entry in
            ``output.scheduled`` order.

        With tensor parallel followers the step's ``StepBatch`` (carrying ``rank_note`` for their
        ``RankHook``, engine.tp_executor) is broadcast to them first.
        """
        prompt_rows: PromptRows | None = None
        if any(s.seq.needs_prompt_logprobs for s in output.scheduled):
            prompt_rows, offset = PromptRows(), 0
            for s in output.scheduled:
                start = s.seq.num_computed_tokens
                if s.seq.needs_prompt_logprobs:
                    prompt_rows.add(s.seq, offset, start, start + s.num_scheduled_tokens)
                offset += s.num_scheduled_tokens
        batch = StepBatch.from_output(output, prompt_rows.rows if prompt_rows is not None else [], rank_note)
        if self.tp.has_followers:
            self.tp.broadcast_bytes(batch.encode())
        logits = self.batch_logits(batch, layer_hook)
        if prompt_rows is None or not prompt_rows.rows:
            return logits
        num_sample = logits.shape[0] - len(prompt_rows.rows)
        _record_prompt_logprobs(logits[num_sample:], prompt_rows)
        return logits[:num_sample]

    @torch.inference_mode()
    def batch_logits(self, batch: StepBatch,
                     layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        """``compute_logits`` of one step's ``StepBatch`` (what the other tensor parallel ranks run)."""
        graphs = self.decode_graphs
        if (graphs is not None and layer_hook is None and batch.is_decode_only and not batch.prompt_rows
                and graphs.fits(len(batch.starts))):
            return self._graph_logits(graphs, batch)
        input_ids, position_ids, sample_rows, meta = self._prepare_inputs(batch, layer_hook)
        result = self.net(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=self._mask,
            use_cache=False,
            logits_to_keep=sample_rows,
            **{META_KWARG: meta, CACHE_KWARG: self.kv_cache, BACKEND_KWARG: self.backend},
        )
        return result.logits[0]

    def _graph_logits(self, graphs: DecodeCudaGraphs, batch: StepBatch) -> torch.Tensor:
        """Decode-only step through the bucket's CUDA graph: logits ``[S_sample, vocab_size]``. On rank 0
        passes each ``Sequence.block_table`` list itself, so ``StaticDecodeInputs`` re-sends only the
        changed rows."""
        logits = graphs.run([tokens[0] for tokens in batch.token_ids], batch.starts, batch.block_tables)
        rows = [i for i, samples in enumerate(batch.samples) if samples]
        if len(rows) == len(batch.samples):
            return logits
        return logits[host_to_device(rows, torch.int64, self.device)]

    def execute(
        self, output: SchedulerOutput, layer_hook: Callable[[int], None] | None = None, rank_note: bytes = b""
    ) -> dict[str, SampleResult]:
        """Run one step and sample a token for every sequence with ``samples=True``.

        Args:
            output: from ``Scheduler.schedule()``; read before ``Scheduler.update`` (uses
                ``num_computed_tokens`` as the start of each sequence's scheduled tokens).
            layer_hook: passed to ``AttentionMetadata.layer_hook`` (called after each layer's KV store).
            rank_note: bytes for the other tensor parallel ranks' ``RankHook`` (compute_logits).

        Returns:
            request id → ``SampleResult`` (empty for an empty step or one without sampling sequences).
        """
        if output.is_empty:
            return {}
        with self.on_device():
            if self.before_forward is not None:
                self.before_forward()
            return self._execute(output, layer_hook, rank_note)

    @torch.inference_mode()
    def launch(self, output: SchedulerOutput, feed: LaunchedStep | None = None) -> LaunchedStep:
        """Enqueue a decode-only step through the decode graphs, every row ``samples_on_device``, without
        waiting for it (asynchronous scheduling; arguments and errors as
        ``engine.async_step.launch_decode``). With ``feed`` each row samples its next output position.

        Rows with a grammar get their bitmask after the forward is enqueued (``launch_decode``'s
        ``grammar``): each matcher first accepts ``feed``'s token of its row (waiting for ``feed``'s tokens).

        Raises:
            RuntimeError: no decode graphs (CPU, ``enforce_eager`` or a backend other than triton).
        """
        graphs = self.decode_graphs
        if graphs is None:
            raise RuntimeError("asynchronous decode steps need the decode graphs")
        if self._token_buffers is None:
            self._token_buffers = TokenBuffers(graphs.inputs.max_batch, self.device)
        later = 0 if feed is None else 1
        seqs = [s.seq for s in output.scheduled]
        rows = None
        if not all(is_plain_greedy(seq.sampling_params, seq.num_output_tokens + later) for seq in seqs):
            rows = [self._row(seq, later) for seq in seqs]
        grammar = None
        if any(seq.grammar is not None for seq in seqs):
            def grammar() -> GrammarMask | None:  # after the forward is enqueued: overlaps it
                return self._grammar_mask(seqs, feed.token_ids() if feed is not None else ())

        with self.on_device():
            if self.before_forward is not None:
                self.before_forward()
            try:
                launched = launch_decode(graphs, output, feed, self._token_buffers, rows, grammar)
            except BaseException:
                if grammar is not None and self.device.type == "cuda":
                    # the grammar mask raised after the forward was enqueued (reading feed's tokens):
                    # let that forward finish writing its KV before the caller frees the blocks
                    torch.cuda.current_stream(self.device).synchronize()
                raise
            if grammar is not None:
                self._grammar_bitmasks().done_reading()
            return launched

    def on_device(self) -> contextlib.AbstractContextManager[object]:
        """Context making ``self.device`` the calling thread's current CUDA device (steps run on an
        executor thread whose current device is cuda:0 by default); a no-op off CUDA."""
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def _execute(self, output: SchedulerOutput, layer_hook: Callable[[int], None] | None,
                 rank_note: bytes = b"") -> dict[str, SampleResult]:
        """Forward, then sampling: a batch of only plain-greedy rows (``is_plain_greedy``) takes the
        device argmax and one copy of ``S`` token ids, with no per-row ``SamplingRow``."""
        logits = self.compute_logits(output, layer_hook, rank_note)
        sampling = [s.seq for s in output.scheduled if s.samples]
        if not sampling:
            return {}
        if all(is_plain_greedy(seq.sampling_params, len(seq.output_token_ids)) for seq in sampling):
            tokens = self.sampler.greedy(logits)
            return {seq.request_id: SampleResult(t) for seq, t in zip(sampling, tokens, strict=True)}
        rows = [self._row(seq) for seq in sampling]
        mask = self._grammar_mask(sampling)
        results = self.sampler(logits, rows, mask)
        if mask is not None:
            self._grammar_bitmasks().done_reading()
        return {seq.request_id: r for seq, r in zip(sampling, results, strict=True)}

    def _grammar_mask(self, seqs: list[Sequence], pending: Sequence_[int] = ()) -> GrammarMask | None:
        """The bitmask of the rows whose sequence has a grammar (each matcher first advanced over the
        tokens it has not seen, ``GrammarState.sync``; ``pending``: one token per row of ``seqs``, sampled
        by the previous step and not yet applied, or empty), or None when no row has one. A row whose
        matcher rejects such a token, or whose fill raises, gets no mask and its ``GrammarState.error``
        is set: the commit of the step that sampled the rejected token (or of this step) ends that
        sequence alone, FINISHED_FAILED (``Scheduler.update``), and the other rows go on.

        Raises:
            ValueError: ``pending`` holds a number of tokens other than ``len(seqs)``.
        """
        if all(seq.grammar is None for seq in seqs):
            return None
        if pending and len(pending) != len(seqs):
            raise ValueError(f"{len(pending)} pending tokens for {len(seqs)} rows")
        states = []
        for i, seq in enumerate(seqs):
            if seq.grammar is not None:
                with contextlib.suppress(StructuredOutputError):  # kept in seq.grammar.error
                    seq.grammar.sync(seq.token_ids, pending[i: i + 1], start=seq.generation_start)
            states.append(seq.grammar)
        return self._grammar_bitmasks().fill(states)

    def _grammar_bitmasks(self) -> BitmaskBuffers:
        """The engine's bitmask buffers (allocated at the first batch with a grammar)."""
        if self._bitmasks is None:
            self._bitmasks = BitmaskBuffers(self.config.scheduler.max_num_seqs, self.vocab_size, self.device)
        return self._bitmasks

    @staticmethod
    def _row(seq: Sequence, later: int = 0) -> SamplingRow:
        """The sampler's view of ``seq``; the prompt (O(prompt) to slice) only when a repetition
        penalty reads it, the output tokens by reference. ``later``: 1 for a step launched before the
        previous token reached ``seq`` (only for ``samples_on_device`` rows, which do not read the
        output tokens). ``SamplingParams.output_offset``: the prompt's last tokens are earlier output of
        the same generation, so positions start there and the penalties count them as output."""
        params = seq.sampling_params
        prompt = seq.token_ids[: seq.num_prompt_tokens] if params.repetition_penalty != 1.0 else ()
        outputs: list[int] = seq.output_token_ids
        if params.output_offset and (params.presence_penalty or params.frequency_penalty):
            outputs = seq.token_ids[max(seq.num_prompt_tokens - params.output_offset, 0):]
        return SamplingRow(
            params=params,
            seed=params.seed if params.seed is not None else fallback_seed(seq.request_id),
            output_position=seq.num_output_tokens + params.output_offset + later,
            prompt_token_ids=prompt,
            output_token_ids=outputs,
            eos_token_ids=seq.eos_token_ids,
        )


def _record_prompt_logprobs(logits: torch.Tensor, prompt_rows: PromptRows) -> None:
    """Append each sequence's entries computed from ``logits`` (``[P, vocab]``, ``prompt_rows``' rows
    in order) to its ``prompt_logprobs``, at the top-N its ``SamplingParams.prompt_logprobs`` asks
    (one pass per distinct N)."""
    by_top: dict[int, list[tuple[Sequence, int, int]]] = {}
    for seq, first, count in prompt_rows.spans:
        num_top = seq.sampling_params.prompt_logprobs
        assert num_top is not None
        by_top.setdefault(num_top, []).append((seq, first, count))
    targets = host_to_device(prompt_rows.targets, torch.int64, logits.device)
    for num_top, spans in by_top.items():
        rows, wanted = logits, targets
        if len(by_top) > 1:  # this N's rows only (one N, the usual case: every row, no copy)
            index = host_to_device([r for _, first, count in spans for r in range(first, first + count)],
                                   torch.int64, logits.device)
            rows, wanted = logits[index], targets[index]
        entries = prompt_token_logprobs(rows, wanted, min(num_top, logits.shape[1]))
        at = 0
        for seq, _, count in spans:
            done = seq.prompt_logprobs
            assert done is not None
            done.extend(entries[at:at + count])
            at += count
