"""HTTP routes: /v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /v1/models/{id},
/tokenize, /detokenize, /v1/status, /health, /ready, /metrics.

Bodies are encoded from the types of gateway/openai_responses.py, which also give the response schemas
of ``/openapi.json`` (referenced here, merged into the document by gateway/app.py).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from gateway.errors import APIError, not_found_model
from gateway.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from gateway.openai_responses import (
    ChatCompletion,
    Completion,
    DetokenizeResponse,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    Readiness,
    ReadyVerdict,
    TokenizeResponse,
    encode,
    schema_ref,
)
from gateway.prepare import max_model_len, prepare, served_model
from gateway.responses_api import ResponsesRequest
from gateway.responses_output import ResponseObject
from gateway.responses_serving import create_response, prepare_response, stream_response
from gateway.service import GatewayService
from gateway.serving import complete, open_stream, sse_events, submit_all
from gateway.status import readiness
from gateway.tokenization import detokenize, tokenize
from gateway.tool_request import check_tool_history

router = APIRouter()
SSE = {"text/event-stream": {"schema": {"type": "string"}}}
_ERRORS = {400: "invalid request", 401: "missing or invalid API key", 404: "unknown model",
           413: "body too large", 429: "queue full (Retry-After)",
           502: "a worker failed the request (a stream: before its first token)",
           503: "no worker available, or the gateway is stopping (Retry-After)",
           504: "request timed out before an answer"}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` entries documenting the OpenAI error body for ``codes``."""
    return {c: {"description": _ERRORS.get(c, "error"), "content": {"application/json": {
        "schema": schema_ref(ErrorResponse)}}} for c in codes}


def ok(body: type[msgspec.Struct], *extra: dict[str, Any]) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` entry documenting a 200 answer of type ``body`` (plus other media types)."""
    content: dict[str, Any] = {"application/json": {"schema": schema_ref(body)}}
    for more in extra:
        content.update(more)
    return {200: {"content": content}}


def json_response(body: msgspec.Struct, status_code: int = 200) -> Response:
    """``body`` encoded as JSON."""
    return Response(encode(body), status_code=status_code, media_type="application/json")


def service(request: Request) -> GatewayService:
    """The app's ``GatewayService``."""
    svc: GatewayService = request.app.state.service
    return svc


def bearer_token(authorization: str) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value; None for another scheme or none.
    The scheme is case-insensitive and followed by one or more spaces (RFC 7235, section 2.1)."""
    scheme, _, token = authorization.partition(" ")
    return token.lstrip(" ") if scheme.lower() == "bearer" else None


def _check_key(request: Request) -> None:
    keys = service(request).settings.api_keys
    if not keys:
        return
    if bearer_token(request.headers.get("authorization", "")) not in keys:
        raise APIError(401, "Invalid or missing API key", "invalid_request_error", None, "invalid_api_key")


def require_key(request: Request) -> None:
    """Dependency: a valid ``Authorization: Bearer <key>`` (any case of ``Bearer``) when ``--api-key`` is
    set. Raises ``APIError`` 401 (``invalid_api_key``) otherwise."""
    _check_key(request)


async def _generate(request: Request, body: ChatCompletionRequest | CompletionRequest) -> Response:
    svc = service(request)
    rid: str = request.state.request_id
    if isinstance(body, ChatCompletionRequest):
        check_tool_history(body.messages)
    prepared = prepare(svc, body, rid)
    reqs = await submit_all(svc, prepared)
    if body.stream:  # the status line waits for the first event: a failure before it is an HTTP error
        events = await open_stream(sse_events(svc, prepared, reqs), request.is_disconnected)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return json_response(await complete(svc, prepared, reqs, request.is_disconnected))


_GEN_ERRORS = error_responses(400, 401, 404, 413, 429, 502, 503, 504)


@router.post("/v1/chat/completions", dependencies=[Depends(require_key)],
             responses={**ok(ChatCompletion, SSE), **_GEN_ERRORS})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI Chat Completions (streaming SSE or not)."""
    return await _generate(request, body)


@router.post("/v1/completions", dependencies=[Depends(require_key)],
             responses={**ok(Completion, SSE), **_GEN_ERRORS})
async def completions(body: CompletionRequest, request: Request) -> Response:
    """OpenAI (legacy) Completions (streaming SSE or not)."""
    return await _generate(request, body)


@router.post("/v1/responses", dependencies=[Depends(require_key)],
             responses={**ok(ResponseObject, SSE), **_GEN_ERRORS})
async def responses(body: ResponsesRequest, request: Request) -> Response:
    """OpenAI Responses (stateless; streaming SSE events or not): gateway/responses_api.py (the body),
    gateway/responses_output.py (the response and its events)."""
    svc = service(request)
    prepared = prepare_response(svc, body, request.state.request_id)
    if body.stream:
        events = await stream_response(svc, body, prepared, request.is_disconnected)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return json_response(await create_response(svc, body, prepared, request.is_disconnected))


def _card(svc: GatewayService) -> ModelCard | None:
    name = served_model(svc)
    return None if name is None else ModelCard(name, "model", int(time.time()), "pdserve", name,
                                                    max_model_len(svc))


@router.get("/v1/models", dependencies=[Depends(require_key)],
            responses={**ok(ModelList), **error_responses(401)})
async def models(request: Request) -> Response:
    """The served model (one entry once a worker registered or --model-name is set)."""
    card = _card(service(request))
    return json_response(ModelList("list", [] if card is None else [card]))


@router.get("/v1/models/{model_id:path}", dependencies=[Depends(require_key)],
            responses={**ok(ModelCard), **error_responses(401, 404)})
async def model(model_id: str, request: Request) -> Response:
    """The served model's card; 404 (OpenAI body, code ``model_not_found``) for any other id."""
    card = _card(service(request))
    if card is None or card.id != model_id:
        raise not_found_model(model_id)
    return json_response(card)


@router.post("/tokenize", dependencies=[Depends(require_key)],
             responses={**ok(TokenizeResponse), **error_responses(400, 401, 404, 413, 503)})
async def tokenize_route(body: TokenizeRequest, request: Request) -> Response:
    """vLLM's tokenize: ``prompt`` or chat ``messages`` → token ids, their count and the context length."""
    return json_response(tokenize(service(request), body))


@router.post("/detokenize", dependencies=[Depends(require_key)],
             responses={**ok(DetokenizeResponse), **error_responses(400, 401, 404, 413, 503)})
async def detokenize_route(body: DetokenizeRequest, request: Request) -> Response:
    """vLLM's detokenize: token ids → text (special tokens kept)."""
    return json_response(detokenize(service(request), body))


@router.get("/health", responses={**ok(Health), **error_responses(401)})
async def health(request: Request) -> Response:
    """Liveness of the gateway process itself."""
    if not service(request).settings.public_health:
        _check_key(request)
    return json_response(Health("ok"))


_READY = {**ok(ReadyVerdict), 503: {"description": "not ready", "content": {"application/json": {
    "schema": schema_ref(ReadyVerdict)}}}, **error_responses(401)}


@router.get("/ready", responses=_READY)
async def ready(request: Request) -> Response:
    """200 when requests can be served, else 503; the body is the verdict and its reason only, whoever
    asks (the probe is public by default: worker ids, addresses and the gateway process are in
    ``/v1/status``, behind the API key). Raises 401 (``APIError``) with ``--public-health false`` and no
    valid key."""
    svc = service(request)
    if not svc.settings.public_health:
        _check_key(request)
    view = readiness(svc.registry, svc.canaries, svc.process_status())
    return json_response(ReadyVerdict(view.ready, view.reason), status_code=200 if view.ready else 503)


@router.get("/v1/status", dependencies=[Depends(require_key)],
            responses={**ok(Readiness), **error_responses(401)})
async def status(request: Request) -> Response:
    """The status view (always 200): workers, pairs, dropped and refused workers with their reasons, and
    the gateway process that answered."""
    svc = service(request)
    return json_response(readiness(svc.registry, svc.canaries, svc.process_status()))


@router.get("/metrics", response_class=Response, responses={
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **error_responses(401)})
async def metrics(request: Request) -> Response:
    """Prometheus metrics (text exposition)."""
    svc = service(request)
    if not svc.settings.public_metrics:
        _check_key(request)
    return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4")
