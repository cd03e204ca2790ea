"""The decode worker: reserves blocks, receives a request's KV, decodes it in a continuous batch.

Queues and states of a request:
  1. ``ReserveKV`` → ``pending`` (no blocks free yet; retried every loop, failed after
     ``reserve_timeout`` s) → blocks reserved (WAITING_FOR_KV): with ``--decode-prefix-reuse`` (the
     default) the prompt's leading full blocks found in this worker's prefix cache first
     (``Scheduler.add_waiting_for_kv``; shared, never the last prompt token's block, whole prefill-grid
     chunks), then the rest, contiguous run preferred; a ``KVHandle`` from the kvtransfer ``KVReceiver``
     for the rest only, with ``num_cached_blocks`` = the cached ones, goes back in ``KVReserved``;
  2. ``in_flight``: waits until every layer has landed (receiver DONE) AND the first token is known
     (``DecodeRequest``); then ``Scheduler.kv_landed`` appends it, registers its full prompt blocks in the
     prefix cache (published as KV events) and the request joins the running batch;
  3. RUNNING: one token per step → ``NextToken``; FINISHED_STOPPED / FINISHED_LENGTH → ``RequestFinished``
     (references dropped: blocks nobody else holds stay cached until evicted);
  4. ``fenced``: aborted or failed while KV was in flight; the blocks are freed only once the receiver
     says no write can still land in them (``KVReceiver.releasable``: the fence). Cached prefix blocks are
     never written by a transfer; an abort drops this request's references to them only.
Transfer FAILED/ABORTED by the peer → ``RequestFailed``; so does a token the request's grammar rejects
(the first one, replayed into this worker's matcher when the KV lands, or a later one). ``AbortRequest``
works in every state.

A canary (``KVCanaryReserve``, a test of the data path): ``canary_blocks`` blocks (at most an eighth of
the free ones, and no more than a prompt of ``max_model_len`` - 1 tokens fills) reserved like a
request's (``Scheduler.add_waiting_for_kv``) and ``KVReceiver.expect``-ed with the gateway's deadline,
answered by ``KVCanaryReserved``; it never joins the batch: ``canaries`` holds it until the receiver says
the blocks are releasable (DONE, or the sender's fence after a failure or an abort), then they are freed.

With a prefill worker or this worker of several tensor parallel ranks (``ReserveKV.prefill_tp_size``, our
``--tensor-parallel-size``), every rank's receiver (``workers.tp_kv.RankReceiver``) expects one transfer per
pair of ranks sharing KV heads into the same block ids, and the handle is ``RankedHandles``; the request's
KV has landed when every pair is DONE, and its blocks are releasable only when every pair's are.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus
from kvtransfer import KVCompat, KVReceiver, TransferStatus, get_transfer_backend
from protocol.logging import log_event
from protocol.messages import (
    AbortRequest,
    DecodeRequest,
    FinishReason,
    KVCanaryReserve,
    KVCanaryReserved,
    KVReserved,
    Message,
    RequestFinished,
    ReserveKV,
    Role,
)
from workers.loop import WorkerLoop
from workers.outputs import stream_outputs
from workers.step import run_step
from workers.tp_kv import RankReceiver, local_config, remote_ranks

if TYPE_CHECKING:
    from engine.engine_core import EngineCore, StepOutput
    from protocol.settings import WorkerSettings

log = logging.getLogger("pdserve.decode")


def make_receiver(settings: WorkerSettings, core: EngineCore) -> KVReceiver:
    """A started ``KVReceiver`` over ``--transfer-backend`` into the engine's ``kv_buffer``, its control
    socket bound at ``--host``:``--port`` (0 = any free port): a CURVE server with ``--curve-keys``, and
    fenced: only the prefill worker incarnations (worker id, KV sender epoch) the gateway named last in a
    ``ReserveKV`` or ``KVCanaryReserve`` may handshake (kvtransfer's ``fence_senders``). Rank 0's: the
    other ranks' receivers run in their own processes (``workers.tp_kv``), bound at any free port."""
    return get_transfer_backend(settings.transfer_backend).receiver(local_config(settings, core),
                                                                    core.runner.kv_cache.kv_buffer)


def _total_kv_heads(core: EngineCore) -> int:
    cfg = core.runner.hf_config
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


class DecodeWorker(WorkerLoop):
    """Decode role; see the module docstring for ``pending`` / ``in_flight`` / ``fenced``."""

    role: Role = "decode"
    reserve_timeout = 30.0  # seconds a ReserveKV may wait for free blocks
    # KV deadline of a request, counted from its prefill worker's Begin (sent in the step that runs the
    # prompt's last chunk) = TransferConfig.timeout_s + this many seconds per prompt token (a long last
    # chunk on a slow CPU prefill worker). A dead prefill worker is still caught within the peer timeout
    # (heartbeats), not by this deadline.
    kv_deadline_per_token_s = 0.02
    # seconds a reservation may wait for its prefill worker to begin (the prefill queue), counted from the
    # reservation: a backstop only (the gateway aborts a request on its --request-timeout, default 600 s,
    # and its admission control refuses work that would queue for longer than --admission-budget)
    kv_claim_timeout_s = 600.0

    def __init__(self, settings: WorkerSettings, core: EngineCore, model_path: str,
                 receiver: KVReceiver | None = None) -> None:
        super().__init__(settings, core, model_path)
        self.receiver = receiver if receiver is not None else make_receiver(settings, core)
        # every rank's receiver (rank 0's is self.receiver): what the worker drives transfers through
        self.kv = RankReceiver([self.receiver, *remote_ranks(settings, core)], _total_kv_heads(core))
        self.pending: deque[tuple[Sequence, float]] = deque()
        self.in_flight: dict[str, Sequence] = {}
        self.first_tokens: dict[str, int] = {}
        self.fenced: set[str] = set()
        self.seqs: dict[str, Sequence] = {}
        self.canaries: dict[str, Sequence] = {}  # canary id → its reserved block, until releasable
        self.prefill_tp: dict[str, int] = {}  # tensor parallel size of each pending request's prefill worker

    def compat(self) -> KVCompat:
        """The KV pairing record: the one rank 0's receiver's handshake checks."""
        return self.kv.compat

    def control_refusals(self) -> int:
        """Peers the KV receiver's control socket refused (no fleet keys, or not named by the gateway)."""
        return self.kv.refused_handshakes()

    def fenced_blocks(self) -> int:
        """Distinct blocks awaiting KV of the requests in ``fenced`` (dropped while their KV was in
        flight, held until the receiver says no write can land in them): the blocks past each one's
        reused prefix (shared, never written; ``expect`` is given the same tail)."""
        size = self.core.block_manager.block_size
        fenced: set[int] = set()
        for rid in self.fenced:
            if (seq := self.core.scheduler.get(rid)) is not None:
                fenced.update(seq.block_table[seq.num_cached_tokens // size:])
        return len(fenced)

    def transfer_address(self) -> str:
        """The receiver's control endpoint."""
        return self.receiver.address

    def kv_endpoint_error(self) -> str | None:
        """Why the KV receiver's loop thread died, or None while it runs."""
        return self.receiver.stats().loop.error

    def on_message(self, msg: Message) -> None:
        """``ReserveKV`` / ``DecodeRequest`` / ``AbortRequest``. Raises ``ValueError`` for a bad request
        (bad prompt, an id already on this worker, a ``DecodeRequest`` without reservation)."""
        if isinstance(msg, ReserveKV):
            # named by the gateway: this incarnation (and only it) may handshake
            self.kv.admit_sender(msg.prefill_worker_id, msg.prefill_sender_epoch, msg.prefill_tp_size)
            self._reserve_new(msg)
        elif isinstance(msg, DecodeRequest):
            if msg.request_id not in self.in_flight:
                raise ValueError(f"DecodeRequest for {msg.request_id!r}, which has no KV reservation here")
            self.first_tokens[msg.request_id] = msg.first_token_id
        elif isinstance(msg, KVCanaryReserve):
            self.kv.admit_sender(msg.prefill_worker_id, msg.prefill_sender_epoch, msg.prefill_tp_size)
            self._reserve_canary(msg)
        elif isinstance(msg, AbortRequest):
            if msg.request_id in self.request_ids():
                seq = self.seqs.get(msg.request_id)
                self.metrics.ended_by_gateway(seq, msg.stop_string, time.monotonic())
            self.drop(msg.request_id)

    def canary_blocks(self, num_bytes: int) -> int:
        """Blocks for a canary of ``num_bytes``: ceil(num_bytes / bytes per block), at least 1 and at most
        an eighth of the free blocks and the blocks ``max_model_len`` - 1 tokens fill (the longest prompt the
        scheduler takes)."""
        want = -(-num_bytes // self.core.runner.kv_cache.bytes_per_block)
        longest = -(-(self.core.max_model_len - 1) // self.core.block_manager.block_size)
        return max(1, min(want, longest, self.core.block_manager.num_free_blocks // 8))

    def canary_tokens(self, num_blocks: int) -> int:
        """Tokens of a canary's ``Sequence`` of ``num_blocks`` blocks: all of theirs, but fewer than
        ``max_model_len`` (so the last block may be partly filled; the transfer sends whole blocks)."""
        return max(1, min(num_blocks * self.core.block_manager.block_size, self.core.max_model_len - 1))

    def _reserve_canary(self, msg: KVCanaryReserve) -> None:
        """Blocks for a canary transfer (``canary_blocks``), freed by ``poll`` once releasable;
        ``KVCanaryReserved`` with the handle, or with ``error`` (no free block, a duplicate id, the
        receiver refused)."""
        cid = msg.canary_id
        error = ""
        if cid in self.canaries or self._knows(cid):
            error = f"canary id {cid!r} is already on this worker"
        else:
            num_tokens = self.canary_tokens(self.canary_blocks(msg.num_bytes))
            seq = Sequence(cid, [0] * num_tokens, SamplingParams(max_tokens=1),
                           time.monotonic(), self.core.eos_token_ids)
            try:
                reserved = self.core.scheduler.add_waiting_for_kv(seq)
            except ValueError as exc:  # a pool smaller than one block's tokens
                reserved, error = False, str(exc)
            if not reserved:
                error = error or "no free KV block"
            else:
                try:
                    handle = self.kv.expect(cid, list(seq.block_table), msg.prefill_tp_size,
                                            timeout_s=msg.timeout_s)
                except Exception as exc:
                    self.core.scheduler.abort(cid)
                    error = f"{type(exc).__name__}: {exc}"
                else:
                    self.canaries[cid] = seq
                    self.emit(KVCanaryReserved(canary_id=cid, worker_id=self.worker_id,
                                               kv_handle=handle))
                    return
        self.emit(KVCanaryReserved(canary_id=cid, worker_id=self.worker_id, kv_handle=None, error=error))

    def _reserve_new(self, msg: ReserveKV) -> None:
        params = msg.sampling
        if params.seed is None:  # fixed here so a recompute after preemption samples the same tokens
            params = params.with_seed(secrets.randbits(63))
        self.core.validate_prompt(msg.prompt_token_ids)
        if self._knows(msg.request_id):
            raise ValueError(f"request id {msg.request_id!r} is already on this worker")
        seq = Sequence(msg.request_id, list(msg.prompt_token_ids), params, time.monotonic(),
                       self.core.eos_token_ids)
        self.core.attach_grammar(seq)  # compiled now, while the prefill runs
        self.prefill_tp[msg.request_id] = msg.prefill_tp_size
        if self.pending or not self._try_reserve(seq):
            self.pending.append((seq, time.monotonic() + self.reserve_timeout))

    def _knows(self, request_id: str) -> bool:
        return (self.core.scheduler.get(request_id) is not None
                or any(p[0].request_id == request_id for p in self.pending))

    def _try_reserve(self, seq: Sequence) -> bool:
        if not self.core.scheduler.add_waiting_for_kv(seq, reuse_prefix=self.settings.decode_prefix_reuse):
            return False
        num_cached = seq.num_cached_tokens // self.core.block_manager.block_size
        try:
            handle = self.kv.expect(seq.request_id, seq.block_table[num_cached:],
                                    self.prefill_tp.pop(seq.request_id, 1),
                                    timeout_s=self.kv_deadline_s(seq.num_prompt_tokens),
                                    claim_timeout_s=self.kv_claim_timeout_s, num_cached_blocks=num_cached)
        except Exception:
            self.core.scheduler.abort(seq.request_id)
            raise
        self.in_flight[seq.request_id] = seq
        self.emit(KVReserved(request_id=seq.request_id, worker_id=self.worker_id, kv_handle=handle))
        return True

    def kv_deadline_s(self, num_prompt_tokens: int) -> float:
        """Seconds the KV of a prompt of ``num_prompt_tokens`` tokens may take to land, counted from its
        prefill worker's Begin (the time it waited in the prefill queue does not count):
        ``timeout_s`` + ``kv_deadline_per_token_s`` per token."""
        return self.receiver.config.timeout_s + num_prompt_tokens * self.kv_deadline_per_token_s

    def drop(self, request_id: str) -> None:
        """Abort in any state; blocks with KV possibly still in flight go to ``fenced`` (a canary's
        stay in ``canaries`` until releasable)."""
        if request_id in self.canaries:
            if not self.kv.status(request_id).is_terminal:
                self.kv.abort(request_id)
            return
        self.first_tokens.pop(request_id, None)
        self.prefill_tp.pop(request_id, None)
        self.pending = deque(p for p in self.pending if p[0].request_id != request_id)
        if self.in_flight.pop(request_id, None) is not None:
            self.kv.abort(request_id)
            self.fenced.add(request_id)
        elif self.seqs.pop(request_id, None) is not None:
            self.core.abort_request(request_id)

    def request_ids(self) -> list[str]:
        """Requests waiting for blocks, for their KV, or decoding (not those fenced: already dropped)."""
        return [*(seq.request_id for seq, _ in self.pending), *self.in_flight, *self.seqs]

    def canary_ids(self) -> list[str]:
        """KV canaries in progress."""
        return list(self.canaries)

    def poll(self) -> None:
        """Move landed requests into the running batch, fail broken transfers, free drained blocks, then
        reserve blocks for waiting requests (so blocks freed in this phase serve them at once)."""
        for rid in list(self.in_flight):
            status = self.kv.status(rid)
            if status is TransferStatus.DONE and rid in self.first_tokens:
                self._join_batch(rid)
            elif status in (TransferStatus.FAILED, TransferStatus.ABORTED):
                self.fail(rid, f"KV transfer {status.value}: {self.kv.reason(rid)}")
        for rid in list(self.fenced):
            if self.kv.releasable(rid):
                self.kv.release(rid)
                self.core.scheduler.abort(rid)
                self.fenced.discard(rid)
        for cid in list(self.canaries):
            if self.kv.status(cid).is_terminal and self.kv.releasable(cid):
                self.kv.release(cid)
                self.core.scheduler.abort(cid)
                del self.canaries[cid]
        self._poll_pending()

    def _poll_pending(self) -> None:
        now = time.monotonic()
        while self.pending:
            seq, deadline = self.pending[0]
            if now > deadline:
                self.pending.popleft()
                self.fail(seq.request_id, f"no free KV blocks for {self.reserve_timeout:g} s")
                continue
            try:
                reserved = self._try_reserve(seq)
            except Exception as exc:  # e.g. the receiver refused the blocks: fail this request only
                self.pending.popleft()
                self.fail(seq.request_id, f"cannot reserve KV blocks: {type(exc).__name__}: {exc}")
                continue
            if not reserved:
                return
            self.pending.popleft()

    def _join_batch(self, rid: str) -> None:
        self.kv.release(rid)
        del self.in_flight[rid]
        seq = self.core.scheduler.kv_landed(rid, self.first_tokens.pop(rid))
        now = time.monotonic()
        self.metrics.joined(seq, now, batch_was_empty=not self.seqs)
        block_size = self.core.block_manager.block_size
        num_cached = seq.num_cached_tokens // block_size
        self.metrics.kv_received(-(-seq.num_prompt_tokens // block_size) - num_cached, num_cached,
                                 self.core.runner.kv_cache.bytes_per_block)
        if seq.error is not None:  # its grammar rejects the first token: blocks freed, nothing streamed
            self.fail(rid, seq.error, "structured_output")
        elif seq.is_finished:  # the first token already ends it (e.g. a stop token id)
            reason: FinishReason = "stop" if seq.status is SequenceStatus.FINISHED_STOPPED else "length"
            self.metrics.finished(seq, reason, now)
            self.emit(RequestFinished(request_id=rid, worker_id=self.worker_id, finish_reason=reason,
                                      num_prompt_tokens=seq.num_prompt_tokens,
                                      num_output_tokens=seq.num_output_tokens))
        else:
            self.seqs[rid] = seq

    def step(self) -> list[StepOutput]:
        """One decode step of the running batch (step thread)."""
        return run_step(self.core)

    def on_step(self, outs: list[StepOutput]) -> None:
        """Stream each token; forget finished requests (the scheduler freed their blocks)."""
        stream_outputs(self.worker_id, self.seqs, outs, self.emit, self.metrics)

    def num_waiting(self) -> int:
        """Requests waiting for blocks, for their KV, or (after preemption) for recompute."""
        return len(self.pending) + len(self.in_flight) + len(self.core.scheduler.waiting)

    def busy(self) -> bool:
        """Reservations or transfers to watch."""
        return bool(self.pending or self.in_flight or self.fenced or self.canaries)

    def close(self) -> None:
        """Stop the receiver thread and its transport (and the command sockets to the other ranks)."""
        held = self.kv.leaks()  # a clean shutdown holds nothing on any rank
        log_event(log, "kv_endpoints_closed", logging.ERROR if held else logging.INFO,
                  ranks=len(self.kv.ranks), held="; ".join(held))
        self.kv.close()
