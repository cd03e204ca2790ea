"""CUDA graphs for decode-only steps: capture the whole forward once per batch-size bucket, then replay.

A batch-1 decode of an 8B model is host-bound in eager mode (about a thousand kernel launches per
forward from transformers' modules); a CUDA graph replays all of them with one launch. Method as in
vLLM's ``CUDAGraphRunner`` and PyTorch's "CUDA Graphs" notes (https://pytorch.org/docs/stable/notes/
cuda.html#cuda-graphs): the graph reads fixed ("static") device buffers, so each step first ``copy_``s
its inputs into them, then replays; outputs land in the graph's own static output tensor.

Per bucket of ``B`` rows (``decode_buckets``: 1, 2, 4, ... up to ``max_num_seqs``) the static buffers
are ``input_ids``, ``position_ids``, ``slot_mapping`` (int64 ``[B]``), ``seq_lens`` (int32 ``[B]``),
``block_tables`` (int32 ``[B, max_blocks_per_seq]``) and ``query_start_loc`` (int32 ``[B+1]`` =
0..B, constant: every row has query length 1). A step of ``n <= B`` sequences fills rows ``[0, n)``;
padding rows ``[n, B)`` get slot ``-1`` (``store_kv`` skips it: nothing is written to the KV cache),
``seq_len`` 1 and position 0, so they read one KV entry of some valid block and their logits are
discarded. The decode kernel's grid depends only on ``B`` and a ``num_splits`` fixed per graph
(``AttentionMetadata.max_seq_len`` is pinned to ``max_model_len``); it reads each length from
``seq_lens`` in device memory. Graphs need CUDA and the ``triton`` attention backend; everything else
(prefill, mixed steps, steps with a ``layer_hook``) runs eagerly in ``ModelRunner``.

The static buffers and their per-step fill (one host-to-device copy, block-table rows re-sent only when
they changed) live in ``engine.decode_inputs``.

On a CPU (tests) nothing is captured and ``DecodeCudaGraphs.run`` executes the same static-buffer forward
eagerly, which is how padding and metadata are tested without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from engine.attention.backend import AttentionBackend
from engine.decode_inputs import PAD_SLOT, StaticDecodeInputs
from engine.kv_cache import KVCachePool
from engine.models.hf_attention import BACKEND_KWARG, CACHE_KWARG, META_KWARG

logger = logging.getLogger(__name__)

__all__ = ["PAD_SLOT", "DecodeCudaGraphs", "StaticDecodeInputs", "bucket_for", "decode_buckets",
           "mask_placeholder"]



def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Graph batch sizes: powers of two below ``max_num_seqs``, then ``max_num_seqs`` itself.

    Raises:
        ValueError: ``max_num_seqs < 1``.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = []
    size = 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    sizes.append(max_num_seqs)
    return tuple(sizes)


def bucket_for(num_seqs: int, buckets: Sequence[int]) -> int | None:
    """Smallest bucket ``>= num_seqs`` (``buckets`` ascending); None when ``num_seqs`` exceeds them all."""
    for size in buckets:
        if size >= num_seqs:
            return size
    return None


def mask_placeholder(device: torch.device) -> torch.Tensor:
    """An empty 4-D bool tensor ``[1, 1, 0, 0]`` passed as ``attention_mask``: transformers' mask builders
    return a 4-D mask unchanged, so they skip their own work (which holds a host sync on the packed
    position ids); the paged attention function ignores the mask (causality comes from the metadata)."""
    return torch.empty((1, 1, 0, 0), dtype=torch.bool, device=device)


class DecodeCudaGraphs:
    """One CUDA graph per decode bucket over a loaded model (see the module docstring).

    Args:
        model: the HF causal LM with paged attention installed (``install_paged_attention``).
        kv_cache: the engine's ``KVCachePool``.
        backend: the attention backend (graphs need ``triton``: its kernels skip slot ``-1``).
        max_num_seqs: largest batch; buckets from ``decode_buckets``.
        max_model_len: tokens per sequence (sizes the block tables and pins ``num_splits``).

    Raises:
        ValueError: a backend other than ``triton``.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: KVCachePool, backend: AttentionBackend,
                 max_num_seqs: int, max_model_len: int) -> None:
        if backend.name != "triton":
            raise ValueError(f"decode CUDA graphs need the triton attention backend, got {backend.name!r}")
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.buckets = decode_buckets(max_num_seqs)
        self.device = kv_cache.device
        max_blocks = -(-max_model_len // kv_cache.block_size)
        self.inputs = StaticDecodeInputs(self.buckets[-1], max_blocks, kv_cache.block_size, max_model_len,
                                         self.device)
        self._mask = mask_placeholder(self.device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0

    @property
    def captured(self) -> tuple[int, ...]:
        """Buckets with a captured graph, ascending."""
        return tuple(sorted(self._graphs))

    def fits(self, num_seqs: int) -> bool:
        """True when a bucket holds ``num_seqs`` sequences (else the step must run eagerly)."""
        return bucket_for(num_seqs, self.buckets) is not None

    def forward(self, bucket: int) -> torch.Tensor:
        """Eager forward over the static buffers' rows ``[:bucket]``; logits ``[bucket, vocab]`` (model
        dtype) for every row, padding included. Stores each real row's K/V in ``kv_cache``."""
        x = self.inputs
        out = self.model(
            input_ids=x.input_ids[None, :bucket], position_ids=x.position_ids[None, :bucket],
            attention_mask=self._mask, use_cache=False, logits_to_keep=0,
            **{META_KWARG: x.metadata(bucket), CACHE_KWARG: self.kv_cache, BACKEND_KWARG: self.backend},
        )
        logits: torch.Tensor = out.logits[0]
        return logits

    @torch.inference_mode()
    def capture(self, warmup: int = 2) -> None:
        """Capture every bucket, largest first, into one shared memory pool (start-up, once).

        Padding-only inputs (slot ``-1``) are used, so capture writes nothing to the KV cache. Each bucket
        first runs ``warmup`` eager forwards on a side stream (Triton compiles its kernels there).

        Raises:
            RuntimeError: not on CUDA, or from CUDA when the forward is not capturable.
        """
        if self.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, the KV cache is on {self.device}")
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        # torch.cuda.graph's default capture stream is created once per process, on the device current
        # at its first use: an engine on another device of the same process must capture on its own
        # stream (seen on 2×H200: "operation not permitted when stream is capturing" for cuda:1)
        capture_stream = torch.cuda.Stream(self.device)
        for bucket in reversed(self.buckets):
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    self.forward(bucket)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=capture_stream):
                self._outputs[bucket] = self.forward(bucket)
            self._graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - started
        logger.info("captured decode CUDA graphs for batch sizes %s in %.2f s", self.buckets,
                    self.capture_seconds)

    def run(self, token_ids: Sequence[int], positions: Sequence[int],
            block_tables: Sequence[list[int]], device_token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step of ``n`` sequences (arguments as ``StaticDecodeInputs.fill``).

        ``device_token_ids`` (int64 ``[n]`` on the device, e.g. the previous step's argmax: asynchronous
        scheduling, engine/async_step.py) replaces ``token_ids`` in ``input_ids``, copied on the device after
        the fill's host-to-device copy, in stream order.

        Returns:
            Logits ``[n, vocab]`` (model dtype): a view of the graph's static output, valid until the next
            ``run``. Replays the bucket's graph when captured, else runs ``forward`` eagerly.

        Raises:
            ValueError: no bucket holds ``n`` sequences, bad inputs (see ``fill``) or ``device_token_ids``
                of another shape.
        """
        n = len(token_ids)
        bucket = bucket_for(n, self.buckets)
        if bucket is None:
            raise ValueError(f"{n} sequences exceed the largest decode graph bucket {self.buckets[-1]}")
        if device_token_ids is not None and device_token_ids.shape != (n,):
            raise ValueError(f"device_token_ids {tuple(device_token_ids.shape)} must be [{n}]")
        self.inputs.fill(token_ids, positions, block_tables, bucket)
        if device_token_ids is not None:
            self.inputs.input_ids[:n].copy_(device_token_ids)
        graph = self._graphs.get(bucket)
        if graph is None:
            return self.forward(bucket)[:n]
        graph.replay()
        return self._outputs[bucket][:n]
