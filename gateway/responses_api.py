"""POST /v1/responses (OpenAI Responses API, stateless): the request body and its translation into a chat
completion request (which then goes through prepare/serving like any other).

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
``output_text`` parts), ``function_call`` items (an earlier call of the model),
``function_call_output`` items (its result: a string or ``input_text`` parts, whose texts are joined)
and ``reasoning`` items (earlier reasoning, given to the chat template as the next assistant turn's
``reasoning_content``): every item of a response's ``output`` is valid input as it was returned. Each
``function_call_output`` answers a ``function_call`` earlier in ``input`` and each ``function_call`` has
an output later in it (``check_call_outputs``; a 400 naming ``input.N`` otherwise).
``instructions`` becomes a leading system message.
``user`` and ``safety_identifier`` are accepted and ignored by design, as on chat (end-user ids for a
provider's abuse monitoring), as is ``service_tier`` ``auto`` / ``default`` (any other tier is a 400,
as on chat). ``max_tool_calls`` limits calls to OpenAI's built-in tools; pdserve has none (function
calls are not counted by it, on OpenAI either), so any value is met. ``background: true``,
``conversation``, ``prompt``, ``prompt_cache_key``, ``prompt_cache_retention``, ``context_management``,
``stream_options.include_obfuscation: true`` and ``text.verbosity`` are 400s naming the field
(``UNSUPPORTED``). A tool other than a function tool (OpenAI's built-in tools) and an image, file or
audio part of a message or of a ``function_call_output``'s ``output`` are 400s naming their ``type``
(``openai_requests.check_type``).

The ``response`` object and its streaming events: gateway/responses_output.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from gateway.errors import bad_request
from gateway.openai_requests import (
    FUNCTION_NAME,
    INT32_MAX,
    TEXT_MODELS,
    FunctionDefinition,
    NullIsDefault,
    check_metadata,
    check_type,
)

# content part types of OpenAI's Responses input messages that pdserve cannot honour, and why
PARTS_NOT_SUPPORTED = {"input_image": TEXT_MODELS, "input_file": TEXT_MODELS, "input_audio": TEXT_MODELS,
                       "refusal": "send the assistant's text as 'output_text' parts"}
# part types of a function_call_output's output that pdserve cannot honour, and why
OUTPUT_PARTS_NOT_SUPPORTED = {"input_image": TEXT_MODELS, "input_file": TEXT_MODELS,
                              "input_audio": TEXT_MODELS}


class InputText(BaseModel):
    """A text part of an input message: ``input_text`` (or ``output_text`` in an assistant turn, as a
    response's message item holds it: ``annotations`` and ``logprobs`` are accepted and not used, since
    they describe the text rather than ask for anything)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return check_type(value, ("input_text", "output_text"), "content parts", PARTS_NOT_SUPPORTED)


class InputMessage(NullIsDefault):
    """A message item of ``input``."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(BaseModel):
    """A ``function_call`` item of ``input``: an earlier tool call of the model."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class ReasoningPart(BaseModel):
    """A ``reasoning_text`` part (``content``) or ``summary_text`` part (``summary``) of a reasoning item."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningInputItem(NullIsDefault):
    """A ``reasoning`` item of ``input`` (an earlier response's reasoning, sent back): its text (the
    ``content`` parts, else the ``summary`` parts) becomes the ``reasoning_content`` of the assistant
    turn that follows it. ``encrypted_content`` (never produced by pdserve) is refused by
    ``check_supported``."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["reasoning"]
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    encrypted_content: str | None = None
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        """The reasoning text: the ``content`` parts joined, else the ``summary`` parts joined."""
        return "".join(p.text for p in (self.content or self.summary))


class OutputTextPart(BaseModel):
    """An ``input_text`` part of a ``function_call_output``'s ``output`` (an image, file or audio part is
    a 400 ``unsupported_parameter`` naming its ``type``, as a message's is)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["input_text"]
    text: str

    @field_validator("type", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return check_type(value, ("input_text",), "content parts", OUTPUT_PARTS_NOT_SUPPORTED)


class FunctionCallOutputItem(BaseModel):
    """A ``function_call_output`` item of ``input``: the result of the call ``call_id``, a string or a
    list of ``input_text`` parts (their texts joined)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[OutputTextPart]
    id: str | None = None
    status: str | None = None


class ResponsesFunctionTool(FunctionDefinition):
    """A function tool of the Responses API (flat: ``type``, ``name``, ``description``,
    ``parameters``, ``strict``). Any other tool type (OpenAI's built-in tools: ``web_search``,
    ``file_search``, ...) is a 400 ``unsupported_parameter`` naming ``tools.<i>.type``."""

    type: Literal["function"]

    @field_validator("type", mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        return check_type(value, ("function",), "tools", {}, "pdserve supports only function tools")


class ResponsesToolChoiceFunction(BaseModel):
    """``tool_choice: {"type": "function", "name": ...}`` (another type, e.g. a built-in tool's, is a 400
    ``unsupported_parameter`` naming ``tool_choice.type``)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    name: str

    @field_validator("type", mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        return check_type(value, ("function",), "tool choices", {}, "pdserve supports only function tools")


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name`` and ``schema`` required,
    ``strict``, ``description``, flat in it; ``name`` as chat's ``response_format.json_schema.name``:
    letters, digits, ``_`` and ``-``, at most 64)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=FUNCTION_NAME)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _check_keys(self) -> TextFormat:
        """``json_schema`` needs ``name`` and ``schema`` (both required by OpenAI's Responses API); the
        other types take none of the four keys (they would be ignored)."""
        given = [key for key, attr in (("name", "name"), ("description", "description"),
                                       ("schema", "json_schema"), ("strict", "strict"))
                 if getattr(self, attr) is not None]
        if self.type != "json_schema" and given:
            raise ValueError(f"{', '.join(given)} only go with type json_schema, not {self.type}")
        missing = [key for key in ("name", "schema") if key not in given]
        if self.type == "json_schema" and missing:
            raise ValueError(f"type json_schema needs {' and '.join(missing)}")
        return self


class TextConfig(BaseModel):
    """``text``: its ``format``; ``verbosity`` is declared only to be refused by name (``UNSUPPORTED``)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    format: TextFormat | None = None
    verbosity: Any = None


class ReasoningConfig(BaseModel):
    """``reasoning``: ``summary`` (``auto``/``detailed``: the reasoning text as the summary; ``concise``
    a 400), ``effort`` (a 400 unless null), ``generate_summary`` (its deprecated name: as ``summary``)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None

    @property
    def wanted_summary(self) -> str | None:
        """The summary asked for (``summary``, else ``generate_summary``)."""
        return self.summary or self.generate_summary


class ResponsesStreamOptions(BaseModel):
    """``stream_options``: ``include_obfuscation`` (pdserve pads no events: false or absent)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    include_obfuscation: bool | None = None


LOGPROBS_INCLUDE = "message.output_text.logprobs"
# field → (is this value harmless, why pdserve cannot honour another); chat's service_tier rule
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "background": (lambda v: not v, "pdserve answers every request in the foreground (stream it instead)"),
    "conversation": (lambda v: v is None, "pdserve is stateless and stores no conversations (send the whole "
                                          "conversation as input)"),
    "prompt_cache_key": (lambda v: v is None, "pdserve's prefix cache needs no key (it matches prompts by "
                                              "their tokens)"),
    "prompt_cache_retention": (lambda v: v is None, "pdserve keeps cached prefixes while KV blocks last"),
    "prompt": (lambda v: v is None, "pdserve stores no prompt templates"),
    "context_management": (lambda v: v is None, "pdserve does not compact the context"),
    "service_tier": (lambda v: v is None or v in ("auto", "default"),
                     "pdserve has one service tier ('auto' or 'default')"),
    "stream_options.include_obfuscation": (lambda v: not v, "pdserve pads no streaming events"),
    "text.verbosity": (lambda v: v is None, "pdserve cannot set a model's verbosity"),
}


def _item_type(item: Any) -> str:
    """The ``type`` of an ``input`` item (a message item may leave it out)."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return kind if isinstance(kind, str) else ""


# tagged by ``type``, so a bad item's error names its own fields, not every kind's
InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningInputItem, Tag("reasoning")],
    Discriminator(_item_type, custom_error_type="input_item_type", custom_error_message=(
        "type must be one of 'message', 'function_call', 'function_call_output', 'reasoning'"))]


class ResponsesRequest(NullIsDefault):
    """POST /v1/responses body (stateless subset; module docstring)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    max_tool_calls: int | None = Field(None, ge=0, le=INT32_MAX)
    stream_options: ResponsesStreamOptions | None = None
    # OpenAI fields pdserve cannot honour: declared only to be refused by name (UNSUPPORTED)
    background: bool | None = None
    conversation: Any = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Any = None
    prompt: Any = None
    context_management: Any = None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(value)

    @property
    def wants_logprobs(self) -> bool:
        """Whether ``include`` asks for the output text's logprobs."""
        return LOGPROBS_INCLUDE in (self.include or ())

    @property
    def wants_summary(self) -> bool:
        """Whether ``reasoning`` asks for a summary (``auto`` or ``detailed``)."""
        return self.reasoning is not None and self.reasoning.wanted_summary is not None


def check_call_outputs(items: list[InputItem]) -> None:
    """OpenAI's pairing of ``function_call`` and ``function_call_output`` items in an input: each output
    answers a call earlier in the input (by ``call_id``) and each call has an output later in it;
    anything may come between (a response's own output, e.g. a call, a message, another call, is
    valid input as it was returned).

    Raises:
        APIError: 400 naming ``input.N`` (the output for no earlier call, or the call without an output).
    """
    calls: dict[str, int] = {}  # call_id -> position of its function_call item
    answered: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            calls.setdefault(item.call_id, i)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise bad_request(f"input.{i}: a function_call_output for call_id {item.call_id!r}, which no "
                                  "function_call before it has", f"input.{i}")
            answered.add(item.call_id)
    for call_id, i in calls.items():
        if call_id not in answered:
            raise bad_request(f"input.{i}: the function_call {call_id!r} has no function_call_output "
                              "after it", f"input.{i}")


def check_supported(body: ResponsesRequest) -> None:
    """Refuse what pdserve cannot honour of ``include``, ``top_logprobs``, ``reasoning`` and ``truncation``.

    Raises:
        APIError: 400 naming ``include`` (a value other than ``message.output_text.logprobs``),
            ``top_logprobs`` (without that value), ``input.N`` (a function call and its output that do not
            pair: ``check_call_outputs``), ``reasoning.effort`` (set),
            ``reasoning.summary`` / ``reasoning.generate_summary`` (``concise``) or ``truncation``
            (``auto``), ``input.N.encrypted_content`` (set), an ``UNSUPPORTED`` field set to a value
            that asks for something, or ``stream_options`` without ``stream``.
    """
    for name, (harmless, why) in UNSUPPORTED.items():
        head, _, key = name.partition(".")
        value = getattr(body, head)
        value = getattr(value, key) if key and value is not None else value
        if not harmless(value):
            raise bad_request(f"{name} is not supported: {why}", name, "unsupported_parameter")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(body.input, str):
        check_call_outputs(body.input)
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
    for i, item in enumerate(body.input if isinstance(body.input, list) else ()):
        if isinstance(item, ReasoningInputItem) and item.encrypted_content is not None:
            raise bad_request("encrypted_content of a reasoning item is not supported (pdserve never "
                              "produces it; send the reasoning's content or summary)",
                              f"input.{i}.encrypted_content", "unsupported_parameter")
    if body.truncation == "auto":
        raise bad_request("truncation: 'auto' is not supported (pdserve drops no input items; a prompt over "
                          "the context length is a 400)", "truncation", "unsupported_parameter")


def _input_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """The chat messages of ``input`` items: a message item as a message of its role (text parts
    joined), ``function_call`` items as the ``tool_calls`` of the assistant turn they follow (one
    of their own when none precedes them: a response's text and calls are one turn), a
    ``function_call_output`` as a ``tool`` message, a ``reasoning`` item as the ``reasoning_content``
    of the assistant turn that follows (an assistant turn of its own when another role's item or
    nothing follows)."""
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    for item in items:
        if isinstance(item, ReasoningInputItem):
            reasoning = (reasoning or "") + item.text()
            continue
        if reasoning is not None and not (isinstance(item, FunctionCallItem) or (
                isinstance(item, InputMessage) and item.role == "assistant")):
            # reasoning followed by another role's item belongs to no later assistant turn: its own turn
            messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
            reasoning = None
        if isinstance(item, InputMessage):
            parts = item.content
            text = parts if isinstance(parts, str) else "".join(p.text for p in parts)
            messages.append({"role": item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if reasoning is None and last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the text and calls of one turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        if reasoning is not None and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = reasoning
            reasoning = None
    if reasoning is not None:
        messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
    return messages


def chat_body(body: ResponsesRequest) -> dict[str, Any]:
    """The chat completion request body equivalent to ``body`` (validated by the caller as a
    ``ChatCompletionRequest``); ``store`` / ``previous_response_id`` must have been refused before."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        messages += _input_messages(body.input)
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
        schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.json_schema}
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
    """The Responses field of a chat request field named by a 400 (``PARAMS``; a tool's
    ``tools.<i>.function.<field>`` is ``tools.<i>.<field>``; others unchanged)."""
    if param is None:
        return None
    parts = param.split(".")
    if parts[0] == "tools" and len(parts) > 2 and parts[2] == "function":  # Responses tools are flat
        return ".".join(parts[:2] + parts[3:])
    head, _, rest = param.partition(".")
    mapped = PARAMS.get(head)
    if mapped is None:
        return param
    if head == "response_format":  # text.format holds json_schema's keys flat
        rest = rest.removeprefix("json_schema").removeprefix(".")
    return mapped + ("." + rest if rest and head != "messages" else "")
