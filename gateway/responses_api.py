"""POST /v1/responses (OpenAI Responses API, stateless): the request body, its translation into a chat
completion request (which then goes through prepare/serving like any other), and the ``response``
object and streaming events built from the chat output's parsed events.

Source: OpenAI API reference, "Responses" (create; the response object; streaming events). Stateless:
``store: true`` and ``previous_response_id`` are 400s naming the field (nothing is stored), as is any
field not declared here. ``include: ["message.output_text.logprobs"]`` (with ``top_logprobs`` 0..20
alternatives) gives the message's ``output_text`` part the logprobs of the tokens whose text it holds
(a token whose text went to reasoning or a tool call is not listed); any other ``include`` value, and
``top_logprobs`` without it, is a 400. ``reasoning.summary`` ``auto`` or ``detailed`` gives the
reasoning item a ``summary_text`` part holding the reasoning text as the model wrote it (pdserve does
not summarize, so ``concise`` is a 400, as is a ``reasoning.effort``: nothing sets a model's effort).
``truncation: "disabled"`` is the behaviour (a prompt over the context length is a 400); ``auto``
(dropping input items to fit) is a 400. ``input`` is a string (one user message) or a list of items: messages
(``role`` user / system / developer / assistant; ``content`` a string or ``input_text`` /
``output_text`` parts), ``function_call`` items (an earlier call of the model) and
``function_call_output`` items (its result). ``instructions`` becomes a leading system message.
Output items: a ``reasoning`` item (when the model's reasoning parser separated some), one ``message``
item with one ``output_text`` part (when there is text), one ``function_call`` item per tool call.
``status``: ``completed``, or ``incomplete`` with ``incomplete_details.reason: "max_output_tokens"``
when ``max_output_tokens`` ended it.

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
from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import bad_request
from gateway.openai_requests import INT32_MAX, FunctionDefinition
from gateway.openai_responses import ChatTokenLogprob
from gateway.tool_parsers.events import ContentText, Event, ReasoningText, ToolCallArguments, ToolCallStart

# ---- request --------------------------------------------------------------------------------------


class InputText(BaseModel):
    """A text part of an input message: ``input_text`` (or ``output_text`` in an assistant turn)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None


class InputMessage(BaseModel):
    """A message item of ``input``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(BaseModel):
    """A ``function_call`` item of ``input``: an earlier tool call of the model."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    """A ``function_call_output`` item of ``input``: the result of the call ``call_id``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ResponsesFunctionTool(FunctionDefinition):
    """A function tool of the Responses API (flat: ``type``, ``name``, ``description``,
    ``parameters``, ``strict``)."""

    type: Literal["function"]


class ResponsesToolChoiceFunction(BaseModel):
    """``tool_choice: {"type": "function", "name": ...}``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``, ``strict``,
    ``description`` flat in it)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    """``text``: its ``format``."""

    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None


class ReasoningConfig(BaseModel):
    """``reasoning``: ``summary`` (``auto``/``detailed``: the reasoning text as the summary; ``concise``
    a 400), ``effort`` (a 400 unless null), ``generate_summary`` (its deprecated name: as ``summary``)."""

    model_config = ConfigDict(extra="forbid")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None

    @property
    def wanted_summary(self) -> str | None:
        """The summary asked for (``summary``, else ``generate_summary``)."""
        return self.summary or self.generate_summary


LOGPROBS_INCLUDE = "message.output_text.logprobs"
InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem


class ResponsesRequest(BaseModel):
    """POST /v1/responses body (stateless subset; module docstring)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None

    @property
    def wants_logprobs(self) -> bool:
        """Whether ``include`` asks for the output text's logprobs."""
        return LOGPROBS_INCLUDE in (self.include or ())

    @property
    def wants_summary(self) -> bool:
        """Whether ``reasoning`` asks for a summary (``auto`` or ``detailed``)."""
        return self.reasoning is not None and self.reasoning.wanted_summary is not None


def check_supported(body: ResponsesRequest) -> None:
    """Refuse what pdserve cannot honour of ``include``, ``top_logprobs``, ``reasoning`` and ``truncation``.

    Raises:
        APIError: 400 naming ``include`` (a value other than ``message.output_text.logprobs``),
            ``top_logprobs`` (without that value), ``reasoning.effort`` (set),
            ``reasoning.summary`` / ``reasoning.generate_summary`` (``concise``) or ``truncation``
            (``auto``).
    """
    for i, value in enumerate(body.include or ()):
        if value != LOGPROBS_INCLUDE:
            raise bad_request(f"include: {value!r} is not supported (pdserve can include only "
                              f"{LOGPROBS_INCLUDE!r})", f"include.{i}", "unsupported_parameter")
    if body.top_logprobs is not None and not body.wants_logprobs:
        raise bad_request(f"top_logprobs requires include: [{LOGPROBS_INCLUDE!r}]", "top_logprobs")
    r = body.reasoning
    if r is not None and r.effort is not None:
        raise bad_request("reasoning.effort is not supported: pdserve cannot set a model's reasoning effort",
                          "reasoning.effort", "unsupported_parameter")
    if r is not None and r.wanted_summary == "concise":
        param = "reasoning.summary" if r.summary else "reasoning.generate_summary"
        raise bad_request(f"{param}: 'concise' is not supported: pdserve does not summarize (the summary "
                          "is the reasoning text; 'auto' or 'detailed')", param, "unsupported_parameter")
    if body.truncation == "auto":
        raise bad_request("truncation: 'auto' is not supported (pdserve drops no input items; a prompt over "
                          "the context length is a 400)", "truncation", "unsupported_parameter")


def chat_body(body: ResponsesRequest) -> dict[str, Any]:
    """The chat completion request body equivalent to ``body`` (validated by the caller as a
    ``ChatCompletionRequest``); ``store`` / ``previous_response_id`` must have been refused before."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        for item in body.input:
            if isinstance(item, InputMessage):
                parts = item.content
                text = parts if isinstance(parts, str) else "".join(p.text for p in parts)
                messages.append({"role": item.role, "content": text})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                    last["tool_calls"].append(call)  # parallel calls: one assistant turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    out: dict[str, Any] = {"model": body.model, "messages": messages, "temperature": body.temperature,
                           "top_p": body.top_p, "stream": body.stream}
    if body.stream:
        out["stream_options"] = {"include_usage": True}
    if body.max_output_tokens is not None:
        out["max_completion_tokens"] = body.max_output_tokens
    if body.wants_logprobs:
        out["logprobs"], out["top_logprobs"] = True, body.top_logprobs or 0
    if body.tools is not None:
        out["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                        for t in body.tools]
    if isinstance(body.tool_choice, ResponsesToolChoiceFunction):
        out["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        out["tool_choice"] = body.tool_choice
    if body.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = body.parallel_tool_calls
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        schema: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.json_schema or {}}
        if fmt.strict is not None:
            schema["strict"] = fmt.strict
        if fmt.description is not None:
            schema["description"] = fmt.description
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None:
        out["response_format"] = {"type": fmt.type}
    return out


# chat request fields named in a 400 → the Responses field the client set
PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
          "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
          "stream_options": "stream"}


def responses_param(param: str | None) -> str | None:
    """The Responses field of a chat request field named by a 400 (``PARAMS``; others unchanged)."""
    if param is None:
        return None
    head, _, rest = param.partition(".")
    mapped = PARAMS.get(head)
    if mapped is None:
        return param
    if head == "response_format":  # text.format holds json_schema's keys flat
        rest = rest.removeprefix("json_schema").removeprefix(".")
    return mapped + ("." + rest if rest and head != "messages" else "")


# ---- response -------------------------------------------------------------------------------------


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
    """The shortest tail of ``entries`` whose tokens' texts are at least ``length`` characters long."""
    take, size = 0, 0
    while take < len(entries) and size < length:
        take += 1
        size += len(entries[-take].token)
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
        out = self._close()
        self.status, self.usage = status, usage
        whole = msgspec.to_builtins(self.response(status, usage))
        return [*out, self._event(f"response.{status}", response=whole)]

    def _add(self, item: OutputItem) -> list[bytes]:
        self.items.append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=len(self.items) - 1,
                            item=msgspec.to_builtins(item))]

    def _close(self) -> list[bytes]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.items) - 1
        item.status = "completed"
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
