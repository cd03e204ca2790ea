"""POST /v1/responses (OpenAI Responses API): the ``response`` object and the streaming events, built from
a chat choice's parsed events (``ResponseBuilder``). The request body is gateway/responses_api.py.

Source: OpenAI API reference, "Responses" (the response object; streaming events).
Output items: a ``reasoning`` item (when the model's reasoning parser separated some), one ``message``
item with one ``output_text`` part (when there is text), one ``function_call`` item per tool call.
``status``: ``completed``, or ``incomplete`` with ``incomplete_details.reason: "max_output_tokens"``
when ``max_output_tokens`` ended it; then the last output item (the one cut) is ``incomplete`` too.

Streaming event order: ``response.created``, ``response.in_progress``; per output item
``response.output_item.added``, then (message) ``response.content_part.added``, the
``response.output_text.delta`` events, ``response.output_text.done``, ``response.content_part.done``;
(reasoning) ``response.reasoning_text.delta`` / ``.done``; (function call)
``response.function_call_arguments.delta`` / ``.done``; then ``response.output_item.done``; at the end
``response.completed`` (or ``response.incomplete``) carrying the whole response. Every event has a
``sequence_number`` counting from 0. A failure after the first event ends the stream with an ``error``
event. A reasoning item with a summary streams ``response.reasoning_summary_part.added``,
``response.reasoning_summary_text.delta`` / ``.done`` and ``response.reasoning_summary_part.done``
beside its ``reasoning_text`` events.
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

import msgspec
from pydantic import BaseModel

from gateway.openai_responses import ChatTokenLogprob
from gateway.responses_api import ResponsesRequest
from gateway.tool_parsers.events import ContentText, Event, ReasoningText, ToolCallArguments, ToolCallStart


class OutputText(msgspec.Struct):
    """An ``output_text`` content part."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[ChatTokenLogprob]


class ReasoningContent(msgspec.Struct):
    """A ``reasoning_text`` part of a reasoning item."""

    type: Literal["reasoning_text"]
    text: str


class SummaryText(msgspec.Struct):
    """A ``summary_text`` part of a reasoning item (``reasoning.summary``: the reasoning text)."""

    type: Literal["summary_text"]
    text: str


class MessageItem(msgspec.Struct, tag_field="type", tag="message"):
    """A ``message`` output item (``type: message``)."""

    id: str
    status: str
    role: Literal["assistant"]
    content: list[OutputText]


class ReasoningItem(msgspec.Struct, tag_field="type", tag="reasoning"):
    """A ``reasoning`` output item (``type: reasoning``: the text the reasoning parser separated)."""

    id: str
    summary: list[SummaryText]
    content: list[ReasoningContent]
    status: str


class FunctionCallOutput(msgspec.Struct, tag_field="type", tag="function_call"):
    """A ``function_call`` output item (``type: function_call``)."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: str


OutputItem = MessageItem | ReasoningItem | FunctionCallOutput


class InputTokensDetails(msgspec.Struct):
    """``usage.input_tokens_details``: prompt tokens found in a worker's prefix cache."""

    cached_tokens: int


class OutputTokensDetails(msgspec.Struct):
    """``usage.output_tokens_details``: reasoning tokens (not counted apart: 0)."""

    reasoning_tokens: int


class ResponseUsage(msgspec.Struct):
    """``usage`` of a response, in tokens."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    """Why a response is ``incomplete``."""

    reason: Literal["max_output_tokens"]


class ResponseTextConfig(msgspec.Struct):
    """``text`` of the response object: the format asked for (as sent)."""

    format: dict[str, Any]


class ResponseReasoning(msgspec.Struct):
    """``reasoning`` of the response object: effort (always null) and the summary asked for."""

    effort: None
    summary: str | None


class ResponseObject(msgspec.Struct):
    """``object: response``."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    tool_choice: Any
    tools: list[dict[str, Any]]
    text: ResponseTextConfig
    temperature: float
    top_p: float
    max_output_tokens: int | None
    instructions: str | None
    metadata: dict[str, str]
    store: bool
    previous_response_id: None
    incomplete_details: IncompleteDetails | None
    error: None
    usage: ResponseUsage | None
    reasoning: ResponseReasoning
    truncation: Literal["disabled"]
    top_logprobs: int | None


def _covering(entries: list[ChatTokenLogprob], length: int) -> list[ChatTokenLogprob]:
    """The shortest tail of ``entries`` whose tokens' bytes decode to at least ``length`` characters (a
    token inside a character shows as ``\\xHH`` escapes, so its ``token`` text's length is not its share
    of the text; bytes of a character the tail starts inside count for nothing)."""
    take, size = 0, 0
    while take < len(entries) and size < length:
        take += 1
        tail = b"".join(bytes(e.bytes or b"") for e in entries[len(entries) - take:])
        size = len(tail.decode("utf-8", errors="ignore"))
    return entries[len(entries) - take:]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class ResponseBuilder:
    """Turns a choice's parsed events (``gateway.tool_parsers.events``) into output items and, when
    streaming, the events that announce them. ``sequence_number`` counts the events made."""

    def __init__(self, body: ResponsesRequest, response_id: str, created_at: int) -> None:
        self.body, self.id, self.created_at = body, response_id, created_at
        self.items: list[OutputItem] = []
        self.sequence_number = 0
        self._open: OutputItem | None = None
        self._pending: list[ChatTokenLogprob] = []  # logprobs of tokens whose text is not placed yet
        self.status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
        self.usage: ResponseUsage | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"

    def response(self, status: Literal["in_progress", "completed", "incomplete"],
                 usage: ResponseUsage | None) -> ResponseObject:
        """The response object as of now (its items so far)."""
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else {
            "type": "text"}
        tools = [t.model_dump(exclude_none=True) for t in b.tools or []]
        choice: Any = (b.tool_choice.model_dump() if isinstance(b.tool_choice, BaseModel)
                       else b.tool_choice or "auto")
        return ResponseObject(
            self.id, "response", self.created_at, status, b.model, list(self.items),
            b.parallel_tool_calls is not False, choice, tools, ResponseTextConfig(fmt), b.temperature,
            b.top_p, b.max_output_tokens, b.instructions, dict(b.metadata or {}), False, None,
            IncompleteDetails("max_output_tokens") if status == "incomplete" else None, None, usage,
            ResponseReasoning(None, b.reasoning.wanted_summary if b.reasoning else None), "disabled",
            b.top_logprobs)

    def start(self) -> list[bytes]:
        """``response.created`` and ``response.in_progress``."""
        created = msgspec.to_builtins(self.response("in_progress", None))
        return [self._event("response.created", response=created),
                self._event("response.in_progress", response=created)]

    def feed(self, events: list[Event], logprobs: list[ChatTokenLogprob] | None = None) -> list[bytes]:
        """Add ``events`` (the parsed text of the tokens received now, whose logprobs are ``logprobs``)
        to the output; returns the streaming events they make. A token's logprob is listed with the
        message text its text is part of: the tokens not placed yet wait (text held back); message
        text takes the latest of them that its length covers (earlier ones were markers or dropped
        whitespace), and events of reasoning or a tool call drop them (those tokens' text went there)."""
        out: list[bytes] = []
        self._pending += logprobs or []
        placed = False
        for e in events:
            if isinstance(e, ContentText):
                if not isinstance(self._open, MessageItem):
                    out += self._close()
                    item = MessageItem(_item_id("msg"), "in_progress", "assistant",
                                       [OutputText("output_text", "", [], [])])
                    out += self._add(item)
                    out.append(self._event("response.content_part.added", item_id=item.id,
                                           output_index=len(self.items) - 1, content_index=0,
                                           part=msgspec.to_builtins(OutputText("output_text", "", [], []))))
                assert isinstance(self._open, MessageItem)
                part = self._open.content[0]
                part.text += e.text
                entries, self._pending = _covering(self._pending, len(e.text)), []
                part.logprobs += entries
                placed = True
                out.append(self._event("response.output_text.delta", item_id=self._open.id,
                                       output_index=len(self.items) - 1, content_index=0, delta=e.text,
                                       logprobs=msgspec.to_builtins(entries)))
            elif isinstance(e, ReasoningText):
                if not isinstance(self._open, ReasoningItem):
                    out += self._close()
                    summary = [SummaryText("summary_text", "")] if self.body.wants_summary else []
                    item_r = ReasoningItem(_item_id("rs"), summary, [ReasoningContent("reasoning_text", "")],
                                           "in_progress")
                    out += self._add(item_r)
                    if summary:
                        out.append(self._event("response.reasoning_summary_part.added", item_id=item_r.id,
                                               output_index=len(self.items) - 1, summary_index=0,
                                               part=msgspec.to_builtins(SummaryText("summary_text", ""))))
                assert isinstance(self._open, ReasoningItem)
                self._open.content[0].text += e.text
                out.append(self._event("response.reasoning_text.delta", item_id=self._open.id,
                                       output_index=len(self.items) - 1, content_index=0, delta=e.text))
                if self._open.summary:
                    self._open.summary[0].text += e.text
                    out.append(self._event("response.reasoning_summary_text.delta", item_id=self._open.id,
                                           output_index=len(self.items) - 1, summary_index=0, delta=e.text))
            elif isinstance(e, ToolCallStart):
                out += self._close()
                out += self._add(FunctionCallOutput(_item_id("fc"), e.id, e.name, "",
                                                    "in_progress"))
            elif isinstance(e, ToolCallArguments):
                assert isinstance(self._open, FunctionCallOutput)
                self._open.arguments += e.fragment
                out.append(self._event("response.function_call_arguments.delta", item_id=self._open.id,
                                       output_index=len(self.items) - 1, delta=e.fragment))
        if events and not placed:
            self._pending = []
        return out

    def finish(self, status: Literal["completed", "incomplete"], usage: ResponseUsage) -> list[bytes]:
        """Close the open item; ``response.completed`` (or ``.incomplete``) with the whole response."""
        out = self._close(status)
        self.status, self.usage = status, usage
        whole = msgspec.to_builtins(self.response(status, usage))
        return [*out, self._event(f"response.{status}", response=whole)]

    def _add(self, item: OutputItem) -> list[bytes]:
        self.items.append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=len(self.items) - 1,
                            item=msgspec.to_builtins(item))]

    def _close(self, status: Literal["completed", "incomplete"] = "completed") -> list[bytes]:
        """Close the open item with ``status``: ``incomplete`` only for the item that
        ``max_output_tokens`` cut (the last one); an item closed because another began is complete."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.items) - 1
        item.status = status
        out: list[bytes] = []
        if isinstance(item, MessageItem):
            part = item.content[0]
            out.append(self._event("response.output_text.done", item_id=item.id, output_index=index,
                                   content_index=0, text=part.text,
                                   logprobs=msgspec.to_builtins(part.logprobs)))
            out.append(self._event("response.content_part.done", item_id=item.id, output_index=index,
                                   content_index=0, part=msgspec.to_builtins(part)))
        elif isinstance(item, ReasoningItem):
            out.append(self._event("response.reasoning_text.done", item_id=item.id, output_index=index,
                                   content_index=0, text=item.content[0].text))
            for summary in item.summary:
                out.append(self._event("response.reasoning_summary_text.done", item_id=item.id,
                                       output_index=index, summary_index=0, text=summary.text))
                out.append(self._event("response.reasoning_summary_part.done", item_id=item.id,
                                       output_index=index, summary_index=0,
                                       part=msgspec.to_builtins(summary)))
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item.id,
                                   output_index=index, name=item.name, arguments=item.arguments))
        out.append(self._event("response.output_item.done", output_index=index,
                               item=msgspec.to_builtins(item)))
        return out

    def error_event(self, message: str, code: str | None) -> bytes:
        """An ``error`` event (a failure after the stream started)."""
        return self._event("error", message=message, code=code, param=None)
