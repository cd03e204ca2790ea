"""Shared pieces of the worker unit tests: a tiny random-weight Llama, worker builders over the loopback
KV transport, a synchronous driver that captures emitted messages, scripted fake KV peers (to hold a
transfer in flight deterministically) and the end-of-test leak check."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import zmq

from decode_worker.worker import DecodeWorker
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from kvtransfer import KVHandle, TransferConfig, get_transfer_backend
from kvtransfer import wire as km
from kvtransfer.staging import layout_of
from kvtransfer.transports.loopback import LoopbackRecvTransport
from prefill_worker.worker import PrefillWorker
from protocol.settings import WorkerSettings
from tests.engine.test_loader import tiny_config
from workers.colocated import ColocatedWorker
from workers.loop import WorkerLoop
from workers.setup import encode_handle

BLOCK_SIZE = 4
VOCAB = 256  # tiny_config's vocabulary; eos id 2
NO_GATEWAY = "inproc://pdserve-workers-test-no-gateway"  # a DEALER may connect to nothing


def write_model_dir(path: Path) -> Path:
    """A config-only Llama directory (2 layers, 2 KV heads, head_dim 16) loaded with dummy weights."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(tiny_config("LlamaForCausalLM", vocab=VOCAB).to_json_string())
    return path


def make_core(model_dir: Path, *, prefill_only: bool = False, num_blocks: int = 32,
              max_num_batched_tokens: int = 64, max_num_seqs: int = 8,
              block_size: int = BLOCK_SIZE, max_model_len: int | None = None) -> EngineCore:
    """fp32 CPU engine with dummy weights (seed 0, so every core has the same weights)."""
    return EngineCore(EngineConfig(
        ModelConfig(str(model_dir), load_format="dummy", dtype="float32", device="cpu",
                    attention_backend="torch", max_model_len=max_model_len),
        CacheConfig(block_size=block_size, num_blocks=num_blocks),
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)),
        prefill_only=prefill_only)


def transfer_config(worker_id: str, timeout_s: float = 30.0) -> TransferConfig:
    return TransferConfig(worker_id=worker_id, model_id="tiny", backend="loopback", timeout_s=timeout_s,
                          heartbeat_interval_s=0.1, peer_timeout_s=5.0)


def settings(role: str, worker_id: str, model_dir: Path, gateway_control: str = NO_GATEWAY) -> WorkerSettings:
    return WorkerSettings(role=role, model=str(model_dir), worker_id=worker_id, transfer_backend="loopback",
                          gateway_control=gateway_control, block_size=BLOCK_SIZE,
                          insecure_control_plane=True)


def prefill_worker(model_dir: Path, gateway_control: str = NO_GATEWAY, **core_kw: Any) -> PrefillWorker:
    core = make_core(model_dir, prefill_only=True, **core_kw)
    sender = get_transfer_backend("loopback").sender(transfer_config("p0"), core.runner.kv_cache.kv_buffer)
    return PrefillWorker(settings("prefill", "p0", model_dir, gateway_control), core, str(model_dir),
                         sender=sender)


def decode_worker(model_dir: Path, timeout_s: float = 30.0, gateway_control: str = NO_GATEWAY,
                  **core_kw: Any) -> DecodeWorker:
    core = make_core(model_dir, **core_kw)
    receiver = get_transfer_backend("loopback").receiver(transfer_config("d0", timeout_s),
                                                         core.runner.kv_cache.kv_buffer)
    return DecodeWorker(settings("decode", "d0", model_dir, gateway_control), core, str(model_dir),
                        receiver=receiver)


def colocated_worker(model_dir: Path, gateway_control: str = NO_GATEWAY, **core_kw: Any) -> ColocatedWorker:
    return ColocatedWorker(settings("colocated", "c0", model_dir, gateway_control),
                           make_core(model_dir, **core_kw), str(model_dir))


def close(worker: WorkerLoop) -> None:
    """What ``WorkerLoop.run`` does on the way out, minus the gateway."""
    worker.close()
    worker.sessions.gateways.close()


def wire(max_tokens: int = 1, **kw: object) -> SamplingParams:
    """Greedy sampling params for a request message (temperature 0) unless overridden."""
    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def run(worker: WorkerLoop, *msgs: Any) -> list[Any]:
    """Deliver ``msgs``, run one phase (``run_once``), return what the worker emitted."""
    for msg in msgs:
        worker.deliver(msg)
    worker.run_once()
    return worker.take_outbox()


def pump(workers: Iterable[WorkerLoop], until: Callable[[], bool], timeout: float = 10.0,
         sink: list[Any] | None = None) -> list[Any]:
    """Run phases of every worker until ``until()`` holds; returns (and appends to ``sink``) the
    emitted messages. Raises AssertionError after ``timeout`` seconds."""
    out: list[Any] = [] if sink is None else sink
    ws = list(workers)
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"condition not reached in {timeout} s"
        ran = [w.run_once() for w in ws]
        for w in ws:
            out.extend(w.take_outbox())
        if not any(ran):
            time.sleep(0.002)
    return out


def of_type(msgs: Iterable[Any], cls: type, rid: str | None = None) -> list[Any]:
    return [m for m in msgs if isinstance(m, cls) and (rid is None or getattr(m, "request_id", None) == rid)]


def assert_clean(*workers: WorkerLoop, timeout: float = 10.0) -> None:
    """Leak check: wait (polling) until no transfer is pending, then every KV block is free, the
    scheduler holds nothing, the transfer endpoint tracks nothing and the worker's tables are empty."""
    def idle() -> bool:
        return not any(w.busy() for w in workers)
    pump(workers, idle, timeout)
    for w in workers:
        w.core.block_manager.check_no_leaks()
        assert w.core.block_manager.num_free_blocks == w.core.block_manager.num_blocks
        assert not w.core.scheduler.has_unfinished()
        tables = {name: getattr(w, name) for name in ("seqs", "kv_handles", "sending", "pending", "in_flight",
                                                    "first_tokens", "fenced", "_aborted", "_hook_errors",
                                                    "canaries")
                  if hasattr(w, name)}
        assert not any(tables.values()), f"{type(w).__name__} still holds {tables}"
        for attr in ("sender", "receiver"):
            if hasattr(w, attr):
                getattr(w, attr).check_no_leaks()


class FakeReceiver:
    """A scripted KV receiver for prefill tests: answers Hello and Begin, takes the loopback writes into
    its own tensor, and sends Done / Fail only when the test says so (so a transfer stays in flight)."""

    def __init__(self, like: torch.Tensor) -> None:
        self.kv = torch.zeros_like(like)
        self.layout = layout_of(self.kv)
        self.transport = LoopbackRecvTransport(self.kv)
        self.epoch = 4242
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.peer: bytes | None = None
        self.got: list[km.Message] = []
        self.layers: dict[str, set[int]] = {}

    def handle(self, request_id: str, block_ids: list[int]) -> bytes:
        """Wire form of a ``KVHandle`` naming this receiver."""
        return encode_handle(KVHandle(worker_id="fake-d", epoch=self.epoch, request_id=request_id,
                                      block_ids=tuple(block_ids), layout=self.layout, address=self.address,
                                      backend="loopback", timeout_s=30.0))

    def serve(self) -> None:
        """Answer what arrived (Hello, Begin), record every message and landed layer; send a heartbeat."""
        while self.sock.poll(0):
            ident, data = self.sock.recv_multipart()
            msg = km.decode(data)
            self.got.append(msg)
            self.peer = ident
            if isinstance(msg, km.Hello):
                self.transport.add_peer(ident.hex(), msg.transport)  # its notices are read only then
                self._send(km.HelloReply("fake-d", self.epoch, [], self.transport.metadata()))
            elif isinstance(msg, km.Begin):
                self._send(km.BeginReply(msg.request_id, True))
        for _, raw in self.transport.poll()[0]:
            for n in km.decode_notices(raw):  # one write may carry several layers (LayerNotices)
                self.layers.setdefault(n.request_id, set()).add(n.layer)
        if self.peer is not None:
            self._send(km.KeepAlive(self.epoch))

    def got_type(self, cls: type) -> list:
        return [m for m in self.got if isinstance(m, cls)]

    def _send(self, msg: km.Message) -> None:
        assert self.peer is not None
        self.sock.send_multipart([self.peer, km.encode(msg)])

    def send(self, msg: km.Message) -> None:
        """Send ``msg`` (Done, Fail, Abort) to the sender that last spoke."""
        self._send(msg)

    def close(self) -> None:
        self.transport.close()
        self.sock.close(0)
        self.ctx.term()
