"""The prefill worker: computes prompts, samples the first token, streams the KV to a decode worker.

Queues and states of a request (``PrefillRequest`` from the gateway):
  1. inbox → engine ``waiting`` (WAITING), prefill-only ``EngineCore``;
  2. chunked prefill under ``--max-num-batched-tokens`` (RUNNING); in the step that runs the LAST prompt
     chunk, the request is added to the kvtransfer ``KVSender`` and the attention ``layer_hook`` hands
     each layer to it as soon as that layer's K/V is stored (layer-by-layer streaming): the prompt's blocks
     from the handle's ``num_cached_blocks`` on (the decode worker holds the ones before in its prefix
     cache; this worker still computes or reuses them, as its attention reads them);
  3. the step samples the first token → FINISHED_PREFILLED; ``FirstToken`` goes out at once (TTFT);
  4. ``sending``: blocks held until the transfer is terminal (DONE / FAILED / ABORTED), then released
     (full blocks stay in the prefix cache). FAILED → ``RequestFailed``.
``max_tokens == 1`` (no ``kv_handle``): steps 1–3, blocks released at once, nothing reaches a decode worker.
``AbortRequest``: dropped from the engine, or its transfer aborted (blocks freed once terminal).
Metrics (``workers.metrics``): the request's part here ends with its first token.
Transfer totals (heartbeat ``WorkerLoad.kv_transfer_bytes`` / ``kv_transfer_seconds``): per transfer that
reaches DONE, the bytes it moved over every rank (blocks sent × ``KVCachePool.bytes_per_block`` per KV
head written over this rank's KV heads; blocks the decode worker had cached are not sent) and the seconds
from the first layer handed to the sender to the ``poll`` that sees DONE (so at most one step late).

A canary (``KVCanarySend``, a test of the data path): as many blocks of this worker's own (from its
``BlockManager``, like a request's) as the handle has are sent, every layer at once, into the handle's
blocks; when the transfer is terminal they are freed, ``KVCanaryResult`` reports the bytes, the
seconds from ``add_request`` to the sender's terminal time (``KVSender.ended_at``) and the writes' time
on the transport (``KVSender.wire_seconds``), and the transfer is forgotten once the sender allows it.
Canaries do not count in the transfer totals.

With ``--tensor-parallel-size`` N > 1 every rank has its own sender (``workers.tp_kv.RankSender``): a
request's ``kv_handle`` is then ``RankedHandles`` (one transfer per pair of ranks sharing KV heads with the
decode worker), rank 0's layer hook sends rank 0's pairs and the step's ``RankNote`` names the other
ranks' pairs, which each rank sends from its own forward; the transfer is terminal when every pair is.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus, check_stop
from kvtransfer import KVCompat, KVHandle, KVSender, TransferStatus, get_transfer_backend
from kvtransfer.ranked import RankedHandles
from protocol.logging import log_event
from protocol.messages import (
    AbortRequest,
    FinishReason,
    FirstToken,
    KVCanaryResult,
    KVCanarySend,
    Message,
    PrefillRequest,
    Role,
)
from workers.loop import WorkerLoop
from workers.outputs import prompt_logprobs_of, top_logprobs_of
from workers.rank_kv import RankNote
from workers.step import LayerHook, run_step
from workers.tp_kv import (
    RankSender,
    decode_kv_handle,
    handle_backend,
    handle_blocks,
    handle_cached_blocks,
    heads_written,
    local_config,
    remote_ranks,
)

if TYPE_CHECKING:
    from engine.engine_core import EngineCore, StepOutput
    from engine.scheduler import SchedulerOutput
    from protocol.settings import WorkerSettings

log = logging.getLogger("pdserve.prefill")
_REASONS: dict[SequenceStatus, FinishReason] = {SequenceStatus.FINISHED_STOPPED: "stop",
                                                SequenceStatus.FINISHED_LENGTH: "length"}


def make_sender(settings: WorkerSettings, core: EngineCore) -> KVSender:
    """Rank 0's started ``KVSender`` over ``--transfer-backend`` reading from the engine's ``kv_buffer``
    (``workers.tp_kv.local_config``; the other ranks' senders run in their own processes)."""
    return get_transfer_backend(settings.transfer_backend).sender(local_config(settings, core),
                                                                  core.runner.kv_cache.kv_buffer)


@dataclass
class _Canary:
    """One canary transfer: its source block (None once freed), ``started`` (time.perf_counter() s at
    add_request), its size in bytes and whether its result went out."""

    seq: Sequence | None
    started: float
    num_bytes: int
    reported: bool = False


class PrefillWorker(WorkerLoop):
    """Prefill role. ``seqs``/``kv_handles``: requests in the engine (and where their KV goes, None for
    ``max_tokens == 1``); ``sending``: KV transfer in flight."""

    role: Role = "prefill"

    def __init__(self, settings: WorkerSettings, core: EngineCore, model_path: str,
                 sender: KVSender | None = None) -> None:
        super().__init__(settings, core, model_path)
        self.sender = sender if sender is not None else make_sender(settings, core)
        # every rank's sender (rank 0's is self.sender): what the worker drives transfers through
        self.kv = RankSender([self.sender, *remote_ranks(settings, core)])
        self._rank_note = b""  # the current step's RankNote for the other ranks
        self.seqs: dict[str, Sequence] = {}
        self.kv_handles: dict[str, KVHandle | RankedHandles | None] = {}
        self.sending: dict[str, Sequence | None] = {}  # None: blocks already freed (failed step)
        self._aborted: set[str] = set()  # transfers we aborted ourselves: no RequestFailed for them
        self._hook_errors: dict[str, str] = {}
        self._transfer_bytes: dict[str, int] = {}  # bytes each started transfer moves (every rank's)
        self._first_layer_at: dict[str, float] = {}  # time.monotonic() when layer 0 went to the sender
        self.kv_sent_bytes = 0  # cumulative over DONE transfers (bytes)
        self.kv_sent_seconds = 0.0  # cumulative over DONE transfers (seconds)
        self.canaries: dict[str, _Canary] = {}

    def compat(self) -> KVCompat:
        """The KV pairing record: the one rank 0's sender's handshake checks."""
        return self.kv.compat

    def kv_sender_epoch(self) -> int:
        """The KV sender's epoch (the one in its Hellos), which decode workers are told to expect."""
        return self.kv.epoch

    def on_message(self, msg: Message) -> None:
        """``PrefillRequest`` → engine; ``AbortRequest`` → drop. Raises ``ValueError`` for a bad request
        (bad prompt; a ``kv_handle`` for another request id, backend or block count)."""
        if isinstance(msg, PrefillRequest):
            self._accept(msg)
        elif isinstance(msg, KVCanarySend):
            self._send_canary(msg)
        elif isinstance(msg, AbortRequest):
            if msg.request_id in self.seqs:  # not once its first token ended its part here
                self.metrics.aborted()
            self.drop(msg.request_id)

    def _send_canary(self, msg: KVCanarySend) -> None:
        """Start a canary transfer of as many blocks of ours as the handle has; a canary that cannot
        start is reported failed at once (``KVCanaryResult``; ``skipped`` when we lack free blocks), its
        blocks freed."""
        cid, transport = msg.canary_id, self.sender.compat.transfer_backend
        bm = self.core.block_manager
        seq: Sequence | None = None
        try:
            if cid in self.canaries or cid in self.seqs or cid in self.sending:
                raise ValueError(f"canary id {cid!r} is already on this worker")
            handle = decode_kv_handle(msg.kv_handle)
            num_blocks = len(handle_blocks(handle))
            num_tokens = num_blocks * bm.block_size
            seq = Sequence(cid, [0] * num_tokens, SamplingParams(max_tokens=1), time.monotonic(),
                           self.core.eos_token_ids)
            if not bm.can_allocate(seq, num_tokens):
                self.emit(KVCanaryResult(canary_id=cid, worker_id=self.worker_id, ok=False, num_bytes=0,
                                         seconds=0.0, transport=transport, skipped=True,
                                         error=f"no {num_blocks} free KV blocks for the canary"))
                return
            bm.allocate(seq, num_tokens)
            started = time.perf_counter()
            self.kv.add_request(handle, list(seq.block_table))
        except Exception as exc:
            if seq is not None and seq.block_table:
                bm.free(seq)
            self.emit(KVCanaryResult(canary_id=cid, worker_id=self.worker_id, ok=False, num_bytes=0,
                                     seconds=0.0, transport=transport, error=f"{type(exc).__name__}: {exc}"))
            return
        self.canaries[cid] = _Canary(seq, started,
                                     self._bytes_of(handle, len(seq.block_table)))
        self.kv.send_layers(cid)

    def _poll_canaries(self) -> None:
        for cid, c in list(self.canaries.items()):
            status = self.kv.status(cid)
            if not status.is_terminal:
                continue
            if c.seq is not None:  # terminal: nothing more is read from the block
                self.core.block_manager.free(c.seq)
                c.seq = None
            if not c.reported:
                ended = self.kv.ended_at(cid) or time.perf_counter()
                ok = status is TransferStatus.DONE
                wire = self.kv.wire_seconds(cid) if ok else None
                self.emit(KVCanaryResult(canary_id=cid, worker_id=self.worker_id, ok=ok,
                                         num_bytes=c.num_bytes if ok else 0,
                                         seconds=max(ended - c.started, 0.0), wire_seconds=wire or 0.0,
                                         transport=self.sender.compat.transfer_backend,
                                         error="" if ok else f"{status.value}: {self.kv.reason(cid)}"))
                c.reported = True
            try:
                self.kv.release(cid)
            except RuntimeError:  # writes in flight or a fence still to send: next poll
                continue
            del self.canaries[cid]

    def _accept(self, msg: PrefillRequest) -> None:
        params = msg.sampling
        kv_handle = decode_kv_handle(msg.kv_handle) if msg.kv_handle is not None else None
        if kv_handle is None and params.max_tokens > 1:
            raise ValueError(f"PrefillRequest without kv_handle needs max_tokens=1, got {params.max_tokens}")
        if kv_handle is not None:
            if kv_handle.request_id != msg.request_id:
                raise ValueError(f"kv_handle is for request {kv_handle.request_id!r}, not {msg.request_id!r}")
            need = math.ceil(len(msg.prompt_token_ids) / self.core.block_manager.block_size)
            cached = handle_cached_blocks(kv_handle)
            blocks, backend = len(handle_blocks(kv_handle)), handle_backend(kv_handle)
            if (cached < 0 or not blocks or blocks + cached != need
                    or backend != self.settings.transfer_backend):
                raise ValueError(f"kv_handle has {blocks} blocks after {cached} cached "
                                 f"over {backend!r}; need {need} in all over "
                                 f"{self.settings.transfer_backend!r}")
        seq = self.core.add_request(msg.request_id, msg.prompt_token_ids, params)
        self.seqs[msg.request_id], self.kv_handles[msg.request_id] = seq, kv_handle
        self.expect_cached(seq, msg.expected_cached_tokens)

    def awaiting_first_token(self) -> Iterable[Sequence]:
        """Requests accepted whose first token is not sampled yet (``seqs``)."""
        return self.seqs.values()

    def drop(self, request_id: str) -> None:
        """Abort in the engine, and abort the request's transfer if one was started (its source blocks
        are released by ``poll`` once the transfer is terminal). A transfer can exist for a request still
        in ``seqs`` when the step that started it failed: it goes to ``sending`` without blocks."""
        if request_id in self.canaries:
            if not self.kv.status(request_id).is_terminal:
                self.kv.abort(request_id)
            return
        self.kv_handles.pop(request_id, None)
        self._hook_errors.pop(request_id, None)
        if self.seqs.pop(request_id, None) is not None:
            self.core.abort_request(request_id)
            if request_id in self.kv.pending():
                self.sending[request_id] = None
        if request_id in self.sending:
            self._aborted.add(request_id)
            self.kv.abort(request_id)

    def request_ids(self) -> list[str]:
        """Requests in the engine, and those whose KV send is still in flight."""
        return list(dict.fromkeys([*self.seqs, *self.sending]))

    def canary_ids(self) -> list[str]:
        """KV canaries in progress."""
        return list(self.canaries)

    def step(self) -> list[StepOutput]:
        """One prefill step; the layer hook streams the KV of requests finishing their prompt."""
        return run_step(self.core, self._hook_for, lambda: self._rank_note)

    def _hook_for(self, output: SchedulerOutput) -> LayerHook | None:
        """The step's layer hook of rank 0's transfers; the other ranks' go in ``_rank_note``."""
        rids = []
        self._rank_note = b""
        for s in output.scheduled:
            rid = s.seq.request_id
            kv_handle = self.kv_handles.get(rid)
            if not s.samples or kv_handle is None:
                continue
            # the decode worker holds the first num_cached_blocks already (its prefix cache): not sent
            suffix = list(s.seq.block_table[handle_cached_blocks(kv_handle):])
            try:
                self.kv.add_request(kv_handle, suffix)
            except (ValueError, RuntimeError) as exc:
                self._hook_errors[rid] = f"KV transfer could not start: {exc}"
                continue
            rids.append(rid)
            self._transfer_bytes[rid] = self._bytes_of(kv_handle, len(suffix))
        if not rids:
            return None
        others = [(rank, sub) for rid in rids for rank, sub in self.kv.rank_pairs(rid) if rank != 0]
        if others:
            self._rank_note = msgspec.msgpack.encode(RankNote(sends=others))

        def hook(layer: int) -> None:
            for rid in rids:
                self._first_layer_at.setdefault(rid, time.monotonic())
                self.kv.send_layer(rid, layer)
        return hook

    def on_step(self, outs: list[StepOutput]) -> None:
        """First tokens out (TTFT); transfers move to ``sending``; requests without one release blocks."""
        now, sampled = time.monotonic(), 0
        for out in outs:
            seq = self.seqs.pop(out.request_id, None)
            if seq is None:
                continue
            sampled += 1
            kv_handle = self.kv_handles.pop(out.request_id, None)
            try:  # the first token through the request's grammar matcher (accepted, or the request fails)
                status = check_stop(seq, self.core.max_model_len)
            except ValueError as exc:  # StructuredOutputError: the only error check_stop raises
                self._first_token_rejected(seq, kv_handle, exc)
                continue
            reason = _REASONS.get(status) if status is not None else None
            if kv_handle is None:
                reason = reason or "length"
            self.emit(FirstToken(request_id=out.request_id, worker_id=self.worker_id, token_id=out.token_id,
                                 logprob=out.logprob, top_logprobs=top_logprobs_of(out),
                                 num_cached_tokens=seq.num_cached_tokens,
                                 finish_reason=reason, prompt_logprobs=prompt_logprobs_of(out)))
            self.metrics.first_token(seq, now)
            # this worker's part ends here: "length" when the KV goes on (a max_tokens=1 prefill)
            self.metrics.finished(seq, reason or "length", now)
            error = self._hook_errors.pop(out.request_id, None)
            if kv_handle is None or error is not None:
                self.core.scheduler.release(seq)
                if error is not None:
                    self.fail(out.request_id, error)
                continue
            self.sending[out.request_id] = seq
            if reason is not None:  # the request ends here: its KV is not needed
                self.drop(out.request_id)
        self.metrics.step(sampled, now)

    def _first_token_rejected(self, seq: Sequence, kv_handle: KVHandle | RankedHandles | None,
                              exc: ValueError) -> None:
        """Fail a request whose grammar rejects its first token: no ``FirstToken``; its transfer (if one
        started) is aborted and its blocks released once that is terminal, else released now."""
        rid = seq.request_id
        self._hook_errors.pop(rid, None)
        if kv_handle is not None and rid in self.kv.pending():
            self.sending[rid] = seq  # ``fail`` → ``drop`` aborts the transfer; ``poll`` releases the blocks
        else:
            self.core.scheduler.release(seq)
        self.fail(rid, f"the first token breaks the request's structured output: {exc}", "structured_output")

    def poll(self) -> None:
        """Release the source blocks of every request whose transfer is terminal, then forget the transfer
        once the sender allows it (its writes done, its fences sent); FAILED → ``RequestFailed``. The same
        for canaries, which report ``KVCanaryResult``."""
        self._poll_canaries()
        self.kv.reap_orphans()
        for rid, seq in list(self.sending.items()):
            status = self.kv.status(rid)
            if not status.is_terminal:
                continue
            if seq is not None:
                # terminal: nothing more is gathered from these blocks for the receiver (writes still in
                # flight read the staging ring, and a terminal request's gathered layers are never
                # posted), so they are free now even if a write to a dead peer never completes
                self.core.scheduler.release(seq)
                self.sending[rid] = seq = None
            reason = self.kv.reason(rid)
            try:
                self.kv.release(rid)
            except RuntimeError as exc:  # writes in flight or a fence still to send: next poll
                if log.isEnabledFor(logging.DEBUG):
                    log_event(log, "release_deferred", logging.DEBUG, request_id=rid, reason=str(exc))
                continue
            del self.sending[rid]
            self._count_transfer(rid, status)
            if status is TransferStatus.FAILED and rid not in self._aborted:
                self.fail(rid, f"KV transfer failed: {reason or 'see prefill log'}")
            self._aborted.discard(rid)

    def _bytes_of(self, handle: KVHandle | RankedHandles, num_blocks: int) -> int:
        """Bytes a transfer of `num_blocks` blocks to `handle` moves over every rank: per block, each KV
        head written (rank 0's heads for a plain handle, every rank pair's for RankedHandles) costs
        this rank's bytes per block / its KV heads."""
        kv = self.core.runner.kv_cache
        return num_blocks * kv.bytes_per_block * heads_written(handle, kv.num_kv_heads) // kv.num_kv_heads

    def _count_transfer(self, request_id: str, status: TransferStatus) -> None:
        """Add a terminal transfer to the totals if it is DONE (forget its bookkeeping either way)."""
        num_bytes = self._transfer_bytes.pop(request_id, 0)
        started = self._first_layer_at.pop(request_id, None)
        if status is TransferStatus.DONE and started is not None:
            self.kv_sent_bytes += num_bytes
            self.metrics.kv_sent_bytes.inc(num_bytes)
            self.kv_sent_seconds += time.monotonic() - started

    def transfer_totals(self) -> tuple[int, float]:
        """Cumulative (bytes, seconds) over this worker's DONE transfers (see the module docstring)."""
        return self.kv_sent_bytes, self.kv_sent_seconds

    def kv_endpoint_error(self) -> str | None:
        """Why the KV sender's loop thread died, or None while it runs."""
        return self.sender.stats().loop.error

    def busy(self) -> bool:
        """Transfers in flight need frequent polling."""
        return bool(self.sending or self.canaries or self.kv.has_orphans())

    def close(self) -> None:
        """Stop the sender thread and its transport (and the command sockets to the other ranks)."""
        held = self.kv.leaks()  # a clean shutdown holds nothing on any rank
        log_event(log, "kv_endpoints_closed", logging.ERROR if held else logging.INFO,
                  ranks=len(self.kv.ranks), held="; ".join(held))
        self.kv.close()

