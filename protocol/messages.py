"""Control-plane messages: one msgspec Struct per process hop (no torch).

Transport: the gateway binds a pyzmq ROUTER socket at ``--control-bind``; every worker connects a DEALER
socket to it and sends ``RegisterWorker`` first. Each frame holds exactly one message encoded with
``encode`` (msgpack); ``decode`` returns the concrete Struct (a tagged union on the ``type`` field).

Request lifecycle (disaggregated; the gateway's side is gateway/orchestrator.py):
  1. gateway → decode D: ``ReserveKV`` (prompt + sampling; D reserves blocks, status WAITING_FOR_KV)
  2. D → gateway: ``KVReserved`` (the opaque, msgspec-encoded kvtransfer ``KVHandle``)
  3. gateway → prefill P: ``PrefillRequest`` (with that KV handle)
  4. P → gateway: ``FirstToken`` (streamed to the client at once: TTFT); P sends the KV to D (kvtransfer)
  5. gateway → D: ``DecodeRequest`` (the first token); D starts decoding once the KV has landed too
  6. D → gateway: one ``NextToken`` per later output token … ``RequestFinished`` (or ``RequestFailed``)
Worker → gateway, the per-request messages of one worker phase (``FirstToken``, ``NextToken``,
``RequestFinished``, ``RequestFailed``, ``KVReserved``: a decode step's tokens for every running request)
travel together in one ``OutputBatch`` frame, in the order they were made.
Prefix-cache state: every worker publishes ``KVEvents`` (blocks stored / removed; a snapshot after each
registration), from which each gateway keeps its prefix index.
``max_tokens=1``: step 3 without a KV handle, and nothing reaches a decode worker. Colocated:
``ColocatedRequest`` → ``FirstToken``, ``NextToken`` …, ``RequestFinished``. At any point the gateway may
send ``AbortRequest`` (client gone, stop string matched, peer failed) to every worker holding state.

Sampling parameters travel as ``engine.sampling_params.SamplingParams`` (torch-free; validated when
decoded). Stop *strings* stay in the gateway, which detokenizes: the request messages refuse a
``sampling.stop`` that is not empty, and workers stop on ``stop_token_ids`` only.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

import msgspec

from engine.sampling_params import SamplingParams
from kvtransfer.compat import KVCompat

Role = Literal["prefill", "decode", "colocated"]
FinishReason = Literal["stop", "length", "abort"]
FailureKind = Literal["worker", "structured_output"]  # RequestFailed.kind
BlockHash = Annotated[int, msgspec.Meta(ge=0)]  # engine/block_hash.py ``block_hash`` (msgpack: < 2**64)
MAX_TENSOR_PARALLEL_SIZE = 64  # ranks of one worker, one GPU each, all on one host
TensorParallelSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_TENSOR_PARALLEL_SIZE)]




class WorkerLoad(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's load: sequences waiting/running, KV blocks free/total (blocks, not bytes).

    ``kv_transfer_bytes`` / ``kv_transfer_seconds``: cumulative since the worker started, over its KV
    transfers that reached DONE (prefill side: blocks sent × bytes per block of all layers, K and V;
    seconds from the first layer handed to the sender to DONE). 0 on workers that send no KV.
    ``kv_control_refused``: cumulative peers the worker's KV control socket refused (handshakes without
    the fleet's CURVE keys, Hellos of senders the gateway never named to it); 0 on workers without one.
    ``prefill_tokens_per_s``: a prefill or colocated worker's measured prefill rate (prompt tokens computed
    per busy second, protocol/prefill_rate.py; from its start-up probe until it has served), and
    ``prefill_largest_tokens`` the largest computed prompt that rate was recently measured on; 0 when not
    measured (decode workers). Gateways judge their queues by it. ``prefill_backlog_tokens``: the prompt
    tokens it expects to compute for the requests it holds that have no first token yet and those it
    received during a step, each its prompt minus what is already computed or (before it is scheduled) the
    prefix the gateway expected cached
    (``PrefillRequest.expected_cached_tokens``), and at most ``TRUSTED_SPAN`` x ``prefill_largest_tokens``
    (protocol/prefill_rate.py); 0 on decode workers. Every gateway adds it to what it routed since, so
    several gateways judge one queue. ``kv_fenced_blocks``: blocks a decode worker still holds for
    requests already dropped (aborted or failed while their KV was in flight), until no write of their
    sender can land in them (the receiver's fence: the sender said it stopped, or it is gone and the
    request's deadline passed, kvtransfer/receiver.py); 0 on other workers. They count as used in
    ``num_free_blocks``. ``draining``: the worker was asked to stop (SIGTERM) and finishes what it holds
    before it leaves (``--drain-timeout``): gateways route no new request to it.
    """

    num_waiting: int = 0
    num_running: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_control_refused: int = 0
    prefill_tokens_per_s: float = 0.0
    prefill_largest_tokens: int = 0
    prefill_backlog_tokens: int = 0
    kv_fenced_blocks: int = 0
    draining: bool = False


class KVPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """Where a worker's KV cache lives, from which the gateway infers the data path a pair's KV transfer
    should take (gateway/canary.py ``expected_path``).

    ``host``: the machine's identity (the kernel's boot id, shared by every container of one host; ""
    when unknown); ``device``: "cuda" or "cpu" (the KV buffer's device type); ``rdma``: the host has an
    RDMA device (a non-empty /sys/class/infiniband)."""

    host: str = ""
    device: str = "cpu"
    rdma: bool = False


class RegisterWorker(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Worker → gateway, first message. A new ``epoch`` for a known ``worker_id`` replaces the old one.

    ``model`` is the served name, ``model_path`` the local model dir (the gateway may load the tokenizer
    from it when on the same host); ``compat`` is the worker's KV pairing record (kvtransfer
    ``KVCompat``: the one its KV handshake checks; the gateway pairs only workers whose records match);
    ``transfer_address`` is where peers reach this worker's KV transport; ``max_model_len`` in tokens.
    ``kv_sender_epoch``: a prefill worker's KV sender incarnation (kvtransfer ``KVSender.epoch``, the
    epoch of its KV Hellos), which the gateway names to decode workers in ``ReserveKV`` /
    ``KVCanaryReserve``: a decode worker answers a KV Hello only for that (worker id, epoch) pair. 0 on
    roles without a KV sender; a prefill worker registered with 0 has every KV Hello refused.
    """

    role: Role
    worker_id: str
    epoch: int
    model: str
    model_path: str
    compat: KVCompat
    transfer_address: str = ""
    max_model_len: int = 2048
    max_num_seqs: int = 256
    load: WorkerLoad = WorkerLoad()
    placement: KVPlacement = KVPlacement()
    kv_sender_epoch: int = 0


def new_epoch() -> int:
    """A fresh incarnation number of a process (nanoseconds since the Unix epoch: grows on restart)."""
    return time.time_ns()


class RegisterAck(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Gateway → worker: registration accepted or refused (``reason`` says why). ``gateway_epoch``: the
    gateway process's incarnation (``new_epoch`` at its start; 0 from a gateway that sends none). A worker
    whose gateway epoch changes drops every request it holds for the previous incarnation: nobody is
    left to stream them to or to abort them. ``sibling_ports``: the control ports of the other processes
    of this gateway's pool (``pdserve gateway --workers N``), on the host the worker reached this one at;
    an accepted worker registers with each it does not serve yet (workers/gateway_links.py). Empty for a
    gateway of one process. Ports, not endpoints: a process binds e.g. ``tcp://0.0.0.0:P``, which no
    worker can connect to, and the pool's processes share one host. ``control_port``: the port this process's
    control socket is bound to (0: not said); a worker that reached it at another port (a port mapping:
    docker ``-p``, a Service's port) cannot reach the siblings at theirs and does not follow them."""

    worker_id: str
    epoch: int
    accepted: bool
    reason: str = ""
    gateway_epoch: int = 0
    sibling_ports: tuple[int, ...] = ()
    control_port: int = 0


class ReRegister(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Gateway → worker: "I do not know you" — the gateway restarted, or it declared the worker dead after
    a silence longer than ``--heartbeat-timeout`` and has failed its requests. The worker sends its
    ``RegisterWorker`` again (same epoch: it did not restart) and keeps serving."""

    worker_id: str
    epoch: int
    reason: str = ""


class Probe(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Gateway → worker: a liveness probe the worker ignores. The gateway sends one to each worker when
    a worker's control connection drops: the send fails at once for the worker whose connection it was."""

    worker_id: str
    epoch: int


class GatewayShutdown(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Gateway → every registered worker: this gateway process is leaving cleanly (its drain is over), so
    the connection that drops next is an announced stop, not a failure; the worker drops the requests that
    gateway still owns, as for a lost gateway. ``gateway_epoch``: the leaving incarnation
    (``RegisterAck.gateway_epoch``)."""

    gateway_epoch: int


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Worker → gateway, periodically; silence longer than ``--heartbeat-timeout`` s marks it dead."""

    worker_id: str
    epoch: int
    load: WorkerLoad


class WorkerShutdown(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Worker → gateway: leaving cleanly; its in-flight requests fail at once."""

    worker_id: str
    epoch: int


class ReserveKV(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Gateway → decode: reserve blocks for ``prompt_token_ids`` and keep the request for decoding. The KV
    comes from prefill worker ``prefill_worker_id`` whose KV sender has epoch ``prefill_sender_epoch``
    (its ``RegisterWorker.kv_sender_epoch``): the only sender incarnation of that id whose KV Hello the
    decode worker answers from then on. ``prefill_tp_size``: that worker's tensor parallel size (its
    ranks' senders share the epoch; the decode worker expects one transfer per pair of ranks sharing KV
    heads)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    prefill_worker_id: str
    prefill_sender_epoch: int
    prefill_tp_size: TensorParallelSize = 1

    def __post_init__(self) -> None:
        _no_stop_strings(self.sampling)


class KVReserved(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Decode → gateway: blocks reserved; ``kv_handle`` is a msgspec-encoded kvtransfer ``KVHandle``."""

    request_id: str
    worker_id: str
    kv_handle: bytes


class PrefillRequest(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Gateway → prefill: compute the prompt, sample the first token; send KV to ``kv_handle`` if set.
    ``expected_cached_tokens``: the prompt's prefix the gateway expects this worker's prefix cache to hold
    (its KV events), counted in the worker's reported backlog until the request is scheduled
    (``WorkerLoad.prefill_backlog_tokens``); never used for scheduling."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    kv_handle: bytes | None = None
    decode_worker_id: str | None = None
    expected_cached_tokens: int = 0

    def __post_init__(self) -> None:
        _no_stop_strings(self.sampling)


class DecodeRequest(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Gateway → decode: the first token sampled by prefill; decoding starts when the KV has landed."""

    request_id: str
    first_token_id: int
    num_cached_tokens: int = 0


class ColocatedRequest(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Gateway → colocated worker: prefill and decode in one place. ``expected_cached_tokens``: as in
    ``PrefillRequest``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    expected_cached_tokens: int = 0

    def __post_init__(self) -> None:
        _no_stop_strings(self.sampling)


class KVCanaryReserve(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Gateway → decode: reserve KV blocks for a canary transfer from ``prefill_worker_id``, KV sender
    epoch ``prefill_sender_epoch`` (fenced as in ``ReserveKV``; a test of the data path, no request); the
    KV must land within ``timeout_s`` s. Answered by ``KVCanaryReserved``.
    ``num_bytes``: the size wanted (every layer, K and V): ceil(num_bytes / bytes per block) blocks, at
    least one, at most an eighth of the free blocks (so a canary never crowds out requests) and no more
    than ``max_model_len`` - 1 tokens fill (the longest prompt the decode worker takes).
    ``AbortRequest`` with ``canary_id`` as request id ends it early. ``prefill_tp_size``: as in
    ``ReserveKV``."""

    canary_id: str
    prefill_worker_id: str
    prefill_sender_epoch: int
    timeout_s: float
    num_bytes: int = 0
    prefill_tp_size: TensorParallelSize = 1


class KVCanaryReserved(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Decode → gateway: the canary's ``KVHandle`` (opaque msgspec bytes, as in ``KVReserved``), or None
    with ``error`` when no block could be reserved."""

    canary_id: str
    worker_id: str
    kv_handle: bytes | None
    error: str = ""


class KVCanarySend(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Gateway → prefill: send as many KV blocks (of the prefill worker's own, every layer) as
    ``kv_handle`` has into it and report with ``KVCanaryResult``. ``AbortRequest`` with ``canary_id`` as
    request id stops it."""

    canary_id: str
    kv_handle: bytes


class KVCanaryResult(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Prefill → gateway: the canary ended: ``ok`` when every layer landed; ``num_bytes`` moved in
    ``seconds`` (from handing the blocks to the sender to the receiver's DONE, control round trips
    included) of which ``wire_seconds`` on the transport (first write posted → last write seen complete:
    ``KVSender.wire_seconds``; 0.0 when unknown); ``transport``: the KV transport's name (e.g. loopback,
    nixl, ucx); ``error`` why it failed; ``skipped``: it did not start for want of free blocks on the
    prefill worker (says nothing of the path)."""

    canary_id: str
    worker_id: str
    ok: bool
    num_bytes: int
    seconds: float
    transport: str
    error: str = ""
    skipped: bool = False
    wire_seconds: float = 0.0


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One alternative: token id and its log-probability (natural log)."""

    token_id: int
    logprob: float


class PromptLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One prompt token's log-probability given the tokens before it (natural log), its 1-based rank in
    the vocabulary and the top-N alternatives, best first (``engine.prompt_logprobs``)."""

    logprob: float
    rank: int
    top_logprobs: list[TopLogprob]


class FirstToken(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Prefill (or colocated) → gateway: the first output token.

    ``finish_reason`` is set when this token already ends the request (eos, or ``max_tokens == 1``).
    ``prompt_logprobs``: with ``SamplingParams.prompt_logprobs``, the entries of prompt tokens
    ``1 .. n - 1`` (the first has no prefix); else None.
    """

    request_id: str
    worker_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[TopLogprob] | None = None
    num_cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    prompt_logprobs: list[PromptLogprob] | None = None


class NextToken(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Decode (or colocated) → gateway: one output token after the first, in order (one per step)."""

    request_id: str
    worker_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[TopLogprob] | None = None


class RequestFinished(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Worker → gateway: the request ended on the worker; counts are tokens."""

    request_id: str
    worker_id: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_output_tokens: int


class RequestFailed(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Worker → gateway: the request failed on the worker (``error`` says why). ``kind``: ``"worker"``
    (the worker's own failure: a KV transfer, a step error; another worker may serve the request, so the
    gateway retries or migrates it) or ``"structured_output"`` (the request's grammar rejected the model's
    token: it would fail the same way anywhere, so the gateway answers 400 naming the request's
    structured-output field, or ends the stream with an error event, and retries nowhere)."""

    request_id: str
    worker_id: str
    error: str
    kind: FailureKind = "worker"


class RequestRejected(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Worker → gateway: the request itself cannot be served, before any token or KV block: its
    ``structured_output`` does not compile in the worker's grammar engine (``param``; ``error`` says
    why). Unlike ``RequestFailed`` it is the client's fault: the gateway answers 400 and retries nowhere."""

    request_id: str
    worker_id: str
    error: str
    param: Literal["structured_output"] = "structured_output"


OutputMessage = FirstToken | NextToken | RequestFinished | RequestFailed | RequestRejected | KVReserved


class OutputBatch(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Worker → gateway: every per-request message (``OutputMessage``) one worker phase produced, in the
    order it produced them: one decode step's ``NextToken`` for each running request, with the
    ``RequestFinished`` of those that ended, the ``FirstToken`` of a prefill step, failures, KV
    reservations. The gateway applies them one by one, exactly as if each had come in its own frame:
    one frame per step instead of one per token and request. ``worker_id``: the sender."""

    worker_id: str
    messages: list[OutputMessage]


class KVEvents(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Worker → gateway: how the worker's prefix cache changed, at most one per worker phase (any role).

    Blocks are named by their chained hash (engine/block_hash.py ``block_hash``, the same number in every
    process: 64-bit, BLAKE2b over the parent hash and the block's token ids; the worker's
    ``compat.block_size`` tokens per block). ``stored``: hashes now cached (a full block whose KV a
    prefix hit can reuse); ``removed``: hashes no longer cached (evicted); disjoint, the net change since
    the previous message. ``snapshot``: ``stored`` is the whole cache and ``removed`` is empty: the reader
    replaces what it held of this worker (an empty snapshot: the cache is empty). ``seq_no``: 1, 2, 3 …
    per worker incarnation (``epoch``), over deltas and snapshots alike: a reader that sees a number
    other than the one after the last it applied has missed one, and asks for a snapshot
    (``KVSnapshotRequest``) ignoring deltas until it comes. A worker sends a snapshot after every
    accepted registration, on request, and when its change log overflowed. Names no request."""

    worker_id: str
    epoch: int
    seq_no: Annotated[int, msgspec.Meta(ge=1)]
    stored: list[BlockHash] = []
    removed: list[BlockHash] = []
    snapshot: bool = False


class KVSnapshotRequest(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Gateway → worker: send a ``KVEvents`` snapshot of your whole prefix cache (the gateway missed a
    ``KVEvents``: its ``seq_no`` skipped one)."""

    worker_id: str
    epoch: int


class AbortRequest(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Gateway → worker: drop the request and free its blocks (once no transfer can still write them).
    ``stop_string``: the request did not fail or go away: it ended at a stop string the gateway matched in
    its text (the worker counts it finished with reason ``stop``, as vLLM would, not aborted)."""

    request_id: str
    reason: str = "abort"
    stop_string: bool = False


def _no_stop_strings(sampling: SamplingParams) -> None:
    if sampling.stop:
        raise ValueError(f"sampling.stop must be empty: stop strings stay in the gateway (workers see "
                         f"stop_token_ids only), got {sampling.stop!r}")


Message = (
    RegisterWorker | RegisterAck | ReRegister | Probe | GatewayShutdown | Heartbeat | WorkerShutdown
    | ReserveKV | KVReserved | PrefillRequest | DecodeRequest | ColocatedRequest | FirstToken | NextToken
    | RequestFinished | RequestFailed | RequestRejected | OutputBatch | AbortRequest | KVCanaryReserve
    | KVCanaryReserved | KVCanarySend | KVCanaryResult | KVEvents | KVSnapshotRequest
)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """Encode one control message to msgpack bytes (the type name travels in the ``type`` field)."""
    return _ENCODER.encode(msg)


def decode(data: bytes) -> Message:
    """Decode bytes made by ``encode``.

    Raises:
        msgspec.ValidationError / msgspec.DecodeError: the bytes are not a valid control message.
    """
    return _DECODER.decode(data)


def request_id_of(data: bytes) -> str | None:
    """The ``request_id`` named by a frame that ``decode`` refused (a msgpack map with a string
    ``request_id``, e.g. a request whose sampling parameter is out of range), else None."""
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    rid = raw.get("request_id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, str) else None
