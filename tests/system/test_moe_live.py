"""A mixture of experts through real processes: a tiny random-weight Qwen3-MoE checkpoint (8 experts,
top-2, saved with ``save_pretrained``, synthetic tokenizer) served on CPU by a disaggregated system
(prefill + decode, KV over NIXL) and a colocated one, started together
(``pdserve.live_system.live_systems``).

* greedy parity: ``bench.serving.parity``'s 8 prompts (chat and completion, one chunked by a 64-token
  budget) give identical text, finish reason and token count on both systems;
* afterwards every worker's KV blocks are free and no child died (leak check).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from bench.serving.parity import check_parity
from engine.models.dummy_tokenizer import write_dummy_tokenizer
from pdserve.live_system import LiveSystem, SystemSpec, live_systems, wait_all_free
from tests.engine.test_loader import tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

FLAGS = ("--max-num-batched-tokens", "64")


@pytest.fixture(scope="module")
def systems(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, LiveSystem]]]:
    import torch
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("moe_model") / "tiny-qwen3-moe"
    torch.manual_seed(5)
    cfg = tiny_config("Qwen3MoeForCausalLM", vocab=1024)  # the parity prompts use ids up to 999
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    write_dummy_tokenizer(path, json.loads((path / "config.json").read_text()))
    logs = tmp_path_factory.mktemp("moe_live")
    model = str(path)
    specs = [SystemSpec("disagg", logs / "disagg", model, ("cpu", "cpu"), 128, FLAGS),
             SystemSpec("colocated", logs / "colo", model, ("cpu",), 128, FLAGS)]
    with live_systems(specs, ready_timeout_s=120) as started:
        yield model, dict(zip(("disagg", "colocated"), started, strict=True))


def test_moe_greedy_disagg_equals_colocated_and_nothing_leaks(systems) -> None:
    model, live = systems
    cases = check_parity(live["disagg"].url, live["colocated"].url, model, max_tokens=12)
    assert len(cases) == 8
    assert [c for c in cases if not c.identical] == []
    assert all(c.a[2] >= 1 for c in cases)  # every answer produced tokens
    wait_all_free(live["disagg"].url, {"live-prefill", "live-decode"})
    wait_all_free(live["colocated"].url, {"live-colocated"})
    assert live["disagg"].sup.dead() == [] and live["colocated"].sup.dead() == []
