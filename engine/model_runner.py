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
import zlib
from collections.abc import Callable

import torch

from engine.async_step import LaunchedStep, TokenBuffers, launch_decode
from engine.attention.backend import get_backend
from engine.attention.metadata import AttentionMetadata, build_attention_metadata
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeCudaGraphs, mask_placeholder
from engine.kv_cache import KVCachePool
from engine.models.fused_model import PROJECTIONS, FusedCausalLM, unsupported_reason
from engine.models.hf_attention import BACKEND_KWARG, CACHE_KWARG, META_KWARG, install_paged_attention
from engine.models.loader import load_model
from engine.ops.pdl import set_pdl
from engine.prompt_logprobs import prompt_token_logprobs
from engine.sampler import GrammarMask, Sampler, SampleResult, SamplingRow, is_plain_greedy
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.structured_output import fill_bitmasks


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
        max_model_len: tokens per sequence (config value, else ``max_position_embeddings``).
        vocab_size: rows of the LM head (logit width).
        decode_graphs: ``DecodeCudaGraphs`` captured at start-up, or None (CPU, ``enforce_eager``, or a
            backend other than ``triton``); setting it to None makes every step eager.

    Raises:
        ValueError / FileNotFoundError: from loading, the backend choice or KV sizing; also when
            ``max_model_len`` exceeds the model's ``max_position_embeddings``.
        RuntimeError: from CUDA when graph capture fails (set ``enforce_eager`` to run without graphs).
    """

    def __init__(self, engine_config: EngineConfig) -> None:
        self.config = engine_config
        self.model, self.hf_config = load_model(engine_config.model)
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if self.device.type == "cuda":
            # Triton launches and CUDA graph capture use the thread's current device, not the tensors':
            # a worker on cuda:1 would otherwise run its kernels on cuda:0, reading its KV over NVLink
            torch.cuda.set_device(self.device)
        set_pdl(engine_config.model.pdl)  # before any kernel compiles or graph is captured
        self.backend = get_backend(engine_config.model.attention_backend, self.device)
        install_paged_attention(self.model)
        cfg = self.hf_config
        limit = int(cfg.max_position_embeddings)
        wanted = engine_config.model.max_model_len
        if wanted is not None and wanted > limit:
            raise ValueError(f"max_model_len={wanted} exceeds the model's max_position_embeddings={limit}")
        self.max_model_len = wanted or limit
        self.net = self._forward_model(engine_config.model.fused_ops)
        self.vocab_size = int(cfg.vocab_size)
        num_heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // num_heads
        cache = engine_config.cache
        self.kv_cache = KVCachePool.from_memory(
            num_layers=int(cfg.num_hidden_layers),
            block_size=cache.block_size,
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or num_heads),
            head_dim=int(head_dim),
            dtype=self.dtype,
            device=self.device,
            memory_fraction=cache.memory_fraction,
            cpu_kv_bytes=cache.cpu_kv_bytes,
            num_blocks=cache.num_blocks,
        )
        self.sampler = Sampler()
        self._mask = mask_placeholder(self.device)
        self.decode_graphs: DecodeCudaGraphs | None = None
        self._token_buffers: TokenBuffers | None = None  # host copies of launched steps' tokens
        use_graphs = self.device.type == "cuda" and self.backend.name == "triton"
        if use_graphs and not engine_config.model.enforce_eager:
            self.decode_graphs = DecodeCudaGraphs(self.net, self.kv_cache, self.backend,
                                                  engine_config.scheduler.max_num_seqs, self.max_model_len)
            self.decode_graphs.capture()

    def _forward_model(self, fused_ops: str) -> torch.nn.Module:
        """``FusedCausalLM`` when ``fused_ops`` asks for it (``auto``: on CUDA and a supported model), with
        Triton kernels when the attention backend is ``triton`` (and, on CUDA, every projection of a
        one-token step through ``engine.ops.gemv``: +3.5 % batch-1 decode on an H200,
        docs/benchmarks/engine.md); else the transformers model.

        Raises:
            ValueError: ``fused_ops="on"`` for a model ``FusedCausalLM`` does not support.
        """
        reason = unsupported_reason(self.model)
        if fused_ops == "off" or (fused_ops == "auto" and (self.device.type != "cuda" or reason)):
            return self.model
        if reason is not None:
            raise ValueError(f"fused_ops=on: {reason}")
        use_triton = self.backend.name == "triton"
        gemv = PROJECTIONS if use_triton and self.device.type == "cuda" else ()
        return FusedCausalLM(self.model, use_triton=use_triton, gemv_projections=gemv,
                             max_positions=self.max_model_len)

    def _prepare_inputs(
        self, output: SchedulerOutput, layer_hook: Callable[[int], None] | None,
        prompt_rows: PromptRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Packed ``input_ids [1, T]``, ``position_ids [1, T]`` (int64), the indices ``[S_sample (+ P)]``
        of the rows to compute logits for (the sampling rows, then ``prompt_rows``' rows, which this
        fills when given), and the step's ``AttentionMetadata``."""
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        for s in output.scheduled:
            start = s.seq.num_computed_tokens
            end = start + s.num_scheduled_tokens
            if prompt_rows is not None and s.seq.needs_prompt_logprobs:
                prompt_rows.add(s.seq, len(ids), start, end)
            ids.extend(s.seq.token_ids[start:end])
            positions.extend(range(start, end))
            if s.samples:
                sample_rows.append(len(ids) - 1)
        if prompt_rows is not None:
            sample_rows.extend(prompt_rows.rows)  # their logits follow the sampling rows'
        meta = build_attention_metadata(
            [s.seq.block_table for s in output.scheduled],
            [s.seq.num_computed_tokens for s in output.scheduled],
            [s.num_scheduled_tokens for s in output.scheduled],
            self.kv_cache.block_size,
            device=self.device,
            layer_hook=layer_hook,
        )
        dev = self.device
        return (
            torch.tensor(ids, dtype=torch.int64, device=dev)[None, :],
            torch.tensor(positions, dtype=torch.int64, device=dev)[None, :],
            torch.tensor(sample_rows, dtype=torch.int64, device=dev),
            meta,
        )

    @torch.inference_mode()
    def compute_logits(
        self, output: SchedulerOutput, layer_hook: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Run the forward pass of one step, storing every scheduled token's K/V in ``kv_cache``.

        A sequence with prompt logprobs still to report (``Sequence.needs_prompt_logprobs``) gets the
        entries of this step's prompt positions appended to ``Sequence.prompt_logprobs``; their logits
        (``[P, vocab_size]`` in the model dtype, P at most the step's tokens) are turned into float32
        logprobs ``ROWS_PER_CHUNK`` rows at a time (``engine.prompt_logprobs``).

        Returns:
            ``[S_sample, vocab_size]`` logits in the model dtype, one row per ``samples=True`` entry in
            ``output.scheduled`` order.
        """
        graphs = self.decode_graphs
        scheduled = output.scheduled
        decode_only = output.num_decodes == len(scheduled) or all(
            s.num_scheduled_tokens == 1 for s in scheduled)
        wants_prompt = any(s.seq.needs_prompt_logprobs for s in scheduled)
        if (graphs is not None and layer_hook is None and decode_only and not wants_prompt
                and graphs.fits(len(output.scheduled))):
            return self._graph_logits(graphs, output)
        prompt_rows = PromptRows() if wants_prompt else None
        input_ids, position_ids, sample_rows, meta = self._prepare_inputs(output, layer_hook, prompt_rows)
        result = self.net(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=self._mask,
            use_cache=False,
            logits_to_keep=sample_rows,
            **{META_KWARG: meta, CACHE_KWARG: self.kv_cache, BACKEND_KWARG: self.backend},
        )
        logits = result.logits[0]
        if prompt_rows is None or not prompt_rows.rows:
            return logits
        num_sample = logits.shape[0] - len(prompt_rows.rows)
        _record_prompt_logprobs(logits[num_sample:], prompt_rows)
        return logits[:num_sample]

    def _graph_logits(self, graphs: DecodeCudaGraphs, output: SchedulerOutput) -> torch.Tensor:
        """Decode-only step through the bucket's CUDA graph: logits ``[S_sample, vocab_size]``. Passes each
        ``Sequence.block_table`` list itself, so ``StaticDecodeInputs`` re-sends only the changed rows."""
        seqs = [s.seq for s in output.scheduled]
        logits = graphs.run(
            [seq.token_ids[seq.num_computed_tokens] for seq in seqs],
            [seq.num_computed_tokens for seq in seqs],
            [seq.block_table for seq in seqs],
        )
        rows = [i for i, s in enumerate(output.scheduled) if s.samples]
        if len(rows) == len(seqs):
            return logits
        return logits[torch.tensor(rows, dtype=torch.int64, pin_memory=self.device.type == "cuda")
                      .to(self.device, non_blocking=True)]

    def execute(
        self, output: SchedulerOutput, layer_hook: Callable[[int], None] | None = None
    ) -> dict[str, SampleResult]:
        """Run one step and sample a token for every sequence with ``samples=True``.

        Args:
            output: from ``Scheduler.schedule()``; read before ``Scheduler.update`` (uses
                ``num_computed_tokens`` as the start of each sequence's scheduled tokens).
            layer_hook: passed to ``AttentionMetadata.layer_hook`` (called after each layer's KV store).

        Returns:
            request id → ``SampleResult`` (empty for an empty step or one without sampling sequences).
        """
        if output.is_empty:
            return {}
        with self.on_device():
            return self._execute(output, layer_hook)

    @torch.inference_mode()
    def launch(self, output: SchedulerOutput, feed: LaunchedStep | None = None) -> LaunchedStep:
        """Enqueue a decode-only step through the decode graphs, every row ``samples_on_device``, without
        waiting for it (asynchronous scheduling; arguments and errors as
        ``engine.async_step.launch_decode``). With ``feed`` each row samples its next output position.

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
        with self.on_device():
            return launch_decode(graphs, output, feed, self._token_buffers, rows)

    def on_device(self) -> contextlib.AbstractContextManager[object]:
        """Context making ``self.device`` the calling thread's current CUDA device (steps run on an
        executor thread whose current device is cuda:0 by default); a no-op off CUDA."""
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def _execute(self, output: SchedulerOutput,
                 layer_hook: Callable[[int], None] | None) -> dict[str, SampleResult]:
        """Forward, then sampling: a batch of only plain-greedy rows (``is_plain_greedy``) takes the
        device argmax and one copy of ``S`` token ids, with no per-row ``SamplingRow``."""
        logits = self.compute_logits(output, layer_hook)
        sampling = [s.seq for s in output.scheduled if s.samples]
        if not sampling:
            return {}
        if all(is_plain_greedy(seq.sampling_params, len(seq.output_token_ids)) for seq in sampling):
            tokens = self.sampler.greedy(logits)
            return {seq.request_id: SampleResult(t) for seq, t in zip(sampling, tokens, strict=True)}
        rows = [self._row(seq) for seq in sampling]
        results = self.sampler(logits, rows, self._grammar_mask(sampling))
        return {seq.request_id: r for seq, r in zip(sampling, results, strict=True)}

    def _grammar_mask(self, seqs: list[Sequence]) -> GrammarMask | None:
        """The bitmask of the rows whose sequence has a grammar (each matcher first advanced over the
        tokens it has not seen, ``GrammarState.sync``), or None when no row has one. Raises
        ``StructuredOutputError`` when a matcher rejects such a token."""
        if all(seq.grammar is None for seq in seqs):
            return None
        states = []
        for seq in seqs:
            if seq.grammar is not None:
                seq.grammar.sync(seq.generated_token_ids)
            states.append(seq.grammar)
        return fill_bitmasks(states, self.vocab_size)

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
            eos_token_id=seq.eos_token_id,
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
    targets = torch.tensor(prompt_rows.targets, dtype=torch.int64, device=logits.device)
    for num_top, spans in by_top.items():
        rows, wanted = logits, targets
        if len(by_top) > 1:  # this N's rows only (one N, the usual case: every row, no copy)
            index = torch.tensor([r for _, first, count in spans for r in range(first, first + count)],
                                 dtype=torch.int64, device=logits.device)
            rows, wanted = logits[index], targets[index]
        entries = prompt_token_logprobs(rows, wanted, min(num_top, logits.shape[1]))
        at = 0
        for seq, _, count in spans:
            done = seq.prompt_logprobs
            assert done is not None
            done.extend(entries[at:at + count])
            at += count
