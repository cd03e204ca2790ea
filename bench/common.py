"""Pieces every engine-side benchmark uses: the model flags, random prompts, device synchronisation."""

from __future__ import annotations

import argparse

import torch


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--model`` (``llama3-8b`` dummy weights, or ``tiny``), ``--device``, ``--dtype`` and
    ``--attention-backend``, defaulting to CUDA/bf16/triton when a GPU is present, else CPU/fp32/torch."""
    cuda = torch.cuda.is_available()
    p.add_argument("--model", default="llama3-8b", help="llama3-8b (dummy weights) or tiny")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    p.add_argument("--attention-backend", default="triton" if cuda else "torch")


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` token ids drawn uniformly from ``[3, min(vocab, 30000))`` (ids
    0–2 are special in the supported tokenizers), the same for the same ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    ids: list[list[int]] = torch.randint(3, min(vocab, 30000), (batch, length), generator=gen).tolist()
    return ids


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
