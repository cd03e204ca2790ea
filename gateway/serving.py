"""OpenAI endpoint logic: request → ``GenerationInput`` (validation, chat template, tokenization,
context check) and generation → response JSON or SSE chunks (``data: {...}`` … ``data: [DONE]``).

Response shapes: OpenAI API reference (chat.completion, chat.completion.chunk, text_completion).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from gateway.errors import APIError, bad_request, not_found_model, unavailable, upstream_failed
from gateway.handle import GenerationFailed, GenerationInput, RequestHandle
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.service import GatewayService
from gateway.text import TokenizerNotFoundError
from pdserve.messages import WireSamplingParams


@dataclass(frozen=True)
class Prepared:
    """A validated request: the generation input, served model name, and response kind."""

    inp: GenerationInput
    model: str
    chat: bool
    include_usage: bool


def served_model(svc: GatewayService) -> str | None:
    """``--model-name`` or the model the workers registered (None before any registration)."""
    if svc.settings.model_name:
        return svc.settings.model_name
    live = svc.registry.live()
    return live[0].info.model if live else None


def max_model_len(svc: GatewayService) -> int:
    """Smallest ``max_model_len`` (tokens) over live workers (2048 with none)."""
    return min((w.info.compat.max_model_len for w in svc.registry.live()), default=2048)


def _check_common(svc: GatewayService, body: ChatCompletionRequest | CompletionRequest) -> str:
    model = served_model(svc)
    if model is None:
        raise unavailable("no worker has registered yet")
    if body.model != model:
        raise not_found_model(body.model)
    if body.n > svc.settings.max_n:
        raise bad_request(f"n must be <= {svc.settings.max_n}, got {body.n}", "n")
    if body.n != 1:
        raise bad_request("n > 1 is not supported by this gateway yet", "n")
    n_stop = len(body.stop_list())
    if n_stop > svc.settings.max_stop:
        raise bad_request(f"at most {svc.settings.max_stop} stop strings, got {n_stop}", "stop")
    if body.logprobs:
        raise bad_request("logprobs are not supported by this gateway yet", "logprobs")
    return model


def _tokenize(svc: GatewayService, body: ChatCompletionRequest | CompletionRequest) -> list[int]:
    try:
        text = svc.text()
    except TokenizerNotFoundError as exc:
        raise unavailable(f"tokenizer unavailable: {exc}") from exc
    if isinstance(body, ChatCompletionRequest):
        try:
            return text.encode(text.render_chat(body.message_dicts()))
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from exc
    prompt = body.prompt
    if isinstance(prompt, str):
        return text.encode(prompt, add_special_tokens=True)
    if prompt and all(isinstance(t, int) for t in prompt):
        return [int(t) for t in prompt]  # type: ignore[arg-type]
    if len(prompt) == 1:
        first = prompt[0]
        return text.encode(first, True) if isinstance(first, str) else list(first)  # type: ignore[arg-type]
    raise bad_request("prompt must be one string or one list of token ids (batches are not supported)",
                      "prompt")


def _max_tokens(svc: GatewayService, body: ChatCompletionRequest | CompletionRequest, n_prompt: int) -> int:
    limit = max_model_len(svc)
    if svc.settings.max_prompt_tokens is not None and n_prompt > svc.settings.max_prompt_tokens:
        raise bad_request(f"prompt has {n_prompt} tokens, more than --max-prompt-tokens "
                          f"{svc.settings.max_prompt_tokens}", "messages" if isinstance(
                              body, ChatCompletionRequest) else "prompt", "context_length_exceeded")
    asked = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        asked = body.max_completion_tokens
    wanted = asked if asked is not None else limit - n_prompt
    if n_prompt + wanted > limit or wanted < 1:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{n_prompt + max(wanted, 1)} tokens ({n_prompt} in the prompt, "
                          f"{max(wanted, 1)} for the completion).", "max_tokens", "context_length_exceeded")
    return wanted


def prepare(svc: GatewayService, body: ChatCompletionRequest | CompletionRequest,
            request_id: str) -> Prepared:
    """Validate and tokenize. Raises ``APIError`` (400/404/503) naming the problem."""
    model = _check_common(svc, body)
    if isinstance(body, CompletionRequest) and (body.echo or body.suffix):
        raise bad_request("echo and suffix are not supported", "echo" if body.echo else "suffix")
    prompt = _tokenize(svc, body)
    if not prompt:
        raise bad_request("the prompt is empty", "prompt")
    max_tokens = _max_tokens(svc, body, len(prompt))
    try:
        sampling = WireSamplingParams(
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            min_p=body.min_p, repetition_penalty=body.repetition_penalty, seed=body.seed,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens)
    except (TypeError, ValueError) as exc:
        raise bad_request(str(exc)) from exc
    inp = GenerationInput(request_id, prompt, sampling, tuple(body.stop_list()))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Prepared(inp, model, isinstance(body, ChatCompletionRequest), include_usage)


def _chunk(p: Prepared, created: int, text: str | None, finish: str | None, role: bool = False) -> str:
    rid = p.inp.request_id
    if p.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created,
               "model": p.model, "choices": [choice]}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": p.model,
               "choices": [choice]}
    return f"data: {json.dumps(obj)}\n\n"


def usage(p: Prepared, n_out: int) -> dict[str, int]:
    """OpenAI usage object (token counts)."""
    n_in = len(p.inp.prompt_token_ids)
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


async def sse_events(svc: GatewayService, p: Prepared, handle: RequestHandle) -> AsyncIterator[str]:
    """SSE lines for a streaming response; ends with ``data: [DONE]`` (after an error event on failure)."""
    created, n_out = int(time.time()), 0
    try:
        if p.chat:
            yield _chunk(p, created, None, None, role=True)
        async for delta in svc.stream(handle):
            n_out += delta.num_tokens
            if delta.text or delta.finish_reason:
                yield _chunk(p, created, delta.text, delta.finish_reason)
        svc.metrics.generation_tokens.inc(n_out)
        if p.include_usage:
            obj: dict[str, Any] = {"id": f"{'chatcmpl' if p.chat else 'cmpl'}-{p.inp.request_id}", "object":
                   "chat.completion.chunk" if p.chat else "text_completion", "created": created,
                   "model": p.model, "choices": [], "usage": usage(p, n_out)}
            yield f"data: {json.dumps(obj)}\n\n"
    except GenerationFailed as exc:
        yield f"data: {json.dumps(upstream_failed(str(exc)).body())}\n\n"
    finally:
        svc.release(handle)
    yield "data: [DONE]\n\n"


async def complete(svc: GatewayService, p: Prepared, handle: RequestHandle) -> dict[str, Any]:
    """The whole (non-streaming) response body. Raises ``APIError`` 502 when a worker failed."""
    parts, n_out, finish = [], 0, None
    try:
        async for delta in svc.stream(handle):
            parts.append(delta.text)
            n_out += delta.num_tokens
            finish = delta.finish_reason or finish
    except GenerationFailed as exc:
        raise upstream_failed(str(exc)) from exc
    finally:
        svc.release(handle)
    svc.metrics.generation_tokens.inc(n_out)
    text, rid, created = "".join(parts), p.inp.request_id, int(time.time())
    if p.chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": finish}
        return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created, "model": p.model,
                "choices": [choice], "usage": usage(p, n_out)}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": p.model,
            "choices": [choice], "usage": usage(p, n_out)}


__all__ = ["APIError", "Prepared", "complete", "prepare", "sse_events"]
