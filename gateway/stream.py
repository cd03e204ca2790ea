"""One request's message loop in the gateway: worker messages in, text deltas out (stop strings here).

Tokens past ``max_tokens`` are ignored; reaching ``max_tokens`` needs no abort (workers stop there too,
and a late message for a released request is answered with ``AbortRequest``). A stop string ends the
request with ``finish_reason="stop"`` and the caller's ``release`` aborts the workers still holding it.
Every wait is bounded by ``--request-timeout``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from gateway.handle import Delta, GenerationFailed, RequestHandle, TokenLogprob, WorkerLost
from gateway.text import IncrementalDetokenizer
from protocol.messages import (
    DecodeRequest,
    FirstToken,
    KVReserved,
    PrefillRequest,
    RequestFailed,
    RequestFinished,
    TokenBatch,
    TopLogprob,
)

if TYPE_CHECKING:
    from gateway.service import GatewayService


async def _next(handle: RequestHandle, deadline: float) -> object:
    remaining = deadline - time.monotonic()
    try:
        return await asyncio.wait_for(handle.inbox.get(), timeout=max(remaining, 0.001))
    except TimeoutError as exc:
        raise GenerationFailed(f"request timed out after {deadline - handle.arrival:.0f} s") from exc


async def _on_kv_reserved(svc: GatewayService, handle: RequestHandle, msg: KVReserved) -> None:
    prefill = handle.route.prefill
    assert prefill is not None
    inp = handle.inp
    await svc.hold_and_send(handle, prefill, PrefillRequest(
        request_id=inp.request_id, prompt_token_ids=inp.prompt_token_ids, sampling=inp.sampling,
        kv_handle=msg.kv_handle, decode_worker_id=msg.worker_id))


async def _on_first_token(svc: GatewayService, handle: RequestHandle, msg: FirstToken) -> None:
    if handle.route.kind == "colocated":
        return
    svc.drop_holder(handle, msg.worker_id)  # prefill is done; it finishes its KV send on its own
    if handle.route.kind != "disaggregated":
        return
    decode = handle.route.decode
    if decode is not None and msg.finish_reason is None:
        await svc.send(decode, DecodeRequest(request_id=handle.request_id, first_token_id=msg.token_id,
                                             num_cached_tokens=msg.num_cached_tokens))


def _logprobs(token_ids: list[int], lps: list[float] | None,
              tops: list[list[TopLogprob]] | None) -> list[TokenLogprob | None]:
    """Per-token logprob entries aligned with ``token_ids`` (None where the worker sent none)."""
    out: list[TokenLogprob | None] = []
    for i, tok in enumerate(token_ids):
        if lps is None or i >= len(lps):
            out.append(None)
            continue
        top = tops[i] if tops is not None and i < len(tops) else []
        out.append(TokenLogprob(tok, lps[i], tuple((t.token_id, t.logprob) for t in top)))
    return out


class _Emitter:
    """Counts tokens (capped at max_tokens), runs them through the detokenizer, keeps their logprobs."""

    def __init__(self, handle: RequestHandle, detok: IncrementalDetokenizer) -> None:
        self.handle, self.detok = handle, detok
        self.max_tokens = handle.inp.sampling.max_tokens

    def tokens(self, token_ids: list[int], lps: list[float] | None = None,
               tops: list[list[TopLogprob]] | None = None) -> Delta:
        text, n, entries = [], 0, _logprobs(token_ids, lps, tops)
        kept: list[TokenLogprob] = []
        for tok, entry in zip(token_ids, entries, strict=True):
            if self.detok.stopped or len(self.handle.token_times) >= self.max_tokens:
                break
            self.handle.token_times.append(time.monotonic())
            n += 1
            text.append(self.detok.add(tok))
            if entry is not None:
                kept.append(entry)
        reason = "stop" if self.detok.stopped else None
        if reason is None and len(self.handle.token_times) >= self.max_tokens:
            reason = "length"
        return Delta("".join(text), n, reason, tuple(kept))


async def run_stream(svc: GatewayService, handle: RequestHandle) -> AsyncIterator[Delta]:
    """Yield deltas until the request finishes; the last delta carries ``finish_reason``.

    Raises:
        GenerationFailed: a worker failed or vanished, or ``--request-timeout`` passed.
    """
    emitter = _Emitter(handle, svc.text().detokenizer(handle.inp.prompt_token_ids, handle.inp.stop))
    deadline = handle.arrival + svc.settings.request_timeout
    while True:
        msg = await _next(handle, deadline)
        delta: Delta | None = None
        if isinstance(msg, KVReserved):
            await _on_kv_reserved(svc, handle, msg)
        elif isinstance(msg, FirstToken):
            await _on_first_token(svc, handle, msg)
            delta = emitter.tokens([msg.token_id], None if msg.logprob is None else [msg.logprob],
                                   None if msg.top_logprobs is None else [msg.top_logprobs])
            if delta.finish_reason is None and msg.finish_reason is not None:
                delta = Delta(delta.text, delta.num_tokens, msg.finish_reason, delta.logprobs)
        elif isinstance(msg, TokenBatch):
            delta = emitter.tokens(msg.token_ids, msg.logprobs, msg.top_logprobs)
        elif isinstance(msg, RequestFinished):
            svc.drop_holder(handle, msg.worker_id)
            delta = Delta("", 0, msg.finish_reason if msg.finish_reason != "abort" else "abort")
        elif isinstance(msg, RequestFailed):
            svc.drop_holder(handle, msg.worker_id)
            raise GenerationFailed(f"worker {msg.worker_id} failed: {msg.error}")
        elif isinstance(msg, WorkerLost):
            raise GenerationFailed(f"worker {msg.worker_id} lost: {msg.reason}")
        if delta is None:
            continue
        if delta.finish_reason is not None:
            if delta.finish_reason == "abort":
                raise GenerationFailed("the worker aborted the request")
            handle.finished = True
            if delta.finish_reason == "length":  # workers stop at max_tokens too: no abort needed
                for worker_id in list(handle.holders):
                    svc.drop_holder(handle, worker_id)
            yield Delta(delta.text + emitter.detok.finish(), delta.num_tokens, delta.finish_reason,
                        delta.logprobs)
            return
        if delta.text or delta.num_tokens:
            yield delta
