"""Send one streaming request to an OpenAI-compatible server and time it.

The stream is Server-Sent Events as the OpenAI API sends them: ``data: {json chunk}`` lines, a final
usage chunk when ``stream_options.include_usage`` is set, then ``data: [DONE]``. A chunk
``{"error": {...}}`` is a server error mid-stream (how pdserve's gateway ends a failed stream).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest.records import RequestRecord

_MAX_ERROR_CHARS = 300


class StreamError(Exception):
    """The response stream broke or carried an error event."""


@dataclass
class _Timing:
    """Accumulates token-chunk arrival times of one stream (seconds from ``clock``)."""

    start: float
    first: float | None = None
    last: float | None = None
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    text: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None

    def token(self, now: float, text: str) -> None:
        if self.last is None:
            self.first = now
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.chunks += 1
        self.text.append(text)


def chunk_text(chunk: dict[str, Any]) -> str:
    """The generated text in one completions or chat chunk ('' when none, e.g. a usage-only chunk)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return str((choice["delta"] or {}).get("content") or "")
    return str(choice.get("text") or "")


async def _read_stream(resp: httpx.Response, timing: _Timing, clock: Callable[[], float]) -> None:
    try:
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                raise StreamError(f"invalid JSON in stream: {data[:80]!r}") from None
            if not isinstance(chunk, dict):
                raise StreamError(f"stream chunk is not a JSON object: {data[:80]!r}")
            if chunk.get("error"):
                raise StreamError(f"error event: {json.dumps(chunk['error'])[:_MAX_ERROR_CHARS]}")
            if chunk.get("usage"):
                timing.usage = chunk["usage"]
            text = chunk_text(chunk)
            if text:
                timing.token(clock(), text)
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        raise StreamError(f"stream broke: {exc!r}") from exc
    raise StreamError("stream ended without [DONE]")


def error_fields(body: bytes) -> tuple[str | None, str]:
    """``(code, message)`` of an HTTP error body; ``message`` is cut to 300 characters.

    OpenAI's shape is ``{"error": {"message", "type", "param", "code"}}`` (OpenAI API reference, "Error
    codes"). ``code`` is taken when it is a non-empty string, else ``type`` (vLLM sends ``"code": 404``
    and ``"type": "NotFoundError"``), else None. A body without an ``error`` object gives ``(None, its
    text)``.
    """
    text = body[:_MAX_ERROR_CHARS].decode("utf-8", "replace")
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None, text
    if err is None:
        return None, text
    if not isinstance(err, dict):
        return None, str(err)[:_MAX_ERROR_CHARS]
    code = next((c for c in (err.get("code"), err.get("type")) if isinstance(c, str) and c), None)
    return code, str(err.get("message"))[:_MAX_ERROR_CHARS]


@dataclass(frozen=True)
class RequestIds:
    """Where a request sits in the run: issue order, session and turn, send time (s since run start)."""

    index: int
    session_id: int
    turn: int
    start_s: float


async def send_request(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    ids: RequestIds,
    timeout_s: float,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[RequestRecord, str]:
    """POST ``body`` to ``path`` (relative to the client's base URL), stream and time the answer.

    Returns the record and the generated text. Never raises for server-side trouble: an HTTP status
    other than 200, a broken or erroring stream, a connection failure, or exceeding ``timeout_s``
    seconds (whole request, stream included) is recorded as ``error_kind``.
    """
    rec = RequestRecord(index=ids.index, session_id=ids.session_id, turn=ids.turn, start_s=ids.start_s)
    timing = _Timing(start=clock())
    try:
        async with asyncio.timeout(timeout_s), client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                rec.error_kind, rec.http_status = "http_status", resp.status_code
                rec.error_code, rec.error = error_fields(await resp.aread())
                return rec, ""
            await _read_stream(resp, timing, clock)
    except (TimeoutError, httpx.TimeoutException):
        rec.error_kind, rec.error = "timeout", f"no complete answer within {timeout_s} s"
    except StreamError as exc:
        rec.error_kind, rec.error = "stream_error", str(exc)
    except httpx.HTTPError as exc:
        rec.error_kind, rec.error = "connection", f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
    _fill(rec, timing, clock())
    return rec, "".join(timing.text)


def _fill(rec: RequestRecord, timing: _Timing, end: float) -> None:
    rec.itl_s = timing.itl
    if timing.first is not None:
        rec.ttft_s = timing.first - timing.start
    usage = timing.usage or {}
    rec.usage_reported = "completion_tokens" in usage
    rec.output_tokens = int(usage.get("completion_tokens", timing.chunks))
    if usage.get("prompt_tokens") is not None:
        rec.prompt_tokens = int(usage["prompt_tokens"])
    if rec.error_kind is None:
        rec.success = timing.first is not None
        rec.e2e_s = end - timing.start
        if not rec.success:
            rec.error_kind, rec.error = "stream_error", "stream finished without any token"
