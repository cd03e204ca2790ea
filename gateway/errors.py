"""OpenAI-style API errors: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status.

Error shape: OpenAI API reference, "Error codes" (https://platform.openai.com/docs/guides/error-codes).
"""

from __future__ import annotations

from gateway.openai_responses import ErrorDetail, ErrorResponse, encode


class APIError(Exception):
    """An error answered to the client. ``status`` is the HTTP status (never 200)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        """The body: ``{"error": {...}}``."""
        return ErrorResponse(ErrorDetail(self.message, self.type, self.param, self.code))

    def json(self) -> bytes:
        """The body as JSON bytes."""
        return encode(self.body())


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400 naming the offending field in ``param``."""
    return APIError(400, message, "invalid_request_error", param, code)


def not_found_model(model: str) -> APIError:
    """404: the requested model is not served here."""
    return APIError(404, f"The model '{model}' does not exist", "invalid_request_error", "model",
                    "model_not_found")


def unavailable(message: str, retry_after_s: int = 1, code: str = "no_worker") -> APIError:
    """503: no worker can serve the request now; ``Retry-After`` (seconds)."""
    return APIError(503, message, "service_unavailable", None, code, {"Retry-After": str(retry_after_s)})


def queue_full(retry_after_s: int = 1) -> APIError:
    """429 ``queue_full`` (``--max-queue`` requests in flight on this gateway process) with ``Retry-After``
    (whole seconds). 1 by default: the gateway has no estimate of when a request in flight finishes."""
    return APIError(429, "Too many requests in flight; retry later", "rate_limit_error", None,
                    "queue_full", {"Retry-After": str(retry_after_s)})


def upstream_failed(message: str) -> APIError:
    """502: a worker failed while serving the request."""
    return APIError(502, message, "server_error", None, "worker_failed")


def gateway_timeout(message: str) -> APIError:
    """504: the request timed out (``--request-timeout``) before it could be answered."""
    return APIError(504, message, "server_error", None, "timeout")
