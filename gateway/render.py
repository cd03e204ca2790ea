"""Responses from a request's output, as the types of gateway/openai_responses.py: chat.completion,
chat.completion.chunk, text_completion (whole and chunks), usage, and the two logprobs layouts (chat
``logprobs.content[]``; completions ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``);
and the SSE framing of a chunk (``data: {...}`` + blank line).

Source: OpenAI API reference (Chat Completions object and chunk object; legacy Completions object).
Token strings are each token's own decoded text (special tokens kept), ``bytes`` its UTF-8 bytes; a token
holding part of a multi-byte character shows U+FFFD. ``text_offset`` counts characters of the choice's
text (after any echoed prompt), summing the token strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.openai_responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    FinishReason,
    PromptTokensDetails,
    Usage,
    encode,
)
from gateway.orchestrator import TokenLogprob
from gateway.prepare import Prepared
from gateway.text import TextProcessor

ChunkChoice = ChatChunkChoice | CompletionChoice


def _top(text: TextProcessor, token_id: int, logprob: float) -> ChatTopLogprob:
    s = text.token_text(token_id)
    return ChatTopLogprob(s, logprob, list(s.encode("utf-8")))


def chat_logprobs(text: TextProcessor, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
    """``choices[i].logprobs`` of a chat completion (or chunk)."""
    content = []
    for e in entries:
        s = text.token_text(e.token_id)
        content.append(ChatTokenLogprob(s, e.logprob, list(s.encode("utf-8")),
                                        [_top(text, t, lp) for t, lp in e.top]))
    return ChatLogprobs(content, None)


def completion_logprobs(text: TextProcessor, entries: Sequence[TokenLogprob],
                        offset: int) -> CompletionLogprobs:
    """``choices[i].logprobs`` of a text completion; ``offset`` is the text offset (chars) of the first."""
    tokens = [text.token_text(e.token_id) for e in entries]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    tops = [{text.token_text(t): lp for t, lp in e.top} for e in entries]
    return CompletionLogprobs(tokens, [e.logprob for e in entries], tops, offsets)


def usage(p: Prepared, n_out: int, cached: Sequence[int | None] = ()) -> Usage:
    """Usage in tokens: prompts counted once each, completions summed over choices. ``cached``: each
    choice's prompt tokens found in the prefix cache (None: unknown), in ``p.choices`` order; a prompt's
    cached tokens are those of its first choice (choice ``j * p.n``)."""
    firsts = [n or 0 for i, n in enumerate(cached) if i % p.n == 0]
    return Usage(p.num_prompt_tokens, n_out, p.num_prompt_tokens + n_out, PromptTokensDetails(sum(firsts)))


def response_id(p: Prepared) -> str:
    """``chatcmpl-<X-Request-Id>`` or ``cmpl-<X-Request-Id>``."""
    return f"chatcmpl-{p.request_id}" if p.chat else f"cmpl-{p.request_id}"


@dataclass
class ChoiceState:
    """One choice's accumulated output: text, tokens counted, finish reason, logprob entries."""

    index: int
    text: str = ""
    num_tokens: int = 0
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


def completion_body(p: Prepared, text: TextProcessor, states: Sequence[ChoiceState], created: int,
                    used: Usage) -> ChatCompletion | Completion:
    """The whole (non-streaming) response; ``created`` in Unix seconds, ``used`` its ``usage``."""
    if p.chat:
        chat = [ChatChoice(s.index, AssistantMessage("assistant", s.text),
                           None if p.logprobs is None else chat_logprobs(text, s.logprobs), s.finish_reason)
                for s in states]
        return ChatCompletion(response_id(p), "chat.completion", created, p.model, chat, used)
    choices = []
    for s, c in zip(states, p.choices, strict=True):
        lp = None if p.logprobs is None else completion_logprobs(text, s.logprobs, len(c.echo_text))
        choices.append(CompletionChoice(s.index, c.echo_text + s.text, lp, s.finish_reason))
    return Completion(response_id(p), "text_completion", created, p.model, choices, used)


def chunk_choice(p: Prepared, text: TextProcessor, index: int, content: str | None,
                 finish: FinishReason | None, entries: Sequence[TokenLogprob], offset: int,
                 role: bool = False) -> ChunkChoice:
    """One choice of a streaming chunk. Chat: ``delta`` with ``role`` (first chunk only) and ``content``;
    completions: ``text``. ``offset`` (chars) feeds the completions ``text_offset``."""
    if p.chat:
        lp = chat_logprobs(text, entries) if p.logprobs is not None and entries else None
        delta = ChatDelta("assistant", content or "") if role else ChatDelta(content=content or None)
        return ChatChunkChoice(index, delta, lp, finish)
    clp = completion_logprobs(text, entries, offset) if p.logprobs is not None and entries else None
    return CompletionChoice(index, content or "", clp, finish)


def sse_chunk(p: Prepared, created: int, choice: ChunkChoice | None,
              final_usage: Usage | None = None) -> bytes:
    """One SSE event of a chunk holding ``choice`` (None: no choice, the final chunk with the usage)."""
    chunk: ChatCompletionChunk | CompletionChunk
    if p.chat:
        assert choice is None or isinstance(choice, ChatChunkChoice)
        chunk = ChatCompletionChunk(response_id(p), "chat.completion.chunk", created, p.model,
                                    [] if choice is None else [choice], final_usage)
    else:
        assert choice is None or isinstance(choice, CompletionChoice)
        chunk = CompletionChunk(response_id(p), "text_completion", created, p.model,
                                [] if choice is None else [choice], final_usage)
    return b"data: " + encode(chunk) + b"\n\n"
