"""Running a prepared request: submit every choice to the workers (all or none), then gather the choices
into one JSON body, or merge their deltas into one SSE stream (``data: {...}`` … ``data: [DONE]``).

Stream layout (OpenAI chat.completion.chunk / text_completion reference): a chat choice's first chunk
carries ``delta.role``; afterwards a chunk is sent only when there is text or a finish reason (a delta
with tokens but no text yet, e.g. a held-back stop-string prefix, rides along with the next chunk with its
logprobs), so no empty chunks repeat and ``finish_reason`` is in each choice's last chunk. With
``stream_options.include_usage`` a final chunk has ``choices: []`` and ``usage``. A worker failure ends
the stream with an error event; a non-streaming request whose client went away is aborted on the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from gateway.errors import APIError, bad_request, queue_full, unavailable, upstream_failed
from gateway.handle import Delta, GenerationFailed, RequestHandle, TokenLogprob
from gateway.prepare import Prepared
from gateway.render import ChoiceState, chunk_choice, envelope, final_choice, usage
from gateway.router import NoWorkerError
from gateway.service import GatewayService

DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there


async def submit_all(svc: GatewayService, p: Prepared) -> list[RequestHandle]:
    """Submit every choice; if one cannot be admitted, release those already sent and raise.

    Raises:
        APIError: 400 (a request with the same X-Request-Id is still in flight), 429 (queue full, counting
            all choices) or 503 (no worker can serve).
    """
    wanted = {c.inp.request_id for c in p.choices}
    if any(svc.client_request_id(rid) in wanted for rid in svc.requests):
        raise bad_request(f"request id {p.request_id!r} is already in flight (X-Request-Id must be unique)",
                          None, "duplicate_request_id")
    if len(svc.requests) + len(p.choices) > svc.settings.max_queue:
        raise queue_full()
    handles: list[RequestHandle] = []
    try:
        for choice in p.choices:
            inp = replace(choice.inp, request_id=svc.worker_request_id(choice.inp.request_id))
            handles.append(await svc.submit(inp))
    except NoWorkerError as exc:
        for h in handles:
            svc.release(h)
        raise unavailable(str(exc)) from exc
    except BaseException:
        for h in handles:
            svc.release(h)
        raise
    svc.metrics.prompt_tokens.inc(p.num_prompt_tokens)
    return handles


async def _collect(svc: GatewayService, handle: RequestHandle, state: ChoiceState) -> None:
    async for delta in svc.stream(handle):
        state.text += delta.text
        state.num_tokens += delta.num_tokens
        state.finish_reason = delta.finish_reason or state.finish_reason
        state.logprobs.extend(delta.logprobs)


async def complete(svc: GatewayService, p: Prepared, handles: list[RequestHandle],
                   is_disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any]:
    """The whole (non-streaming) body; polls ``is_disconnected`` and aborts the workers if the client left.

    Raises:
        APIError: 502 when a worker failed, 499 when the client disconnected.
    """
    states = [ChoiceState(c.index) for c in p.choices]
    gather = asyncio.ensure_future(asyncio.gather(
        *(_collect(svc, h, s) for h, s in zip(handles, states, strict=True))))
    try:
        while not gather.done():
            await asyncio.wait([gather], timeout=DISCONNECT_POLL_S)
            if not gather.done() and await is_disconnected():
                raise APIError(499, "client disconnected", "invalid_request_error", None, "client_closed")
        gather.result()
    except GenerationFailed as exc:
        raise upstream_failed(str(exc)) from exc
    finally:
        gather.cancel()
        with contextlib.suppress(BaseException):
            await gather
        for h in handles:
            svc.release(h)
    n_out = sum(s.num_tokens for s in states)
    svc.metrics.generation_tokens.inc(n_out)
    body = envelope(p, int(time.time()), chunk=False)
    body["choices"] = [final_choice(p, svc.text(), s, c.echo_text)
                       for s, c in zip(states, p.choices, strict=True)]
    body["usage"] = usage(p, n_out)
    return body


_END = object()


async def _pump(svc: GatewayService, index: int, handle: RequestHandle,
                queue: asyncio.Queue[tuple[int, object]]) -> None:
    try:
        async for delta in svc.stream(handle):
            await queue.put((index, delta))
    except GenerationFailed as exc:
        await queue.put((index, exc))
    await queue.put((index, _END))


class _ChunkWriter:
    """Turns (choice position, delta) into SSE lines, holding textless deltas' logprobs for the next."""

    def __init__(self, svc: GatewayService, p: Prepared) -> None:
        self.svc, self.p, self.created = svc, p, int(time.time())
        self.prefix = [c.echo_text for c in p.choices]
        self.offset = [0] * len(p.choices)
        self.held: list[list[TokenLogprob]] = [[] for _ in p.choices]
        self.n_out = 0

    def line(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        obj = envelope(self.p, self.created, chunk=True)
        obj["choices"] = choices
        obj.update(extra)
        return f"data: {json.dumps(obj)}\n\n"

    def first(self) -> list[str]:
        if not self.p.chat:
            return []
        return [self.line([chunk_choice(self.p, self.svc.text(), c.index, None, None, [], 0, role=True)])
                for c in self.p.choices]

    def delta(self, pos: int, d: Delta) -> str | None:
        self.n_out += d.num_tokens
        self.held[pos].extend(d.logprobs)
        if not d.text and d.finish_reason is None:
            return None
        content = self.prefix[pos] + d.text
        self.prefix[pos] = ""
        entries, self.held[pos] = self.held[pos], []
        choice = chunk_choice(self.p, self.svc.text(), self.p.choices[pos].index, content, d.finish_reason,
                              entries, self.offset[pos] + len(self.p.choices[pos].echo_text))
        self.offset[pos] += sum(len(self.svc.text().token_text(e.token_id)) for e in entries)
        return self.line([choice])


async def sse_events(svc: GatewayService, p: Prepared, handles: list[RequestHandle]) -> AsyncIterator[str]:
    """SSE lines of a streaming response; ends with ``data: [DONE]`` (after an error event on failure)."""
    writer = _ChunkWriter(svc, p)
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(svc, i, h, queue)) for i, h in enumerate(handles)]
    try:
        for line in writer.first():
            yield line
        live = len(tasks)
        while live:
            pos, item = await queue.get()
            if item is _END:
                live -= 1
            elif isinstance(item, GenerationFailed):
                yield f"data: {json.dumps(upstream_failed(str(item)).body())}\n\n"
                break
            elif isinstance(item, Delta) and (out := writer.delta(pos, item)) is not None:
                yield out
        else:
            svc.metrics.generation_tokens.inc(writer.n_out)
            if p.include_usage:
                yield writer.line([], usage=usage(p, writer.n_out))
    finally:
        for task in tasks:
            task.cancel()
        for h in handles:
            svc.release(h)
    yield "data: [DONE]\n\n"


__all__ = ["complete", "sse_events", "submit_all"]
