"""``--cpu-threads``: a worker sets torch's intra-op threads before it builds its model (workers/boot.py);
0 leaves torch's default. And what else ``build_core`` hands the engine for its other ranks."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from protocol.settings import WorkerSettings
from tests.engine.test_loader import tiny_config
from workers.boot import build_core


@pytest.fixture
def threads_restored() -> Iterator[int]:
    saved = torch.get_num_threads()
    yield saved
    torch.set_num_threads(saved)


def _tiny(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(tiny_config("LlamaForCausalLM").to_json_string())
    return str(tmp_path)


@pytest.mark.parametrize("threads", [0, 2, 3])
def test_build_core_sets_the_threads_before_the_model(tmp_path: Path, threads_restored: int,
                                                      threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.engine_core

    seen: list[int] = []
    real = engine.engine_core.EngineCore

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(torch.get_num_threads())  # what the model is built and run with
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.engine_core, "EngineCore", spy)
    settings = WorkerSettings(role="colocated", model=_tiny(tmp_path), load_format="dummy", device="cpu",
                              num_blocks=8, cpu_threads=threads, insecure_control_plane=True)
    core, _ = build_core(settings)
    try:
        assert seen == [threads or threads_restored]
    finally:
        core.close()


def test_build_core_hands_its_log_format_to_the_other_tensor_parallel_ranks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other ranks are spawned processes: the worker gives them its ``--log-level`` and
    ``--log-format`` (``rank_setup``), so with ``--log-format json`` their lines are JSON too."""
    import engine.engine_core
    from protocol.logging import configure_logging

    seen: dict[str, object] = {}

    class Core:
        def __init__(self, config: object, **kwargs: object) -> None:
            seen.update(kwargs)

    monkeypatch.setattr(engine.engine_core, "EngineCore", Core)
    settings = WorkerSettings(role="colocated", model=_tiny(tmp_path), load_format="dummy", device="cpu",
                              num_blocks=8, tensor_parallel_size=2, log_level="warning", log_format="json",
                              insecure_control_plane=True)
    build_core(settings)
    setup = seen["rank_setup"]
    assert isinstance(setup, functools.partial) and setup.func is configure_logging
    assert setup.args == ("warning", "json") and not setup.keywords
