"""HTTP routes: /v1/chat/completions, /v1/completions, /v1/models, /health, /ready, /metrics."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.errors import APIError, unavailable
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.registry import pairing_mismatch
from gateway.router import NoWorkerError
from gateway.service import GatewayService
from gateway.serving import complete, prepare, served_model, sse_events

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
    try:
        handle = await svc.submit(prepared.inp)
    except NoWorkerError as exc:
        raise unavailable(str(exc)) from exc
    svc.metrics.prompt_tokens.inc(len(prepared.inp.prompt_token_ids))
    if body.stream:
        return StreamingResponse(sse_events(svc, prepared, handle), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return JSONResponse(await complete(svc, prepared, handle))


@router.post("/v1/chat/completions", dependencies=[Depends(require_key)])
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI Chat Completions (streaming SSE or not)."""
    return await _generate(request, body)


@router.post("/v1/completions", dependencies=[Depends(require_key)])
async def completions(body: CompletionRequest, request: Request) -> Response:
    """OpenAI (legacy) Completions (streaming SSE or not)."""
    return await _generate(request, body)


@router.get("/v1/models", dependencies=[Depends(require_key)])
async def models(request: Request) -> dict[str, Any]:
    """The served model (one entry once a worker registered or --model-name is set)."""
    name = served_model(service(request))
    data = [] if name is None else [{"id": name, "object": "model", "created": int(time.time()),
                                     "owned_by": "pdserve"}]
    return {"object": "list", "data": data}


@router.get("/health")
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


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """200 when requests can be served, else 503 with the reason."""
    svc = service(request)
    if not svc.settings.public_health:
        _check_key(request)
    ok, reason = readiness(svc)
    return JSONResponse({"ready": ok, "reason": reason}, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus metrics (text exposition)."""
    svc = service(request)
    if not svc.settings.public_metrics:
        _check_key(request)
    return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4")
