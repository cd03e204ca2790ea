"""A first-token worker's prefill rate, measured from first tokens: prompt tokens computed per busy second.

One server working through its queue: a request that arrived (or was routed) at ``t0`` and got its first
token at ``t1`` kept the worker busy from ``max(t0, the previous first token)`` to ``t1``; the prompt
tokens it computed (its prompt minus its prefix-cache hit) over that time, both summed with exponential
decay over the last requests (``DECAY``), is the rate. Requests finishing in one batch add their tokens
with little time each: the sums stay right.

A worker counts only the first tokens of a step that batched several prompts or after which other
requests still waited (``observe``'s ``count``): the rate that matters is how fast it drains a queue,
where one step's fixed cost is shared by the prompts batched in it. Requests that each find it idle pay
that cost alone: counted, a light stream of short prompts pulled the rate to a quarter of what the next
burst met (112-183 against 420-580 prompt tokens/s, embedded model on 2 CPU cores), and half of that
burst was refused while the admitted ones waited 13 s of a 30 s budget.

Measured in two places with the same arithmetic: by each prefill or colocated worker over the requests
it computed (from their arrival there; seeded at start-up by ``engine.warmup.probe_prefill``), reported in
every heartbeat (``WorkerLoad.prefill_tokens_per_s``, ``prefill_largest_tokens``, beside the backlog it
judges, ``prefill_backlog_tokens``); and by each gateway over
the requests it routed (from routing, so it also counts the hops), which gateway/admission.py falls back on
for a worker that reports none. No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# weight of the history at each new measurement: about the last 20 requests count, several prefill steps
# (the requests of one step report nearly together, the first with the whole step's time)
DECAY = 0.95
# a queued request counts at most TRUSTED_SPAN times the largest prompt the rate was measured on: a
# request's time is a fixed cost plus its tokens over the throughput, and a rate measured on short prompts
# is mostly the fixed cost, so it overstates a long prompt's time many times over (gateway/admission.py)
TRUSTED_SPAN = 4.0


def judged(tokens: int, largest: float) -> float:
    """The part of a queued request computing ``tokens`` prompt tokens that a rate measured on prompts of
    at most ``largest`` computed tokens judges: at most ``TRUSTED_SPAN`` times ``largest`` (all of it
    before any measurement, ``largest`` 0)."""
    return min(float(tokens), TRUSTED_SPAN * largest) if largest > 0 else float(tokens)


@dataclass(slots=True)
class PrefillRate:
    """Decayed sums of prompt tokens computed and busy seconds, the time (monotonic seconds) of the last
    first token, and the largest computed-token count measured (decayed by ``DECAY`` per measurement, so it
    follows the recent prompts)."""

    tokens: float = 0.0
    seconds: float = 0.0
    last_first_token: float = -math.inf
    largest: float = 0.0

    def observe(self, tokens: int, started: float, now: float, count: bool = True) -> None:
        """A first token at ``now`` for ``tokens`` computed prompt tokens of a request that arrived or was
        routed at ``started`` (monotonic seconds). With ``count`` False only the time of the last first
        token moves (the next request's busy time starts there); the sums do not, unless nothing was
        measured yet."""
        busy = max(0.0, now - max(started, self.last_first_token))
        self.last_first_token = now
        if not count and self.tokens > 0:
            return
        self.tokens = self.tokens * DECAY + tokens
        self.seconds = self.seconds * DECAY + busy
        self.largest = max(float(tokens), self.largest * DECAY)

    def judged(self, tokens: int) -> float:
        """``judged(tokens, self.largest)``."""
        return judged(tokens, self.largest)

    def tokens_per_s(self) -> float | None:
        """Prompt tokens per second, or None before a measurement with busy time."""
        return self.tokens / self.seconds if self.seconds > 1e-6 and self.tokens > 0 else None
