"""OpenAI response shapes: chat.completion, chat.completion.chunk, text_completion (whole and chunks),
usage, and the two logprobs layouts (chat ``logprobs.content[]``; completions ``tokens`` /
``token_logprobs`` / ``top_logprobs`` / ``text_offset``).

Source: OpenAI API reference (Chat Completions object and chunk object; legacy Completions object).
Token strings are each token's own decoded text (special tokens kept), ``bytes`` its UTF-8 bytes; a token
holding part of a multi-byte character shows U+FFFD. ``text_offset`` counts characters of the choice's
text (after any echoed prompt), summing the token strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.handle import TokenLogprob
from gateway.prepare import Prepared
from gateway.text import TextProcessor


def _tok(text: TextProcessor, token_id: int, logprob: float) -> dict[str, Any]:
    s = text.token_text(token_id)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(text: TextProcessor, entries: list[TokenLogprob]) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion (or chunk): ``{"content": [...], "refusal": None}``."""
    content = [{**_tok(text, e.token_id, e.logprob),
                "top_logprobs": [_tok(text, t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(text: TextProcessor, entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """``choices[i].logprobs`` of a text completion; ``offset`` is the text offset (chars) of the first."""
    tokens = [text.token_text(e.token_id) for e in entries]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    tops = [{text.token_text(t): lp for t, lp in e.top} for e in entries]
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


def usage(p: Prepared, n_out: int) -> dict[str, int]:
    """OpenAI usage object (tokens): prompts counted once each, completions summed over choices."""
    return {"prompt_tokens": p.num_prompt_tokens, "completion_tokens": n_out,
            "total_tokens": p.num_prompt_tokens + n_out}


def envelope(p: Prepared, created: int, chunk: bool) -> dict[str, Any]:
    """The fields every response object has (``choices`` to be filled in)."""
    if p.chat:
        return {"id": f"chatcmpl-{p.request_id}", "object": "chat.completion.chunk" if chunk
                else "chat.completion", "created": created, "model": p.model, "choices": []}
    return {"id": f"cmpl-{p.request_id}", "object": "text_completion", "created": created,
            "model": p.model, "choices": []}


@dataclass
class ChoiceState:
    """One choice's accumulated output: text, tokens counted, finish reason, logprob entries."""

    index: int
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


def final_choice(p: Prepared, text: TextProcessor, c: ChoiceState, echo_text: str) -> dict[str, Any]:
    """One choice of a non-streaming response."""
    lp: dict[str, Any] | None = None
    if p.logprobs is not None:
        lp = chat_logprobs(text, c.logprobs) if p.chat else completion_logprobs(
            text, c.logprobs, len(echo_text))
    if p.chat:
        return {"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                "finish_reason": c.finish_reason}
    return {"index": c.index, "text": echo_text + c.text, "logprobs": lp, "finish_reason": c.finish_reason}


def chunk_choice(p: Prepared, text: TextProcessor, index: int, content: str | None, finish: str | None,
                 entries: list[TokenLogprob], offset: int, role: bool = False) -> dict[str, Any]:
    """One choice of a streaming chunk. Chat: ``delta`` with ``role`` (first chunk only) and ``content``;
    completions: ``text``. ``offset`` (chars) feeds the completions ``text_offset``."""
    lp: dict[str, Any] | None = None
    if p.logprobs is not None and entries:
        lp = chat_logprobs(text, entries) if p.chat else completion_logprobs(text, entries, offset)
    if p.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if content:
            delta["content"] = content
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
    return {"index": index, "text": content or "", "logprobs": lp, "finish_reason": finish}
