"""Shared pytest set-up.

On a machine without CUDA, Triton kernels run through Triton's interpreter: ``TRITON_INTERPRET=1`` must
be set before ``triton`` is first imported, so it is set here, at collection start.
"""

from __future__ import annotations

import importlib.util
import os


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
