"""One request's KV transfer between two tensor parallel workers, as one transfer per pair of ranks that
share KV heads (no torch).

Every rank runs its own endpoint over its own kv_buffer shard (a sender on each prefill rank, a receiver
on each decode rank). For a request, `head_map.head_slices` of the two placements names the (source rank,
destination rank) pairs; each pair is its own request of the endpoints, id `sub_request_id`, so that
deadlines, Begin/claim, abort and block lifetime are the endpoints' own rules, per pair:

- `RankedReceive` (decode side) expects the request on every destination rank once per source rank that
  writes into it and answers with `RankedHandles` (each handle with its head slice), which travel to the
  prefill worker. The request is DONE when every pair is DONE; FAILED or ABORTED when any pair is (the
  first such pair's reason); its blocks, shared by every pair on a rank, are releasable only when every
  pair is (no write of any source rank can still land).
- `RankedSend` (prefill side) adds each pair to its source rank's sender with the pair's head slice.

The endpoints here are `api.KVReceiver` / `api.KVSender`: in-process objects or proxies of endpoints that
live in a rank's own process.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from kvtransfer.head_map import HeadRange, HeadSlice, head_slices
from kvtransfer.types import KVHandle, TransferStatus

if TYPE_CHECKING:
    from kvtransfer.api import KVReceiver, KVSender

S = TransferStatus
POLL_S = 0.005  # RankedReceive.wait's look interval over the ranks


def sub_request_id(request_id: str, heads: HeadSlice) -> str:
    """The endpoints' request id of `request_id`'s transfer from source rank heads.src_rank into
    destination rank heads.dst_rank."""
    return f"{request_id}/tp{heads.src_rank}-{heads.dst_rank}"


class RankHandle(msgspec.Struct, frozen=True):
    """One rank pair's destination (`handle`, made by the destination rank's receiver) and the heads the
    source rank writes into it."""

    heads: HeadSlice
    handle: KVHandle


class RankedHandles(msgspec.Struct, frozen=True):
    """Every rank pair's destination of one request, in head_slices order (what the decode worker hands to
    the prefill worker). placement: the decode worker's head placement (head_map.rank_kv_heads)."""

    request_id: str
    placement: tuple[HeadRange, ...]
    handles: tuple[RankHandle, ...]


def combined_status(statuses: Sequence[TransferStatus]) -> TransferStatus:
    """One request's status from its pairs': FAILED if any failed, else ABORTED if any was aborted, DONE
    if all are, TRANSFERRING if any is, else PENDING."""
    for final in (S.FAILED, S.ABORTED):
        if final in statuses:
            return final
    if all(s is S.DONE for s in statuses):
        return S.DONE
    return S.TRANSFERRING if any(s is not S.PENDING for s in statuses) else S.PENDING


class RankedReceive:
    """The decode side: `receivers[r]` is rank r's receiver, `placement[r]` its (first head, count)."""

    def __init__(self, receivers: Sequence[KVReceiver], placement: tuple[HeadRange, ...]) -> None:
        if len(receivers) != len(placement):
            raise ValueError(f"{len(receivers)} receivers for {len(placement)} ranks")
        self.receivers = list(receivers)
        self.placement = placement
        self._pairs: dict[str, list[tuple[int, str]]] = {}  # request id → (destination rank, sub id)

    def expect(self, request_id: str, block_ids: list[int], source: tuple[HeadRange, ...],
               timeout_s: float | None = None, claim_timeout_s: float | None = None, *,
               num_cached_blocks: int = 0) -> RankedHandles:
        """Expect `request_id` into `block_ids` (the same ids on every rank) from a prefill worker of head
        placement `source`, after `num_cached_blocks` leading blocks already held (KVHandle's). Raises
        ValueError for a duplicate request id or a placement that cannot fill ours (head_map.head_slices), and
        what a receiver's expect raises (the pairs expected before are aborted and released first: nothing is
        kept).
        """
        if request_id in self._pairs:
            raise ValueError(f"request_id {request_id!r} already expected")
        slices = head_slices(source, self.placement)
        made: list[tuple[int, str]] = []
        handles = []
        try:
            for sl in slices:
                sub = sub_request_id(request_id, sl)
                handle = self.receivers[sl.dst_rank].expect(sub, block_ids, timeout_s, claim_timeout_s,
                                                            num_cached_blocks=num_cached_blocks)
                made.append((sl.dst_rank, sub))
                handles.append(RankHandle(sl, handle))
        except BaseException:
            for rank, sub in made:  # never handed out: no sender claimed them
                self.receivers[rank].abort(sub)
                self.receivers[rank].release(sub)
            raise
        self._pairs[request_id] = made
        return RankedHandles(request_id, self.placement, tuple(handles))

    def _each(self, request_id: str) -> list[tuple[KVReceiver, str]]:
        return [(self.receivers[rank], sub) for rank, sub in self._pairs[request_id]]  # KeyError if unknown

    def status(self, request_id: str) -> TransferStatus:
        """combined_status of the request's pairs. Raises KeyError for an unknown request."""
        return combined_status([rx.status(sub) for rx, sub in self._each(request_id)])

    def reason(self, request_id: str) -> str:
        """The first failed or aborted pair's reason, naming the pair ("" if none)."""
        for rx, sub in self._each(request_id):
            if rx.status(sub) in (S.FAILED, S.ABORTED):
                return f"{sub}: {rx.reason(sub)}"
        return ""

    def wait(self, request_id: str, timeout: float) -> TransferStatus:
        """Block until the request is terminal (combined_status) or `timeout` s pass; the status then."""
        end = time.monotonic() + timeout
        while True:
            status = self.status(request_id)
            if status.is_terminal or time.monotonic() >= end:
                return status
            time.sleep(POLL_S)

    def abort(self, request_id: str) -> None:
        """Abort every pair still running (each receiver tells its sender)."""
        for rx, sub in self._each(request_id):
            rx.abort(sub)

    def releasable(self, request_id: str) -> bool:
        """True when no write of any source rank can still land in the request's blocks on any rank."""
        return all(rx.releasable(sub) for rx, sub in self._each(request_id))

    def release(self, request_id: str) -> None:
        """Forget the request on every rank. Raises RuntimeError (releasing nothing) naming a pair that may
        still be written."""
        pairs = self._each(request_id)
        for rx, sub in pairs:
            if not rx.releasable(sub):
                raise RuntimeError(f"request {request_id!r}: pair {sub} ({rx.status(sub).name}) may still be "
                                   "written")
        for rx, sub in pairs:
            rx.release(sub)
        del self._pairs[request_id]

    def pending(self) -> list[str]:
        """Request ids not yet released."""
        return list(self._pairs)

    def check_no_leaks(self) -> None:
        """Raise AssertionError if a request or any rank's pair is still held."""
        assert not self._pairs, f"requests still held: {sorted(self._pairs)[:8]}"
        for rx in self.receivers:
            rx.check_no_leaks()


class RankedSend:
    """The prefill side: `senders[r]` is rank r's sender."""

    def __init__(self, senders: Sequence[KVSender]) -> None:
        self.senders = list(senders)

    def add_request(self, handles: RankedHandles, block_ids: list[int]) -> list[tuple[int, str]]:
        """Start every pair's transfer of this worker's `block_ids` (the same ids on every rank): each on
        its source rank's sender with its head slice. Returns (source rank, sub request id) of each pair,
        whose layers each rank then sends from its own forward pass. Raises ValueError for a pair of a
        rank this worker does not have (nothing added), and what a sender's add_request raises: the pairs
        added before are then aborted, and stay in their senders until released like any aborted
        request (KVSender.pending lists them)."""
        bad = [h.heads.src_rank for h in handles.handles if not 0 <= h.heads.src_rank < len(self.senders)]
        if bad:
            raise ValueError(f"head slices of source ranks {bad} for a worker of {len(self.senders)} ranks")
        added: list[tuple[int, str]] = []
        try:
            for h in handles.handles:
                self.senders[h.heads.src_rank].add_request(h.handle, block_ids, heads=h.heads)
                added.append((h.heads.src_rank, h.handle.request_id))
        except BaseException:
            for rank, sub in added:
                self.senders[rank].abort(sub)
            raise
        return added
