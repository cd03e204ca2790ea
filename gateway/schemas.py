"""Response schemas for ``/openapi.json`` (pydantic; documentation only — the handlers build plain dicts
in gateway/render.py with exactly these fields). Shapes: OpenAI API reference (chat.completion,
chat.completion.chunk, text_completion, model list, error object).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    """``error``: human message, type (e.g. ``invalid_request_error``), offending ``param``, ``code``."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every non-2xx answer: ``{"error": {...}}``."""

    error: ErrorDetail


class Usage(BaseModel):
    """Token counts of a request (all choices)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(BaseModel):
    """The assistant message of a chat choice."""

    role: str
    content: str


class ChatChoice(BaseModel):
    """One chat choice; ``logprobs`` is ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    """``object: chat.completion`` (non-streaming). Streaming answers ``text/event-stream`` of
    ``chat.completion.chunk`` objects (``choices[].delta``) ending with ``data: [DONE]``."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    """One completion choice; ``logprobs`` has ``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset``."""

    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """``object: text_completion`` (streaming: the same object per chunk, as SSE)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    """One served model."""

    id: str
    object: str
    created: int
    owned_by: str


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: str
    data: list[ModelCard]


class Health(BaseModel):
    """``GET /health``."""

    status: str


class Readiness(BaseModel):
    """``GET /ready`` (200 ready, 503 not, same body)."""

    ready: bool
    reason: str


_ERRORS = {400: "invalid request", 401: "missing or invalid API key", 404: "unknown model",
           413: "body too large", 429: "queue full (Retry-After)", 503: "no worker available"}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` entries documenting the OpenAI error body for ``codes``."""
    return {c: {"model": ErrorResponse, "description": _ERRORS.get(c, "error")} for c in codes}


SSE = {"text/event-stream": {"schema": {"type": "string"}}}
