"""Arguments shared by the GPU benchmarks (``bench/prefill.py``, ``bench/ttft.py``)."""

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
