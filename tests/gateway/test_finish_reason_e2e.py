"""``finish_reason`` at ``max_tokens`` end to end: a real gateway in front of fake workers whose reply is
five tokens then eos. An eos that is the ``max_tokens``-th token ends the request with ``stop`` (the
worker checks stop tokens before the length, as vLLM does), on every path: chat and completions, streamed
and not, ``n > 1``, ``/v1/responses`` (status ``completed``), disaggregated and colocated; ``length`` only
when the reply was cut. Each test ends with a leak check."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.text import TextProcessor
from tests.gateway.conftest import MSGS, Cluster, assert_no_leaks_by_name, disaggregated_and_colocated

pytestmark = pytest.mark.slow  # starts processes

WORDS = 5  # reply tokens before the eos


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, proc: TextProcessor,
             reply_ids: list[int]) -> Iterator[dict[str, Cluster]]:
    eos = proc.eos_token_id
    ids = ",".join(map(str, [*reply_ids[:WORDS], eos]))
    yield from disaggregated_and_colocated(tmp_path_factory, tokenizer_dir, ids, eos, max_n=4)


# max_tokens → (finish_reason, completion tokens): the eos is token WORDS + 1
CASES = [(WORDS, "length", WORDS), (WORDS + 1, "stop", WORDS + 1), (WORDS + 2, "stop", WORDS + 1)]


@pytest.mark.parametrize("name", ["disagg", "colo"])
@pytest.mark.parametrize("max_tokens,reason,used", CASES)
def test_chat_and_completions_streamed_and_not(clusters: dict[str, Cluster], name: str, max_tokens: int,
                                               reason: str, used: int) -> None:
    c = clusters[name]
    client = c.client()
    kw: dict[str, Any] = {"model": "fake-model", "max_tokens": max_tokens, "n": 2}
    chat = client.chat.completions.create(messages=MSGS, **kw)  # type: ignore[call-overload]
    assert [ch.finish_reason for ch in chat.choices] == [reason, reason]
    assert chat.usage is not None and chat.usage.completion_tokens == 2 * used
    cmpl = client.completions.create(prompt="Say hello", **kw)
    assert [ch.finish_reason for ch in cmpl.choices] == [reason, reason]
    assert cmpl.usage is not None and cmpl.usage.completion_tokens == 2 * used
    for create, extra in ((client.chat.completions.create, {"messages": MSGS}),
                          (client.completions.create, {"prompt": "Say hello"})):
        finishes: dict[int, list[str | None]] = {0: [], 1: []}
        for chunk in create(stream=True, **extra, **kw):  # type: ignore[operator]
            for ch in chunk.choices:
                finishes[ch.index].append(ch.finish_reason)
        for got in finishes.values():  # one finish_reason per choice, on its last chunk
            assert got[-1] == reason and got[:-1] == [None] * (len(got) - 1), got
    assert_no_leaks_by_name(c, name)


@pytest.mark.parametrize("name", ["disagg", "colo"])
@pytest.mark.parametrize("max_tokens,reason,used", CASES)
def test_responses_status(clusters: dict[str, Cluster], name: str, max_tokens: int, reason: str,
                          used: int) -> None:
    c = clusters[name]
    kw: dict[str, Any] = {"model": "fake-model", "input": "Say hello", "max_output_tokens": max_tokens}
    r = c.client().responses.create(**kw)
    want = "incomplete" if reason == "length" else "completed"
    assert r.status == want and r.output[0].status == want  # type: ignore[union-attr]
    assert r.usage is not None and r.usage.output_tokens == used
    assert (r.incomplete_details is None) == (reason == "stop")
    events = [e.type for e in c.client().responses.create(stream=True, **kw)]
    assert events[-1] == f"response.{want}"
    assert_no_leaks_by_name(c, name)


@pytest.mark.parametrize("name", ["disagg", "colo"])
def test_an_eos_first_token_at_max_tokens_one_is_a_stop(clusters: dict[str, Cluster], name: str) -> None:
    """Seed 5 rotates the reply to start at the eos: the one token allowed is a stop token."""
    c = clusters[name]
    r = c.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=1,  # type: ignore[arg-type]
                                           seed=WORDS)
    assert r.choices[0].finish_reason == "stop" and r.usage is not None and r.usage.completion_tokens == 1
    assert_no_leaks_by_name(c, name)


@pytest.mark.parametrize("name", ["disagg", "colo"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_in_the_last_allowed_token_is_a_stop(clusters: dict[str, Cluster], proc: TextProcessor,
                                                           reply_ids: list[int], name: str,
                                                           stream: bool) -> None:
    c = clusters[name]
    last = proc.decode(reply_ids[WORDS - 1:WORDS])  # the text of the max_tokens-th token
    body = {"model": "fake-model", "messages": MSGS, "max_tokens": WORDS, "stop": [last], "stream": stream}
    r = httpx.post(c.base + "/v1/chat/completions", json=body, timeout=20)
    assert r.status_code == 200, r.text
    if stream:
        reasons = [line for line in r.text.splitlines() if '"finish_reason":"' in line]
        assert len(reasons) == 1 and '"finish_reason":"stop"' in reasons[0], r.text
    else:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert choice["message"]["content"] == proc.decode(reply_ids[:WORDS - 1])
    assert_no_leaks_by_name(c, name)
