"""Admission control: refuse, at once, work the workers could not start in time (no torch).

Called by the orchestrator for each routed request before its first message goes out (``admit``), and
told of each new attempt of an admitted request (``record``: a retry or migration queues like the
attempt it replaces, and is not refused), of each ``FirstToken`` (``first_token``) and of each released
request or given-up attempt (``forget``). Three answers:

* **400** (``prompt_too_long``): the prompt needs more KV blocks than the whole pool of the prefill
  worker, or of every compatible decode worker (it could never run, retrying does not help);
* **429** (``kv_blocks``): no compatible decode worker has the prompt's blocks free now: its last
  heartbeat's ``num_free_blocks`` minus the blocks of the requests routed to it since that heartbeat
  (the decode worker would otherwise queue the reservation, and fail it after 30 s);
* **429** (``prefill_queue``): the prompt tokens queued ahead on the chosen first-token worker (prefill,
  or colocated), divided by that worker's prefill rate (``rate``), exceed the budget
  (``--admission-budget`` seconds). Queued ahead: the larger of what this gateway routed there and has no
  ``FirstToken`` for, and the backlog the worker reported in its last heartbeat
  (``WorkerLoad.prefill_backlog_tokens``: every gateway's requests it holds or received during a step)
  plus what this gateway routed there since that heartbeat or has not sent yet (a disaggregated request's
  ``PrefillRequest`` follows its decode worker's ``KVReserved``); so the gateway processes and replicas of
  one fleet judge one queue, a heartbeat (0.5 s) late. A queued request computing more than
  ``TRUSTED_SPAN`` times the largest prompt the rate was recently measured on counts only that many
  tokens: the wait is then a lower bound, so a long prompt is not refused on a short prompts' rate, and a
  flood of prompts the rate knows still is.

The prefill rate (protocol/prefill_rate.py) is the one the worker reports in its heartbeats: a request
that reached it at ``t0`` and got its first token at ``t1`` kept it busy from ``max(t0, its previous first
token)`` to ``t1``, with the prompt tokens it computed (the prompt minus its prefix-cache hit), over every
request it computed, whichever gateway sent it, and from its start-up probe (``engine.warmup.probe_prefill``)
before its first. So a gateway process just started, restarted or added beside others judges the queue
like the others from its first request on. A worker that reports none (an older worker) is judged by this
gateway's own measurement, the same arithmetic from routing to ``FirstToken`` (hops included), and not
judged before that: admit. The queue is counted in the same unit: a queued request is expected to compute
its prompt minus the prefix the worker's KV events report cached (``Route.prefix_blocks``). Counting whole
prompts against a rate of computed tokens overstated the wait by the prompts' hit ratio: prompts served
again from the prefix cache were refused as overload.

Why the span: a request's time is a fixed cost (round trips, scheduling, one step's overhead) plus its
tokens over the worker's throughput, and the rate above folds both into one number. Measured on short
prompts it is mostly the fixed cost and overstates a long prompt's time many times over. Once a long
prompt has been measured it dominates the sums (they weigh each request by its tokens), so the rate is
right for long prompts from then on.

Every 429 carries ``Retry-After`` (whole seconds, at least 1). ``overloaded`` (``prefill_queue``): the
estimated wait past the budget, rounded up, capped at ``RETRY_AFTER_CAP_S`` (60): by then the queue ahead
would be within the budget, were nothing else to arrive. ``kv_full`` (``kv_blocks``): 1, since the gateway
has no estimate of when a decode worker's blocks free (that depends on when its requests finish); a
heartbeat (0.5 s) brings the next free-block count within it. Refusals are counted in
``pdserve_admission_refused_total{reason}``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from gateway.errors import APIError, bad_request
from gateway.metrics import GatewayMetrics
from gateway.registry import WorkerEntry, WorkerRegistry, pairing_mismatch
from gateway.router import Route
from protocol.messages import FirstToken, WorkerLoad
from protocol.prefill_rate import PrefillRate, judged

# The longest Retry-After (seconds) an ``overloaded`` 429 gives: the openai Python client (the release
# locked here) does not retry at all on a Retry-After over 120 s, and a wait that far ahead depends mostly
# on arrivals and rate changes still to come.
RETRY_AFTER_CAP_S = 60


@dataclass(slots=True)
class _Routed:
    """One admitted request not yet answered by a FirstToken: its first-token worker, prompt tokens, the
    prompt tokens it is expected to compute (its prompt minus the prefix reported cached there), routing
    time (monotonic seconds) and the worker's load when routed (the heartbeat object: a newer one may
    count the request in its backlog)."""

    worker_id: str
    tokens: int
    expected_tokens: int
    routed_at: float
    load: WorkerLoad


@dataclass(slots=True)
class _Reserved:
    """Blocks of the requests routed to one decode worker since its heartbeat ``load`` (the object of
    that heartbeat: a newer heartbeat already counts them)."""

    load: WorkerLoad
    blocks: int


class Admission:
    """Admission checks of one gateway over the workers of ``registry``. ``budget_s``: the longest
    estimated wait (seconds) before a request's prefill starts that is still admitted, 0 = no queue
    check (the KV and size checks stay). ``clock`` returns monotonic seconds (injectable for tests)."""

    def __init__(self, registry: WorkerRegistry, budget_s: float, metrics: GatewayMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry, self.budget_s, self.metrics, self._clock = registry, budget_s, metrics, clock
        self.rates: dict[str, PrefillRate] = {}
        self._routed: dict[str, _Routed] = {}
        self._reserved: dict[str, _Reserved] = {}

    # ---- the checks ------------------------------------------------------------------------------
    def admit(self, request_id: str, num_prompt_tokens: int, route: Route) -> Route:
        """Check a routed request and record it; returns the route to use (another compatible decode
        worker when the chosen one lacks free blocks and another has them).

        Raises:
            APIError: 400 when the prompt can never fit a worker's KV pool, 429 (with Retry-After) when
                no compatible decode worker has its blocks free now or the first-token worker's queue
                would make it wait longer than the budget.
        """
        first = route.prefill if route.kind != "colocated" else route.colocated
        if first is not None:
            self._check_fits(first, num_prompt_tokens)
        if route.kind == "disaggregated":
            route = self._with_free_decode(route, num_prompt_tokens)
        if first is not None:
            self._check_queue(first)
        self.record(request_id, num_prompt_tokens, route)
        return route

    def record(self, request_id: str, num_prompt_tokens: int, route: Route) -> None:
        """Count a request routed without the checks (``admit`` records each one it admits; the
        orchestrator records an already-admitted request's new attempt, routed again after a worker
        failed it): it queues on its first-token worker until its ``FirstToken`` or ``forget``, and its
        blocks count against its decode worker until that worker's next heartbeat."""
        first = route.prefill if route.kind != "colocated" else route.colocated
        if first is not None:
            expected = max(1, num_prompt_tokens - route.prefix_tokens())
            self._routed[request_id] = _Routed(first.worker_id, num_prompt_tokens, expected, self._clock(),
                                               first.load)
        if route.kind == "disaggregated" and route.decode is not None:
            self._reserve(route.decode, num_prompt_tokens)

    def _check_fits(self, worker: WorkerEntry, num_prompt_tokens: int) -> None:
        total = worker.load.num_total_blocks
        need = _blocks(num_prompt_tokens, worker)
        if total and need > total:
            self._refuse("prompt_too_long")
            raise bad_request(f"the prompt ({num_prompt_tokens} tokens) needs {need} KV blocks; "
                              f"{worker.role} worker {worker.worker_id} holds {total} in all",
                              "prompt", "prompt_too_long")

    def _with_free_decode(self, route: Route, num_prompt_tokens: int) -> Route:
        assert route.decode is not None and route.prefill is not None
        if self._free_for(route.decode, num_prompt_tokens):
            return route
        prefill = route.prefill
        others = [d for d in self.registry.routable("decode")
                  if d is not route.decode and pairing_mismatch(prefill.info, d.info) is None]
        fitting = [d for d in others if self._free_for(d, num_prompt_tokens)]
        if fitting:
            # the router's decode prefix count was the first choice's: unknown for this one
            return replace(route, decode=max(fitting, key=self.free_blocks), decode_prefix_blocks=0)
        candidates = [route.decode, *others]
        totals = [d.load.num_total_blocks for d in candidates]
        most = max(totals)
        if all(totals) and all(_blocks(num_prompt_tokens, d) > d.load.num_total_blocks for d in candidates):
            self._refuse("prompt_too_long")
            raise bad_request(f"the prompt ({num_prompt_tokens} tokens) needs more KV blocks than any decode "
                              f"worker holds in all (largest pool: {most} blocks)", "prompt",
                              "prompt_too_long")
        self._refuse("kv_blocks")
        raise _too_many(f"no decode worker has the {_blocks(num_prompt_tokens, route.decode)} free KV blocks "
                        f"this prompt ({num_prompt_tokens} tokens) needs now; retry later", "kv_full", 1)

    def _check_queue(self, worker: WorkerEntry) -> None:
        if self.budget_s <= 0:
            return
        measured = self.rate(worker)
        if measured is None:
            return  # no measurement yet: admit
        tokens_per_s, largest = measured
        mine = [(rid, r) for rid, r in self._routed.items() if r.worker_id == worker.worker_id]
        ahead = sum(judged(r.expected_tokens, largest) for _, r in mine)
        if worker.load.prefill_backlog_tokens:  # the worker's queue, every gateway's requests in it
            since = sum(judged(r.expected_tokens, largest) for rid, r in mine
                        if r.load is worker.load or rid in worker.unsent)
            ahead = max(ahead, worker.load.prefill_backlog_tokens + since)
        wait = ahead / tokens_per_s
        if wait > self.budget_s:
            self._refuse("prefill_queue")
            raise _too_many(f"overloaded: about {wait:.0f} s of prompts are queued ahead of this one on "
                            f"{worker.role} worker {worker.worker_id} (admission budget "
                            f"{self.budget_s:g} s); retry later", "overloaded",
                            min(RETRY_AFTER_CAP_S, max(1, math.ceil(wait - self.budget_s))))

    def rate(self, worker: WorkerEntry) -> tuple[float, float] | None:
        """``worker``'s prefill rate (prompt tokens per second) and the largest computed-token count it
        was recently measured on: the one the worker reports in its heartbeats
        (``WorkerLoad.prefill_tokens_per_s``: over every prompt it computed, whichever gateway sent it,
        and from its start-up probe before its first), else this gateway's own measurement (a worker that
        reports none), else None."""
        load = worker.load
        if load.prefill_tokens_per_s > 0 and load.prefill_largest_tokens > 0:
            return load.prefill_tokens_per_s, float(load.prefill_largest_tokens)
        own = self.rates.get(worker.worker_id)
        tokens_per_s = own.tokens_per_s() if own is not None else None
        if own is not None and tokens_per_s is not None:
            return tokens_per_s, own.largest
        return None

    # ---- decode blocks ---------------------------------------------------------------------------
    def free_blocks(self, decode: WorkerEntry) -> int:
        """Blocks free on ``decode``: its last heartbeat's count minus the blocks routed to it since."""
        held = self._reserved.get(decode.worker_id)
        since = held.blocks if held is not None and held.load is decode.load else 0
        return decode.load.num_free_blocks - since

    def _free_for(self, decode: WorkerEntry, num_prompt_tokens: int) -> bool:
        if not decode.load.num_total_blocks:  # no load reported yet: nothing to judge by
            return True
        return self.free_blocks(decode) >= _blocks(num_prompt_tokens, decode)

    def _reserve(self, decode: WorkerEntry, num_prompt_tokens: int) -> None:
        held = self._reserved.get(decode.worker_id)
        if held is None or held.load is not decode.load:
            held = self._reserved[decode.worker_id] = _Reserved(decode.load, 0)
        held.blocks += _blocks(num_prompt_tokens, decode)

    # ---- what the orchestrator reports -------------------------------------------------------------
    def first_token(self, msg: FirstToken) -> None:
        """A FirstToken arrived: measure its worker's prefill rate; the request no longer queues."""
        routed = self._routed.pop(msg.request_id, None)
        if routed is None or routed.worker_id != msg.worker_id:
            return
        computed = max(1, routed.tokens - msg.num_cached_tokens)
        self.rates.setdefault(msg.worker_id, PrefillRate()).observe(computed, routed.routed_at, self._clock())

    def queued_tokens(self, worker_id: str) -> int:
        """Prompt tokens ``worker_id`` is expected to compute for the admitted requests not yet answered by
        a FirstToken whose first-token worker it is."""
        return sum(r.expected_tokens for r in self._routed.values() if r.worker_id == worker_id)

    def forget(self, request_id: str) -> None:
        """The request was released (finished, failed, aborted): it no longer queues anywhere."""
        self._routed.pop(request_id, None)

    def _refuse(self, reason: str) -> None:
        self.metrics.admission_refused.labels(reason).inc()


def _blocks(num_tokens: int, worker: WorkerEntry) -> int:
    """KV blocks ``num_tokens`` tokens fill on ``worker``."""
    return -(-num_tokens // max(1, worker.info.compat.block_size))


def _too_many(message: str, code: str, retry_after_s: int) -> APIError:
    """429 with ``Retry-After: retry_after_s`` (whole seconds, at least 1: the caller's estimate, or 1
    where it has none)."""
    return APIError(429, message, "rate_limit_error", None, code, {"Retry-After": str(retry_after_s)})
