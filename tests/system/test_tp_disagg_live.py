"""Prefill and decode workers of different tensor parallel sizes through real processes: a tiny random
Llama (4 query heads, 2 KV heads, fp32, saved with ``save_pretrained``, synthetic tokenizer) served on CPU
(gloo) by two disaggregated systems, P TP=2 / D TP=1 and P TP=1 / D TP=2, KV over NIXL on loopback, each
prefill rank writing its KV-head slice into the decode ranks' blocks, and by one colocated worker of one
rank, all started together (``pdserve.live_system.live_systems``). Between them every multi-rank path of a
live worker runs (a prefill worker's follower ranks sending, a decode worker's follower ranks receiving);
the rank pairings they do not cover (P TP=2 / D TP=2, more ranks than heads) are checked in process by
``tests/workers/test_tp_kv.py``, ``tests/kvtransfer/test_tp_slices.py`` and ``test_ranked.py``.

* through each gateway with the openai client, completions and chat, streaming and not, greedy: the
  same text and token counts as the colocated worker; a prompt sent twice (a prefix-cache hit on the
  second) answers the same;
* afterwards every worker's KV blocks are free, no child died, and at shutdown every rank's KV endpoint
  of every prefill and decode worker held nothing (each worker logs ``kv_endpoints_closed`` with its rank
  count and what was held).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine.models.dummy_tokenizer import write_dummy_tokenizer
from pdserve.live_system import LiveSystem, SystemSpec, live_systems, wait_all_free

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SHAPES = ((2, 1), (1, 2))  # (prefill tensor parallel size, decode tensor parallel size)
FLAGS = ("--dtype", "float32", "--num-blocks", "64")
PROMPTS = ("t5 t17 t3 t99 t42 t7 t11",
           " ".join(f"t{(i * 37) % 250 + 3}" for i in range(40)))  # 40 tokens: two full blocks of 16
MAX_TOKENS = 6
CLOSED = re.compile(r"kv_endpoints_closed ranks=(\d+) held=(.*)$", re.MULTILINE)


@contextmanager
def one_thread_children() -> Iterator[None]:
    """One intra-op torch thread in every child (the ranks spin against each other on 2 cores)."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def tiny_llama(path: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.engine.test_loader import tiny_config

    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(tiny_config("LlamaForCausalLM", vocab=256),
                                     dtype=torch.float32).save_pretrained(path)
    write_dummy_tokenizer(path, json.loads((path / "config.json").read_text()))
    return str(path)


def answers(url: str, model: str) -> list[tuple[str, str, int]]:
    """(kind, text, completion tokens) of each prompt, as completion and chat, streaming and not;
    the last prompt a second time (its full blocks then come from the prefix cache)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60.0, max_retries=0)
    out: list[tuple[str, str, int]] = []
    for prompt in (*PROMPTS, PROMPTS[-1]):
        done = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
        assert done.usage is not None
        out.append(("completion", done.choices[0].text, done.usage.completion_tokens))
        text, count = "", 0
        for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                               temperature=0.0, stream=True,
                                               stream_options={"include_usage": True}):
            text += "".join(c.text for c in chunk.choices)
            count = chunk.usage.completion_tokens if chunk.usage is not None else count
        out.append(("completion stream", text, count))
        messages = [{"role": "user", "content": prompt}]
        chat = client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                              max_tokens=MAX_TOKENS, temperature=0.0)
        assert chat.usage is not None
        out.append(("chat", chat.choices[0].message.content or "", chat.usage.completion_tokens))
        text, count = "", 0
        for part in client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                                   max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
                                                   stream_options={"include_usage": True}):
            text += "".join(c.delta.content or "" for c in part.choices)
            count = part.usage.completion_tokens if part.usage is not None else count
        out.append(("chat stream", text, count))
    return out


def test_prefill_and_decode_of_different_tp_sizes_answer_as_one_colocated_rank(tmp_path: Path) -> None:
    model = tiny_llama(tmp_path / "tiny-llama")
    logs = tmp_path / "logs"
    specs = [SystemSpec("colocated", logs / "colo", model, ("cpu",), 64, FLAGS)]
    specs += [SystemSpec("disagg", logs / f"p{p}d{d}", model, ("cpu", "cpu"), 64, FLAGS,
                         prefill_flags=("--tensor-parallel-size", str(p)),
                         decode_flags=("--tensor-parallel-size", str(d))) for p, d in SHAPES]
    systems: list[LiveSystem] = []
    with one_thread_children(), live_systems(specs, ready_timeout_s=180) as started:
        systems = started
        want = answers(systems[0].url, model)
        assert all(count >= 1 for _, _, count in want)
        for (p, d), system in zip(SHAPES, systems[1:], strict=True):
            got = answers(system.url, model)
            assert got == want, f"P TP={p} / D TP={d}"
        wait_all_free(systems[0].url, {"live-colocated"})
        for system in systems[1:]:
            wait_all_free(system.url, {"live-prefill", "live-decode"})
        assert [s.sup.dead() for s in systems] == [[]] * len(systems)
    for (p, d), system in zip(SHAPES, systems[1:], strict=True):
        for child, size in (("prefill", p), ("decode", d)):
            closed = CLOSED.findall(system.log(child))
            assert closed == [(str(size), "")], f"P TP={p} / D TP={d} {child}: {closed}"
