"""Worker set-up helpers: settings → ``EngineConfig``, the KV pairing record, KV handle encoding.

Kept free of torch at import time (``EngineCore`` is passed in, not built here).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    kv_block_problem,
    kv_capacity_problem,
)
from engine.models.context_limits import context_problem
from engine.models.registry import max_model_len_problem, tensor_parallel_problem

if TYPE_CHECKING:
    from engine.engine_core import EngineCore
    from kvtransfer.compat import KVCompat
    from kvtransfer.types import KVHandle
    from protocol.settings import WorkerSettings


def engine_config_from_settings(settings: WorkerSettings) -> EngineConfig:
    """The engine config of a worker: model, KV cache (``block_size`` tokens, ``num_blocks`` or
    ``kv_memory_fraction``, ``kv_cache_dtype``; the prefix cache on unless ``enable_prefix_caching`` is
    off, and never on a decode worker without ``decode_prefix_reuse``; the host KV tier's
    ``kv_host_cache_gib``), scheduler limits and prefill grid, and tensor parallel size. Raises
    ``ValueError`` naming a bad value."""
    return EngineConfig(
        ModelConfig(settings.model, dtype=settings.dtype, device=settings.device,
                    attention_backend=settings.attention_backend, enforce_eager=settings.enforce_eager,
                    load_format=settings.load_format, fused_ops=settings.fused_ops,
                    pdl=settings.pdl, max_model_len=settings.max_model_len,
                    quantization=settings.quantization),
        CacheConfig(block_size=settings.block_size, num_blocks=settings.num_blocks,
                    memory_fraction=settings.kv_memory_fraction, kv_cache_dtype=settings.kv_cache_dtype,
                    enable_prefix_caching=settings.enable_prefix_caching
                    and (settings.role != "decode" or settings.decode_prefix_reuse),
                    host_kv_bytes=int(settings.kv_host_cache_gib * (1 << 30))),
        SchedulerConfig(max_num_seqs=settings.max_num_seqs,
                        max_num_batched_tokens=settings.max_num_batched_tokens,
                        prefill_grid=settings.prefill_grid,
                        async_scheduling=settings.async_scheduling),
        ParallelConfig(tensor_parallel_size=settings.tensor_parallel_size),
    )


def model_config_problem(settings: WorkerSettings, config: Mapping[str, Any], device: str,
                         model: str) -> str | None:
    """Why a worker with ``settings`` cannot serve the model named ``model`` whose ``config.json`` is
    ``config`` on ``device`` (``cpu``, ``cuda``, ``cuda:N``), found from the config alone, before any
    weight is read (one line naming the flag), or None: a ``--max-model-len`` beyond the model's
    ``max_position_embeddings`` (``max_model_len_problem``) or its sliding window or LongRoPE's original
    context (``context_problem``), a model ``--tensor-parallel-size`` ranks cannot split
    (``tensor_parallel_problem``), a ``--max-model-len`` beyond the KV cache of an explicit
    ``--num-blocks`` (``kv_capacity_problem``), or a ``--block-size`` no block of which could be filled or
    fit the KV budget on the CPU (``kv_block_problem``). Shared by ``pdserve up`` (before any child
    starts) and each worker (before loading weights)."""
    raw = dict(config)
    if (why := max_model_len_problem(settings.max_model_len, raw)) is not None:
        return f"--max-model-len {settings.max_model_len}: {why}"
    if (why := context_problem(raw, settings.max_model_len)) is not None:
        return f"--model {model}: {why} (--max-model-len)"
    size = settings.tensor_parallel_size
    if size > 1 and (why := tensor_parallel_problem(raw, size, "--tensor-parallel-size")) is not None:
        return f"--model {model}: {why}"
    if settings.num_blocks is not None and (
            why := kv_capacity_problem(settings.max_model_len, settings.num_blocks, settings.block_size)):
        return why
    return kv_block_problem(settings.block_size, settings.max_model_len, raw, device, dtype=settings.dtype,
                            kv_cache_dtype=settings.kv_cache_dtype,
                            memory_fraction=settings.kv_memory_fraction, num_blocks=settings.num_blocks,
                            tensor_parallel_size=size)


def compat_of(core: EngineCore, model: str, transfer_backend: str) -> KVCompat:
    """The KV pairing record of a worker running `model` over `transfer_backend` ("none": it moves no
    KV) with the engine's KV cache, as its tensor parallel rank (rank 0 in the worker's process): what a
    peer must match (kvtransfer.compat)."""
    from kvtransfer.compat import kv_compat
    from kvtransfer.staging import layout_of

    runner = core.runner
    cfg = runner.hf_config
    total = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    return kv_compat(model, transfer_backend, layout_of(runner.kv_cache.kv_buffer), runner.tp.size,
                     runner.tp.rank, prefill_grid=core.config.scheduler.prefill_grid, total_kv_heads=total)


def default_transport_env(host: str = "127.0.0.1") -> None:
    """UCX settings of a worker whose peers reach it at ``host`` (its ``--advertise-host``, else its
    ``--host``): no warning about unused variables, and, unless ``UCX_NET_DEVICES`` is set already, UCX's
    network devices follow that address (``net_device_of``): a loopback address keeps UCX's TCP on
    loopback (one host; facts.md), another address puts it on the interface that holds the address (so
    the KV crosses between hosts where the worker said it can be reached), and a wildcard address leaves
    UCX its own choice."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if "UCX_NET_DEVICES" not in os.environ:
        device = net_device_of(host)
        if device is not None:
            os.environ["UCX_NET_DEVICES"] = device


def net_device_of(host: str) -> str | None:
    """The network interface that holds ``host``'s address (a name or an IP literal): "lo" for a loopback
    address; None for a wildcard address (0.0.0.0, ::), a name that does not resolve, or an address no
    local interface holds."""
    import ipaddress
    import socket

    import psutil

    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return None
    for *_, sockaddr in infos:
        address = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
        if address.is_unspecified:
            return None
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address.split("%")[0] == str(address) for a in addrs):
                return name
        if address.is_loopback:
            return "lo"
    return None


def encode_handle(handle: KVHandle) -> bytes:
    """msgpack bytes of a kvtransfer ``KVHandle`` (the opaque ``KVReserved.kv_handle``)."""
    return msgspec.msgpack.encode(handle)


def decode_handle(data: bytes) -> KVHandle:
    """Inverse of :func:`encode_handle`. Raises ``ValueError`` when the bytes are not a ``KVHandle``."""
    from kvtransfer.types import KVHandle

    try:
        return msgspec.msgpack.decode(data, type=KVHandle)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"kv_handle is not a valid KVHandle: {exc}") from exc
