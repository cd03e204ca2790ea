"""Response bodies of the OpenAI HTTP API: one msgspec Struct per shape, encoded with ``msgspec.json`` by
the handlers and, through ``openapi_components``, the schemas of ``/openapi.json``.

Shapes: OpenAI API reference (chat.completion, chat.completion.chunk, text_completion whole and as
stream chunks, the two logprobs layouts, model list and model, error object; vLLM's tokenize and
detokenize). Every field is always present in the
JSON (``null`` when empty) except where a Struct says ``omit_defaults``: a chat chunk's ``delta`` holds
only what is new (``role`` on a choice's first chunk, ``content``, ``reasoning_content`` or
``tool_calls`` when there is some), an assistant message has ``reasoning_content`` and ``tool_calls``
only when there are some, and a chunk has ``usage`` only with ``stream_options.include_usage`` (null
but in the last chunk).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

# what a client sees; a worker abort is an error, not a finish; tool_calls: the model stopped after calls
FinishReason = Literal["stop", "length", "tool_calls"]


class ErrorDetail(msgspec.Struct):
    """``error``: human message, type (e.g. ``invalid_request_error``), offending ``param``, ``code``."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """Every non-2xx answer (and a stream's error event): ``{"error": {...}}``."""

    error: ErrorDetail


class PromptTokensDetails(msgspec.Struct):
    """``usage.prompt_tokens_details``: ``cached_tokens``, the prompt tokens found in a worker's prefix
    cache (their KV was not recomputed)."""

    cached_tokens: int


class Usage(msgspec.Struct):
    """Token counts of a request: prompts counted once each, completions summed over choices."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatTopLogprob(msgspec.Struct):
    """One alternative: its text, natural-log probability and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    """One output token (text, logprob, UTF-8 bytes) with its top alternatives."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(msgspec.Struct):
    """``choices[i].logprobs`` of a chat completion or chunk."""

    content: list[ChatTokenLogprob]
    refusal: None


class CompletionLogprobs(msgspec.Struct):
    """``choices[i].logprobs`` of a text completion: per token its text, logprob, top alternatives
    (text → logprob) and character offset in the choice's text. With ``echo`` the prompt's tokens come
    first, the first one's logprob and alternatives null (it has no prefix)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptTokenLogprob(msgspec.Struct):
    """vLLM's ``Logprob`` of a ``prompt_logprobs`` entry: natural-log probability, 1-based rank in the
    vocabulary, and the token's text."""

    logprob: float
    rank: int
    decoded_token: str


class FunctionCall(msgspec.Struct):
    """The function of a tool call: its name and arguments (a JSON text)."""

    name: str
    arguments: str


class ToolCall(msgspec.Struct):
    """One tool call of an assistant message: id (``call_<random>``), type and function."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    """The assistant message of a chat choice: ``content`` (null when the model only called tools),
    ``reasoning_content`` (present when the model's reasoning was split off) and ``tool_calls`` (present
    when it called tools)."""

    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(msgspec.Struct):
    """One choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletion(msgspec.Struct, omit_defaults=True):
    """``object: chat.completion`` (non-streaming). Streaming answers ``text/event-stream`` of
    ``ChatCompletionChunk`` objects ending with ``data: [DONE]``. ``prompt_logprobs`` (vLLM's, only when
    asked): the rendered prompt's, shaped as a completion choice's (``CompletionChoice``), once for the
    response as vLLM places it (every choice shares the prompt)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptTokenLogprob] | None] | None = None


class ChunkFunctionCall(msgspec.Struct, omit_defaults=True):
    """A tool call's function in a chunk: ``name`` in the call's first delta (with ``arguments`` "") and
    fragments of ``arguments`` afterwards."""

    name: str | None = None
    arguments: str | None = None


class ChunkToolCall(msgspec.Struct, omit_defaults=True):
    """One tool call's delta: ``index`` always; ``id`` and ``type`` in its first delta only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ChunkFunctionCall | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    """What a chat chunk adds: ``role`` on a choice's first chunk, ``content`` when there is text (on the
    first chunk ``""``, or null where the output is tool calls alone, as OpenAI streams them; left out of
    the other chunks without text), ``reasoning_content`` when there is reasoning text, ``tool_calls`` when
    a call starts or its arguments grow."""

    role: Literal["assistant"] | None = None
    content: str | msgspec.UnsetType | None = msgspec.UNSET
    reasoning_content: str | None = None
    tool_calls: list[ChunkToolCall] | None = None


class ChatChunkChoice(msgspec.Struct):
    """One choice of a chat chunk."""

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(msgspec.Struct, omit_defaults=True):
    """``object: chat.completion.chunk``; with ``include_usage`` every chunk has ``usage``: null, but
    the last, which has no choices and the usage (OpenAI's reference); without it no chunk has the key."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | msgspec.UnsetType | None = msgspec.UNSET


class CompletionChoice(msgspec.Struct, omit_defaults=True):
    """One choice of a text completion (whole or chunk): its text (the echoed prompt first).
    ``prompt_logprobs`` (vLLM's, only when asked): null for the first prompt token, then per prompt
    token a map token id (a string) → ``PromptTokenLogprob`` of the token and its top-N alternatives."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    prompt_logprobs: list[dict[str, PromptTokenLogprob] | None] | None = None


class Completion(msgspec.Struct):
    """``object: text_completion`` (non-streaming)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(msgspec.Struct, omit_defaults=True):
    """A streamed ``text_completion``; ``usage`` as in ``ChatCompletionChunk``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | msgspec.UnsetType | None = msgspec.UNSET


class ModelCard(msgspec.Struct):
    """One served model (``created`` in Unix seconds; ``root``: the model it serves, its own id, as vLLM
    and SGLang give it; ``max_model_len``: the context length in tokens, the smallest of the live
    workers'). ``GET /v1/models/{id}`` answers one."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class TokenizeResponse(msgspec.Struct, omit_defaults=True):
    """``POST /tokenize``: the token ids, their ``count``, the context length ``max_model_len`` (tokens)
    and, when asked (``return_token_strs``), each token's text."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    """``POST /detokenize``: the text of the tokens (special tokens kept)."""

    prompt: str


class ModelList(msgspec.Struct):
    """``GET /v1/models``."""

    object: Literal["list"]
    data: list[ModelCard]


class Health(msgspec.Struct):
    """``GET /health``."""

    status: Literal["ok"]


class WorkerStatus(msgspec.Struct):
    """One registered worker: ``address`` is its KV transfer address ("" for none), ``last_seen_s`` the
    seconds since its last message, then its last reported load (sequences waiting and running, KV
    blocks free and in all, and the prefill rate it measured, prompt tokens per second, 0 when it reports
    none), ``requests``, the requests the gateway routed to it that are not done, and
    ``kv_fenced_blocks``: a decode worker's blocks still held for requests already dropped, until no
    write of their KV can land (why blocks are in use while nothing runs, for up to the KV deadline
    after a prefill worker died); ``draining``: it was asked to stop and finishes what it holds, routed
    no new request."""

    worker_id: str
    role: Literal["prefill", "decode", "colocated"]
    epoch: int
    address: str
    last_seen_s: float
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    prefill_tokens_per_s: float
    requests: int
    kv_fenced_blocks: int
    draining: bool = False


class LostWorkerStatus(msgspec.Struct):
    """A worker out of routing, and why: dropped (unreachable, silent, shut down) or refused at
    registration. ``at``: when (Unix seconds); ``age_s``: seconds ago. Gone once it registers again."""

    worker_id: str
    role: Literal["prefill", "decode", "colocated"]
    epoch: int
    address: str
    reason: str
    at: float
    age_s: float


class KVPathStatus(msgspec.Struct):
    """A pair's KV data path as its latest canary measured it: the ``transport`` (KV backend), ``gbps``
    (1e9 bytes/s: ``num_bytes`` over ``wire_seconds``, the writes' time on the transport; over
    ``seconds`` when that is unknown), ``seconds`` end to end (control round trips included), when
    (``at``, Unix seconds), the path the two workers' placements allow (``expected``: cuda_ipc, rdma, shm
    or tcp) with its ``floor_gbps``, and a ``warning`` ("" when the speed is not below that floor)."""

    transport: str
    gbps: float
    num_bytes: int
    seconds: float
    at: float
    warning: str
    expected: str = ""
    floor_gbps: float = 0.0
    wire_seconds: float = 0.0


class PairStatus(msgspec.Struct):
    """One prefill/decode pair of registered workers: ``usable`` for routing, else ``reason`` names
    each incompatible field (e.g. ``block_size 16 != 32``) or the data path's failure; ``path`` its
    measured KV path (None before its first canary landed, or for an incompatible pair)."""

    prefill: str
    decode: str
    usable: bool
    reason: str
    path: KVPathStatus | None


class GatewayProcessStatus(msgspec.Struct):
    """The gateway process that answered (``pdserve gateway --workers N``): its ``index`` (0-based) of
    ``count``, its ``pid``, and the ``control`` endpoint its socket bound (the workers it lists are those
    registered with that socket)."""

    index: int
    count: int
    pid: int
    control: str


class ReadyVerdict(msgspec.Struct):
    """``GET /ready`` (200 ready, 503 not, same body): whether requests can be served and why, nothing
    more (the probe is served without a key by default; the full view is ``GET /v1/status``)."""

    ready: bool
    reason: str


class Readiness(msgspec.Struct):
    """``GET /v1/status`` (the status view): whether requests can be served and why (as ``/ready``), the
    registered workers, every prefill/decode pair, the workers dropped and refused, and which gateway
    process answered."""

    ready: bool
    reason: str
    workers: list[WorkerStatus]
    pairs: list[PairStatus]
    dropped: list[LostWorkerStatus]
    refused: list[LostWorkerStatus]
    process: GatewayProcessStatus | None = None


# the types /openapi.json documents (chunks travel inside text/event-stream, documented as a string)
DOCUMENTED = (ChatCompletion, Completion, ModelList, ModelCard, TokenizeResponse, DetokenizeResponse, Health,
              ReadyVerdict, Readiness, ErrorResponse)
REF_TEMPLATE = "#/components/schemas/{name}"


def schema_ref(cls: type[msgspec.Struct]) -> dict[str, str]:
    """The OpenAPI reference to ``cls``'s schema (one of ``openapi_components``)."""
    return {"$ref": REF_TEMPLATE.format(name=cls.__name__)}


def openapi_components(more: tuple[type[msgspec.Struct], ...] = ()) -> dict[str, Any]:
    """JSON schemas (OpenAPI 3.1 ``components.schemas``) of the documented types, ``more`` (response
    types defined elsewhere, e.g. gateway/responses_output.py) and those they hold."""
    _, components = msgspec.json.schema_components(DOCUMENTED + more, ref_template=REF_TEMPLATE)
    return components


def encode(body: msgspec.Struct) -> bytes:
    """JSON bytes of a response body (compact, UTF-8)."""
    return _ENCODER.encode(body)


_ENCODER = msgspec.json.Encoder()
