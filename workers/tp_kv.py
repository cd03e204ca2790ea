"""A prefill or decode worker's KV endpoint over all its tensor parallel ranks (no torch).

Rank 0's endpoint lives in the worker's process; rank r > 0's in the rank's own process
(workers.rank_kv), reached through a `RemoteEndpoint`. `RankSender` and `RankReceiver` give the worker
one endpoint keyed by the worker's request ids, whatever the two sides' tensor parallel sizes:

- a request between two workers of one rank each keeps the plain path: one endpoint request under the
  request's id, its handle a msgpack `KVHandle`;
- otherwise the request is one endpoint request per (prefill rank, decode rank) pair sharing KV heads
  (kvtransfer.ranked); the handle the decode worker hands out is a msgpack `RankedHandles`.

Every rank of a prefill worker sends as "<worker id>-tp<r>" (rank 0: the worker id) with rank 0's KV
sender epoch (TransferConfig.sender_epoch), so a decode worker told (prefill worker id, epoch, tp size)
admits every prefill rank on every rank of its own (`RankReceiver.admit_sender`).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from kvtransfer.head_map import rank_kv_heads
from kvtransfer.ranked import RankedHandles, RankedReceive, RankedSend, combined_status
from kvtransfer.types import KVHandle, TransferConfig, TransferStatus
from kvtransfer.wire import new_epoch
from protocol.settings import control_keys
from workers.rank_kv import RankKVSpec, RemoteEndpoint, command_address, rank_config, shaped_config

if TYPE_CHECKING:
    from engine.engine_core import EngineCore
    from kvtransfer.compat import KVCompat
    from protocol.settings import WorkerSettings

S = TransferStatus
COMMAND_TIMEOUT_S = 10.0  # deadline of one command to another rank's endpoint (RemoteEndpoint)
_SPECS: dict[tuple[str, str], RankKVSpec] = {}  # (role, worker id) → its spec, one per process


def transfer_config(settings: WorkerSettings) -> TransferConfig:
    """The transfer config of a prefill worker's KV sender (peer timeout 5 s, the fleet's CURVE keys) or a
    decode worker's receiver (also bound at ``--host``:``--port`` and fenced: only the prefill worker
    incarnations the gateway names may handshake, kvtransfer's ``fence_senders``)."""
    config = TransferConfig(worker_id=settings.worker_id, model_id=settings.model,
                            backend=settings.transfer_backend, peer_timeout_s=5.0,
                            curve=control_keys(settings))
    if settings.role == "decode":
        return dataclasses.replace(config, host=settings.host, port=settings.port, fence_senders=True)
    return config


def rank_kv_spec(settings: WorkerSettings) -> RankKVSpec:
    """The `RankKVSpec` of a prefill or decode worker of several ranks: `transfer_config`, with one KV sender
    epoch for every rank of a prefill worker, and a fresh private command directory under /tmp (ipc paths
    stay short). The same object for the same (role, worker id) in one process (the engine's rank hook
    and the worker's `RankSender`/`RankReceiver` must agree)."""
    key = (settings.role, settings.worker_id)
    if key not in _SPECS:
        config = transfer_config(settings)
        if settings.role == "prefill":
            config = dataclasses.replace(config, sender_epoch=new_epoch())
        base = "/tmp" if os.path.isdir("/tmp") else None
        command_dir = tempfile.mkdtemp(prefix="pdkv-", dir=base)
        atexit.register(shutil.rmtree, command_dir, True)
        _SPECS[key] = RankKVSpec(settings.role, config, command_dir)
    return _SPECS[key]


def local_config(settings: WorkerSettings, core: EngineCore) -> TransferConfig:
    """Rank 0's transfer config: `transfer_config` (of `rank_kv_spec` with several ranks) with the worker's
    tensor parallel size and the model's KV heads."""
    size = core.runner.tp.size
    config = rank_kv_spec(settings).config if size > 1 else transfer_config(settings)
    return rank_config(shaped_config(config, core.runner, size), 0)


def remote_ranks(settings: WorkerSettings, core: EngineCore) -> list[RemoteEndpoint]:
    """Rank 0's handles on ranks 1..N-1's endpoints (none with one rank)."""
    size = core.runner.tp.size
    if size == 1:
        return []
    spec = rank_kv_spec(settings)
    return [RemoteEndpoint(command_address(spec, r), r, COMMAND_TIMEOUT_S) for r in range(1, size)]


def rank_sender_id(worker_id: str, rank: int) -> str:
    """The KV sender id of tensor parallel rank `rank` of prefill worker `worker_id` (rank_kv.rank_config)."""
    return worker_id if rank == 0 else f"{worker_id}-tp{rank}"


def encode_kv_handle(handle: KVHandle | RankedHandles) -> bytes:
    """msgpack bytes of a handle (the opaque ``KVReserved.kv_handle`` / ``PrefillRequest.kv_handle``)."""
    return msgspec.msgpack.encode(handle)


def decode_kv_handle(data: bytes) -> KVHandle | RankedHandles:
    """Inverse of `encode_kv_handle`. Raises ValueError when the bytes are neither."""
    try:
        return msgspec.msgpack.decode(data, type=RankedHandles)
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass
    try:
        return msgspec.msgpack.decode(data, type=KVHandle)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"kv_handle is neither a KVHandle nor RankedHandles: {exc}") from exc


def handle_blocks(handle: KVHandle | RankedHandles) -> list[int]:
    """The destination block ids of a handle (of its first rank pair: every pair has the same count)."""
    if isinstance(handle, KVHandle):
        return list(handle.block_ids)
    return list(handle.handles[0].handle.block_ids) if handle.handles else []


def handle_cached_blocks(handle: KVHandle | RankedHandles) -> int:
    """Leading prompt blocks the decode side already holds (``KVHandle.num_cached_blocks``: its prefix
    cache), which the prefill side does not send; every rank pair's is the same."""
    if isinstance(handle, KVHandle):
        return handle.num_cached_blocks
    return handle.handles[0].handle.num_cached_blocks if handle.handles else 0


def heads_written(handle: KVHandle | RankedHandles, local_heads: int) -> int:
    """KV heads a transfer to `handle` writes per token: `local_heads` (the sender's, all of them) for a
    plain handle; the sum over rank pairs for RankedHandles (a head replicated on several decode ranks
    counts once per rank)."""
    if isinstance(handle, KVHandle):
        return local_heads
    return sum(h.heads.count for h in handle.handles)


def handle_backend(handle: KVHandle | RankedHandles) -> str:
    """The transfer backend a handle names (every pair's; "" for a handle of no pair)."""
    if isinstance(handle, KVHandle):
        return handle.backend
    backends = {h.handle.backend for h in handle.handles}
    return backends.pop() if len(backends) == 1 else ""


def rank_leaks(requests: Sequence[str], ranks: Sequence[Any]) -> list[str]:
    """What is still held: the worker's `requests`, then each rank's endpoint's ("rank r: ...": its
    check_no_leaks failed or the rank did not answer); empty when nothing is."""
    out = [f"requests {sorted(requests)[:8]}"] if requests else []
    for rank, endpoint in enumerate(ranks):
        try:
            endpoint.check_no_leaks()
        except (AssertionError, TimeoutError, RuntimeError) as exc:
            out.append(f"rank {rank}: {exc}")
    return out


class RankSender:
    """A prefill worker's KV sender: `ranks[r]` is rank r's (rank 0: an api.KVSender, others
    RemoteEndpoints). Methods are those of api.KVSender the prefill worker calls, by request id."""

    def __init__(self, ranks: Sequence[Any]) -> None:
        self.ranks = list(ranks)
        self.local = self.ranks[0]
        self._ranked = RankedSend(self.ranks)
        self._pairs: dict[str, list[tuple[int, str]]] = {}  # request id → (rank, endpoint request id)
        self._orphans: list[tuple[int, str]] = []  # pairs of an add_request that failed part-way (aborted)

    @property
    def compat(self) -> KVCompat:
        """Rank 0's pairing record (with every rank's head placement)."""
        return self.local.compat  # type: ignore[no-any-return]

    @property
    def epoch(self) -> int:
        """The KV sender epoch of every rank."""
        return int(self.local.epoch)

    def add_request(self, handle: KVHandle | RankedHandles, block_ids: list[int]) -> None:
        """Start the request's transfer(s) of `block_ids` (the same ids on every rank). Raises ValueError for
        a plain handle given to a worker of several ranks, a duplicate id, and what RankedSend raises."""
        if handle.request_id in self._pairs:
            raise ValueError(f"request_id {handle.request_id!r} already added")
        if isinstance(handle, KVHandle):
            if len(self.ranks) != 1:
                raise ValueError(f"a KV handle of one rank pair for a prefill worker of {len(self.ranks)} "
                                 "tensor parallel ranks")
            self.local.add_request(handle, block_ids)
            self._pairs[handle.request_id] = [(0, handle.request_id)]
            return
        try:
            self._pairs[handle.request_id] = self._ranked.add_request(handles=handle, block_ids=block_ids)
        except BaseException:
            # the pairs added before the failure were aborted and stay in their senders: forget them
            # once each sender allows it (reap_orphans)
            for h in handle.handles:
                rank = h.heads.src_rank
                if 0 <= rank < len(self.ranks) and h.handle.request_id in self.ranks[rank].pending():
                    self._orphans.append((rank, h.handle.request_id))
            raise

    def has_orphans(self) -> bool:
        """True while pairs of failed add_requests wait to be released."""
        return bool(self._orphans)

    def reap_orphans(self) -> None:
        """Release the pairs of failed add_requests whose senders now allow it (the others: next call)."""
        left = []
        for rank, sub in self._orphans:
            try:
                self.ranks[rank].release(sub)
            except RuntimeError:  # writes in flight or its fence still to send
                left.append((rank, sub))
        self._orphans = left

    def rank_pairs(self, request_id: str) -> list[tuple[int, str]]:
        """(rank, endpoint request id) of each of the request's transfers."""
        return list(self._pairs.get(request_id, []))

    def send_layer(self, request_id: str, layer: int) -> None:
        """Hand `layer` of the request's rank 0 transfers to rank 0's sender (the other ranks send theirs
        from their own forward, told by the step's rank note)."""
        for rank, sub in self._pairs[request_id]:
            if rank == 0:
                self.local.send_layer(sub, layer)

    def send_layers(self, request_id: str) -> None:
        """Send every layer of the request's transfers on every rank (a canary)."""
        for rank, sub in self._pairs[request_id]:
            self.ranks[rank].send_layers(sub)

    def status(self, request_id: str) -> TransferStatus:
        """combined_status of the request's transfers. Raises KeyError for an unknown request."""
        return combined_status([self.ranks[r].status(sub) for r, sub in self._pairs[request_id]])

    def reason(self, request_id: str) -> str:
        """The first failed or aborted transfer's reason (naming its endpoint request when ranked)."""
        for rank, sub in self._pairs[request_id]:
            if self.ranks[rank].status(sub) in (S.FAILED, S.ABORTED):
                why = self.ranks[rank].reason(sub)
                return why if sub == request_id else f"{sub}: {why}"
        return ""

    def abort(self, request_id: str) -> None:
        """Abort every transfer of the request still running."""
        for rank, sub in self._pairs[request_id]:
            if not self.ranks[rank].status(sub).is_terminal:
                self.ranks[rank].abort(sub)

    def release(self, request_id: str) -> None:
        """Forget the request's transfers, each once its sender allows it. Raises RuntimeError while one
        still has writes in flight or a fence to send (those released before stay released)."""
        pairs = self._pairs[request_id]
        while pairs:
            rank, sub = pairs[0]
            self.ranks[rank].release(sub)
            pairs.pop(0)
        del self._pairs[request_id]

    def pending(self) -> list[str]:
        """Request ids not yet released."""
        return list(self._pairs)

    def ended_at(self, request_id: str) -> float | None:
        """When rank 0's last transfer of the request ended (time.perf_counter() s; None: none ended, or
        none on rank 0)."""
        ends = [self.local.ended_at(sub) for rank, sub in self._pairs[request_id] if rank == 0]
        return max((e for e in ends if e is not None), default=None)

    def wire_seconds(self, request_id: str) -> float | None:
        """Rank 0's transfers' time on the transport (s; None when unknown)."""
        secs = [self.local.wire_seconds(sub) for rank, sub in self._pairs[request_id] if rank == 0]
        return sum(s for s in secs if s is not None) if any(s is not None for s in secs) else None

    def leaks(self) -> list[str]:
        """rank_leaks of the requests not released (pairs of failed add_requests too) and every rank's
        sender."""
        return rank_leaks([*self._pairs, *(sub for _, sub in self._orphans)], self.ranks)

    def close(self) -> None:
        """Close the command sockets to the other ranks and rank 0's sender."""
        for endpoint in self.ranks[1:]:
            endpoint.close()
        self.local.close()


class RankReceiver:
    """A decode worker's KV receiver: `ranks[r]` is rank r's (rank 0: an api.KVReceiver, others
    RemoteEndpoints); `total_kv_heads`: the model's. Methods are those of api.KVReceiver the decode worker
    calls, by request id; `expect` returns the handle's bytes."""

    def __init__(self, ranks: Sequence[Any], total_kv_heads: int) -> None:
        self.ranks = list(ranks)
        self.local = self.ranks[0]
        self.total_kv_heads = total_kv_heads
        self._ranked = RankedReceive(self.ranks, rank_kv_heads(total_kv_heads, len(self.ranks)))
        self._plain: set[str] = set()

    @property
    def compat(self) -> KVCompat:
        """Rank 0's pairing record (with every rank's head placement)."""
        return self.local.compat  # type: ignore[no-any-return]

    @property
    def config(self) -> TransferConfig:
        """Rank 0's transfer config."""
        return self.local.config  # type: ignore[no-any-return]

    @property
    def address(self) -> str:
        """Rank 0's control endpoint (each handle names its own rank's)."""
        return str(self.local.address)

    def refused_handshakes(self) -> int:
        """Hellos refused by any rank's receiver."""
        return sum(int(endpoint.refused_handshakes()) for endpoint in self.ranks)

    def admit_sender(self, worker_id: str, epoch: int, tp_size: int) -> None:
        """Admit every rank of prefill worker `worker_id` (`tp_size` ranks, KV sender epoch `epoch`) on
        every rank."""
        for endpoint in self.ranks:
            for rank in range(tp_size):
                endpoint.admit_sender(rank_sender_id(worker_id, rank), epoch)

    def expect(self, request_id: str, block_ids: list[int], prefill_tp_size: int,
               timeout_s: float | None = None, claim_timeout_s: float | None = None, *,
               num_cached_blocks: int = 0) -> bytes:
        """Expect the request's KV into `block_ids` (the same ids on every rank) from a prefill worker of
        `prefill_tp_size` ranks, after `num_cached_blocks` leading blocks this worker holds already (not
        sent); the handle's bytes (encode_kv_handle). Raises ValueError for a duplicate id or a prefill
        placement that cannot fill ours, and what a receiver's expect raises."""
        if request_id in self._plain or request_id in self._ranked.pending():
            raise ValueError(f"request_id {request_id!r} already expected")
        if len(self.ranks) == 1 and prefill_tp_size == 1:
            handle = self.local.expect(request_id, block_ids, timeout_s, claim_timeout_s,
                                       num_cached_blocks=num_cached_blocks)
            self._plain.add(request_id)
            return encode_kv_handle(handle)
        source = rank_kv_heads(self.total_kv_heads, prefill_tp_size)
        return encode_kv_handle(self._ranked.expect(request_id, block_ids, source, timeout_s,
                                                    claim_timeout_s, num_cached_blocks=num_cached_blocks))

    def status(self, request_id: str) -> TransferStatus:
        """The request's (combined) status. Raises KeyError for an unknown request."""
        if request_id in self._plain:
            return self.local.status(request_id)  # type: ignore[no-any-return]
        return self._ranked.status(request_id)

    def reason(self, request_id: str) -> str:
        """Why the request FAILED or was ABORTED (naming the rank pair when ranked)."""
        if request_id in self._plain:
            return str(self.local.reason(request_id))
        return self._ranked.reason(request_id)

    def abort(self, request_id: str) -> None:
        """Abort the request on every rank."""
        if request_id in self._plain:
            self.local.abort(request_id)
        else:
            self._ranked.abort(request_id)

    def releasable(self, request_id: str) -> bool:
        """True when no write can still land in the request's blocks on any rank."""
        if request_id in self._plain:
            return bool(self.local.releasable(request_id))
        return self._ranked.releasable(request_id)

    def release(self, request_id: str) -> None:
        """Forget the request on every rank. Raises RuntimeError when a write may still land."""
        if request_id in self._plain:
            self.local.release(request_id)
            self._plain.discard(request_id)
        else:
            self._ranked.release(request_id)

    def pending(self) -> list[str]:
        """Request ids not yet released."""
        return [*self._plain, *self._ranked.pending()]

    def leaks(self) -> list[str]:
        """rank_leaks of the requests not released and every rank's receiver."""
        return rank_leaks(self.pending(), self.ranks)

    def close(self) -> None:
        """Close the command sockets to the other ranks and rank 0's receiver."""
        for endpoint in self.ranks[1:]:
            endpoint.close()
        self.local.close()
