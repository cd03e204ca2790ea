"""Attention: per-step metadata and the backends (``torch``, ``triton``, ``flash_attn``)."""

from engine.attention.backend import AttentionBackend, get_backend
from engine.attention.metadata import AttentionMetadata, build_attention_metadata

__all__ = ["AttentionBackend", "AttentionMetadata", "build_attention_metadata", "get_backend"]
