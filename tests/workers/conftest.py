"""Fixtures of the worker unit tests: one tiny model directory per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.workers.helpers import write_model_dir


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("workers") / "tiny-llama")
