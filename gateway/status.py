"""The gateway's status view (``/v1/status``; ``/ready`` shows its verdict and reason), built from the
registry (no torch)."""

from __future__ import annotations

import time

from gateway.canary import CanaryTracker
from gateway.openai_responses import (
    GatewayProcessStatus,
    LostWorkerStatus,
    PairStatus,
    Readiness,
    WorkerStatus,
)
from gateway.registry import LostWorker, WorkerEntry, WorkerRegistry, pairing_mismatch


def pair_statuses(registry: WorkerRegistry, canaries: CanaryTracker | None = None) -> list[PairStatus]:
    """Every (prefill, decode) pair of registered workers, in registration order, with its mismatch or
    data-path failure and its measured path (from ``canaries``)."""
    out = []
    for p in registry.live("prefill"):
        for d in registry.live("decode"):
            problem = pairing_mismatch(p.info, d.info)
            path = None
            if canaries is not None:
                blocked = canaries.blocked(p.worker_id, d.worker_id)
                if problem is None and blocked:
                    problem = f"{p.worker_id} / {d.worker_id}: {blocked}"
                path = canaries.path(p.worker_id, d.worker_id)
            draining = [w.worker_id for w in (p, d) if w.load.draining]
            if problem is None and draining:
                problem = f"{p.worker_id} / {d.worker_id}: {' and '.join(draining)} draining (stopping)"
            out.append(PairStatus(p.worker_id, d.worker_id, problem is None, problem or "", path))
    return out


def readiness(registry: WorkerRegistry, canaries: CanaryTracker | None = None,
              process: GatewayProcessStatus | None = None) -> Readiness:
    """Ready when a colocated worker is routable (live, not draining), or a routable prefill worker has a
    usable decode worker (KV compatible, data path not failed, not draining); the reason names what is
    missing (no live worker at all, or none but draining ones; or the pair, with each unusable pair's
    fields, path failure or draining worker), then each dropped worker. ``process``: the
    answering gateway process, shown as is."""
    pairs = pair_statuses(registry, canaries)
    prefills, decodes = registry.routable("prefill"), registry.routable("decode")
    if registry.routable("colocated"):
        ok, reason = True, "colocated worker live"
    elif any(p.usable for p in pairs):
        ok, reason = True, "prefill/decode pair live"
    else:
        ok = False
        draining = [e.worker_id for e in registry.live() if e.load.draining]
        if not prefills and not decodes and draining:
            reason = f"no worker takes requests: {', '.join(draining)} draining (stopping)"
        elif not prefills and not decodes:
            reason = "no live worker (neither a colocated worker nor a prefill and a decode worker)"
        else:
            reason = f"no compatible prefill+decode pair ({len(prefills)} prefill, {len(decodes)} decode)"
        refused = [p.reason for p in pairs if not p.usable]
        if refused:
            reason += ": " + "; ".join(refused)
    now = time.time()
    lost = [f"{w.worker_id} ({w.role}) {w.reason} {now - w.at:.1f} s ago" for w in registry.dropped.values()]
    if lost:
        reason += "; dropped: " + "; ".join(lost)
    return Readiness(ok, reason, [_worker(registry, e) for e in registry.live()], pairs,
                     [_lost(w, now) for w in registry.dropped.values()],
                     [_lost(w, now) for w in registry.refused.values()], process)


def _worker(registry: WorkerRegistry, e: WorkerEntry) -> WorkerStatus:
    return WorkerStatus(e.worker_id, e.role, e.info.epoch, e.info.transfer_address,
                        round(registry.age(e), 3), e.load.num_waiting, e.load.num_running,
                        e.load.num_free_blocks, e.load.num_total_blocks,
                        round(e.load.prefill_tokens_per_s, 1), len(e.requests) + len(e.unsent),
                        e.load.kv_fenced_blocks, e.load.draining)


def _lost(w: LostWorker, now: float) -> LostWorkerStatus:
    return LostWorkerStatus(w.worker_id, w.role, w.epoch, w.address, w.reason, w.at, round(now - w.at, 3))
