"""Responses from a request's output, as the types of gateway/openai_responses.py: chat.completion,
chat.completion.chunk, text_completion (whole and chunks), usage, and the two logprobs layouts (chat
``logprobs.content[]``; completions ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``);
and the SSE framing of a chunk (``data: {...}`` + blank line).

Source: OpenAI API reference (Chat Completions object and chunk object; legacy Completions object).
Token strings are each token's own decoded text (special tokens kept), ``bytes`` its UTF-8 bytes; a token
holding part of a multi-byte character shows U+FFFD. ``text_offset`` counts characters of the choice's
text, summing the token strings: the output's start after the echoed prompt, the echoed prompt's
tokens (``echo`` with ``logprobs``) at 0. vLLM's ``prompt_logprobs`` keep its shape (``PromptTokenLogprob``).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from gateway.chat_output import parse_whole
from gateway.errors import upstream_failed
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
    PromptTokenLogprob,
    PromptTokensDetails,
    ToolCall,
    Usage,
    encode,
)
from gateway.prepare import ChoiceInput, Prepared
from gateway.request_state import TokenLogprob
from gateway.text import TextProcessor
from gateway.tool_parsers.events import ContentText, Event, ReasoningText, ToolCallArguments, ToolCallStart
from protocol.messages import PromptLogprob

ChunkChoice = ChatChunkChoice | CompletionChoice


def _top(text: TextProcessor, token_id: int, logprob: float) -> ChatTopLogprob:
    s, raw = text.logprob_token(token_id)
    return ChatTopLogprob(s, logprob, list(raw))


def chat_logprobs(text: TextProcessor, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
    """``choices[i].logprobs`` of a chat completion (or chunk): each token's text and bytes as
    ``TextProcessor.logprob_token`` gives them."""
    content = []
    for e in entries:
        s, raw = text.logprob_token(e.token_id)
        content.append(ChatTokenLogprob(s, e.logprob, list(raw), [_top(text, t, lp) for t, lp in e.top]))
    return ChatLogprobs(content, None)


def text_offsets(pieces: Sequence[bytes], offset: int) -> tuple[list[int], int]:
    """The text offset (characters) of each of ``pieces`` (consecutive tokens' bytes) in the text they
    decode to, the first at ``offset``, and the offset after the last, by an incremental UTF-8 decoder:
    a token that ends inside a character adds none of it and the token completing it the whole character
    (every token of a split character starts at it, as in OpenAI's legacy ``text_offset``); a byte that
    can start no character counts as one U+FFFD. A character still cut short after the last piece is
    not counted (a stream's chunk never ends inside one: the detokenizer holds such tokens back)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets = []
    for raw in pieces:
        offsets.append(offset)
        offset += len(decoder.decode(raw))
    return offsets, offset


def completion_logprobs(text: TextProcessor, entries: Sequence[TokenLogprob],
                        offset: int) -> CompletionLogprobs:
    """``choices[i].logprobs`` of a text completion; ``offset`` is the text offset (chars) of the first.
    Tokens as ``TextProcessor.logprob_token`` writes them, offsets by ``text_offsets``."""
    shown = [text.logprob_token(e.token_id) for e in entries]
    tokens = [s for s, _ in shown]
    offsets, _ = text_offsets([raw for _, raw in shown], offset)
    tops: list[dict[str, float] | None] = [
        _with_chosen([(text.logprob_token(t)[0], lp) for t, lp in e.top], s, e.logprob)
        for e, s in zip(entries, tokens, strict=True)]
    return CompletionLogprobs(tokens, [e.logprob for e in entries], tops, offsets)


def _with_chosen(best: list[tuple[str, float]], token: str, logprob: float) -> dict[str, float]:
    """A completions ``top_logprobs`` entry, keyed by token text: the ``logprobs`` best alternatives
    (``best``, best first; of two with the same text the better one's value) and the chosen (or prompt)
    token itself, as OpenAI's legacy API always returns it (up to ``logprobs`` + 1 entries); under its
    own text the chosen token's logprob, also where an alternative of another id has that text."""
    top: dict[str, float] = {}
    for text, value in best:
        top.setdefault(text, value)
    top[token] = logprob
    return top


def echo_logprobs(text: TextProcessor, prompt_ids: Sequence[int], entries: Sequence[PromptLogprob],
                  top: int) -> CompletionLogprobs:
    """The prompt's part of a text completion's logprobs with ``echo``: each prompt token's text, its
    logprob and its ``top`` best alternatives (null for the first token: it has no prefix), offsets from
    0 (the echoed prompt starts the choice's text).

    Raises:
        ValueError: ``entries`` is not one per prompt token after the first.
    """
    if len(entries) != len(prompt_ids) - 1:
        raise ValueError(f"{len(entries)} prompt logprob entries for a prompt of {len(prompt_ids)} tokens")
    shown = [text.logprob_token(t) for t in prompt_ids]
    tokens = [s for s, _ in shown]
    offsets, _ = text_offsets([raw for _, raw in shown], 0)
    values: list[float | None] = [None, *(e.logprob for e in entries)]
    tops: list[dict[str, float] | None] = [None, *(
        _with_chosen([(text.logprob_token(t.token_id)[0], t.logprob) for t in e.top_logprobs[:top]], s,
                     e.logprob)
        for e, s in zip(entries, tokens[1:], strict=True))]
    return CompletionLogprobs(tokens, values, tops, offsets)


def joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    """``first``'s entries followed by ``then``'s (offsets kept as they are)."""
    return CompletionLogprobs(first.tokens + then.tokens, first.token_logprobs + then.token_logprobs,
                              first.top_logprobs + then.top_logprobs, first.text_offset + then.text_offset)


def vllm_prompt_logprobs(text: TextProcessor, prompt_ids: Sequence[int], entries: Sequence[PromptLogprob],
                         top: int) -> list[dict[str, PromptTokenLogprob] | None]:
    """vLLM's ``prompt_logprobs`` of a choice: None for the first prompt token, then per token a map
    token id → ``PromptTokenLogprob``: the prompt token first (its rank in the vocabulary), then its
    ``top`` best alternatives (ranks 1..top).

    Raises:
        ValueError: ``entries`` is not one per prompt token after the first.
    """
    if len(entries) != len(prompt_ids) - 1:
        raise ValueError(f"{len(entries)} prompt logprob entries for a prompt of {len(prompt_ids)} tokens")
    out: list[dict[str, PromptTokenLogprob] | None] = [None]
    for token, e in zip(prompt_ids[1:], entries, strict=True):
        entry = {str(token): PromptTokenLogprob(e.logprob, e.rank, text.token_text(token))}
        for rank, t in enumerate(e.top_logprobs[:top], start=1):
            alt = PromptTokenLogprob(t.logprob, rank, text.token_text(t.token_id))
            entry.setdefault(str(t.token_id), alt)
        out.append(entry)
    return out


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
    """One choice's accumulated output: text, tokens counted, finish reason, logprob entries, and the
    prompt logprobs its first token came with (None unless asked)."""

    index: int
    text: str = ""
    num_tokens: int = 0
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] | None = None


def prompt_entries(entries: list[PromptLogprob] | None) -> list[PromptLogprob]:
    """The prompt logprobs a worker sent. Raises ``APIError`` 502 when it sent none though asked."""
    if entries is None:
        raise upstream_failed("the worker sent no prompt logprobs")
    return entries


def completion_choice_logprobs(p: Prepared, text: TextProcessor, c: ChoiceInput,
                               entries: Sequence[TokenLogprob], offset: int,
                               prompt: list[PromptLogprob] | None, first: bool) -> CompletionLogprobs | None:
    """A text completion choice's (or chunk's) ``logprobs``: ``entries`` from ``offset`` (chars), after
    the echoed prompt's entries on the ``first`` chunk of an ``echo`` request with logprobs."""
    if p.logprobs is None:
        return None
    out = completion_logprobs(text, entries, offset)
    if p.echo_logprobs and first:
        out = joined(echo_logprobs(text, c.inp.prompt_token_ids, prompt_entries(prompt), p.logprobs), out)
    return out


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
        vllm_chat = None if p.prompt_logprobs is None else vllm_prompt_logprobs(
            text, p.choices[0].inp.prompt_token_ids, prompt_entries(states[0].prompt_logprobs),
            p.prompt_logprobs)
        return ChatCompletion(response_id(p), "chat.completion", created, p.model, chat, used, vllm_chat)
    choices = []
    for s, c in zip(states, p.choices, strict=True):
        lp = completion_choice_logprobs(p, text, c, s.logprobs, len(c.echo_text), s.prompt_logprobs, True)
        vllm = None if p.prompt_logprobs is None else vllm_prompt_logprobs(
            text, c.inp.prompt_token_ids, prompt_entries(s.prompt_logprobs), p.prompt_logprobs)
        choices.append(CompletionChoice(s.index, c.echo_text + s.text, lp, s.finish_reason, vllm))
    return Completion(response_id(p), "text_completion", created, p.model, choices, used)


def chunk_choice(p: Prepared, text: TextProcessor, index: int, content: str | None,
                 finish: FinishReason | None, entries: Sequence[TokenLogprob], offset: int,
                 role: bool = False, echo: CompletionLogprobs | None = None) -> ChunkChoice:
    """One choice of a streaming chunk. Chat: ``delta`` with ``role`` (first chunk only; its ``content`` is
    null where a ``required`` or named ``tool_choice`` makes the output tool calls alone) and ``content``;
    completions: ``text``. ``offset`` (chars) feeds the completions ``text_offset``; ``echo``: the
    echoed prompt's logprobs, put before ``entries``' (the choice's first chunk)."""
    if p.chat:
        lp = chat_logprobs(text, entries) if p.logprobs is not None and entries else None
        if role:  # OpenAI's first chunk: content "" unless the output is tool calls alone (then null)
            delta = ChatDelta("assistant", None if p.output.only_tool_calls else content or "")
        else:
            delta = ChatDelta(content=content or msgspec.UNSET)
        return ChatChunkChoice(index, delta, lp, finish)
    clp = completion_logprobs(text, entries, offset) if p.logprobs is not None and (entries or echo) else None
    if echo is not None and clp is not None:
        clp = joined(echo, clp)
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
    """One SSE event of a chunk holding ``choice`` (None: no choice, the final chunk with the usage);
    with ``include_usage`` a chunk with a choice has ``usage``: null, else no ``usage`` key."""
    chunk: ChatCompletionChunk | CompletionChunk
    usage = final_usage if choice is None else None if p.include_usage else msgspec.UNSET
    if p.chat:
        assert choice is None or isinstance(choice, ChatChunkChoice)
        chunk = ChatCompletionChunk(response_id(p), "chat.completion.chunk", created, p.model,
                                    [] if choice is None else [choice], usage)
    else:
        assert choice is None or isinstance(choice, CompletionChoice)
        chunk = CompletionChunk(response_id(p), "text_completion", created, p.model,
                                [] if choice is None else [choice], usage)
    return b"data: " + encode(chunk) + b"\n\n"
