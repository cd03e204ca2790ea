"""The dummy-weight path and the FP8 KV cache through real processes: ``pdserve`` gateways and workers
with ``--model tiny-llama`` (random weights, seed 0 on every worker; synthetic tokenizer) and
``--kv-cache-dtype fp8`` on CPU, started the way ``bench.serving.disagg_vs_colocated`` starts them (both
systems at once, ``pdserve.live_system.live_systems``). The two share one pair of systems: the KV cache's
dtype and the weights' origin are independent, and every other live system runs the default KV dtype.

* every worker of both systems runs an fp8 KV cache (its ``worker_ready`` log line);
* a chat and a completion are served, the text decodes from the synthetic vocabulary, usage is right;
* greedy parity: the bench's 8 prompts give identical text, finish reason and token count on the
  disaggregated system (prefill + decode, KV over NIXL: the decode worker reads the fp8 bytes the prefill
  worker wrote, exactly as the colocated worker reads its own) and the colocated one;
* afterwards every worker's KV blocks are free and nothing is in flight (leak check).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from bench.serving.parity import check_parity
from pdserve.live_system import LiveSystem, SystemSpec, live_systems, registered, wait_all_free

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MODEL = "tiny-llama"
# 64: the 200-token prompt is chunked
FLAGS = ("--max-num-batched-tokens", "64", "--load-format", "dummy", "--kv-cache-dtype", "fp8")


@pytest.fixture(scope="module")
def systems(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LiveSystem]]:
    logs = tmp_path_factory.mktemp("dummy_live")
    specs = [SystemSpec("disagg", logs / "disagg", MODEL, ("cpu", "cpu"), 128, FLAGS),
             SystemSpec("colocated", logs / "colo", MODEL, ("cpu",), 128, FLAGS)]
    with live_systems(specs, ready_timeout_s=120) as started:
        yield dict(zip(("disagg", "colocated"), started, strict=True))


def test_all_workers_registered_before_ready(systems: dict[str, LiveSystem]) -> None:
    assert systems["disagg"].worker_ids == {"live-prefill", "live-decode"}
    assert registered(systems["disagg"].url) == {"live-prefill", "live-decode"}
    assert registered(systems["colocated"].url) == {"live-colocated"}


def test_every_worker_runs_an_fp8_kv_cache(systems: dict[str, LiveSystem]) -> None:
    workers = [(system, name) for system in systems.values() for name in system.commands if name != "gateway"]
    assert len(workers) == 3
    for system, name in workers:
        ready = [line for line in system.log(name).splitlines() if "worker_ready" in line]
        assert ready and "kv_cache_dtype=float8_e4m3fn" in ready[0], (name, ready)


def test_serves_chat_and_completion(systems: dict[str, LiveSystem]) -> None:
    url = systems["disagg"].url
    models = httpx.get(f"{url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": "t10 t11 t12"}]}).json()
    # each id decodes to " t<id>" (the words of the synthetic vocabulary, space-joined after the prompt)
    assert re.fullmatch(r"( t\d+){6}", chat["choices"][0]["message"]["content"]), chat
    # prompt: <s> user(unk) t10 t11 t12 </s> <s> assistant(unk) = 8 ids
    assert (chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"]) == (8, 6)
    comp = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": [101, 102, 103], "max_tokens": 4, "temperature": 0,
        "ignore_eos": True}).json()
    assert re.fullmatch(r"( t\d+){4}", comp["choices"][0]["text"]), comp
    usage = comp["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (3, 4, 7)


def test_greedy_parity_disagg_equals_colocated(systems: dict[str, LiveSystem]) -> None:
    cases = check_parity(systems["disagg"].url, systems["colocated"].url, MODEL, max_tokens=16)
    assert len(cases) == 8
    assert [c for c in cases if not c.identical] == []
    assert all(c.a[2] >= 1 and c.a[0] for c in cases)  # every answer produced text and tokens


def test_no_kv_block_leaked(systems: dict[str, LiveSystem]) -> None:
    wait_all_free(systems["disagg"].url, {"live-prefill", "live-decode"})
    wait_all_free(systems["colocated"].url, {"live-colocated"})
    assert systems["disagg"].sup.dead() == [] and systems["colocated"].sup.dead() == []
