"""Request bodies of the OpenAI HTTP API (pydantic, used at the HTTP edge only; the response types are in
gateway/openai_responses.py).

Fields follow the OpenAI API reference (Chat Completions and legacy Completions), plus vLLM's extra
sampling fields (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``, ``chat_template_kwargs``, ``structured_outputs``). Nothing is silently ignored: an
unknown field is a 400 naming it (``extra="forbid"``), and an OpenAI field pdserve does not implement yet
(``NOT_SUPPORTED``: the deprecated ``functions``, audio, ...) is declared here only so that
``unsupported_fields`` can refuse it with a 400 saying so (a harmless value, e.g. ``functions: []``,
passes). Tools (``tools``, ``tool_choice``, ``parallel_tool_calls``) are checked against each other and
the model in gateway/tool_request.py; ``response_format`` and ``structured_outputs`` are checked and mapped
in gateway/structured_output.py.
``user``, ``safety_identifier``, ``metadata`` and ``store: false`` are accepted and ignored by design
(end-user ids for abuse monitoring, and tags of stored completions, which pdserve never stores).
Types are strict (``strict=True``), as OpenAI's JSON Schema checks are: an integer field takes a JSON
integer only (not ``"3"``, ``3.0`` or ``true``), a boolean a JSON boolean (not ``"true"`` or ``1``), a number
field a JSON integer or number (not ``"1"``), a string a JSON string; a 400 names the field, the type
expected and the JSON type sent (gateway/validation_message.py). ``logit_bias`` keys are token ids
written as JSON object keys (strings). Integers are bounded so that every accepted value fits the
msgpack wire (int64) and floats must be finite (no NaN/Infinity): a bad value is a 400, never a 5xx.
Caps that depend on the deployment (``--max-n``, ``--max-stop``, the vocabulary, the context length) are
checked later, in ``gateway/prepare.py``, which also maps a body into the engine's ``SamplingParams``
(the one type the workers receive).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator
from pydantic_core import PydanticCustomError

from engine.sampling_params import MAX_LOGPROBS

INT64_MAX = (1 << 63) - 1
INT32_MAX = (1 << 31) - 1
MAX_STOP_CHARS = 1024  # characters per stop string
# keys of an assistant message in a response that a client may send back with the history
MESSAGE_NOT_SUPPORTED = ("function_call", "refusal", "audio", "annotations")
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for a function's name


# the error types of ``check_type``: gateway/validation_message.py names such an error alone, first
UNSUPPORTED_TYPE, UNKNOWN_TYPE = "unsupported_parameter", "unknown_type"
TEXT_MODELS = "pdserve serves text models (send the content as text)"
# content part types of OpenAI's chat messages that pdserve cannot honour, and why
CHAT_PARTS_NOT_SUPPORTED = {"image_url": TEXT_MODELS, "input_audio": TEXT_MODELS, "file": TEXT_MODELS,
                            "refusal": "send the assistant's text as 'text' parts"}


def check_type(value: Any, allowed: tuple[str, ...], what: str, not_supported: Mapping[str, str],
               otherwise: str | None = None) -> Any:
    """``value`` (the ``type`` of an item: a content part, a tool) when it is one of ``allowed`` (or no
    string: the field's own type check answers); else a validation error of that ``type`` key in one
    sentence, which the 400 names alone (the item's other keys' errors follow from its type): code
    ``unsupported_parameter`` for an OpenAI type pdserve cannot honour (``not_supported``: type → why;
    ``otherwise``: why, for every other type), ``unknown_type`` for any other value."""
    if not isinstance(value, str) or value in allowed:
        return value
    why = not_supported.get(value, otherwise)
    if why is not None:
        raise PydanticCustomError(UNSUPPORTED_TYPE, "'{kind}' {what} are not supported: {why}",
                                  {"kind": value, "what": what, "why": why})
    raise PydanticCustomError(UNKNOWN_TYPE, "type must be {allowed}, not '{kind}'",
                              {"kind": value, "allowed": " or ".join(map(repr, allowed))})


def _is_number(text: str) -> bool:
    """``text`` reads as a number to Python (``int`` or ``float``: " 17 ", "1_7", "17.0", "1e3")."""
    try:
        float(text)
    except ValueError:
        return False
    return True


# OpenAI's limits of ``metadata``: pairs, characters of a key, characters of a value
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def check_metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    """``metadata`` within OpenAI's limits (``MAX_METADATA_*``), else a validation error of the field
    (a 400 naming ``metadata``) saying which limit."""
    if value is None:
        return None
    limits = (f"at most {MAX_METADATA_PAIRS} pairs, keys of at most {MAX_METADATA_KEY} characters and "
              f"string values of at most {MAX_METADATA_VALUE}")
    if len(value) > MAX_METADATA_PAIRS:
        raise PydanticCustomError("metadata", "{limits}: {n} pairs given",
                                  {"limits": limits, "n": len(value)})
    for key, text in value.items():
        if len(key) > MAX_METADATA_KEY:
            raise PydanticCustomError("metadata", "{limits}: key '{key}...' has {n} characters",
                                      {"limits": limits, "key": key[:20], "n": len(key)})
        if len(text) > MAX_METADATA_VALUE:
            raise PydanticCustomError("metadata", "{limits}: the value of key '{key}' has {n} characters",
                                      {"limits": limits, "key": key, "n": len(text)})
    return value


class NullIsDefault(BaseModel):
    """Base of the request bodies and of their parts: JSON ``null`` given for a field whose type does not
    take None and whose default is not None means that default, as OpenAI's reference makes its
    optional fields nullable (the ``openai`` client sends ``temperature=None`` as ``null``; vLLM takes
    it). A field whose type takes None keeps its null (completions ``max_tokens: null``: up to the
    context length, as on vLLM); a required field's ``null`` is still refused with pydantic's error
    naming the field."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaulted = _defaulted_keys(cls)
        return {k: v for k, v in data.items() if not (v is None and k in defaulted)}


@functools.cache
def _defaulted_keys(model: type[BaseModel]) -> frozenset[str]:
    """The keys of ``model``'s fields whose null means their default (``NullIsDefault``): its alias, and
    its name only where the model takes names beside aliases."""
    config = model.model_config
    alias_only = not config.get("populate_by_name") and not config.get("validate_by_name")
    keys: set[str] = set()
    for name, f in model.model_fields.items():
        if not f.is_required() and f.default is not None and type(None) not in get_args(f.annotation):
            keys |= {name} if not f.alias else {f.alias} if alias_only else {f.alias, name}
    return frozenset(keys)


class StreamOptions(NullIsDefault):
    """``stream_options``: ``include_usage`` adds a final chunk with usage and empty ``choices``;
    ``include_obfuscation`` is accepted false or null (pdserve pads no chunks; true is refused in
    gateway/prepare.py)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool | None = None


class ContentPart(BaseModel):
    """One text part of a message's content (only ``type: text`` is supported: an image, audio, file or
    refusal part is a 400 ``unsupported_parameter`` naming its ``type``)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text"]
    text: str

    @field_validator("type", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return check_type(value, ("text",), "content parts", CHAT_PARTS_NOT_SUPPORTED)


class ToolCallFunction(BaseModel):
    """The function of a tool call in an assistant message: name and arguments (a JSON text)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    name: str
    arguments: str


class MessageToolCall(NullIsDefault):
    """One tool call of an assistant message sent back with the history."""

    model_config = ConfigDict(strict=True, extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One chat message; content as a string or a list of text parts.

    An assistant message may carry ``tool_calls`` (its content may then be null) and
    ``reasoning_content`` (its reasoning, as a response returned it: given to the chat template, which
    may render or drop it, e.g. Qwen3's keeps only the latest turn's); a ``tool`` message is
    the result of one call and carries its ``tool_call_id``. ``name`` goes to the chat template, and is
    refused where the template does not render it (gateway/prepare.py). The keys an assistant message of
    a response carries back into the history (``function_call``, ``refusal``, ``audio``, ``annotations``)
    are accepted only empty (null or ``[]``): another value is a 400 naming the key, on every endpoint
    that takes messages (``prepare.check_message_keys``). Any other key is refused.

    Raises (validation, a 400 naming the message): content null outside an assistant message with tool
    calls, ``tool_calls`` or ``reasoning_content`` on another role, a ``tool`` message without
    ``tool_call_id``, ``tool_call_id`` on another role.
    """

    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    function_call: Any = None
    refusal: Any = None
    audio: Any = None
    annotations: Any = None

    @model_validator(mode="after")
    def _check_roles(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls is only allowed on an assistant message, not {self.role}")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be null only in an assistant message with tool_calls")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError(f"reasoning_content is only allowed on an assistant message, not {self.role}")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id, and only a tool message may have one")
        return self

    def unsupported_keys(self) -> list[str]:
        """The keys of ``MESSAGE_NOT_SUPPORTED`` this message sets to something (not null, not ``[]``)."""
        return [key for key in MESSAGE_NOT_SUPPORTED if getattr(self, key) not in (None, [])]

    def text(self) -> str:
        """The content as one string (null: empty)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message for the chat template (transformers' shape): role and content (None kept for an
        assistant message with only tool calls), ``tool_calls`` with each call's arguments decoded into
        an object (templates write them with ``tojson``; arguments that are not a JSON object stay text),
        ``tool_call_id``, ``reasoning_content`` and ``name`` when set."""
        out: dict[str, Any] = {"role": self.role, "content": None if self.content is None else self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _decoded(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.name is not None:
            out["name"] = self.name
        return out


def _decoded(arguments: str) -> dict[str, Any] | str:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


class FunctionDefinition(BaseModel):
    """A function tool: ``name`` (OpenAI's rule: letters, digits, ``_``, ``-``, at most 64), an optional
    ``description``, ``parameters`` (a JSON Schema, checked in gateway/tool_request.py) and ``strict``
    (true: under ``tool_choice`` ``auto`` the calls the model writes are constrained to the tools, this
    one's arguments to ``parameters``: gateway/tool_grammar.py; false or absent: not strict; ``required``
    and a named choice constrain every tool's arguments regardless; README "Tools")."""

    model_config = ConfigDict(strict=True, extra="forbid")

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(BaseModel):
    """One entry of ``tools`` (only ``type: function``; any other, e.g. ``custom``, is a 400
    ``unsupported_parameter`` naming ``tools.<i>.type``)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition

    @field_validator("type", mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        return check_type(value, ("function",), "tools", {}, "pdserve supports only function tools")


class NamedFunction(BaseModel):
    """The function a named ``tool_choice`` forces."""

    model_config = ConfigDict(strict=True, extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}`` (another type, e.g. ``custom``, is a
    400 ``unsupported_parameter`` naming ``tool_choice.type``)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    function: NamedFunction

    @field_validator("type", mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        return check_type(value, ("function",), "tool choices", {}, "pdserve supports only function tools")


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JSONSchemaFormat(NullIsDefault):
    """``response_format.json_schema``: OpenAI's ``name`` (required; letters, digits, ``_`` and ``-``, at
    most 64, OpenAI's rule for a function's name), ``description``, ``schema`` and ``strict`` (pdserve
    always enforces the schema, strict or not)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: ``text``, ``json_object`` or ``json_schema`` (with ``json_schema`` set)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class GenerationRequestBase(NullIsDefault):
    """Fields shared by both endpoints (model, choices, streaming, stops, sampling); ranges as in the
    OpenAI reference.

    ``seed`` is an int64; choice ``i`` of ``n`` samples with ``seed + i`` (wrapped into int64), so a
    seeded request is reproducible choice by choice. ``logit_bias`` maps token ids (JSON object keys) to
    an additive bias in [-100, 100] on the logits (ids checked against the vocabulary in prepare.py).
    ``user``, ``safety_identifier``, ``metadata`` (within OpenAI's limits: ``check_metadata``) and
    ``store: false`` are accepted and ignored by design (``store: true`` is refused in prepare.py); the
    ``NOT_SUPPORTED`` fields are refused by ``unsupported_fields`` unless harmless.
    """

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    model: str
    n: int = Field(1, ge=1, le=INT32_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=INT32_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    stop_token_ids: list[int] | None = None
    logit_bias: dict[Annotated[int, Strict(False)], float] | None = None  # JSON keys are strings: "17"
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # OpenAI fields not implemented yet: declared only to be refused by name (unsupported_fields)
    service_tier: Any = None
    prompt_cache_key: Any = None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(value)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_id_keys(cls, value: Any) -> Any:
        """A key is a token id written in decimal digits ("17", "-1" for the vocabulary check to refuse):
        not "17.0", " 17 " or "1_7", which int() would read as 17 and fold into another key."""
        if isinstance(value, dict):  # a key that is no number at all gets pydantic's error, one per key
            bad = [k for k in value
                   if isinstance(k, str) and not re.fullmatch(r"-?[0-9]+", k) and _is_number(k)]
            if bad:
                raise PydanticCustomError("logit_bias", "keys must be token ids in decimal digits, got {key}",
                                          {"key": repr(bad[0])})
        return value

    def stop_list(self) -> list[str]:
        """``stop`` as a list (OpenAI accepts a string or a list)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def unsupported_fields(self) -> list[str]:
        """The fields set to a value pdserve cannot honour yet (``NOT_SUPPORTED``, in its order)."""
        return [name for name, harmless in NOT_SUPPORTED.items()
                if name in type(self).model_fields and not harmless(getattr(self, name))]


class ChatCompletionRequest(GenerationRequestBase):
    """POST /v1/chat/completions body. ``top_logprobs`` (0..20) needs ``logprobs: true``. vLLM's
    ``prompt_logprobs`` (0..20, not with ``stream``) adds the response's ``prompt_logprobs``, those of the
    rendered prompt, shaped as on completions (``CompletionRequest``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # OpenAI fields not implemented yet: declared only to be refused by name (unsupported_fields)
    functions: Any = None
    function_call: Any = None
    prediction: Any = None
    audio: Any = None
    modalities: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None

    def message_dicts(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for the chat template (``ChatMessage.template_dict``)."""
        return [m.template_dict() for m in self.messages]


class CompletionRequest(GenerationRequestBase):
    """POST /v1/completions body.

    ``prompt`` is a string, a list of strings, a list of token ids, or a list of token-id lists; each
    prompt of a list gives ``n`` choices, in prompt order (choice index = prompt index * n + sample).
    ``logprobs`` (0..5) is the number of top alternatives per token (0: the sampled token's logprob only).
    ``echo`` prepends the prompt text to each choice's text (a token-id prompt decoded with its special
    tokens); with ``logprobs`` the logprobs start with the prompt's tokens (the first one's logprob and
    top alternatives null, as OpenAI's), computed by the worker that prefills the prompt.
    ``max_tokens: 0`` (only with ``echo``, as OpenAI's legacy API allowed) returns the prompt alone:
    no output token, ``finish_reason: "length"``, 0 completion tokens (the worker still samples one
    token, which is dropped). vLLM's ``prompt_logprobs`` (0..20, not with ``stream``) adds each choice's
    ``prompt_logprobs``: null for the first prompt token, then per token a map of token id →
    ``{logprob, rank, decoded_token}`` holding the prompt token and its top-N alternatives.
    ``best_of`` is accepted only equal to ``n``; ``suffix`` is refused.
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0, le=INT32_MAX)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=INT32_MAX)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


def _none(value: Any) -> bool:
    return value is None


def _no_tools(value: Any) -> bool:
    return value is None or value == []


NOT_SUPPORTED: dict[str, Callable[[Any], bool]] = {
    # field -> is this value harmless (nothing to do)?
    "functions": _no_tools,
    "function_call": lambda v: v is None or v == "none",
    "prediction": _none,
    "audio": _none,
    "modalities": lambda v: v is None or v == ["text"],
    "reasoning_effort": _none,
    "verbosity": _none,
    "web_search_options": _none,
    "service_tier": lambda v: v is None or v in ("auto", "default"),
    "prompt_cache_key": _none,
}


class TokenizeRequest(NullIsDefault):
    """POST /tokenize body (vLLM's shape): exactly one of ``prompt`` (text; ``add_special_tokens``
    defaults to true) or ``messages`` (rendered with the chat template like a chat completion, with
    ``add_generation_prompt`` (default true) and ``chat_template_kwargs``; ``add_special_tokens``
    defaults to false: the template places them) and ``tools`` (rendered as a chat completion renders
    them). ``model`` is optional; when given it must be the served one. ``return_token_strs`` adds each
    token's vocabulary string."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[FunctionTool] | None = None
    return_token_strs: bool = False

    def message_dicts(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for the chat template (none: an empty list)."""
        return [m.template_dict() for m in self.messages or []]


class DetokenizeRequest(BaseModel):
    """POST /detokenize body (vLLM's shape): ``tokens`` (ids in the vocabulary) → their text, special
    tokens kept. ``model`` is optional; when given it must be the served one."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)
