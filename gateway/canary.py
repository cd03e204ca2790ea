"""Data-path health of each prefill/decode pair: a canary KV transfer of one block (no torch).

When a prefill and a decode worker first become a compatible pair (either registers), the gateway sends
the decode worker ``KVCanaryReserve`` (one block from its ``BlockManager``, expected within
``--kv-canary-timeout`` s), forwards the handle of ``KVCanaryReserved`` to the prefill worker in
``KVCanarySend``, and reads ``KVCanaryResult``. The first canary of a pair pays for the transport's
handshake, so it only warms the path up; the next one, sent at once, measures it: the transport's name
and bytes over seconds give the pair's path (logged, in ``/ready`` and ``/v1/status``, and the gauge
``pdserve_kv_path_gbps{prefill,decode,transport}``). A path slower than ``MIN_GBPS`` of its transport
is reported as a warning. Every ``--kv-canary-period`` s (0 = never) each pair is measured again. A
canary that fails, or has no result by its deadline, takes the pair out of routing (the workers get
``AbortRequest`` for it; each frees the block by the rules of a request's) until a later canary lands;
an unusable pair is tried again every ``--kv-canary-timeout`` s, also with period 0. A decode worker
with no free block for the canary changes nothing (tried again after the timeout).
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.metrics import GatewayMetrics
from gateway.openai_responses import KVPathStatus
from gateway.registry import WorkerEntry, WorkerRegistry, pairing_mismatch
from protocol.logging import log_event
from protocol.messages import (
    AbortRequest,
    KVCanaryReserve,
    KVCanaryReserved,
    KVCanaryResult,
    KVCanarySend,
    Message,
)

log = logging.getLogger("pdserve.gateway")

# GB/s below which a one-block canary over this transport is reported as a warning: conservative floors
# (one block is latency-bound: a control round trip and a write of ~0.1-2 MB), far under each
# transport's bandwidth, so a warning means a path much slower than its kind can be
MIN_GBPS: dict[str, float] = {"loopback": 0.01, "nixl": 0.02, "ucx": 0.02, "tcp": 0.02, "cuda_ipc": 1.0,
                              "rc": 0.5, "rc_mlx5": 0.5, "dc_mlx5": 0.5, "ud": 0.1, "ud_mlx5": 0.1}

Send = Callable[[bytes, Message], Awaitable[bool]]


@dataclass
class PairHealth:
    """The canary state of one pair of worker incarnations. ``unusable``: why the pair is out of routing
    ("" when usable); ``canary``: the id in flight (None when none) with its monotonic ``deadline``;
    ``next_at``: monotonic time the next canary is due; ``warm``: a canary has landed (the transport's
    handshake is done)."""

    prefill: str
    prefill_epoch: int
    decode: str
    decode_epoch: int
    path: KVPathStatus | None = None
    unusable: str = ""
    canary: str | None = None
    deadline: float = 0.0
    next_at: float = 0.0
    warm: bool = False


class CanaryTracker:
    """The pairs' canaries. ``send`` delivers a control message to a worker identity; ``timeout_s`` is each
    canary's deadline and ``period_s`` the re-measure period (0 = never), both in seconds; ``clock`` returns
    monotonic seconds (injectable for tests)."""

    def __init__(self, registry: WorkerRegistry, metrics: GatewayMetrics, send: Send, timeout_s: float,
                 period_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry, self.metrics, self._send = registry, metrics, send
        self.timeout_s, self.period_s, self._clock = timeout_s, period_s, clock
        self.pairs: dict[tuple[str, str], PairHealth] = {}
        self._canaries: dict[str, tuple[str, str]] = {}  # canary id → pair key
        self._ids = itertools.count(1)
        self._tag = secrets.token_hex(3)  # canary ids of another gateway incarnation never collide

    def blocked(self, prefill_id: str, decode_id: str) -> str:
        """Why the pair may not be routed to ("" when it may)."""
        pair = self.pairs.get((prefill_id, decode_id))
        return pair.unusable if pair is not None else ""

    def path(self, prefill_id: str, decode_id: str) -> KVPathStatus | None:
        """The pair's latest measured path, or None."""
        pair = self.pairs.get((prefill_id, decode_id))
        return pair.path if pair is not None else None

    async def tick(self) -> None:
        """Sync the pairs with the registry (a new compatible pair gets its pairing canary), end canaries
        past their deadline (the pair becomes unusable) and start the periodic ones that are due."""
        now = self._clock()
        live: dict[tuple[str, str], tuple[WorkerEntry, WorkerEntry]] = {}
        for p in self.registry.live("prefill"):
            for d in self.registry.live("decode"):
                if pairing_mismatch(p.info, d.info) is None:
                    live[(p.worker_id, d.worker_id)] = (p, d)
        for key in [k for k, pair in self.pairs.items() if k not in live or self._replaced(pair, *live[k])]:
            self._forget(key)
        for key, (p, d) in live.items():
            pair = self.pairs.get(key)
            if pair is None:
                pair = self.pairs[key] = PairHealth(p.worker_id, p.info.epoch, d.worker_id, d.info.epoch)
                await self._start(pair, p, d, now)
            elif pair.canary is not None and now > pair.deadline:
                await self._expire(pair, p, d)
            elif pair.canary is None and now >= pair.next_at:
                await self._start(pair, p, d, now)

    def _end(self, pair: PairHealth, wait_s: float) -> None:
        """No canary in flight now; the next is due in ``wait_s`` s (inf: never)."""
        if pair.canary is not None:
            self._canaries.pop(pair.canary, None)
        pair.canary, pair.next_at = None, self._clock() + wait_s

    @staticmethod
    def _replaced(pair: PairHealth, p: WorkerEntry, d: WorkerEntry) -> bool:
        return (pair.prefill_epoch, pair.decode_epoch) != (p.info.epoch, d.info.epoch)

    def _forget(self, key: tuple[str, str]) -> None:
        pair = self.pairs.pop(key)
        if pair.canary is not None:
            self._canaries.pop(pair.canary, None)
        if pair.path is not None:
            self.metrics.drop_kv_path(pair.prefill, pair.decode, pair.path.transport)

    async def _start(self, pair: PairHealth, p: WorkerEntry, d: WorkerEntry, now: float) -> None:
        cid = f"canary-{self._tag}-{next(self._ids)}"
        pair.canary, pair.deadline, pair.next_at = cid, now + self.timeout_s, math.inf
        self._canaries[cid] = (p.worker_id, d.worker_id)
        await self._send(d.identity, KVCanaryReserve(canary_id=cid, prefill_worker_id=p.worker_id,
                                                     timeout_s=self.timeout_s))

    async def _expire(self, pair: PairHealth, p: WorkerEntry, d: WorkerEntry) -> None:
        cid = pair.canary
        assert cid is not None
        self._end(pair, self.timeout_s)
        self._unusable(pair, f"KV canary did not land within {self.timeout_s:g} s")
        for worker in (p, d):
            await self._send(worker.identity, AbortRequest(request_id=cid, reason="KV canary deadline"))

    def _unusable(self, pair: PairHealth, reason: str) -> None:
        pair.unusable = reason
        log_event(log, "kv_path_unusable", logging.WARNING, prefill=pair.prefill, decode=pair.decode,
                  reason=reason)

    async def on_reserved(self, msg: KVCanaryReserved) -> None:
        """The decode worker reserved the canary's block (send it to the prefill worker) or could not."""
        pair = self._pair_of(msg.canary_id)
        if pair is None:  # expired or forgotten: the decode worker frees the block on the abort
            return
        prefill, decode = self.registry.get(pair.prefill), self.registry.get(pair.decode)
        if msg.kv_handle is None or prefill is None:
            self._end(pair, self.timeout_s)
            log_event(log, "kv_canary_skipped", logging.WARNING, prefill=pair.prefill, decode=pair.decode,
                      reason=msg.error or "prefill worker gone")
            if msg.kv_handle is not None and decode is not None:  # free its block now
                await self._send(decode.identity, AbortRequest(request_id=msg.canary_id,
                                                               reason="KV canary skipped"))
            return
        await self._send(prefill.identity, KVCanarySend(canary_id=msg.canary_id, kv_handle=msg.kv_handle))

    def on_result(self, msg: KVCanaryResult) -> None:
        """The prefill worker's result: record the path (landed) or take the pair out of routing."""
        pair = self._pair_of(msg.canary_id)
        if pair is None:
            return
        if not msg.ok:
            self._end(pair, self.timeout_s)
            self._unusable(pair, f"KV canary failed: {msg.error}")
            return
        if not pair.warm:  # the handshake's canary: measure again at once
            pair.warm = True
            self._end(pair, 0.0)
            pair.unusable = ""
            log_event(log, "kv_path_warmed_up", prefill=pair.prefill, decode=pair.decode,
                      transport=msg.transport, seconds=round(msg.seconds, 6))
            return
        self._end(pair, self.period_s if self.period_s > 0 else math.inf)
        gbps = msg.num_bytes / msg.seconds / 1e9 if msg.seconds > 0 else 0.0
        floor = MIN_GBPS.get(msg.transport)
        warning = (f"{gbps:.3g} GB/s is far below the {floor:g} GB/s expected of {msg.transport}"
                   if floor is not None and gbps < floor else "")
        if pair.path is not None and pair.path.transport != msg.transport:
            self.metrics.drop_kv_path(pair.prefill, pair.decode, pair.path.transport)
        pair.path = KVPathStatus(msg.transport, round(gbps, 6), msg.num_bytes, round(msg.seconds, 6),
                                 time.time(), warning)
        self.metrics.kv_path_gbps.labels(pair.prefill, pair.decode, msg.transport).set(gbps)
        was = pair.unusable
        pair.unusable = ""
        log_event(log, "kv_path_measured", logging.WARNING if warning else logging.INFO, prefill=pair.prefill,
                  decode=pair.decode, transport=msg.transport, gbps=round(gbps, 4), bytes=msg.num_bytes,
                  seconds=round(msg.seconds, 6), warning=warning, recovered=bool(was))

    def _pair_of(self, canary_id: str) -> PairHealth | None:
        key = self._canaries.get(canary_id)
        return self.pairs.get(key) if key is not None else None
