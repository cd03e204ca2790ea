"""Engine configuration: frozen dataclasses shared by the scheduler, the KV cache and the model runner.

Each config validates itself in ``__post_init__`` and raises ``ValueError`` naming the bad field.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_LOAD_FORMATS = ("auto", "dummy")
_BACKENDS = ("auto", "torch", "triton", "flash_attn")
_FUSED_OPS = ("auto", "on", "off")
_QUANTIZATION = (None, "fp8")
_KV_CACHE_DTYPES = ("auto", "fp8")
CPU_KV_BYTES = 1 << 30  # the memory a KV cache on the CPU is sized from (x --kv-memory-fraction)
# bytes per K/V element of the cache on the CPU by --dtype (auto: float32 there, engine.models.loader)
_CPU_ELEMENT_BYTES = {"auto": 4, "float32": 4, "bfloat16": 2, "float16": 2}


def flash_attn_available() -> bool:
    """True when the ``flash_attn`` package can be imported (nothing is imported)."""
    return importlib.util.find_spec("flash_attn") is not None


def attention_backend_problem(name: str, device: str) -> str | None:
    """Why attention backend ``name`` cannot run on ``device`` (``cpu``, ``cuda``, ``cuda:N``), or None
    (no torch: ``pdserve up`` asks before starting workers, ``engine.attention.get_backend`` when building
    one). ``triton`` needs CUDA, or Triton's interpreter (``TRITON_INTERPRET=1`` in the environment);
    ``flash_attn`` needs CUDA and the ``flash_attn`` package; ``auto`` and ``torch`` run anywhere."""
    on_cuda = device.split(":")[0] == "cuda"
    if name == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return f"triton backend needs CUDA (or TRITON_INTERPRET=1), got device {device}"
    if name == "flash_attn" and not on_cuda:
        return f"flash_attn backend needs CUDA, got device {device}"
    if name == "flash_attn" and not flash_attn_available():
        return "flash_attn backend requested but the flash_attn package is not installed"
    return None


def kv_capacity_problem(max_model_len: int | None, num_blocks: int, block_size: int,
                        memory_fraction: float | None = None) -> str | None:
    """Why an explicit ``--max-model-len`` does not fit a KV cache of ``num_blocks`` blocks of
    ``block_size`` tokens (one sequence's KV must fit one worker's cache), or None (also when
    ``max_model_len`` is None: the engine then takes the capacity as its limit). ``memory_fraction``:
    None when the block count was given (``--num-blocks``), else the ``--kv-memory-fraction`` it was
    sized from. Shared by ``pdserve up`` (before any process starts, when ``--num-blocks`` is given) and
    the model runner (once the KV cache is sized); imports no torch."""
    capacity = num_blocks * block_size
    if max_model_len is None or max_model_len <= capacity:
        return None
    if memory_fraction is None:
        blocks, fix = f"--num-blocks {num_blocks}", "raise --num-blocks"
    else:
        blocks = f"{num_blocks} blocks sized from --kv-memory-fraction {memory_fraction:g}"
        fix = "raise --kv-memory-fraction or give --num-blocks"
    return (f"--max-model-len {max_model_len} exceeds the KV cache's capacity of {capacity} tokens "
            f"({blocks} x --block-size {block_size}; one sequence's KV must fit a worker's cache): lower "
            f"--max-model-len or {fix}")


def kv_block_problem(block_size: int, max_model_len: int | None, config: Mapping[str, Any], device: str, *,
                     dtype: str = "auto", kv_cache_dtype: str = "auto", memory_fraction: float = 0.9,
                     num_blocks: int | None = None, tensor_parallel_size: int = 1) -> str | None:
    """Why KV blocks of ``--block-size`` ``block_size`` tokens cannot serve the model of HF config
    ``config`` (its ``config.json`` as a dict) on ``device`` (``cpu``, ``cuda``, ``cuda:N``), known
    before any weight is read, or None. A block longer than the longest sequence (``max_model_len``, else
    the config's ``max_position_embeddings``) could never be filled: a block holds one sequence's tokens.
    On the CPU, with the block count sized from memory (``num_blocks`` None), one block must fit the
    cache's budget, ``CPU_KV_BYTES`` x ``memory_fraction`` (``KVCachePool.fit_num_blocks``; on CUDA the
    budget is the free memory at start, unknown here). A count the dict lacks is not checked. Shared by
    ``pdserve up`` (before any process starts) and the workers (before loading weights); imports no
    torch."""
    limit = max_model_len or config.get("max_position_embeddings")
    if isinstance(limit, int) and block_size > limit:
        longest = (f"--max-model-len {limit}" if max_model_len
                   else f"the model's max_position_embeddings ({limit})")
        return (f"--block-size {block_size} exceeds {longest}: a KV block holds one sequence's tokens, so "
                f"it could never be filled; use at most {limit}")
    if device != "cpu" or num_blocks is not None:
        return None
    layers, heads = config.get("num_hidden_layers"), config.get("num_attention_heads")
    hidden = config.get("hidden_size")
    head_dim = config.get("head_dim")
    if not head_dim and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        head_dim = hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    if not all(isinstance(n, int) and n > 0 for n in (layers, kv_heads, head_dim)):
        return None
    assert isinstance(layers, int) and isinstance(kv_heads, int) and isinstance(head_dim, int)
    element = 1 if kv_cache_dtype == "fp8" else _CPU_ELEMENT_BYTES.get(dtype, 4)
    per_token = layers * 2 * max(kv_heads // max(1, tensor_parallel_size), 1) * head_dim * element
    budget = int(CPU_KV_BYTES * memory_fraction)
    if block_size * per_token <= budget:
        return None
    return (f"--block-size {block_size}: one KV block takes {block_size * per_token} bytes ({per_token} per "
            f"token), more than the KV cache budget on the CPU, {budget} bytes (--kv-memory-fraction "
            f"{memory_fraction:g} of {CPU_KV_BYTES >> 30} GiB); at most {budget // per_token} tokens per "
            "block fit")


@dataclass(frozen=True)
class CacheConfig:
    """KV cache shape and prefix caching.

    ``block_size`` is in tokens per block; ``num_blocks`` is an explicit block count (else sized from
    ``memory_fraction`` of free device memory, or of ``cpu_kv_bytes`` bytes on CPU).
    ``host_kv_bytes``: the budget (bytes) of the host-memory KV tier evicted prefix blocks are saved to
    and restored from (engine/kv_host_tier.py; pinned memory beside a CUDA device, plain memory beside a
    CPU one); 0, the default: no tier. Needs ``enable_prefix_caching``.
    ``kv_cache_dtype``: ``"auto"`` stores K/V in the model's dtype; ``"fp8"`` in ``float8_e4m3fn`` (one
    byte per element, so twice the blocks of bf16 in the same memory) with a static per-layer K and V
    scale of 1.0 (``engine.kv_cache``); needs the ``triton`` or ``torch`` attention backend.
    """

    block_size: int = 16
    num_blocks: int | None = None
    memory_fraction: float = 0.9
    cpu_kv_bytes: int = CPU_KV_BYTES
    enable_prefix_caching: bool = True
    host_kv_bytes: int = 0
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 token, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 or None, got {self.num_blocks}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.cpu_kv_bytes < 1:
            raise ValueError(f"cpu_kv_bytes must be >= 1 byte, got {self.cpu_kv_bytes}")
        if self.host_kv_bytes < 0:
            raise ValueError(f"host_kv_bytes must be >= 0 bytes (0: no host tier), got {self.host_kv_bytes}")
        if self.host_kv_bytes and not self.enable_prefix_caching:
            raise ValueError("host_kv_bytes (--kv-host-cache-gib) needs enable_prefix_caching "
                             "(--enable-prefix-caching true; on a decode worker also --decode-prefix-reuse "
                             "true): the host tier holds blocks evicted from the prefix cache")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {_KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits per step: ``max_num_seqs`` running sequences, ``max_num_batched_tokens`` tokens.

    With ``enable_chunked_prefill`` a prompt larger than the remaining token budget is split across steps;
    without it such a prompt waits until it fits whole. ``async_scheduling``: decode-only steps through
    the decode CUDA graphs whose rows sample on the device (greedy or seeded; no logprobs or penalties)
    launch their successor before their own tokens reach the host
    (engine/async_step.py).

    ``prefill_grid`` (tokens; 0: off): the deterministic prefix-cache mode. Every prefill is cut at the
    absolute positions that are multiples of ``prefill_grid`` and a sequence computes at most one such
    grid chunk per step (a chunk is scheduled whole or waits for a later step); a prefix-cache hit is
    rounded down to a multiple of ``prefill_grid``; and only the KV of whole grid chunks computed by a
    prefill step (``prefill_grid`` tokens in one forward) is registered in the prefix cache (not the
    prompt's last partial chunk, not tokens computed one at a time by decode steps). So chunk ``i`` of a
    token sequence is computed from the same inputs (its tokens, the KV of chunks ``0..i-1``), with the
    same GEMM shapes and the same attention kernel reading the earlier chunks through the paged cache,
    whether those chunks came from the prefix cache or were computed in this request.

    The guarantee: a request's KV, logits, logprobs and greedy tokens are bit-identical with and without
    a prefix-cache hit when each of its steps runs the same other sequences beside it, e.g. when the
    request runs alone (same model, dtype, device, attention backend and ``prefill_grid``). Sequences
    packed into the same step change every GEMM's row count M, so under concurrent load the bits can
    differ exactly as they can without a cache hit (batch-invariant GEMMs would be needed to promise
    more). The cost: a prompt of L tokens takes ``ceil(L / prefill_grid)`` steps instead of
    ``ceil(L / max_num_batched_tokens)``, up to ``prefill_grid - 1`` more tokens are recomputed per
    hit, and output tokens' KV (decoded one at a time) is never reused (bench/engine/prefix_grid.py,
    docs/benchmarks/README.md). Must be a multiple of ``CacheConfig.block_size`` (``EngineConfig``
    checks), at least 2, at most ``max_num_batched_tokens`` (so a chunk fits an empty step), and needs
    ``enable_chunked_prefill``.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    async_scheduling: bool = True
    prefill_grid: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1 token, got {self.max_num_batched_tokens}")
        if self.prefill_grid:
            if not 2 <= self.prefill_grid <= self.max_num_batched_tokens:
                raise ValueError(f"prefill_grid must be 0 (off) or in [2, max_num_batched_tokens="
                                 f"{self.max_num_batched_tokens}] tokens, got {self.prefill_grid}")
            if not self.enable_chunked_prefill:
                raise ValueError("prefill_grid needs enable_chunked_prefill: it cuts prefills into grid "
                                 "chunks")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how: path or alias, dtype, weight format, device, attention backend.

    ``enforce_eager``: never use CUDA graphs (by default decode-only steps replay graphs captured at
    start-up when on CUDA with the ``triton`` backend; see ``engine.cuda_graphs``).
    ``fused_ops``: the forward with merged QKV / gate-up GEMMs and fused RMSNorm, rotary and SiLU kernels
    (``engine.models.fused_model``): ``auto`` = on a CUDA device when the architecture is supported,
    ``on`` = always (torch reference ops off CUDA; an unsupported model is an error), ``off`` = transformers'
    own modules.
    ``quantization``: ``"fp8"`` quantizes a bf16/fp16/fp32 checkpoint's decoder projections to FP8 per output
    feature on load (``engine.models.quant_config``; an FP8 checkpoint is FP8 without it); None: as stored.
    ``pdl``: launch the Triton kernels with programmatic dependent launch on Hopper and newer GPUs, so each
    kernel's launch overlaps the tail of the one before it (``engine.ops.pdl``; no effect elsewhere).
    """

    model: str
    dtype: str = "auto"
    load_format: str = "auto"
    max_model_len: int | None = None
    device: str = "auto"
    attention_backend: str = "auto"
    seed: int = 0
    enforce_eager: bool = False
    fused_ops: str = "auto"
    pdl: bool = True
    quantization: str | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a non-empty path or alias")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {_LOAD_FORMATS}, got {self.load_format!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 tokens or None, got {self.max_model_len}")
        if self.quantization not in _QUANTIZATION:
            raise ValueError(f"quantization must be one of {_QUANTIZATION}, got {self.quantization!r}")
        if self.fused_ops not in _FUSED_OPS:
            raise ValueError(f"fused_ops must be one of {_FUSED_OPS}, got {self.fused_ops!r}")
        if self.attention_backend not in _BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {_BACKENDS}, got {self.attention_backend!r}"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: ``tensor_parallel_size`` processes share one model, one device each
    (``engine.models.tensor_parallel``, ``engine.tp_executor``).

    ``force_distributed``: at ``tensor_parallel_size=1`` still initialise ``torch.distributed`` (NCCL on
    CUDA, gloo on the CPU) and run the tensor-parallel forward with its collectives, to compare that path
    with the plain one; at 1 without it no ``torch.distributed`` is used.
    ``timeout_s``: how long a rank waits for the others to join and in every collective of the forward
    (a follower waits for rank 0's next step up to ``engine.distributed.IDLE_TIMEOUT_S``: an idle engine
    sends none; a rank that exits fails its peers' waits at once).
    """

    tensor_parallel_size: int = 1
    force_distributed: bool = False
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s}")

    @property
    def distributed(self) -> bool:
        """True when the ranks use ``torch.distributed`` (several ranks, or forced at one)."""
        return self.tensor_parallel_size > 1 or self.force_distributed


@dataclass(frozen=True)
class EngineConfig:
    """The configs of one engine instance (``parallel``: one rank, no ``torch.distributed``, by default).

    Raises:
        ValueError: ``scheduler.prefill_grid`` that is not a multiple of ``cache.block_size``.
    """

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig = ParallelConfig()

    def __post_init__(self) -> None:
        grid, block_size = self.scheduler.prefill_grid, self.cache.block_size
        if grid % block_size:
            raise ValueError(f"prefill_grid={grid} tokens must be a multiple of block_size={block_size}")
