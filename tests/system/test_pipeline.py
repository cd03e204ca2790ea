"""The whole system: real processes, NIXL on 127.0.0.1, the embedded SmolLM2, the official openai client.

Disaggregated answers are compared with the colocated worker and with offline ``engine.llm.LLM``; after
aborted and killed streams every surviving worker must report all KV blocks free (gateway /metrics).
The system is the session's shared one (``live``, tests/live.py). The decode-worker kill runs after every
other test that uses it (``kills_live_child``: it ends the disaggregated half of that system).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from pdserve.live_system import SystemPair, wait_all_free, worker_id
from tests.live import API_KEY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "smollm2-135m"
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]


PREFILL, DECODE, COLO = worker_id("prefill"), worker_id("decode"), worker_id("colocated")


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def aclient(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm():
    from engine.llm import LLM

    return LLM(MODEL, num_blocks=256)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_capital_of_france(live: SystemPair, stream: bool) -> None:
    c = client(live.disagg_url)
    if stream:
        chunks = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0,
                                           stream=True)
        parts = [ch.choices[0].delta.content or "" for ch in chunks
                 if isinstance(ch, ChatCompletionChunk) and ch.choices]
        text = "".join(parts)
        assert len(parts) >= 3  # streamed piece by piece
    else:
        out = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
        text = out.choices[0].message.content or ""
        assert out.usage is not None and out.usage.completion_tokens >= 2
    assert "Paris" in text
    wait_all_free(live.disagg_url, {PREFILL, DECODE})


def _prompts() -> list[str]:
    """Five prompts of 5, 49, 16, 31 and 68 tokens: under one block of 16, exactly one, and two to five
    blocks, so the concurrent batch mixes prefill lengths across block boundaries."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
             "lambda", "mu"]
    return [f"List {i}: " + " ".join(words[: (i * 5) % 12 + 1] * (1 + i % 4)) for i in (0, 2, 4, 6, 7)]


async def _complete_all(url: str, prompts: list[str], max_tokens: list[int]) -> list[str]:
    c = aclient(url)
    outs = await asyncio.gather(*[c.completions.create(model=MODEL, prompt=p, max_tokens=m, temperature=0)
                                  for p, m in zip(prompts, max_tokens, strict=True)])
    return [o.choices[0].text for o in outs]


def test_concurrent_greedy_equals_colocated_and_offline(live: SystemPair, llm) -> None:
    from engine.sampling_params import SamplingParams

    prompts = _prompts()
    max_tokens = [4, 10, 7, 4, 7]  # the sequences finish at different steps of the batch
    disagg = asyncio.run(_complete_all(live.disagg_url, prompts, max_tokens))
    colo = asyncio.run(_complete_all(live.colo_url, prompts, max_tokens))
    offline = llm.generate(prompts, [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens])
    assert all(d for d in disagg), disagg
    assert disagg == colo
    assert disagg == [o.text for o in offline]
    wait_all_free(live.disagg_url, {PREFILL, DECODE})
    wait_all_free(live.colo_url, {COLO})


def test_max_tokens_one_never_reaches_decode(live: SystemPair) -> None:
    c = client(live.disagg_url)
    one, two = f"mt1-{uuid.uuid4().hex}", f"mt2-{uuid.uuid4().hex}"
    out = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0,
                               extra_headers={"X-Request-Id": one})
    assert out.choices[0].finish_reason == "length" and out.usage and out.usage.completion_tokens == 1
    c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2, temperature=0,
                         extra_headers={"X-Request-Id": two})
    # logs are written asynchronously: wait (with a deadline) for the control request's line; the 1-token
    # request went first, so had it reached decode its line would be there by then
    deadline = time.monotonic() + 10
    while two not in (decode_log := live.disagg.log("decode")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert two in decode_log  # the control: a 2-token request does reach decode and is logged
    assert one not in decode_log


def test_stop_string_spanning_two_tokens(live: SystemPair, llm) -> None:
    from engine.sampling_params import SamplingParams

    prompt = "The capital of France is"
    ref = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    pieces = [llm.tokenizer.decode([t]) for t in ref.token_ids]
    k = next(i for i in range(1, len(pieces)) if len(pieces[i - 1].strip()) >= 2 and pieces[i].strip())
    stop = pieces[k - 1][-2:] + pieces[k][:1]
    expected = "".join(pieces[: k - 1]) + pieces[k - 1][:-2]
    for url in (live.disagg_url, live.colo_url):
        out = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                             stop=[stop])
        assert out.choices[0].text == expected, (url, stop)
        assert out.choices[0].finish_reason == "stop"


def test_seeded_sampling_same_disaggregated_and_colocated(live: SystemPair) -> None:
    texts = []
    for url in (live.disagg_url, live.colo_url):
        out = client(url).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                             temperature=0.9, top_p=0.95, seed=1234)
        texts.append(out.choices[0].text)
    assert texts[0] and texts[0] == texts[1]


def test_client_abort_mid_stream_frees_blocks(live: SystemPair) -> None:
    for url, workers in ((live.disagg_url, {PREFILL, DECODE}), (live.colo_url, {COLO})):
        c = client(url)
        stream = c.completions.create(model=MODEL, prompt="Write a long story about a dragon.",
                                      max_tokens=200, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        got = 0
        for _chunk in stream:
            got += 1
            if got == 3:
                break
        stream.close()
        assert got == 3
        wait_all_free(url, workers)


def test_bad_request_fails_alone_and_worker_keeps_serving(live: SystemPair) -> None:
    # a token id outside the 49152-entry vocabulary: the gateway knows the vocabulary and refuses it with
    # a 400 naming the range (the workers' own RequestFailed path for it is tested in tests/workers/)
    c = client(live.disagg_url)
    with pytest.raises(openai.APIStatusError) as err:
        c.completions.create(model=MODEL, prompt=[1, 2, 10_000_000], max_tokens=4, temperature=0)
    assert err.value.status_code == 400 and "[0, 49152)" in str(err.value)
    out = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0)
    assert "Paris" in out.choices[0].text
    wait_all_free(live.disagg_url, {PREFILL, DECODE})


@pytest.mark.kills_live_child
def test_decode_killed_mid_stream_client_gets_error(live: SystemPair) -> None:
    c = client(live.disagg_url)
    stream = c.completions.create(model=MODEL, prompt="Write a long story about a dragon.", max_tokens=400,
                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    next(it)
    os.kill(live.disagg.sup.children["decode"].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _chunk in it:
            pass
    assert time.monotonic() - start < 30
    used = wait_all_free(live.disagg_url, {PREFILL})
    assert DECODE not in used  # the dead worker is gone from /metrics
