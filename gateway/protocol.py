"""Request schemas of the OpenAI HTTP API (pydantic, used at the HTTP edge only).

Fields follow the OpenAI API reference (Chat Completions and legacy Completions), plus vLLM's extra
sampling fields (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``). Unknown fields are ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with usage."""

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


class SamplingFields(BaseModel):
    """Sampling fields shared by both endpoints; ranges as in the OpenAI reference."""

    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    user: str | None = None

    def stop_list(self) -> list[str]:
        """``stop`` as a list (OpenAI accepts a string or a list)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def message_dicts(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for the chat template."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(SamplingFields):
    """POST /v1/completions body: ``prompt`` is a string or a list of token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
