"""A KV transfer endpoint on every other tensor parallel rank of a prefill or decode worker, driven from
rank 0.

Rank r > 0 of a worker's engine runs in its own process (engine.tp_executor) and owns its kv_buffer shard,
so its KV endpoint (a sender on a prefill worker, a receiver on a decode worker) lives there too:
`rank_kv_hook` is the `RankHookFactory` the worker gives its `EngineCore`; the `RankKVHook` it builds
starts the rank's endpoint and a command socket (zmq REP at `command_address(spec, r)`, an ipc path), and
streams the layers rank 0 names in each step's `StepBatch.rank_note` (`RankNote`) from its own forward.
Rank 0 reaches the endpoint through `RemoteEndpoint`, which offers the endpoint methods that
kvtransfer.ranked's `RankedReceive` / `RankedSend` call (so they drive local and remote ranks alike).

The commands are typed messages of this module (`Command`, `Reply`; msgpack): they carry kvtransfer types
(KVHandle, HeadSlice), which protocol/messages.py, importing no kvtransfer data types, cannot.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from kvtransfer.head_map import HeadSlice
from kvtransfer.types import KVHandle, TransferConfig, TransferStatus

if TYPE_CHECKING:
    from engine.distributed import TensorParallel
    from engine.model_runner import ModelRunner
    from engine.step_batch import StepBatch

POLL_MS = 100  # the command thread looks at its stop flag at least this often
SEND_ROLES = ("prefill",)
# endpoint errors RemoteEndpoint raises again as their own type (others: RuntimeError)
ERRORS: dict[str, type[Exception]] = {
    e.__name__: e for e in (ValueError, KeyError, RuntimeError, AssertionError, TimeoutError)}


@dataclass(frozen=True)
class RankKVSpec:
    """What each rank needs to start its endpoint: the worker's `role` ("prefill": a sender, "decode": a
    receiver), rank 0's transfer `config` (rank r's: `rank_config`) and `command_dir`, where rank r's
    command socket lives."""

    role: str
    config: TransferConfig
    command_dir: str


def rank_config(config: TransferConfig, rank: int) -> TransferConfig:
    """Rank `rank`'s transfer config: worker id "<id>-tp<rank>" (rank 0 keeps the worker's id), that tp_rank,
    a port of its own (0: any free one)."""
    if rank == 0:
        return dataclasses.replace(config, tp_rank=0)
    return dataclasses.replace(config, worker_id=f"{config.worker_id}-tp{rank}", tp_rank=rank, port=0)


def shaped_config(config: TransferConfig, runner: ModelRunner, tp_size: int) -> TransferConfig:
    """`config` with the worker's tensor parallel size and the model's KV heads (from the runner's model
    config: num_key_value_heads, else num_attention_heads)."""
    cfg = runner.hf_config
    total = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    return dataclasses.replace(config, tp_size=tp_size, total_kv_heads=total)


def command_address(spec: RankKVSpec, rank: int) -> str:
    """Rank `rank`'s command socket (zmq ipc)."""
    return f"ipc://{spec.command_dir}/tp{rank}"


class RankNote(msgspec.Struct, frozen=True):
    """A step's `StepBatch.rank_note`: (rank, request id of the rank's endpoint) of each transfer whose
    layers that rank streams during the step's forward."""

    sends: list[tuple[int, str]]


class Command(msgspec.Struct, frozen=True):
    """Call `method` of rank r's endpoint. request_id: the endpoint request it is about; block_ids,
    timeout_s, claim_timeout_s, num_cached_blocks: expect's / add_request's; handle, heads:
    add_request's; wait_s: how long `release_settled` waits for the request to settle; text, epoch,
    reason: admit_sender's / drop_sender's sender id, epoch and reason."""

    method: str
    request_id: str = ""
    block_ids: list[int] = []
    timeout_s: float | None = None
    claim_timeout_s: float | None = None
    handle: KVHandle | None = None
    heads: HeadSlice | None = None
    wait_s: float = 0.0
    text: str = ""
    epoch: int = 0
    reason: str = ""
    num_cached_blocks: int = 0


class Reply(msgspec.Struct, frozen=True):
    """A command's result: `error` ("" when it ran; else "<exception type>: <message>") and one of the
    typed values."""

    error: str = ""
    status: str = ""
    flag: bool = False
    text: str = ""
    handle: KVHandle | None = None
    ids: list[str] = []
    count: int = 0


def _settled(endpoint: Any, request_id: str) -> bool:
    snap = endpoint.snapshot(request_id)
    if hasattr(snap, "inflight"):  # a sender: nothing in flight, its Stopped/Withdraw sent
        return bool(snap.status.is_terminal and snap.inflight == 0 and not snap.fence_pending)
    return bool(endpoint.releasable(request_id))


def run_command(endpoint: Any, cmd: Command) -> Reply:
    """Run `cmd` on `endpoint` (an api.KVSender or api.KVReceiver). Raises AttributeError for a method
    outside the command set; what the endpoint raises."""
    m, rid = cmd.method, cmd.request_id
    if m == "expect":
        return Reply(handle=endpoint.expect(rid, cmd.block_ids, cmd.timeout_s, cmd.claim_timeout_s,
                                            num_cached_blocks=cmd.num_cached_blocks))
    if m == "add_request":
        endpoint.add_request(cmd.handle, cmd.block_ids, heads=cmd.heads)
        return Reply()
    if m == "status":
        return Reply(status=endpoint.status(rid).value)
    if m == "reason":
        return Reply(text=endpoint.reason(rid))
    if m == "releasable":
        return Reply(flag=endpoint.releasable(rid))
    if m in ("abort", "release", "check_no_leaks"):
        getattr(endpoint, m)(*([rid] if m != "check_no_leaks" else []))
        return Reply()
    if m == "send_layers":
        endpoint.send_layers(rid)
        return Reply()
    if m == "admit_sender":
        endpoint.admit_sender(cmd.text, cmd.epoch)
        return Reply()
    if m == "drop_sender":
        endpoint.drop_sender(cmd.text, cmd.reason)
        return Reply()
    if m == "refused_handshakes":
        return Reply(count=endpoint.refused_handshakes())
    if m == "release_settled":
        if not endpoint.wait_until(lambda: _settled(endpoint, rid), cmd.wait_s):
            raise TimeoutError(f"request {rid!r} not settled within {cmd.wait_s} s")
        endpoint.release(rid)
        return Reply()
    if m == "pending":
        return Reply(ids=endpoint.pending())
    raise AttributeError(f"no command {m!r}")


class CommandServer:
    """Serves `Command`s for `endpoint` at `address` (zmq REP) on its own thread until `close`."""

    def __init__(self, address: str, endpoint: Any) -> None:
        self.endpoint = endpoint
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-kv-commands", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sock.poll(POLL_MS):
                    continue
                raw = self._sock.recv()
                try:
                    reply = run_command(self.endpoint, msgspec.msgpack.decode(raw, type=Command))
                except Exception as exc:  # AssertionError of check_no_leaks too: the caller raises it
                    reply = Reply(error=f"{type(exc).__name__}: {exc}")
                self._sock.send(msgspec.msgpack.encode(reply))
        finally:
            self._sock.close(0)
            self._ctx.term()

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving (within POLL_MS) and close the socket."""
        self._stop.set()
        self._thread.join(timeout)


class RankKVHook:
    """The `RankHook` of rank r > 0 (module docstring): its endpoint over the rank's kv_buffer, a command
    server, and each step's layer hook. Raises ValueError for an unknown role."""

    def __init__(self, spec: RankKVSpec, runner: ModelRunner, tp: TensorParallel) -> None:
        from kvtransfer.backends import get_transfer_backend

        if spec.role not in ("prefill", "decode"):
            raise ValueError(f"role {spec.role!r} moves no KV")
        self.rank = tp.rank
        backend = get_transfer_backend(spec.config.backend)
        config = rank_config(shaped_config(spec.config, runner, tp.size), tp.rank)
        kv = runner.kv_cache.kv_buffer
        self.endpoint: Any = (backend.sender(config, kv) if spec.role in SEND_ROLES
                              else backend.receiver(config, kv))
        try:
            self.server = CommandServer(command_address(spec, tp.rank), self.endpoint)
        except BaseException:
            self.endpoint.close()
            raise

    def layer_hook_for(self, batch: StepBatch) -> Callable[[int], None] | None:
        """A hook sending each layer of this rank's transfers the step's rank note names (None: none)."""
        if not batch.rank_note:
            return None
        note = msgspec.msgpack.decode(batch.rank_note, type=RankNote)
        mine = [rid for rank, rid in note.sends if rank == self.rank]
        if not mine:
            return None

        def hook(layer: int) -> None:
            for rid in mine:
                self.endpoint.send_layer(rid, layer)
        return hook

    def close(self) -> None:
        """Stop the command server and close the endpoint."""
        self.server.close()
        self.endpoint.close()


def rank_kv_hook(spec: RankKVSpec, runner: ModelRunner, tp: TensorParallel) -> RankKVHook:
    """The `RankHookFactory` of a prefill or decode worker (functools.partial(rank_kv_hook, spec))."""
    return RankKVHook(spec, runner, tp)


class RemoteEndpoint:
    """Rank 0's handle on rank r's endpoint: the methods kvtransfer.ranked calls, each one command with a
    deadline of `timeout_s` (raises TimeoutError past it; every later command then raises RuntimeError at
    once: the worker ends, as on any rank failure). An error of the endpoint is raised again as its type
    when it is in ERRORS, else RuntimeError; the message names the rank."""

    def __init__(self, address: str, rank: int, timeout_s: float = 10.0) -> None:
        self.rank = rank
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REQ)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._timeout_ms = int(timeout_s * 1000)
        self._lock = threading.Lock()
        self._lost = ""  # why the rank stopped answering ("" while it answers)

    def _call(self, cmd: Command) -> Reply:
        with self._lock:
            if self._lost:
                raise RuntimeError(f"tensor parallel rank {self.rank} is unreachable: {self._lost}")
            self._sock.send(msgspec.msgpack.encode(cmd))
            if not self._sock.poll(self._timeout_ms + int(cmd.wait_s * 1000)):
                self._lost = f"no answer to {cmd.method} within {self._timeout_ms} ms"
                raise TimeoutError(f"tensor parallel rank {self.rank}: {self._lost}")
            reply = msgspec.msgpack.decode(self._sock.recv(), type=Reply)
        if reply.error:
            kind = reply.error.partition(": ")[0]
            raise ERRORS.get(kind, RuntimeError)(f"tensor parallel rank {self.rank}: {reply.error}")
        return reply

    def expect(self, request_id: str, block_ids: list[int], timeout_s: float | None = None,
               claim_timeout_s: float | None = None, *, num_cached_blocks: int = 0) -> KVHandle:
        """api.KVReceiver.expect on the rank."""
        handle = self._call(Command("expect", request_id, list(block_ids), timeout_s, claim_timeout_s,
                                    num_cached_blocks=num_cached_blocks)).handle
        assert handle is not None
        return handle

    def add_request(self, handle: KVHandle, block_ids: list[int], heads: HeadSlice | None = None) -> None:
        """api.KVSender.add_request on the rank."""
        self._call(Command("add_request", handle.request_id, list(block_ids), handle=handle, heads=heads))

    def status(self, request_id: str) -> TransferStatus:
        """The request's status on the rank."""
        return TransferStatus(self._call(Command("status", request_id)).status)

    def reason(self, request_id: str) -> str:
        """Why the request FAILED or was ABORTED on the rank."""
        return self._call(Command("reason", request_id)).text

    def releasable(self, request_id: str) -> bool:
        """api.KVReceiver.releasable on the rank."""
        return self._call(Command("releasable", request_id)).flag

    def abort(self, request_id: str) -> None:
        """Abort the request on the rank."""
        self._call(Command("abort", request_id))

    def release(self, request_id: str) -> None:
        """Forget the request on the rank (the endpoint's release rules)."""
        self._call(Command("release", request_id))

    def release_settled(self, request_id: str, wait_s: float) -> None:
        """Wait up to `wait_s` until the rank may forget the request (a sender: terminal, nothing in
        flight, its fence sent; a receiver: releasable), then release it. Raises TimeoutError."""
        self._call(Command("release_settled", request_id, wait_s=wait_s))

    def send_layers(self, request_id: str) -> None:
        """api.KVSender.send_layers of every layer on the rank (a canary: no forward pass streams it)."""
        self._call(Command("send_layers", request_id))

    def admit_sender(self, sender_id: str, epoch: int) -> None:
        """api.KVReceiver.admit_sender on the rank."""
        self._call(Command("admit_sender", text=sender_id, epoch=epoch))

    def drop_sender(self, sender_id: str, reason: str) -> None:
        """api.KVReceiver.drop_sender on the rank."""
        self._call(Command("drop_sender", text=sender_id, reason=reason))

    def refused_handshakes(self) -> int:
        """api.KVReceiver.refused_handshakes on the rank."""
        return self._call(Command("refused_handshakes")).count

    def pending(self) -> list[str]:
        """Request ids the rank holds."""
        return self._call(Command("pending")).ids

    def check_no_leaks(self) -> None:
        """Raise AssertionError if the rank's endpoint still holds anything."""
        self._call(Command("check_no_leaks"))

    def close(self) -> None:
        """Close the command socket (the rank's endpoint lives on until its engine closes)."""
        self._sock.close(0)
        self._ctx.term()
