"""Request bodies of the OpenAI HTTP API (pydantic, used at the HTTP edge only; the response types are in
gateway/openai_responses.py).

Fields follow the OpenAI API reference (Chat Completions and legacy Completions), plus vLLM's extra
sampling fields (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``). Unknown fields are ignored. Integers are bounded so that every accepted value fits the
msgpack wire (int64) and floats must be finite (no NaN/Infinity): a bad value is a 400, never a 5xx.
Caps that depend on the deployment (``--max-n``, ``--max-stop``, the vocabulary, the context length) are
checked later, in ``gateway/prepare.py``, which also maps a body into the engine's ``SamplingParams``
(the one type the workers receive).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MAX = (1 << 63) - 1
INT32_MAX = (1 << 31) - 1
MAX_STOP_CHARS = 1024  # characters per stop string


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with usage and empty ``choices``."""

    include_usage: bool = False


class ContentPart(BaseModel):
    """One text part of a message's content (only ``type: text`` is supported)."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; content as a string or a list of text parts."""

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart]
    name: str | None = None

    def text(self) -> str:
        """The content as one string."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class GenerationRequestBase(BaseModel):
    """Fields shared by both endpoints (model, choices, streaming, stops, sampling); ranges as in the
    OpenAI reference.

    ``seed`` is an int64; choice ``i`` of ``n`` samples with ``seed + i`` (wrapped into int64), so a
    seeded request is reproducible choice by choice. ``user`` is accepted and ignored.
    """

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    n: int = Field(1, ge=1, le=INT32_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=INT32_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    stop_token_ids: list[int] | None = None
    user: str | None = None

    def stop_list(self) -> list[str]:
        """``stop`` as a list (OpenAI accepts a string or a list)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(GenerationRequestBase):
    """POST /v1/chat/completions body. ``top_logprobs`` (0..20) needs ``logprobs: true``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def message_dicts(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for the chat template."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(GenerationRequestBase):
    """POST /v1/completions body.

    ``prompt`` is a string, a list of strings, a list of token ids, or a list of token-id lists; each
    prompt of a list gives ``n`` choices, in prompt order (choice index = prompt index * n + sample).
    ``logprobs`` (0..5) is the number of top alternatives per token. ``echo`` prepends the prompt text to
    each choice's text (prompt-token logprobs are not returned: ``logprobs`` covers generated tokens only).
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
