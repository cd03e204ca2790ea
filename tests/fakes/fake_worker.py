"""A fake pdserve worker process (prefill, decode or colocated), in the style of Dynamo's mocker.

It registers with the gateway like a real worker (DEALER → the gateway's ROUTER), heartbeats its load,
and produces deterministic tokens with known timings: output position i is
``output_ids[(i + seed) % len]`` (seed 0 when unset, so a seed picks a rotation of the reply); a prompt
that ends with the reply's first k tokens continues at position k, as a model continues its own text
(what a migrated request sends). With
``sampling.logprobs`` set it sends logprob ``fake_logprob(i)`` for position i and, for N > 0, the top-N
alternatives of ``fake_top``; its ``FirstToken`` reports ``--cached-tokens`` prefix-cache hits.
Prefill takes ``--prefill-delay`` s; the decode side (decode and colocated roles) runs its requests as one
batch in steps of ``--token-delay`` s, each step sending one token of every running request in one
``OutputBatch`` frame, as a real worker's step does.
The decode role "reserves" ``ceil(prompt / block_size) + 1`` blocks per request from ``--total-blocks``
and frees them on finish or abort, so heartbeats show leaks. Every received message is appended to
``--record`` (JSON lines: type, request_id, and ``sampling`` (a dict) when it carries sampling
params, ``prompt_token_ids`` when it carries a prompt) for tests to inspect. Faults: ``--fail-at P``
answers ``RequestFailed`` (of ``--fail-kind``) instead of output position P, ``--hang-at P`` stalls the
whole worker there (no tokens, no heartbeats: the gateway declares it lost; it still records messages);
P = -1 at ``ReserveKV`` (before any token). KV canaries: the decode role answers ``KVCanaryReserve`` with a
fake handle, the prefill role ``KVCanarySend`` with a landed canary of ``--canary-bytes`` in
``--canary-seconds`` over transport ``fake``; ``--canary-wedged 1`` never answers (a wedged data path).
``--curve-keys DIR`` makes its socket a CURVE client with that key pair (a gateway with ``--curve-keys``
accepts only the fleet's); without it the socket is plain.
Several gateways (``--gateway-control A,B,...``, e.g. the processes of ``pdserve gateway --workers N``):
one DEALER per gateway; it registers with and heartbeats to each, registers again with one that sends
``ReRegister`` (a restarted gateway process) and, when a gateway's ``RegisterAck`` shows a new gateway
epoch, drops the requests of its earlier incarnation (freeing their blocks), as a real worker does; a
message a gateway cannot take (dead, queue full) is dropped rather than waited on. A
request's outputs go to the gateway that sent it; the record's ``gateway`` field (only with several) is
the index of the gateway a message came from. Load and blocks are the worker's, shared.
Run: ``python -m tests.fakes.fake_worker --role decode ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import time
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from engine.sampling_params import SamplingParams
from kvtransfer.compat import KVCompat
from kvtransfer.curve import load_keys, secure_client
from kvtransfer.head_map import rank_kv_heads
from protocol.messages import (
    AbortRequest,
    ColocatedRequest,
    DecodeRequest,
    FinishReason,
    FirstToken,
    Heartbeat,
    KVCanaryReserve,
    KVCanaryReserved,
    KVCanaryResult,
    KVCanarySend,
    KVReserved,
    Message,
    NextToken,
    PrefillRequest,
    RegisterAck,
    RegisterWorker,
    RequestFailed,
    RequestFinished,
    ReRegister,
    ReserveKV,
    TopLogprob,
    WorkerLoad,
    WorkerShutdown,
    decode,
    encode,
)
from workers.outputs import batch_outputs


def fake_logprob(pos: int) -> float:
    """The fake log-probability of output position ``pos`` (exact in binary floating point)."""
    return -0.125 * (pos % 8 + 1)


def fake_top(token_id: int, pos: int, n: int) -> list[TopLogprob]:
    """The fake top-``n`` alternatives of output position ``pos``: the sampled token first."""
    return [TopLogprob(token_id + k, fake_logprob(pos) - k) for k in range(n)]


@dataclass
class Generation:
    """One request being generated: its prompt, sampling, the reply offset it continues at
    (``FakeWorker.continued``) and its next output position ``i`` (0: the prefill's first token)."""

    rid: str
    prompt: list[int]
    sampling: SamplingParams
    offset: int
    i: int


class FakeWorker:
    """The worker's state: pending decode reservations, prefills in progress (``tasks``), the running
    decode batch (``running``), free blocks, and the outbox of the current phase."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.output_ids = [int(x) for x in args.output_ids.split(",")]
        self.epoch = args.epoch or time.time_ns()
        self.ctx = zmq.asyncio.Context()
        self.socks: list[zmq.asyncio.Socket] = []
        for endpoint in args.gateway_control.split(","):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if args.curve_keys:  # like a real worker (workers/control_client.py); without: a plain DEALER
                secure_client(sock, load_keys(args.curve_keys))
            sock.connect(endpoint)
            self.socks.append(sock)
        self.origin: dict[str, int] = {}  # request id → index of the gateway that sent it
        self.gateway_epochs: dict[int, int] = {}  # gateway index → its epoch from its last RegisterAck
        self.free_blocks = args.total_blocks
        self.reserved: dict[str, tuple[ReserveKV, int]] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.running: dict[str, Generation] = {}
        self.outbox: list[tuple[int, Message]] = []
        self.wake = asyncio.Event()
        self.hung = asyncio.Event()

    async def send(self, msg: Message, gateway: int = 0) -> None:
        """Send to gateway ``gateway``. With several, without blocking: a message a gateway cannot take
        (gone, its queue full) is dropped, so that one dead gateway never stalls the others."""
        if len(self.socks) == 1:
            await self.socks[0].send(encode(msg))
            return
        with contextlib.suppress(zmq.Again):
            await self.socks[gateway].send(encode(msg), flags=zmq.NOBLOCK)

    def emit(self, msg: Message) -> None:
        """Queue a message for the gateway its request came from; ``flush`` sends the queue as a real
        worker's phase does."""
        self.outbox.append((self.origin.get(getattr(msg, "request_id", ""), 0), msg))

    async def flush(self) -> None:
        """Send the queued messages, to each gateway its own: the per-request ones in one
        ``OutputBatch`` per gateway (``batch_outputs``)."""
        queued, self.outbox = self.outbox, []
        for gateway in sorted({g for g, _ in queued}):
            for frame in batch_outputs(self.args.worker_id, [m for g, m in queued if g == gateway]):
                await self.send(frame, gateway)

    def load(self) -> WorkerLoad:
        busy = len(self.tasks) + len(self.running)
        return WorkerLoad(num_waiting=max(len(self.reserved) - busy, 0), num_running=busy,
                          num_free_blocks=self.free_blocks, num_total_blocks=self.args.total_blocks)

    def record(self, msg: Message, gateway: int = 0) -> None:
        if self.args.record:
            entry: dict[str, object] = {"type": type(msg).__name__,
                                        "request_id": getattr(msg, "request_id",
                                                              getattr(msg, "canary_id", None))}
            if len(self.socks) > 1:
                entry["gateway"] = gateway
            sampling = getattr(msg, "sampling", None)
            if sampling is not None:
                entry["sampling"] = msgspec.to_builtins(sampling)
            prompt = getattr(msg, "prompt_token_ids", None)
            if prompt is not None:
                entry["prompt_token_ids"] = list(prompt)
            with open(self.args.record, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def token(self, i: int, sampling: SamplingParams) -> int:
        return self.output_ids[(i + (sampling.seed or 0)) % len(self.output_ids)]

    def finish_of(self, sampling: SamplingParams, n: int, tok: int) -> FinishReason | None:
        """The finish reason after this request's ``n``-th token ``tok`` (``n`` counts from 1)."""
        if tok == self.args.eos_id and not sampling.ignore_eos:
            return "stop"
        return "length" if n >= sampling.max_tokens else None

    def continued(self, prompt: list[int], sampling: SamplingParams) -> int:
        """The largest k such that the prompt ends with the reply's first k tokens (0: none)."""
        for k in range(min(len(prompt), 4 * len(self.output_ids)), 0, -1):
            if prompt[-k:] == [self.token(i, sampling) for i in range(k)]:
                return k
        return 0

    def fault(self, rid: str, pos: int) -> bool:
        """Apply ``--fail-at`` / ``--hang-at`` at output position ``pos``; True when the request gets no
        token here (failed: ``RequestFailed`` queued; or the worker hangs)."""
        if pos == self.args.hang_at:
            self.hung.set()
        if self.hung.is_set():
            return True
        if pos == self.args.fail_at:
            self.emit(RequestFailed(request_id=rid, worker_id=self.args.worker_id,
                                    error=f"injected failure at position {pos}", kind=self.args.fail_kind))
            return True
        return False

    async def register(self, gateway: int) -> None:
        a = self.args
        compat = KVCompat(model_id=a.model, dtype=a.dtype, block_size=a.block_size, num_layers=2,
                          num_kv_heads=1, head_dim=8, transfer_backend=a.transfer_backend)
        if a.total_kv_heads:  # rank 0's record of a tensor parallel worker (compat.kv_compat's fields)
            placement = rank_kv_heads(a.total_kv_heads, a.tensor_parallel_size)
            heads = placement[0][1]
            compat = msgspec.structs.replace(
                compat, num_kv_heads=heads, block_strides=(a.block_size * heads * 8, heads * 8, 8, 1),
                tp_size=a.tensor_parallel_size, total_kv_heads=a.total_kv_heads, rank_kv_heads=placement)
        await self.send(RegisterWorker(role=a.role, worker_id=a.worker_id, epoch=self.epoch, model=a.model,
                                       model_path=a.model_path, compat=compat, max_model_len=a.max_model_len,
                                       load=self.load()), gateway)

    async def heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.args.heartbeat_interval)
            if self.hung.is_set():
                return
            for gateway in range(len(self.socks)):
                await self.send(Heartbeat(worker_id=self.args.worker_id, epoch=self.epoch, load=self.load()),
                                gateway)

    def logprobs_of(self, gen: Generation, tok: int) -> tuple[float | None, list[TopLogprob] | None]:
        pos, n = gen.offset + gen.i, gen.sampling.logprobs
        return (None if n is None else fake_logprob(pos)), (fake_top(tok, pos, n) if n else None)

    async def prefill(self, gen: Generation) -> None:
        """Position 0 of ``gen`` after ``--prefill-delay``: a ``FirstToken``; then (colocated) the request
        joins the running batch."""
        wid = self.args.worker_id
        try:
            if self.fault(gen.rid, gen.offset):
                if self.hung.is_set():
                    await asyncio.Event().wait()  # stalled until aborted or killed
                await self.flush()
                return
            await asyncio.sleep(self.args.prefill_delay)
            tok = self.token(gen.offset, gen.sampling)
            finish = self.finish_of(gen.sampling, 1, tok)
            lp, top = self.logprobs_of(gen, tok)
            cached = min(self.args.cached_tokens, len(gen.prompt) - 1)
            self.emit(FirstToken(request_id=gen.rid, worker_id=wid, token_id=tok, logprob=lp,
                                 top_logprobs=top, num_cached_tokens=cached, finish_reason=finish))
            if finish is not None and self.args.role == "colocated":
                self.emit(RequestFinished(request_id=gen.rid, worker_id=wid, finish_reason=finish,
                                          num_prompt_tokens=len(gen.prompt), num_output_tokens=1))
            elif finish is None and self.args.role == "colocated":
                gen.i = 1
                self.running[gen.rid] = gen
                self.wake.set()
            await self.flush()
        finally:
            self.tasks.pop(gen.rid, None)
            if gen.rid not in self.running:
                self.release(gen.rid)

    async def step_loop(self) -> None:
        """The decode batch, in steps: every ``--token-delay`` s each running request gets its next token,
        and the step's messages go to the gateway in one ``OutputBatch`` (as a real worker's step)."""
        wid = self.args.worker_id
        while True:
            if not self.running or self.hung.is_set():
                self.wake.clear()
                await self.wake.wait()
                continue
            await asyncio.sleep(self.args.token_delay)
            for gen in list(self.running.values()):
                if self.fault(gen.rid, gen.offset + gen.i):
                    if self.hung.is_set():
                        break  # stalled: the batch keeps its requests until aborted or killed
                    self.end(gen.rid)
                    continue
                tok = self.token(gen.offset + gen.i, gen.sampling)
                finish = self.finish_of(gen.sampling, gen.i + 1, tok)
                lp, top = self.logprobs_of(gen, tok)
                self.emit(NextToken(request_id=gen.rid, worker_id=wid, token_id=tok, logprob=lp,
                                    top_logprobs=top))
                if finish is not None:
                    self.emit(RequestFinished(request_id=gen.rid, worker_id=wid, finish_reason=finish,
                                              num_prompt_tokens=len(gen.prompt), num_output_tokens=gen.i + 1))
                    self.end(gen.rid)
                else:
                    gen.i += 1
            await self.flush()

    def end(self, rid: str) -> None:
        """The request leaves the running batch; its blocks are freed."""
        self.running.pop(rid, None)
        self.release(rid)

    def release(self, rid: str) -> None:
        if rid not in self.tasks and rid not in self.running:
            self.origin.pop(rid, None)
        entry = self.reserved.pop(rid, None)
        if entry is not None:
            self.free_blocks += entry[1]

    def generation(self, rid: str, prompt: list[int], sampling: SamplingParams, i: int) -> Generation:
        return Generation(rid, prompt, sampling, self.continued(prompt, sampling), i)

    async def on_message(self, msg: Message, gateway: int = 0) -> None:
        self.record(msg, gateway)
        if isinstance(msg, PrefillRequest | ColocatedRequest | ReserveKV):
            self.origin[msg.request_id] = gateway
        if isinstance(msg, PrefillRequest | ColocatedRequest):
            gen = self.generation(msg.request_id, msg.prompt_token_ids, msg.sampling, 0)
            self.tasks[msg.request_id] = asyncio.create_task(self.prefill(gen))
        elif isinstance(msg, ReserveKV):
            need = math.ceil(len(msg.prompt_token_ids) / self.args.block_size) + 1
            self.free_blocks -= need
            self.reserved[msg.request_id] = (msg, need)
            if self.fault(msg.request_id, -1):
                if not self.hung.is_set():
                    self.release(msg.request_id)
            else:
                self.emit(KVReserved(request_id=msg.request_id, worker_id=self.args.worker_id,
                                     kv_handle=f"fake-handle:{msg.request_id}".encode()))
            await self.flush()
        elif isinstance(msg, DecodeRequest) and msg.request_id in self.reserved:
            res = self.reserved[msg.request_id][0]
            gen = self.generation(msg.request_id, res.prompt_token_ids, res.sampling, 1)
            self.running[msg.request_id] = gen
            self.wake.set()
        elif isinstance(msg, AbortRequest):
            task = self.tasks.pop(msg.request_id, None)
            if task is not None:
                task.cancel()
            self.end(msg.request_id)
        elif isinstance(msg, KVCanaryReserve) and not self.args.canary_wedged:
            await self.send(KVCanaryReserved(canary_id=msg.canary_id, worker_id=self.args.worker_id,
                                             kv_handle=f"fake-handle:{msg.canary_id}".encode()), gateway)
        elif isinstance(msg, KVCanarySend) and not self.args.canary_wedged:
            await asyncio.sleep(self.args.canary_seconds)
            await self.send(KVCanaryResult(canary_id=msg.canary_id, worker_id=self.args.worker_id, ok=True,
                                           num_bytes=self.args.canary_bytes,
                                           seconds=self.args.canary_seconds, transport="fake"), gateway)
        elif isinstance(msg, RegisterAck) and not msg.accepted:
            raise SystemExit(f"registration refused: {msg.reason}")
        elif isinstance(msg, RegisterAck) and len(self.socks) > 1:
            self.new_gateway_epoch(gateway, msg.gateway_epoch)
        elif isinstance(msg, ReRegister) and len(self.socks) > 1:
            await self.register(gateway)

    def new_gateway_epoch(self, gateway: int, epoch: int) -> None:
        """A gateway acknowledged a registration with ``epoch``: if it changed, the requests its earlier
        incarnation sent have nobody to stream to; drop them and free their blocks."""
        previous = self.gateway_epochs.get(gateway)
        self.gateway_epochs[gateway] = epoch
        if previous is None or previous == epoch:
            return
        for rid in [r for r, g in self.origin.items() if g == gateway]:
            task = self.tasks.pop(rid, None)
            if task is not None:
                task.cancel()
            self.end(rid)
            self.origin.pop(rid, None)

    async def run(self) -> None:
        for gateway in range(len(self.socks)):
            await self.register(gateway)
        loops = [asyncio.create_task(self.heartbeat_loop()), asyncio.create_task(self.step_loop())]
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        recv = asyncio.create_task(self.recv_loop())
        await asyncio.wait([asyncio.create_task(stop.wait()), recv], return_when=asyncio.FIRST_COMPLETED)
        for gateway in range(len(self.socks)):
            await self.send(WorkerShutdown(worker_id=self.args.worker_id, epoch=self.epoch), gateway)
        for task in (*loops, recv):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, SystemExit):
                await task
        await asyncio.sleep(0.05)
        for sock in self.socks:
            sock.close(linger=100)
        self.ctx.term()

    async def recv_loop(self) -> None:
        """Messages from every gateway, each handled with the index of the socket it came from."""
        poller = zmq.asyncio.Poller()
        for sock in self.socks:
            poller.register(sock, zmq.POLLIN)
        while True:
            for sock, _ in await poller.poll():
                await self.on_message(decode(await sock.recv()), self.socks.index(sock))  # type: ignore[arg-type]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--role", required=True, choices=["prefill", "decode", "colocated"])
    p.add_argument("--gateway-control", required=True, help="the gateway's control endpoint, or several "
                   "comma-separated (one DEALER each)")
    p.add_argument("--curve-keys", default="", help="the fleet's CURVE key dir (none: a plain socket)")
    p.add_argument("--worker-id", default=f"fake-{os.getpid()}")
    p.add_argument("--epoch", type=int, default=0)
    p.add_argument("--model", default="fake-model")
    p.add_argument("--model-path", default="")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="with --total-kv-heads")
    p.add_argument("--total-kv-heads", type=int, default=0, help="register a tensor parallel pairing record "
                   "of this many KV heads (0: a record of one rank holding one head)")
    p.add_argument("--transfer-backend", default="loopback")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--total-blocks", type=int, default=64)
    p.add_argument("--output-ids", default="42,43,44")
    p.add_argument("--eos-id", type=int, default=-1)
    p.add_argument("--prefill-delay", type=float, default=0.01)
    p.add_argument("--token-delay", type=float, default=0.005)
    p.add_argument("--heartbeat-interval", type=float, default=0.2)
    p.add_argument("--record", default="")
    p.add_argument("--fail-at", type=int, default=None, help="RequestFailed at this output position")
    p.add_argument("--fail-kind", default="worker", choices=["worker", "structured_output"],
                   help="RequestFailed.kind of --fail-at")
    p.add_argument("--hang-at", type=int, default=None, help="stall the worker at this output position")
    p.add_argument("--canary-bytes", type=int, default=1 << 20)
    p.add_argument("--canary-seconds", type=float, default=0.001)
    p.add_argument("--canary-wedged", type=int, default=0)
    p.add_argument("--cached-tokens", type=int, default=0, help="FirstToken.num_cached_tokens (at most "
                   "the prompt's length - 1)")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(FakeWorker(parse_args()).run())
