"""Serving POST /v1/responses: the body becomes a chat completion request (``responses_api.chat_body``),
prepared and submitted like one (one choice), and its output becomes a ``response`` object or the
Responses streaming events (``responses_output.ResponseBuilder``).

Errors keep the chat path's rules, with the Responses field named (``responses_param``): 400 before
anything is sent; a stream's status line waits for its first token, so a failure before it is an HTTP
error (502/503/504) and one after it an ``error`` event. The non-streamed response is built by the same
token-by-token loop as the stream (its events dropped), so both hold the same output.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Literal

from pydantic import ValidationError

from gateway.chat_output import ChatOutputParser
from gateway.errors import APIError, bad_request
from gateway.openai_requests import ChatCompletionRequest
from gateway.prepare import Prepared, prepare
from gateway.render import chat_logprobs
from gateway.request_state import GenerationFailed
from gateway.responses_api import ResponsesRequest, chat_body, check_supported, responses_param
from gateway.responses_output import (
    InputTokensDetails,
    OutputTokensDetails,
    ResponseBuilder,
    ResponseObject,
    ResponseUsage,
)
from gateway.service import GatewayService
from gateway.serving import DISCONNECT_POLL_S, open_stream, submit_all
from gateway.stream import text_deltas
from gateway.tool_parsers.events import ContentText, Event
from gateway.validation_message import validation_error


def prepare_response(svc: GatewayService, body: ResponsesRequest, request_id: str) -> Prepared:
    """Validate and prepare ``body`` as its chat request.

    Raises:
        APIError: 400 naming the Responses field (``store: true``, ``previous_response_id``, or what
            the chat path refuses), 404/503 as the chat path.
    """
    if body.store:
        raise bad_request("store: true is not supported: pdserve is stateless and stores no responses",
                          "store", "unsupported_parameter")
    if body.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported: pdserve is stateless (send the whole "
                          "conversation as input)", "previous_response_id", "unsupported_parameter")
    check_supported(body)
    chat_dict = chat_body(body)
    try:
        chat = ChatCompletionRequest.model_validate(chat_dict)
    except ValidationError as exc:
        raise validation_error(exc.errors(), chat_dict, _rename) from exc
    try:
        return prepare(svc, chat, f"resp_{request_id}")
    except APIError as exc:
        raise responses_error(exc) from None


def responses_error(exc: APIError) -> APIError:
    """``exc`` (an error of the chat path: the gateway's checks or a worker's refusal) naming the
    Responses field instead of the chat field (``responses_param``), in ``param`` and the message."""
    chat_param, exc.param = exc.param, responses_param(exc.param)
    if chat_param and exc.param and chat_param != exc.param:
        exc.message = exc.message.replace(chat_param, exc.param)
    return exc


def _rename(path: str) -> str:
    return responses_param(path) or path


def _usage(p: Prepared, n_out: int, cached: int | None) -> ResponseUsage:
    return ResponseUsage(p.num_prompt_tokens, InputTokensDetails(cached or 0), n_out, OutputTokensDetails(0),
                         p.num_prompt_tokens + n_out)


def _status(finish_reason: str | None) -> Literal["completed", "incomplete"]:
    return "incomplete" if finish_reason == "length" else "completed"


async def _events(svc: GatewayService, body: ResponsesRequest, p: Prepared, builder: ResponseBuilder,
                  streaming: bool) -> AsyncGenerator[bytes, None]:
    """Submit ``p`` and build its output in ``builder`` token by token, yielding the streaming events
    (the first token's with ``response.created`` / ``.in_progress``). Streamed and not, the output is
    built the same way, so both answers hold the same items.

    Raises:
        APIError: a failure before the first event, or any failure when not ``streaming`` (502/503/504).
    """
    (req,) = await submit_all(svc, p)
    parser = ChatOutputParser(p.output) if p.output.active else None
    head: list[bytes] | None = builder.start()  # sent with the first token's events
    n_out = 0
    try:
        async for d in text_deltas(svc.orchestrator, svc.text(), req):
            n_out += d.num_tokens
            events: list[Event]
            if parser is None:
                events = [ContentText(d.text)] if d.text else []
            else:
                events = parser.feed(d.text) if d.text else []
                if d.finish_reason is not None:
                    events += parser.finish()
            logprobs = chat_logprobs(svc.text(), d.logprobs).content if body.wants_logprobs else None
            out = builder.feed(events, logprobs)
            if d.finish_reason is not None:
                svc.metrics.generation_tokens.inc(n_out)
                out += builder.finish(_status(d.finish_reason), _usage(p, n_out, req.num_cached_tokens))
            if head is not None and out:
                out, head = head + out, None
            if out:
                yield b"".join(out)
    except GenerationFailed as exc:
        err = responses_error(exc.api_error())
        if head is not None or not streaming:
            raise err from exc
        yield builder.error_event(err.message, err.code)
    finally:
        svc.orchestrator.release(req)


async def create_response(svc: GatewayService, body: ResponsesRequest, p: Prepared,
                          is_disconnected: Callable[[], Awaitable[bool]]) -> ResponseObject:
    """The whole (non-streaming) response object: the stream's output, built the same way; polls
    ``is_disconnected`` and aborts the workers if the client left.

    Raises:
        APIError: 502 when a worker failed, 503 when no other worker could take it over, 504 when it timed
            out, 499 when the client disconnected.
    """
    builder = ResponseBuilder(body, p.request_id, int(time.time()))
    events = _events(svc, body, p, builder, streaming=False)

    async def drain() -> None:
        async for _ in events:
            pass

    run = asyncio.ensure_future(drain())
    try:
        while not run.done():
            await asyncio.wait([run], timeout=DISCONNECT_POLL_S)
            if not run.done() and await is_disconnected():
                raise APIError(499, "client disconnected", "invalid_request_error", None, "client_closed")
        run.result()
    finally:
        run.cancel()
        with contextlib.suppress(BaseException):
            await run
        await events.aclose()
    assert builder.status != "in_progress" and builder.usage is not None
    return builder.response(builder.status, builder.usage)


async def stream_response(svc: GatewayService, body: ResponsesRequest, p: Prepared,
                          is_disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[bytes]:
    """The streaming events, once the first token's are ready (``serving.open_stream``).

    Raises:
        APIError: a failure before the first token (502/503/504), 499 when the client left.
    """
    events = _events(svc, body, p, ResponseBuilder(body, p.request_id, int(time.time())), streaming=True)
    try:
        return await open_stream(events, is_disconnected)
    except BaseException:
        with contextlib.suppress(Exception):
            await events.aclose()
        raise
