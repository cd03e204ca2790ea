"""Running a prepared request: submit every choice to the workers (all or none), then gather the choices
into one response body, or merge their deltas into one SSE stream (``data: {...}`` … ``data: [DONE]``).

Stream layout (OpenAI chat.completion.chunk / text_completion reference): a chat choice's first chunk
carries ``delta.role``; afterwards a chunk is sent only when there is text or a finish reason (a delta
with tokens but no text yet, e.g. a held-back stop-string prefix, rides along with the next chunk with its
logprobs), so no empty chunks repeat and ``finish_reason`` is in each choice's last chunk. With
``stream_options.include_usage`` a final chunk has ``choices: []`` and ``usage``.

Status line: a streaming response starts (HTTP 200 and its headers) only with its first event that carries
text or a finish reason (``open_stream``; the chat role chunks go out with it), so a request that fails
before any output gets a real HTTP error (502 worker failure, 503 no worker could take it over or the
gateway stops serving it, 504 timeout) with the OpenAI error body. A failure after the first event ends
the stream with an error event and ``data: [DONE]``. A request whose client went away, before its first
event or (non-streaming) before its body, is aborted on the workers. Retries and migrations after a
worker failure happen below, in the orchestrator: here they only look like a continuing token sequence.

Per token, the stream does little: the deltas already received for a request are turned into events
together and sent in one write (``_groups``; each token keeps its own event), and a chunk with text only
is the choice's pre-encoded JSON around the encoded text (``_ChunkWriter``), byte for byte what the
response structs encode to.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence

import msgspec

from gateway.chat_output import ChatOutputParser, merge_texts
from gateway.errors import APIError
from gateway.openai_responses import ChatCompletion, ChatDelta, Completion
from gateway.prepare import Prepared
from gateway.render import (
    ChoiceState,
    chat_event_choice,
    chunk_choice,
    completion_body,
    echo_logprobs,
    event_delta,
    prompt_entries,
    sse_chunk,
    text_offsets,
    usage,
    with_calls,
)
from gateway.request_state import GatewayRequest, GenerationFailed, TokenLogprob
from gateway.service import GatewayService
from gateway.stream import Delta, text_deltas

DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there
DONE = b"data: [DONE]\n\n"
MAX_GROUP = 64  # deltas turned into events and written together, at most
_TEXT_SLOT = "\x00pdserve-chunk-text\x00"  # placeholder whose encoding is cut out of a chunk template


async def submit_all(svc: GatewayService, p: Prepared) -> list[GatewayRequest]:
    """Submit every choice (``Orchestrator.submit_all``: all or none) and count the prompt tokens.

    Raises:
        APIError: 400 (a request with the same X-Request-Id is still in flight), 429 (queue full, counting
            all choices) or 503 (no worker can serve).
    """
    reqs = await svc.orchestrator.submit_all(p.request_id, [c.inp for c in p.choices])
    svc.metrics.prompt_tokens.inc(p.num_prompt_tokens)
    return reqs


async def _collect(svc: GatewayService, req: GatewayRequest, state: ChoiceState, prompt_only: bool) -> None:
    async for delta in text_deltas(svc.orchestrator, svc.text(), req, prompt_only):
        state.prompt_logprobs = req.prompt_logprobs
        state.text += delta.text
        state.num_tokens += delta.num_tokens
        state.finish_reason = delta.finish_reason or state.finish_reason
        state.logprobs.extend(delta.logprobs)


async def complete(svc: GatewayService, p: Prepared, reqs: list[GatewayRequest],
                   is_disconnected: Callable[[], Awaitable[bool]]) -> ChatCompletion | Completion:
    """The whole (non-streaming) body; polls ``is_disconnected`` and aborts the workers if the client left.

    Raises:
        APIError: 502 when a worker failed, 503 when no other worker could take a failed request over,
            504 when it timed out, 499 when the client disconnected.
    """
    states = [ChoiceState(c.index) for c in p.choices]
    gather = asyncio.ensure_future(asyncio.gather(
        *(_collect(svc, r, s, c.prompt_only) for r, s, c in zip(reqs, states, p.choices, strict=True))))
    try:
        while not gather.done():
            await asyncio.wait([gather], timeout=DISCONNECT_POLL_S)
            if not gather.done() and await is_disconnected():
                raise APIError(499, "client disconnected", "invalid_request_error", None, "client_closed")
        gather.result()
    except GenerationFailed as exc:
        raise exc.api_error() from exc
    finally:
        gather.cancel()
        with contextlib.suppress(BaseException):
            await gather
        for r in reqs:
            svc.orchestrator.release(r)
    n_out = sum(s.num_tokens for s in states)
    svc.metrics.generation_tokens.inc(n_out)
    return completion_body(p, svc.text(), states, int(time.time()),
                           usage(p, n_out, [r.num_cached_tokens for r in reqs]))


_END = object()


async def _pump(svc: GatewayService, index: int, req: GatewayRequest, prompt_only: bool,
                queue: asyncio.Queue[tuple[int, object]]) -> None:
    try:
        async for delta in text_deltas(svc.orchestrator, svc.text(), req, prompt_only):
            queue.put_nowait((index, delta))
    except GenerationFailed as exc:
        queue.put_nowait((index, exc))
    queue.put_nowait((index, _END))


async def _groups(svc: GatewayService, p: Prepared,
                  reqs: list[GatewayRequest]) -> AsyncGenerator[list[tuple[int, object]], None]:
    """(choice position, ``Delta`` | ``GenerationFailed`` | ``_END``) items of every request, in arrival
    order, in groups: each group holds what is ready now (at most ``MAX_GROUP``), waiting only for its
    first item. One request is read directly; several through one task each and a shared queue."""
    if len(reqs) == 1:
        req, deltas = reqs[0], text_deltas(svc.orchestrator, svc.text(), reqs[0], p.choices[0].prompt_only)
        try:
            while True:
                group: list[tuple[int, object]] = []
                try:
                    group.append((0, await anext(deltas)))
                    while len(group) < MAX_GROUP and svc.orchestrator.has_message(req):
                        group.append((0, await anext(deltas)))
                except StopAsyncIteration:
                    group.append((0, _END))
                except GenerationFailed as exc:
                    group.append((0, exc))
                yield group
                if group[-1][1] is _END or isinstance(group[-1][1], GenerationFailed):
                    return
        finally:
            if isinstance(deltas, AsyncGenerator):
                await deltas.aclose()
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(svc, i, r, c.prompt_only, queue))
             for i, (r, c) in enumerate(zip(reqs, p.choices, strict=True))]
    try:
        while True:
            group = [await queue.get()]
            while len(group) < MAX_GROUP and not queue.empty():
                group.append(queue.get_nowait())
            yield group
    finally:
        for task in tasks:
            task.cancel()


class _ChunkWriter:
    """Turns (choice position, delta) into SSE events, holding textless deltas' logprobs for the next."""

    def __init__(self, svc: GatewayService, p: Prepared, reqs: Sequence[GatewayRequest] = ()) -> None:
        self.svc, self.p, self.created, self.reqs = svc, p, int(time.time()), reqs
        self.prefix: list[str | None] = [c.echo_text for c in p.choices]  # None once sent
        self.offset = [0] * len(p.choices)
        self.held: list[list[TokenLogprob]] = [[] for _ in p.choices]
        self.n_out = 0
        self.parsers = [ChatOutputParser(p.output) for _ in p.choices] if p.chat and p.output.active else None
        self._templates: list[tuple[bytes, bytes] | None] = [None] * len(p.choices)

    def _text_event(self, pos: int, content: str) -> bytes:
        """The event of a chunk holding only ``content`` for choice ``pos``: its template (the event of
        such a chunk, encoded once with a placeholder text) around the JSON-encoded ``content``."""
        template = self._templates[pos]
        if template is None:
            event = sse_chunk(self.p, self.created, chunk_choice(
                self.p, self.svc.text(), self.p.choices[pos].index, _TEXT_SLOT, None, [], 0))
            head, _, tail = event.partition(msgspec.json.encode(_TEXT_SLOT))
            template = self._templates[pos] = (head, tail)
        return template[0] + msgspec.json.encode(content) + template[1]

    def first(self) -> list[bytes]:
        if not self.p.chat:
            return []
        return [sse_chunk(self.p, self.created, chunk_choice(self.p, self.svc.text(), c.index, None, None, [],
                                                             0, role=True))
                for c in self.p.choices]

    def parsed(self, pos: int, d: Delta) -> bytes | None:
        """The chunks of a chat choice whose text goes through parsers: one per (merged) event, the
        held logprobs on the first, the finish reason on the last (or on a chunk of its own)."""
        assert self.parsers is not None
        parser = self.parsers[pos]
        events = parser.feed(d.text) if d.text else []
        if d.finish_reason is not None:
            events += parser.finish()
        deltas = [event_delta(e) for e in merge_texts(events)]
        reason = with_calls(d.finish_reason, parser.num_calls)
        if reason is not None and not deltas:
            deltas = [ChatDelta()]
        out = []
        for i, delta in enumerate(deltas):
            entries, self.held[pos] = self.held[pos], []
            finish = reason if i == len(deltas) - 1 else None
            out.append(sse_chunk(self.p, self.created, chat_event_choice(
                self.p, self.svc.text(), self.p.choices[pos].index, delta, finish, entries)))
        return b"".join(out) or None

    def delta(self, pos: int, d: Delta) -> bytes | None:
        self.n_out += d.num_tokens
        self.held[pos].extend(d.logprobs)
        if self.parsers is not None:
            return self.parsed(pos, d)
        if not d.text and d.finish_reason is None:
            return None
        first = self.prefix[pos] is not None
        content = (self.prefix[pos] or "") + d.text
        self.prefix[pos] = None
        echo = None
        c = self.p.choices[pos]
        if first and self.p.echo_logprobs:  # the echoed prompt's logprobs lead the choice's first chunk
            echo = echo_logprobs(self.svc.text(), c.inp.prompt_token_ids,
                                 prompt_entries(self.reqs[pos].prompt_logprobs), self.p.logprobs or 0)
        if not self.held[pos] and d.finish_reason is None and echo is None:
            return self._text_event(pos, content)  # content is not empty here
        entries, self.held[pos] = self.held[pos], []
        choice = chunk_choice(self.p, self.svc.text(), c.index, content, d.finish_reason,
                              entries, self.offset[pos] + len(c.echo_text), echo=echo)
        text = self.svc.text()
        self.offset[pos] = text_offsets([text.logprob_token(e.token_id)[1] for e in entries],
                                        self.offset[pos])[1]
        return sse_chunk(self.p, self.created, choice)

    def usage(self, reqs: list[GatewayRequest]) -> bytes:
        return sse_chunk(self.p, self.created, None,
                         usage(self.p, self.n_out, [r.num_cached_tokens for r in reqs]))


async def sse_events(svc: GatewayService, p: Prepared,
                     reqs: list[GatewayRequest]) -> AsyncGenerator[bytes, None]:
    """SSE events of a streaming response; ends with ``data: [DONE]`` (after an error event on a failure
    after the first event). The first event holds the chat role chunks and the first chunk with text or
    a finish reason.

    Raises:
        APIError: a failure before the first event (``GenerationFailed.api_error``: 502, 503 or 504).
    """
    writer = _ChunkWriter(svc, p, reqs)
    groups = _groups(svc, p, reqs)
    started = False
    try:
        live = len(reqs)
        while live:
            events: list[bytes] = []
            failed: GenerationFailed | None = None
            for pos, item in await anext(groups):
                if item is _END:
                    live -= 1
                elif isinstance(item, GenerationFailed):
                    failed = item
                    break
                elif isinstance(item, Delta) and (out := writer.delta(pos, item)) is not None:
                    if not started:
                        started = True
                        events.extend(writer.first())
                    events.append(out)
            if failed is not None:
                if not started:
                    raise failed.api_error() from failed
                events.append(b"data: " + failed.api_error().json() + b"\n\n")
            if events:
                yield b"".join(events)
            if failed is not None:
                break
        else:
            svc.metrics.generation_tokens.inc(writer.n_out)
            if p.include_usage:
                yield writer.usage(reqs)
    finally:
        await groups.aclose()
        for r in reqs:
            svc.orchestrator.release(r)
    yield DONE


async def open_stream(events: AsyncGenerator[bytes, None],
                      is_disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[bytes]:
    """Wait for the first event of ``events`` (``sse_events``), polling ``is_disconnected``; return the
    events from that one on, for the response to send once its status line is known.

    Raises:
        APIError: the stream failed before its first event (502, 503, 504), or 499 when the client
            disconnected meanwhile (the workers are aborted: ``events`` is closed, releasing its requests).
    """
    first = asyncio.ensure_future(anext(events))
    try:
        while not first.done():
            await asyncio.wait([first], timeout=DISCONNECT_POLL_S)
            if not first.done() and await is_disconnected():
                raise APIError(499, "client disconnected", "invalid_request_error", None, "client_closed")
        head = first.result()
    except BaseException:
        first.cancel()
        with contextlib.suppress(BaseException):
            await first
        await events.aclose()
        raise
    return _prepend(head, events)


async def _prepend(head: bytes, rest: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    try:
        yield head
        async for event in rest:
            yield event
    finally:
        await rest.aclose()


__all__ = ["complete", "open_stream", "sse_events", "submit_all"]
