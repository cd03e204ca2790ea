"""One request's text: its output tokens (from gateway/orchestrator.py) through the incremental
detokenizer, with the stop strings, into ``Delta``s.

A stop string ends the request with ``finish_reason="stop"`` (the orchestrator's ``finish``; holders
still running are aborted when the caller releases it); otherwise the finish reason is the one the
orchestrator reports (the worker's: ``length`` only when ``max_tokens`` cut the output). The last delta
carries the finish reason and the detokenizer's held-back text.

With stop strings, a token's logprob goes out with the first delta that releases some of its text (the
detokenizer holds back a tail that could begin a stop string); a token whose text lies wholly in the stop
string (or after it) has no logprob in the output, so the logprobs list the tokens of the text returned.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

from gateway.openai_responses import FinishReason
from gateway.orchestrator import Orchestrator
from gateway.request_state import GatewayRequest, TokenLogprob
from gateway.text import TextProcessor


@dataclass(frozen=True, slots=True)
class Delta:
    """What the HTTP layer streams: new text, new tokens counted, the finish reason at the end, and the
    counted tokens' logprobs (empty unless the request asked for logprobs and the worker sent them)."""

    text: str
    num_tokens: int
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


async def text_deltas(orch: Orchestrator, text: TextProcessor, req: GatewayRequest,
                      prompt_only: bool = False) -> AsyncIterator[Delta]:
    """Deltas of ``req`` until it finishes; the last one carries ``finish_reason``. ``prompt_only``
    (``max_tokens: 0`` with echo): the one token the workers sample is dropped, a single empty delta
    ends the request with ``length``.

    Raises:
        GenerationFailed: a worker failed, vanished or aborted, ``--request-timeout`` passed, or the
            gateway stops serving the request (the end of its drain).
    """
    if prompt_only:
        while (await orch.next_output(req)).finish_reason is None:
            pass
        orch.finish(req, "length")
        yield Delta("", 0, "length")
        return
    detok = text.detokenizer(req.inp.prompt_token_ids, req.inp.stop)
    held: list[tuple[int, TokenLogprob]] = []  # (where its text starts, logprob) of tokens not released

    def released(upto: int) -> tuple[TokenLogprob, ...]:
        """The held logprobs of tokens whose text starts before character ``upto``; kept: the rest."""
        nonlocal held
        out = tuple(lp for start, lp in held if start < upto)
        held = [(start, lp) for start, lp in held if start >= upto]
        return out

    while True:
        out = await orch.next_output(req)
        start = detok.decoded_length
        new, n = ("", 0) if out.token_id is None else (detok.add(out.token_id), 1)
        if out.logprob is not None:
            held.append((start, out.logprob))
        reason = "stop" if detok.stopped else out.finish_reason
        if reason is None:  # without stop strings no text is held back: every logprob goes out at once
            yield Delta(new, n, None, released(detok.released_length if req.inp.stop else sys.maxsize))
            continue
        orch.finish(req, reason)
        assert reason != "abort"  # finish raised
        new += detok.finish()
        yield Delta(new, n, reason, released(detok.released_length if detok.stopped else sys.maxsize))
        return
