"""FastAPI application factory: wires routes, middleware, OpenAI-style error handlers and the service.

The gateway imports no torch: tokenization uses ``tokenizers`` + Jinja2 (gateway/text.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.middleware import GatewayMiddleware
from gateway.openai_responses import openapi_components
from gateway.process import GatewayProcess
from gateway.responses_output import ResponseObject
from gateway.routes import router
from gateway.service import GatewayService
from gateway.text import TextProcessor, resolve_tokenizer_dir
from gateway.validation_message import validation_error
from protocol.heap import freeze_start_up_heap
from protocol.settings import GatewaySettings

log = logging.getLogger("pdserve.gateway")


def _api_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return Response(exc.json(), status_code=exc.status, headers=exc.headers, media_type="application/json")


def _content_type_problem(content_type: str | None) -> str | None:
    """Why FastAPI did not read a request body as JSON, or None when it did: a Content-Type other than
    ``application/json`` or ``application/*+json``, or none at all (FastAPI's ``strict_content_type``)."""
    if not content_type:
        return "the request body must be JSON sent with Content-Type: application/json, got no Content-Type"
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return None
    return ("the request body must be JSON sent with Content-Type: application/json, got Content-Type: "
            f"{content_type[:100]}")


def _validation_error(request: Request, exc: Exception) -> Response:
    """A pydantic validation failure → 400 naming the client's field (gateway/validation_message.py); a
    body sent with a Content-Type other than JSON (curl's default ``-d`` form type, ``text/plain``) or
    without one → 400 saying so, as FastAPI hands such a body over unparsed (vLLM refuses these too: its
    ``validate_json_request``)."""
    assert isinstance(exc, RequestValidationError)
    if (why := _content_type_problem(request.headers.get("content-type"))) is not None:
        return _api_error(request, APIError(400, why, code="unsupported_media_type"))
    errors = []
    for e in exc.errors():
        loc = tuple(e.get("loc", ()))
        errors.append({**e, "loc": loc[1:] if loc[:1] == ("body",) else loc})  # FastAPI's prefix
    return _api_error(request, validation_error(errors, exc.body))


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 415: "unsupported_media_type"}


def _http_error(_: Request, exc: Exception) -> Response:
    """Starlette/FastAPI ``HTTPException`` (unknown path, wrong method, unparsable body) → OpenAI body."""
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code if 400 <= exc.status_code < 500 else 400
    message = exc.detail if isinstance(exc.detail, str) else "invalid request"
    if "parsing the body" in message:
        message = "request body is not valid JSON (or not UTF-8)"
    return _api_error(_, APIError(status, message, "invalid_request_error", None,
                                  _HTTP_CODES.get(status), dict(exc.headers or {})))


def _unhandled(_: Request, exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    return _api_error(_, APIError(500, f"internal error: {type(exc).__name__}", "server_error"))


def _document_responses(app: FastAPI) -> None:
    """Add the response types' schemas (gateway/openai_responses.py, referenced by the routes) to the
    app's OpenAPI document, next to the request models' schemas FastAPI generates.

    Raises:
        RuntimeError: (when the document is first built) a response type shares a name with a request model.
    """
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = FastAPI.openapi(app)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            extra = openapi_components((ResponseObject,))
            if clash := set(schemas) & set(extra):
                raise RuntimeError(f"response schemas clash with request schemas: {sorted(clash)}")
            schemas.update(extra)
        return app.openapi_schema  # type: ignore[return-value]  # set by FastAPI.openapi

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(settings: GatewaySettings, process: GatewayProcess | None = None) -> FastAPI:
    """Build the gateway app. The control socket binds when the app starts (lifespan). ``process``:
    which of several gateway processes this is (default: the only one; gateway/process.py).

    Raises:
        TokenizerNotFoundError: ``--tokenizer`` is set but has no ``tokenizer.json`` (checked up front).
        RuntimeError: ``process`` shares a metrics directory prometheus-client was not set up for.
    """
    text = TextProcessor.from_dir(resolve_tokenizer_dir(settings.tokenizer, None)) if settings.tokenizer \
        else None
    metrics = GatewayMetrics(process.metrics_dir if process is not None else None)
    svc = GatewayService(settings, metrics, text, process)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await svc.start()
        freeze_start_up_heap()
        log.info("gateway control socket bound", extra={"endpoint": svc.control.endpoint if svc.control
                                                         else ""})
        try:
            yield
        finally:
            await svc.stop()

    app = FastAPI(title="pdserve gateway", lifespan=lifespan)
    _document_responses(app)
    app.state.service = svc
    app.include_router(router)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unhandled)
    app.add_middleware(GatewayMiddleware, metrics=metrics, max_body_bytes=settings.max_body_bytes)
    return app
