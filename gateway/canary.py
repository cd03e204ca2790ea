"""Data-path health of each prefill/decode pair: canary KV transfers (no torch).

When a prefill and a decode worker first become a compatible pair (either registers), the gateway sends
the decode worker ``KVCanaryReserve`` (``--kv-canary-mib`` of blocks from its ``BlockManager``, at most
an eighth of its free ones and the blocks its ``max_model_len`` - 1 tokens fill, expected within
``--kv-canary-timeout`` s), forwards the handle of ``KVCanaryReserved`` to the prefill worker in
``KVCanarySend``, and reads ``KVCanaryResult``. The first canary of a pair pays for the transport's
handshake, so it only warms the path up; the next one, sent at once, measures it: its bytes over the
writes' time on the transport (``wire_seconds``: first write posted → last seen complete; the end-to-end
seconds, control round trips included, are shown beside it) give the pair's path (logged, in
``/v1/status``, and the gauge ``pdserve_kv_path_gbps{prefill,decode,transport}``).

The path the KV should take follows from where the two KV caches live (``KVPlacement`` of each
registration; ``expected_path``): GPU memory on one host → CUDA IPC (NVLink or PCIe peer copies); GPU
memory on two hosts that both have RDMA devices → RDMA; host memory on one host → shared memory; else
TCP. The transport library picks the path itself (UCX under NIXL tells no caller which), so the canary
judges by speed: a measured rate below ``PATH_FLOOR_GBPS`` of the expected path (e.g. TCP's ~1-3 GB/s
where CUDA IPC's tens to hundreds were expected) is reported as a warning in the log, the status view
and ``pdserve_kv_path_slow{prefill,decode}``, never silent.

Every ``--kv-canary-period`` s (0 = never) each pair is measured again, at a moment when neither worker
reports requests running or waiting (their heartbeats' loads): a canary shares the path and the GPU with
the requests' KV, and on one H200 under 64 streams one measured 4.35 GB/s where the idle path gave
39 GB/s, below the CUDA IPC floor. A pair busy all the time is measured once a further period has passed,
and a warning from a canary that found requests on the pair says so (``under load: N requests``).

A canary that fails, or has no result by its deadline, takes the pair out of routing (the workers get
``AbortRequest`` for it; each frees the blocks by the rules of a request's) until a later canary lands;
an unusable pair is tried again every ``--kv-canary-timeout`` s, also with period 0. A worker with no
free blocks for the canary changes nothing (tried again after the timeout).
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
    KVPlacement,
    Message,
)

log = logging.getLogger("pdserve.gateway")

# GB/s below which a canary over the expected path is reported as slow: conservative floors, a small
# fraction of each path's bandwidth, and above the next slower path's (a warning means the KV took a
# slower path than its placement allows, or the expected one is badly degraded). A canary's writes are
# many pieces of one block-run per layer, K and V, so it measures less than the path's peak: on one
# H200 a 16 MiB canary (1.3 ms on the wire) measured 12.6 GB/s over CUDA IPC and 0.46 GB/s with UCX
# restricted to TCP (docs/benchmarks/faults.md).
PATH_FLOOR_GBPS: dict[str, float] = {"cuda_ipc": 5.0, "rdma": 2.0, "shm": 0.2, "tcp": 0.02}


@dataclass(frozen=True)
class ExpectedPath:
    """The data path a pair's KV should take (``name``: cuda_ipc, rdma, shm or tcp), why (``reason``),
    and the GB/s below which a canary over it is reported (``floor_gbps``)."""

    name: str
    reason: str
    floor_gbps: float


def expected_path(prefill: KVPlacement, decode: KVPlacement) -> ExpectedPath:
    """The path the KV between two placements should take; an unknown host counts as another host."""
    same_host = bool(prefill.host) and prefill.host == decode.host
    if prefill.device == decode.device == "cuda":
        if same_host:
            name, why = "cuda_ipc", "GPU memory on one host"
        elif prefill.rdma and decode.rdma:
            name, why = "rdma", "GPU memory on two hosts with RDMA devices"
        else:
            name, why = "tcp", "GPU memory on two hosts, not both with RDMA devices"
    elif same_host:
        name, why = "shm", "host memory on one host"
    elif prefill.rdma and decode.rdma:
        name, why = "rdma", "two hosts with RDMA devices"
    else:
        name, why = "tcp", "two hosts"
    return ExpectedPath(name, why, PATH_FLOOR_GBPS[name])


Send = Callable[[bytes, Message], Awaitable[bool]]


@dataclass
class PairHealth:
    """The canary state of one pair of worker incarnations. ``unusable``: why the pair is out of routing
    ("" when usable); ``canary``: the id in flight (None when none) with its monotonic ``deadline``;
    ``next_at``: monotonic time the next canary is due; ``warm``: a canary has landed (the transport's
    handshake is done); ``load_at_start``: requests running or waiting on the two workers when the canary
    in flight started."""

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
    load_at_start: int = 0


class CanaryTracker:
    """The pairs' canaries. ``send`` delivers a control message to a worker identity; ``timeout_s`` is each
    canary's deadline and ``period_s`` the re-measure period (0 = never), both in seconds; ``num_bytes``
    the size of a canary (the decode worker takes at least one block, at most an eighth of its free
    ones and the blocks its ``max_model_len`` - 1 tokens fill); ``clock`` returns monotonic seconds
    (injectable for tests)."""

    def __init__(self, registry: WorkerRegistry, metrics: GatewayMetrics, send: Send, timeout_s: float,
                 period_s: float, num_bytes: int = 64 << 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry, self.metrics, self._send = registry, metrics, send
        self.timeout_s, self.period_s, self.num_bytes, self._clock = timeout_s, period_s, num_bytes, clock
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
            draining = p.load.draining or d.load.draining  # no new canary holds up a worker's stop
            if pair is None:
                pair = self.pairs[key] = PairHealth(p.worker_id, p.info.epoch, d.worker_id, d.info.epoch)
                if not draining:
                    await self._start(pair, p, d, now)
            elif pair.canary is not None and now > pair.deadline:
                await self._expire(pair, p, d)
            elif (pair.canary is None and now >= pair.next_at and not draining
                  and not self._postponed(pair, p, d, now)):
                await self._start(pair, p, d, now)

    def _postponed(self, pair: PairHealth, p: WorkerEntry, d: WorkerEntry, now: float) -> bool:
        """Whether a due periodic canary of a usable, measured pair waits for the workers to be idle (at
        most one further period)."""
        if pair.unusable or pair.path is None or self.period_s <= 0:
            return False
        return _load(p) + _load(d) > 0 and now < pair.next_at + self.period_s

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
        pair.load_at_start = _load(p) + _load(d)
        self._canaries[cid] = (p.worker_id, d.worker_id)
        await self._send(d.identity, KVCanaryReserve(canary_id=cid, prefill_worker_id=p.worker_id,
                                                     prefill_sender_epoch=p.info.kv_sender_epoch,
                                                     timeout_s=self.timeout_s, num_bytes=self.num_bytes,
                                                     prefill_tp_size=p.info.compat.tp_size))

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

    async def on_result(self, msg: KVCanaryResult) -> None:
        """The prefill worker's result: record the path (landed) or take the pair out of routing; a canary
        the prefill worker skipped (no free blocks) changes nothing, and the decode worker's blocks are
        freed at once (``AbortRequest``)."""
        pair = self._pair_of(msg.canary_id)
        if pair is None:
            return
        if msg.skipped:  # the prefill worker had no free blocks: says nothing of the path
            self._end(pair, self.timeout_s)
            log_event(log, "kv_canary_skipped", logging.WARNING, prefill=pair.prefill, decode=pair.decode,
                      reason=msg.error)
            decode = self.registry.get(pair.decode)
            if decode is not None:
                await self._send(decode.identity, AbortRequest(request_id=msg.canary_id,
                                                               reason="KV canary skipped"))
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
        took = msg.wire_seconds if msg.wire_seconds > 0 else msg.seconds
        gbps = msg.num_bytes / took / 1e9 if took > 0 else 0.0
        expected = self._expected(pair)
        warning = (f"{gbps:.3g} GB/s is far below the {expected.floor_gbps:g} GB/s expected of "
                   f"{expected.name} ({expected.reason}) over {msg.transport}: the KV may be taking a slower "
                   f"path (e.g. TCP), or this one is degraded" if gbps < expected.floor_gbps else "")
        if warning and pair.load_at_start:
            warning += f" (measured under load: {pair.load_at_start} requests on the two workers)"
        if pair.path is not None and pair.path.transport != msg.transport:
            self.metrics.drop_kv_path(pair.prefill, pair.decode, pair.path.transport)
        pair.path = KVPathStatus(msg.transport, round(gbps, 6), msg.num_bytes, round(msg.seconds, 6),
                                 time.time(), warning, expected.name, expected.floor_gbps,
                                 round(msg.wire_seconds, 6))
        self.metrics.kv_path_gbps.labels(pair.prefill, pair.decode, msg.transport).set(gbps)
        self.metrics.kv_path_slow.labels(pair.prefill, pair.decode).set(1.0 if warning else 0.0)
        was = pair.unusable
        pair.unusable = ""
        log_event(log, "kv_path_measured", logging.WARNING if warning else logging.INFO, prefill=pair.prefill,
                  decode=pair.decode, transport=msg.transport, expected=expected.name, gbps=round(gbps, 4),
                  floor_gbps=expected.floor_gbps, bytes=msg.num_bytes, seconds=round(msg.seconds, 6),
                  wire_seconds=round(msg.wire_seconds, 6),
                  warning=warning, recovered=bool(was))

    def _expected(self, pair: PairHealth) -> ExpectedPath:
        p, d = self.registry.get(pair.prefill), self.registry.get(pair.decode)
        return expected_path(p.info.placement if p is not None else KVPlacement(),
                             d.info.placement if d is not None else KVPlacement())

    def _pair_of(self, canary_id: str) -> PairHealth | None:
        key = self._canaries.get(canary_id)
        return self.pairs.get(key) if key is not None else None


def _load(worker: WorkerEntry) -> int:
    """Requests running or waiting on ``worker`` (its last heartbeat)."""
    return worker.load.num_running + worker.load.num_waiting
