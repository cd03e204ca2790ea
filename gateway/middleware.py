"""ASGI middleware: X-Request-Id (accepted or generated, echoed back), body-size limit, request metrics.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client disconnects pass through untouched.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError
from gateway.metrics import GatewayMetrics

_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# every API path of gateway/routes.py (each its own label), less the probes below and /v1/models/{id}
ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/v1/status",
                       "/tokenize", "/detokenize"})
MODEL_ENDPOINT = "/v1/models/{id}"  # one label for every model id asked (bounded label values)
# Health/readiness probes and Prometheus scrapes are not user traffic: `pdserve up`, Kubernetes probes and
# Prometheus poll them every few seconds, which would swamp the request rate and error-ratio panels. As
# vLLM does (vllm/entrypoints/serve/instrumentator/metrics.py: prometheus-fastapi-instrumentator with
# excluded_handlers /metrics, /health, /load, /ping, /version, /server_info), they are not counted at all.
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's X-Request-Id if it is safe (≤128 chars of [A-Za-z0-9._:-]), else a new random id."""
    for key, value in headers:
        if key.lower() == b"x-request-id":
            text = value.decode("latin-1")
            if _SAFE_ID.match(text):
                return text
    return uuid.uuid4().hex


class GatewayMiddleware:
    """Sets ``scope["state"]["request_id"]``, refuses bodies over ``max_body_bytes`` (413), counts
    ``pdserve_requests_total{endpoint,status}`` for every path except the probes in ``PROBE_PATHS``
    (``endpoint`` is the API path, ``/v1/models/{id}`` for any model id, or ``other`` for unknown paths)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, max_body_bytes: int) -> None:
        self.app, self.metrics, self.max_body_bytes = app, metrics, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id_from(scope.get("headers", []))
        scope.setdefault("state", {})["request_id"] = rid
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"
        if path.startswith("/v1/models/"):
            endpoint = MODEL_ENDPOINT
        status: dict[str, int] = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            length = self._content_length(scope)
            replay = None if length is not None and length > self.max_body_bytes else \
                await self._read_body(receive)
            if replay is None:
                err = APIError(413, f"request body of {length or 'more than ' + str(self.max_body_bytes)}"
                               f" bytes exceeds the limit of {self.max_body_bytes} bytes", param=None,
                               code="body_too_large")
                await self._send_error(send_wrapper, err)
                return
            await self.app(scope, replay, send_wrapper)
        finally:
            if path not in PROBE_PATHS:
                self.metrics.requests.labels(endpoint, str(status["code"])).inc()

    async def _read_body(self, receive: Receive) -> Receive | None:
        """Read the whole body (bounded by ``max_body_bytes`` whatever Content-Length says, so chunked
        uploads are capped too); return a ``receive`` that replays it, then passes through (disconnects),
        or None when the body is too large."""
        chunks, total, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                chunks.append(b"")
                break
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_body_bytes:
                return None
            chunks.append(body)
            more = message.get("more_body", False)
        buffered: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:
            return buffered.pop() if buffered else await receive()

        return replay

    @staticmethod
    def _content_length(scope: Scope) -> int | None:
        for key, value in scope.get("headers", []):
            if key.lower() == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None
        return None

    @staticmethod
    async def _send_error(send: Send, err: APIError) -> None:
        body = err.json()
        headers: list[Any] = [(b"content-type", b"application/json"),
                              (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
