"""``max_model_len`` against the KV cache's capacity (``num_blocks x block_size`` tokens): an explicit
``max_model_len`` beyond it is refused by the engine at start, naming the flags; the model's own limit is
cut to it with one INFO line. Found by a new-user trial: ``--max-model-len 4096 --num-blocks 64`` served
1024 tokens without a word (``pdserve up``'s own refusal: tests/system/test_up_refusals.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, kv_capacity_problem
from engine.engine_core import EngineCore

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# the tiny Llama (tests/engine/test_loader.py tiny_config): 2 layers x K,V x 16 tokens x 2 heads x 16 x fp32
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


def _core(path: Path, max_model_len: int | None, cache: CacheConfig) -> EngineCore:
    return EngineCore(EngineConfig(
        ModelConfig(str(path), dtype="float32", device="cpu", attention_backend="torch", load_format="dummy",
                    max_model_len=max_model_len),
        cache, SchedulerConfig(max_num_batched_tokens=64)))


def test_an_explicit_max_model_len_beyond_memory_sized_blocks_is_refused(tiny_dummy_dir: Path) -> None:
    """The capacity comes from the memory budget (``--kv-memory-fraction``; on a CPU of 1 GiB, here of 8
    blocks' bytes): 4 blocks of 16 tokens hold 64 tokens, so 100 is refused and 64 taken."""
    cache = CacheConfig(memory_fraction=0.5, cpu_kv_bytes=8 * BLOCK_BYTES)
    with pytest.raises(ValueError) as info:
        _core(tiny_dummy_dir, 100, cache)
    assert str(info.value) == (
        "--max-model-len 100 exceeds the KV cache's capacity of 64 tokens (4 blocks sized from "
        "--kv-memory-fraction 0.5 x --block-size 16; one sequence's KV must fit a worker's cache): lower "
        "--max-model-len or raise --kv-memory-fraction or give --num-blocks")
    assert _core(tiny_dummy_dir, 64, cache).max_model_len == 64


def test_an_explicit_max_model_len_beyond_given_blocks_is_refused(tiny_dummy_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"^--max-model-len 200 exceeds the KV cache's capacity of 128 "
                                         r"tokens \(--num-blocks 8 x --block-size 16; .*raise --num-blocks$"):
        _core(tiny_dummy_dir, 200, CacheConfig(num_blocks=8))


def test_the_models_own_limit_is_capped_to_the_capacity_with_one_info_line(
        tiny_dummy_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No ``--max-model-len``: the model's 512 positions are cut to the 128 tokens 8 blocks hold, said once
    at INFO; the runner (decode graphs, attention plans) and the scheduler agree on it."""
    with caplog.at_level(logging.INFO, logger="engine.model_runner"):
        core = _core(tiny_dummy_dir, None, CacheConfig(num_blocks=8))
    assert core.max_model_len == core.runner.max_model_len == 128
    lines = [r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage()]
    assert lines == ["max_model_len capped to 128 tokens, the KV cache's capacity (--num-blocks 8 x "
                     "--block-size 16), from the model's max_position_embeddings=512: one sequence's KV must "
                     "fit the cache"]
    assert [r.levelno for r in caplog.records if "max_model_len" in r.getMessage()] == [logging.INFO]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.model_runner"):
        roomy = _core(tiny_dummy_dir, None, CacheConfig(num_blocks=64))
    assert roomy.max_model_len == 512 and "max_model_len" not in caplog.text


def test_kv_capacity_problem_imports_no_torch() -> None:
    """``pdserve up`` asks it before any worker starts: engine.config must stay free of torch."""
    import subprocess
    import sys

    code = ("import sys; from engine.config import kv_capacity_problem as p; "
            "print(p(4096, 64, 16) is not None, p(1024, 64, 16), p(None, 1, 16)); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["True None None", "False"]
    assert kv_capacity_problem(17, 1, 16, 0.9) is not None
