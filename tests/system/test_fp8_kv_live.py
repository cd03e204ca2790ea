"""The FP8 KV cache through real processes: a tiny random-weight Llama (fp32 weights, synthetic tokenizer)
served on CPU by a disaggregated system (prefill + decode, KV over NIXL) and a colocated one, every worker
with ``--kv-cache-dtype fp8`` (``pdserve.live_system.live_systems``).

* every worker of both systems runs an fp8 KV cache (its ``worker_ready`` log line);
* greedy parity: ``bench.serving.parity``'s 8 prompts give identical text, finish reason and token count
  on both systems (the decode worker reads the fp8 bytes the prefill worker wrote, exactly as the
  colocated worker reads its own);
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

FLAGS = ("--max-num-batched-tokens", "64", "--kv-cache-dtype", "fp8")


@pytest.fixture(scope="module")
def systems(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, LiveSystem]]]:
    import torch
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("fp8kv_model") / "tiny-llama"
    torch.manual_seed(7)
    cfg = tiny_config("LlamaForCausalLM", vocab=1024)  # the parity prompts use ids up to 999
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    write_dummy_tokenizer(path, json.loads((path / "config.json").read_text()))
    logs = tmp_path_factory.mktemp("fp8kv_live")
    model = str(path)
    specs = [SystemSpec("disagg", logs / "disagg", model, ("cpu", "cpu"), 128, FLAGS),
             SystemSpec("colocated", logs / "colo", model, ("cpu",), 128, FLAGS)]
    with live_systems(specs, ready_timeout_s=120) as started:
        yield model, dict(zip(("disagg", "colocated"), started, strict=True))


def test_fp8_kv_greedy_disagg_equals_colocated_and_nothing_leaks(systems) -> None:
    model, live = systems
    workers = [(system, name) for system in live.values() for name in system.commands if name != "gateway"]
    assert len(workers) == 3
    for system, name in workers:
        ready = [line for line in system.log(name).splitlines() if "worker_ready" in line]
        assert ready and "kv_cache_dtype=float8_e4m3fn" in ready[0], (name, ready)
    cases = check_parity(live["disagg"].url, live["colocated"].url, model, max_tokens=12)
    assert len(cases) == 8
    assert [c for c in cases if not c.identical] == []
    assert all(c.a[2] >= 1 for c in cases)  # every answer produced tokens
    wait_all_free(live["disagg"].url, {"live-prefill", "live-decode"})
    wait_all_free(live["colocated"].url, {"live-colocated"})
    assert live["disagg"].sup.dead() == [] and live["colocated"].sup.dead() == []
