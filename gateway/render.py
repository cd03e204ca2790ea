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

from gateway.chat_output import parse_whole
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
    ChunkFunctionCall,
    ChunkToolCall,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    FinishReason,
    FunctionCall,
    PromptTokensDetails,
    ToolCall,
    Usage,
    encode,
)
from gateway.orchestrator import TokenLogprob
from gateway.prepare import Prepared
from gateway.text import TextProcessor
from gateway.tool_parsers.events import ContentText, Event, ReasoningText, ToolCallArguments, ToolCallStart

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


def with_calls(reason: FinishReason | None, num_calls: int) -> FinishReason | None:
    """The finish reason a client sees: ``tool_calls`` when the model stopped after calling tools."""
    return "tool_calls" if reason == "stop" and num_calls else reason


def assistant_message(p: Prepared, s: ChoiceState) -> tuple[AssistantMessage, FinishReason | None]:
    """A chat choice's message (content, reasoning and tool calls split by ``p.output``'s parsers) and
    its finish reason."""
    if not p.output.active:
        return AssistantMessage("assistant", s.text), s.finish_reason
    out = parse_whole(p.output, s.text)
    calls = [ToolCall(c.id, "function", FunctionCall(c.name, c.arguments)) for c in out.calls]
    return (AssistantMessage("assistant", out.content, out.reasoning, calls or None),
            with_calls(s.finish_reason, len(calls)))


def completion_body(p: Prepared, text: TextProcessor, states: Sequence[ChoiceState], created: int,
                    used: Usage) -> ChatCompletion | Completion:
    """The whole (non-streaming) response; ``created`` in Unix seconds, ``used`` its ``usage``."""
    if p.chat:
        chat = []
        for s in states:
            message, reason = assistant_message(p, s)
            chat.append(ChatChoice(s.index, message,
                                   None if p.logprobs is None else chat_logprobs(text, s.logprobs), reason))
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


def event_delta(event: Event) -> ChatDelta:
    """The chat delta of one parser event: content, reasoning, a call's start (id, type, name and empty
    arguments, as OpenAI streams it) or a fragment of its arguments."""
    if isinstance(event, ContentText):
        return ChatDelta(content=event.text)
    if isinstance(event, ReasoningText):
        return ChatDelta(reasoning_content=event.text)
    if isinstance(event, ToolCallStart):
        return ChatDelta(tool_calls=[ChunkToolCall(event.index, event.id, "function",
                                                   ChunkFunctionCall(event.name, ""))])
    assert isinstance(event, ToolCallArguments)
    fragment = ChunkFunctionCall(arguments=event.fragment)
    return ChatDelta(tool_calls=[ChunkToolCall(event.index, function=fragment)])


def chat_event_choice(p: Prepared, text: TextProcessor, index: int, delta: ChatDelta,
                      finish: FinishReason | None, entries: Sequence[TokenLogprob]) -> ChatChunkChoice:
    """One choice of a chat chunk carrying ``delta`` (from ``event_delta``, or empty with a finish
    reason), with the logprobs of ``entries``."""
    lp = chat_logprobs(text, entries) if p.logprobs is not None and entries else None
    return ChatChunkChoice(index, delta, lp, finish)


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
