"""HTTP routes: /v1/chat/completions, /v1/completions, /v1/models, /health, /ready, /metrics."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.errors import APIError
from gateway.prepare import prepare, served_model
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.registry import pairing_mismatch
from gateway.schemas import (
    SSE,
    ChatCompletion,
    Completion,
    Health,
    ModelList,
    Readiness,
    error_responses,
)
from gateway.service import GatewayService
from gateway.serving import complete, sse_events, submit_all

router = APIRouter()


def service(request: Request) -> GatewayService:
    """The app's ``GatewayService``."""
    svc: GatewayService = request.app.state.service
    return svc


def _check_key(request: Request) -> None:
    keys = service(request).settings.api_keys
    if not keys:
        return
    auth = request.headers.get("authorization", "")
    if not auth.startswith("Bearer ") or auth[len("Bearer "):] not in keys:
        raise APIError(401, "Invalid or missing API key", "invalid_request_error", None, "invalid_api_key")


def require_key(request: Request) -> None:
    """Dependency: a valid ``Authorization: Bearer <key>`` when ``--api-key`` is set. Raises 401."""
    _check_key(request)


async def _generate(request: Request, body: ChatCompletionRequest | CompletionRequest) -> Response:
    svc = service(request)
    rid: str = request.state.request_id
    prepared = prepare(svc, body, rid)
    handles = await submit_all(svc, prepared)
    if body.stream:
        return StreamingResponse(sse_events(svc, prepared, handles), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return JSONResponse(await complete(svc, prepared, handles, request.is_disconnected))


_GEN_ERRORS = error_responses(400, 401, 404, 413, 429, 502, 503)


@router.post("/v1/chat/completions", dependencies=[Depends(require_key)], response_model=ChatCompletion,
             responses={200: {"content": SSE}, **_GEN_ERRORS})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI Chat Completions (streaming SSE or not)."""
    return await _generate(request, body)


@router.post("/v1/completions", dependencies=[Depends(require_key)], response_model=Completion,
             responses={200: {"content": SSE}, **_GEN_ERRORS})
async def completions(body: CompletionRequest, request: Request) -> Response:
    """OpenAI (legacy) Completions (streaming SSE or not)."""
    return await _generate(request, body)


@router.get("/v1/models", dependencies=[Depends(require_key)], response_model=ModelList,
            responses=error_responses(401))
async def models(request: Request) -> dict[str, Any]:
    """The served model (one entry once a worker registered or --model-name is set)."""
    name = served_model(service(request))
    data = [] if name is None else [{"id": name, "object": "model", "created": int(time.time()),
                                     "owned_by": "pdserve"}]
    return {"object": "list", "data": data}


@router.get("/health", response_model=Health, responses=error_responses(401))
async def health(request: Request) -> dict[str, str]:
    """Liveness of the gateway process itself."""
    if not service(request).settings.public_health:
        _check_key(request)
    return {"status": "ok"}


def readiness(svc: GatewayService) -> tuple[bool, str]:
    """Ready when a colocated worker is live, or a live prefill worker has a compatible decode worker."""
    if svc.registry.live("colocated"):
        return True, "colocated worker live"
    prefills, decodes = svc.registry.live("prefill"), svc.registry.live("decode")
    for p in prefills:
        if any(pairing_mismatch(p.info, d.info) is None for d in decodes):
            return True, "prefill/decode pair live"
    return False, f"no compatible prefill+decode pair ({len(prefills)} prefill, {len(decodes)} decode)"


@router.get("/ready", response_model=Readiness,
            responses={503: {"model": Readiness, "description": "not ready"}, **error_responses(401)})
async def ready(request: Request) -> JSONResponse:
    """200 when requests can be served, else 503 with the reason."""
    svc = service(request)
    if not svc.settings.public_health:
        _check_key(request)
    ok, reason = readiness(svc)
    return JSONResponse({"ready": ok, "reason": reason}, status_code=200 if ok else 503)


@router.get("/metrics", response_class=Response, responses={
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **error_responses(401)})
async def metrics(request: Request) -> Response:
    """Prometheus metrics (text exposition)."""
    svc = service(request)
    if not svc.settings.public_metrics:
        _check_key(request)
    return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4")
