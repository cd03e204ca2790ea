"""Fixtures of the worker unit tests: one tiny model directory per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.workers.helpers import FakeReceiver, write_model_dir


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("workers") / "tiny-llama")


@pytest.fixture
def fake(prefill: Any) -> Iterator[FakeReceiver]:
    """A scripted decode-side receiver over the ``prefill`` fixture's KV layout (each test module
    defines its own ``prefill`` worker)."""
    f = FakeReceiver(prefill.core.runner.kv_cache.kv_buffer)
    yield f
    f.close()
