"""One request through the official ``openai`` client, streamed or not, chat or completions, reduced to
an ``Outcome`` that compares equal across both modes and both gateways: per choice its text, finish
reason and token logprobs (token string, logprob, top-N alternatives), plus usage (tokens)."""

from __future__ import annotations

import functools
import ssl
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import openai

from pdserve.live_system import MODEL, SystemPair
from tests.live import wait_all_free_at_once

Endpoint = Literal["chat", "completions"]
ENDPOINTS: list[Endpoint] = ["chat", "completions"]
# (token, logprob, top-N); an echoed prompt's first token has neither logprob nor top-N (None)
LogprobEntry = tuple[str, float | None, tuple[tuple[str, float], ...] | None]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Choice:
    """One choice: text, finish reason, and one logprob entry per generated token (when asked)."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[LogprobEntry] = field(default_factory=list)


@dataclass
class Outcome:
    """A whole response: choices by index and usage ``(prompt, completion, total)`` tokens."""

    choices: list[Choice]
    usage: tuple[int, int, int] | None

    def texts(self) -> list[str]:
        """Each choice's text, in index order."""
        return [c.text for c in self.choices]


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every client: building one loads the CA bundle (~20 ms of CPU a client)."""
    return httpx.create_ssl_context()


def client(url: str, api_key: str | None) -> openai.OpenAI:
    """The official client for a gateway (no retries: a failure must show), with its own connections."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key or "unused", max_retries=0, timeout=120,
                         http_client=openai.DefaultHttpxClient(verify=_tls()))


def _entries(lp: Any, chat: bool) -> list[LogprobEntry]:
    if lp is None:
        return []
    if chat:
        return [(e.token, e.logprob, tuple((t.token, t.logprob) for t in e.top_logprobs))
                for e in lp.content or []]
    tops = lp.top_logprobs or [{}] * len(lp.tokens or [])
    return [(tok, val, None if top is None else tuple(top.items())) for tok, val, top in
            zip(lp.tokens or [], lp.token_logprobs or [], tops, strict=True)]


def _usage(u: Any) -> tuple[int, int, int] | None:
    return None if u is None else (u.prompt_tokens, u.completion_tokens, u.total_tokens)


def call(c: openai.OpenAI, endpoint: Endpoint, stream: bool, **kw: Any) -> Outcome:
    """Run one request; streaming asks for ``include_usage`` so both modes report usage.

    ``kw`` are the request's fields (``messages`` defaults to ``MESSAGES`` on chat); fields the client
    does not know go in ``extra_body``. Raises ``openai.APIError`` on an error response.
    """
    kw.setdefault("model", MODEL)
    if endpoint == "chat":
        kw.setdefault("messages", MESSAGES)
    create: Any = c.chat.completions.create if endpoint == "chat" else c.completions.create
    chat = endpoint == "chat"
    if not stream:
        r = create(**kw)
        choices = [Choice(ch.index, (ch.message.content or "") if chat else ch.text, ch.finish_reason,
                          _entries(ch.logprobs, chat)) for ch in r.choices]
        return Outcome(sorted(choices, key=lambda ch: ch.index), _usage(r.usage))
    kw.setdefault("stream_options", {"include_usage": True})
    by_index: dict[int, Choice] = {}
    usage = None
    for chunk in create(stream=True, **kw):
        if chunk.usage is not None:
            assert chunk.choices == [], "usage must come in a chunk of its own, with no choices"
            usage = _usage(chunk.usage)
        for ch in chunk.choices:
            got = by_index.setdefault(ch.index, Choice(ch.index))
            assert got.finish_reason is None, f"choice {ch.index} got a chunk after its finish_reason"
            got.text += (ch.delta.content or "") if chat else ch.text
            got.finish_reason = ch.finish_reason
            got.logprobs += _entries(ch.logprobs, chat)
    return Outcome([by_index[i] for i in sorted(by_index)], usage)


def assert_same(a: Outcome, b: Outcome, what: str, tol: float = 0.0) -> None:
    """Equality of two outcomes: text, finish reasons, usage and sampled tokens exactly; logprobs exactly
    (with their top-N) when ``tol`` is 0, else the sampled tokens' logprobs within ``tol`` (nats) and only
    the number of top-N alternatives compared (near-ties may swap). Raises AssertionError naming the first
    difference."""
    assert a.texts() == b.texts(), what
    assert [c.finish_reason for c in a.choices] == [c.finish_reason for c in b.choices], what
    assert a.usage == b.usage, what
    for ca, cb in zip(a.choices, b.choices, strict=True):
        if tol == 0.0:
            assert ca.logprobs == cb.logprobs, f"{what}: choice {ca.index} logprobs differ"
            continue
        assert [e[0] for e in ca.logprobs] == [e[0] for e in cb.logprobs], f"{what}: choice {ca.index}"
        assert [None if e[2] is None else len(e[2]) for e in ca.logprobs] == \
            [None if e[2] is None else len(e[2]) for e in cb.logprobs], f"{what}: choice {ca.index} top-N"
        # an echoed prompt's first token has no logprob on either side (compared exactly above by token)
        assert [e[1] is None for e in ca.logprobs] == [e[1] is None for e in cb.logprobs], what
        worst = max((abs(x[1] - y[1]) for x, y in zip(ca.logprobs, cb.logprobs, strict=True)
                     if x[1] is not None and y[1] is not None), default=0.0)
        assert worst <= tol, f"{what}: choice {ca.index} logprobs differ by {worst} > {tol}"


def leak_check(live: SystemPair) -> None:
    """All KV blocks free on every worker and nothing in flight, on both gateways (polled: heartbeats lag).
    Raises AssertionError naming what is still held."""
    wait_all_free_at_once(live.pairs())
