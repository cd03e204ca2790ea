"""Prefill attention over the paged KV cache through cuDNN's fused attention (the cuDNN frontend's graph
API, package ``nvidia-cudnn-frontend``): the Hopper kernels (wgmma, TMA, warp specialisation) for the
steps whose queries attend over a long KV, which the paged Triton kernel (engine/ops/paged_prefill.py)
runs at 280-370 TFLOP/s on an H200.

What one graph computes is ``paged_prefill_attention`` for sequences ``seq_offset .. S-1`` of a packed
step (same arguments, same bottom-right causal mask: new token ``j`` of a sequence with ``n`` new tokens
and ``L`` tokens of KV sees positions ``<= L - n + j``), read straight from the cache pages
(``paged_attention_k_table``: the engine's block tables, ``[num_blocks, block_size, Hkv, D]`` pages, no
gather); the plain-torch reference is ``paged_prefill_attention_reference``. The query and output rows
are ragged (one offset per sequence), the lengths come from device tensors (``use_padding_mask`` with
per-sequence query and KV lengths), so one built graph serves every step whose sequence count, longest
query and longest KV fit its bucket (``PagedGraphKey``: powers of two); sequences past the step's count
have length 0. Padding the lengths costs nothing measurable on an H200, so the backend sizes them to
the engine's token budget and ``max_model_len``; padding the sequence count to 256 costs tens of
microseconds, so counts are bucketed. cuDNN builds a graph in ~50 ms on an H200, so
``warm_paged_prefill_graphs`` builds the buckets a worker can meet before it reports ready.

On an H200 (docs/benchmarks/engine.md) it takes 0.68-0.87x the Triton kernel's time on the benchmark's
cases; the engine uses it from ``CUDNN_PAGED_MIN_KV`` tokens of KV on, where the gain was measured
first (a step's longest sequence, decode rows included). A fresh long prompt keeps the dense cuDNN path
(engine/ops/cudnn_attention.py), faster still.

Determinism: cuDNN's forward has no atomics, so a given step shape gives the same bits run after run (a
GPU test checks it); the bits differ from the Triton kernel's, so the choice depends only on the step's
shape, and a prefill grid (``SchedulerConfig.prefill_grid``) computes each chunk the same way whether its
prefix came from the cache or not.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("pdserve.engine")

# a step's prefill sequences go through cuDNN when its longest sequence (decode rows included) has this
# many tokens of KV
CUDNN_PAGED_MIN_KV = 2048
_MIN_QUERY_BUCKET = 128  # smallest query-length bucket (tokens)
_MAX_OFFSET = 2 ** 31  # the ragged offsets are int32 element indices
_UIDS = {"q": 1, "k": 2, "v": 3, "o": 4, "seq_len_q": 5, "seq_len_kv": 6, "page_table": 7, "q_offsets": 8,
         "o_offsets": 9, "scale": 10}


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class PagedGraphKey:
    """What a built graph is specialised on: the device, dtype, heads and head size, the cache's pages
    (count, tokens per page, strides), and the bucket: ``batch`` sequences, queries of up to
    ``max_query_len`` and KVs of up to ``max_seq_len`` tokens (each a power of two). Queries are given
    ``[T, H, D]``-contiguous and the softmax scale at run time, so neither is part of the key."""

    device_index: int
    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    cache_strides: tuple[int, ...]
    batch: int
    max_query_len: int
    max_seq_len: int

    @property
    def pages(self) -> int:
        """Block-table width of the bucket: pages of ``block_size`` tokens covering ``max_seq_len``."""
        return -(-self.max_seq_len // self.block_size)


def paged_graph_key(q: torch.Tensor, k_cache: torch.Tensor, num_seqs: int, max_query_len: int,
                    max_seq_len: int) -> PagedGraphKey:
    """The bucket of a step with ``num_seqs`` prefill sequences (``q [T, H, D]``, ``k_cache [num_blocks,
    block_size, Hkv, D]``): each count and length rounded up to a power of two (queries to at least
    ``_MIN_QUERY_BUCKET``, KVs to at least one page)."""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    index = q.device.index if q.device.index is not None else -1
    if index < 0 and q.is_cuda:
        index = torch.cuda.current_device()
    return PagedGraphKey(
        device_index=index, dtype=q.dtype, heads=q.shape[1], kv_heads=kv_heads, head_dim=head_dim,
        num_blocks=num_blocks, block_size=block_size, cache_strides=tuple(k_cache.stride()),
        batch=_pow2(num_seqs),
        max_query_len=max(_MIN_QUERY_BUCKET, _pow2(max_query_len)),
        max_seq_len=max(block_size, _pow2(max_seq_len)))


@functools.cache
def frontend_available() -> bool:
    """The cuDNN frontend package (``nvidia-cudnn-frontend``, import name ``cudnn``) is installed."""
    return importlib.util.find_spec("cudnn") is not None


@functools.cache
def _hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def frontend_missing_on(device: torch.device, q_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the paged cuDNN path would serve a worker with these dtypes on ``device`` (a Hopper-or-newer
    CUDA device, a float16/bfloat16 cache of the queries' dtype, outside the Triton interpreter) but for
    the cuDNN frontend package, which is not installed."""
    if device.type != "cuda" or q_dtype not in (torch.float16, torch.bfloat16) or cache_dtype != q_dtype:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1" or frontend_available():
        return False
    return _hopper(device.index if device.index is not None else torch.cuda.current_device())


def paged_prefill_usable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         max_seq_len: int) -> bool:
    """Whether a step's prefill sequences may go through ``cudnn_paged_prefill``: a float16/bfloat16 ``q``
    on a Hopper-or-newer CUDA device, K and V caches of the same dtype (an FP8 cache stays on the Triton
    kernel, which dequantizes) and strides, unit last strides, fewer than 2**31 query elements (the
    graph's offsets are int32), a step whose longest sequence has at least ``CUDNN_PAGED_MIN_KV`` tokens
    (``max_seq_len``), outside the Triton interpreter, with the frontend installed. Python ints only: no
    device read."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == q.dtype
            and max_seq_len >= CUDNN_PAGED_MIN_KV and q.stride(2) == 1 and k_cache.stride(3) == 1
            and v_cache.dtype == k_cache.dtype and v_cache.stride() == k_cache.stride()
            and q.numel() < _MAX_OFFSET):
        return False
    if os.environ.get("TRITON_INTERPRET") == "1" or not frontend_available():
        return False
    return _hopper(q.device.index if q.device.index is not None else torch.cuda.current_device())


class PagedPrefillGraph:
    """One built cuDNN graph (``key``'s bucket) and its workspace.

    Raises (constructor):
        RuntimeError: cuDNN cannot build or support the graph (the message says why). Errors the frontend
            raises while the graph is described (a library that fails to load, an attribute it refuses)
            propagate as raised; ``paged_prefill_graph`` catches any of them.
    """

    def __init__(self, key: PagedGraphKey) -> None:
        import cudnn

        self.key = key
        self._cudnn = cudnn
        self.handle = _handle(key.device_index)
        io = cudnn.data_type.BFLOAT16 if key.dtype == torch.bfloat16 else cudnn.data_type.HALF
        b, h, hkv, d = key.batch, key.heads, key.kv_heads, key.head_dim
        sq, pages = key.max_query_len, key.pages
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)

        def tensor(name: str, dim: tuple[int, ...], stride: tuple[int, ...], dtype: Any = io,
                   ragged: Any = None) -> Any:
            t = g.tensor(name=name, dim=dim, stride=stride, data_type=dtype, ragged_offset=ragged)
            t.set_uid(_UIDS[name])
            return t

        int32, one = cudnn.data_type.INT32, (1, 1, 1, 1)
        q_offsets = tensor("q_offsets", (b + 1, 1, 1, 1), one, int32)
        o_offsets = tensor("o_offsets", (b + 1, 1, 1, 1), one, int32)
        q = tensor("q", (b, h, sq, d), (sq * h * d, d, h * d, 1), ragged=q_offsets)
        # pages [num_blocks, block_size, Hkv, D] seen as [num_blocks, Hkv, block_size, D]
        s0, s1, s2, _ = key.cache_strides
        k = tensor("k", (key.num_blocks, hkv, key.block_size, d), (s0, s2, s1, 1))
        v = tensor("v", (key.num_blocks, hkv, key.block_size, d), (s0, s2, s1, 1))
        seq_len_q = tensor("seq_len_q", (b, 1, 1, 1), one, int32)
        seq_len_kv = tensor("seq_len_kv", (b, 1, 1, 1), one, int32)
        table = tensor("page_table", (b, 1, pages, 1), (pages, pages, 1, 1), int32)
        scale = g.tensor(name="scale", dim=one, stride=one, data_type=cudnn.data_type.FLOAT,
                         is_pass_by_value=True)
        scale.set_uid(_UIDS["scale"])
        o, _ = g.sdpa(name="sdpa", q=q, k=k, v=v, is_inference=True, attn_scale=scale,
                      use_padding_mask=True, seq_len_q=seq_len_q, seq_len_kv=seq_len_kv,
                      use_causal_mask_bottom_right=True, paged_attention_k_table=table,
                      paged_attention_v_table=table, paged_attention_max_seq_len_kv=key.max_seq_len)
        o.set_output(True).set_dim((b, h, sq, d)).set_stride((sq * h * d, d, h * d, 1))
        o.set_ragged_offset(o_offsets).set_uid(_UIDS["o"])
        try:
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()
        except Exception as exc:  # cudnn raises its own error types; the caller falls back
            raise RuntimeError(f"cuDNN cannot build paged prefill attention for {key}: {exc}") from exc
        self.graph = g
        self.workspace = torch.empty(g.get_workspace_size(), dtype=torch.uint8,
                                     device=torch.device("cuda", key.device_index))

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, inputs: PagedPrefillInputs,
            out: torch.Tensor) -> None:
        """Attend ``q``'s rows into ``out``'s (both ``[T', H, D]``-contiguous, starting at the step's first
        prefill token, see ``PagedPrefillInputs``) on the current stream."""
        self._cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
        pack = {_UIDS["q"]: q, _UIDS["k"]: k_cache, _UIDS["v"]: v_cache, _UIDS["o"]: out,
                _UIDS["seq_len_q"]: inputs.seq_len_q, _UIDS["seq_len_kv"]: inputs.seq_len_kv,
                _UIDS["page_table"]: inputs.page_table, _UIDS["q_offsets"]: inputs.q_offsets,
                _UIDS["o_offsets"]: inputs.o_offsets, _UIDS["scale"]: inputs.scale}
        self.graph.execute(pack, self.workspace, handle=self.handle)


@functools.cache
def _handle(device_index: int) -> Any:
    import cudnn

    with torch.cuda.device(device_index):
        return cudnn.create_handle()


_graphs: dict[PagedGraphKey, PagedPrefillGraph | None] = {}  # None: cuDNN refused this bucket


def paged_prefill_graph(key: PagedGraphKey, warming: bool = False) -> PagedPrefillGraph | None:
    """The graph of ``key``, built at its first use; None where cuDNN cannot run it (logged once at
    WARNING; the caller stays on the Triton kernel). A build outside the warm-up (``warming`` False) is a
    first-use stall on the serving path: logged at WARNING with the seconds it took."""
    if key in _graphs:
        return _graphs[key]
    start = time.monotonic()
    try:
        graph: PagedPrefillGraph | None = PagedPrefillGraph(key)
    except Exception as exc:  # the frontend's own error types (and a library that fails to load): fall back
        log.warning("cudnn_paged_prefill_unsupported error=%s", exc)
        graph = None
    _graphs[key] = graph
    if graph is not None:
        log.log(logging.DEBUG if warming else logging.WARNING,
                "cudnn_paged_prefill_graph_built batch=%d max_query_len=%d max_seq_len=%d seconds=%.3f",
                key.batch, key.max_query_len, key.max_seq_len, time.monotonic() - start)
    return graph


@dataclass(frozen=True)
class PagedPrefillInputs:
    """One step's device inputs to a graph of bucket ``key`` (built once per step, read by every layer):
    int32 ``[b + 1, 1, 1, 1]`` element offsets of each sequence's first query row in ``q`` and in ``out``
    (``q`` and ``out`` start at the step's first prefill token), int32 ``[b, 1, 1, 1]`` query and KV
    lengths (0 past the step's sequences), int32 ``[b, 1, pages, 1]`` block tables (0-padded), and the
    softmax scale (float32 ``[1, 1, 1, 1]`` on the host, passed by value)."""

    key: PagedGraphKey
    q_offsets: torch.Tensor
    o_offsets: torch.Tensor
    seq_len_q: torch.Tensor
    seq_len_kv: torch.Tensor
    page_table: torch.Tensor
    scale: torch.Tensor


def paged_prefill_inputs(key: PagedGraphKey, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         query_start_loc: torch.Tensor, seq_offset: int, first_token: int,
                         scale: float) -> PagedPrefillInputs:
    """``PagedPrefillInputs`` for sequences ``seq_offset .. S-1`` of a step (its ``AttentionMetadata``
    tensors), whose first query token is row ``first_token`` of the step (torch ops on the device, no
    host read).

    Raises:
        ValueError: more sequences, or a wider block table, than ``key``'s bucket holds.
    """
    starts = query_start_loc[seq_offset:].to(torch.int32) - first_token  # [n + 1]
    n = starts.shape[0] - 1
    pages = key.pages
    if n > key.batch or block_tables.shape[1] > pages:
        raise ValueError(f"{n} sequences / {block_tables.shape[1]} pages do not fit the bucket {key}")
    dev = block_tables.device
    offsets = torch.empty(key.batch + 1, dtype=torch.int32, device=dev)
    offsets[: n + 1] = starts
    offsets[n + 1:] = starts[-1:]
    lengths = torch.zeros(key.batch, dtype=torch.int32, device=dev)
    lengths[:n] = starts[1:] - starts[:-1]
    kv = torch.zeros(key.batch, dtype=torch.int32, device=dev)
    kv[:n] = seq_lens[seq_offset:]
    table = torch.zeros(key.batch, pages, dtype=torch.int32, device=dev)
    table[:n, : block_tables.shape[1]] = block_tables[seq_offset:]
    ragged = (offsets * (key.heads * key.head_dim)).view(-1, 1, 1, 1)
    return PagedPrefillInputs(
        key=key, q_offsets=ragged, o_offsets=ragged, seq_len_q=lengths.view(-1, 1, 1, 1),
        seq_len_kv=kv.view(-1, 1, 1, 1), page_table=table.view(key.batch, 1, pages, 1),
        scale=torch.full((1, 1, 1, 1), float(scale), dtype=torch.float32))


def cudnn_paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        inputs: PagedPrefillInputs, out: torch.Tensor, first_token: int) -> bool:
    """Attention of the step's prefill sequences (``inputs``) through cuDNN into ``out``'s rows from
    ``first_token`` on; False (nothing written) where cuDNN refused ``inputs.key``'s bucket.

    Args:
        q: ``[T, H, D]`` queries of the whole step (unit last stride; rows copied together when they are
            not contiguous); k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` (same strides), ``q``'s
            dtype, the new tokens' K/V already stored; out: ``[T, H, D]`` contiguous.
    """
    graph = paged_prefill_graph(inputs.key)
    if graph is None:
        return False
    graph.run(q[first_token:].contiguous(), k_cache, v_cache, inputs, out[first_token:])
    return True


def warm_paged_prefill_graphs(q_probe: torch.Tensor, k_cache: torch.Tensor, max_seqs: int,
                              max_query_len: int, max_seq_len: int, warn_missing: bool = True) -> int:
    """Build the graphs of every sequence-count bucket (1, 2, 4, .. up to ``max_seqs``) for queries of up
    to ``max_query_len`` and KVs of up to ``max_seq_len`` tokens (the engine's token budget and
    ``max_model_len``: one bucket each, the lengths being free to pad), for queries like ``q_probe``
    (``[1, H, D]``: device, dtype, heads). Returns the number of graphs built or found (0 where
    ``paged_prefill_usable`` would never take the path; logs a warning where only the frontend package is
    missing for it, unless ``warn_missing`` is False: the tensor parallel ranks past the first, so a worker
    says it once)."""
    if max_seq_len < CUDNN_PAGED_MIN_KV:
        return 0
    if frontend_missing_on(q_probe.device, q_probe.dtype, k_cache.dtype):
        if not warn_missing:
            return 0
        log.warning("cudnn_frontend_missing: the cuDNN frontend (package nvidia-cudnn-frontend, in the gpu "
                    "extra: pip install 'pdserve[gpu]') is not installed, so prefill over a KV of %d tokens "
                    "or more runs on the slower Triton kernel", CUDNN_PAGED_MIN_KV)
        return 0
    if not paged_prefill_usable(q_probe, k_cache, k_cache, max_seq_len):
        return 0
    count, seqs = 0, 1
    while seqs <= _pow2(max_seqs):  # 1, 2, 4, .. the power of two at or above max_seqs
        key = paged_graph_key(q_probe, k_cache, seqs, max_query_len, max_seq_len)
        count += paged_prefill_graph(key, warming=True) is not None
        seqs *= 2
    return count
