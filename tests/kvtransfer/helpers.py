"""Shared helpers for kvtransfer tests: random KV tensors and configs."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import zmq

from kvtransfer import TransferConfig
from kvtransfer.wakeup import Waker

LAYERS, BLOCKS, BS, HEADS, DIM = 4, 32, 4, 2, 8


def make_kv(seed: int | None, num_blocks: int = BLOCKS, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[LAYERS, 2, num_blocks, BS, HEADS, DIM]: random if seed is given, else zeros."""
    shape = (LAYERS, 2, num_blocks, BS, HEADS, DIM)
    if seed is None:
        return torch.zeros(shape, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def config(worker_id: str, backend: str, **kw: object) -> TransferConfig:
    return TransferConfig(worker_id=worker_id, model_id="test-model", backend=backend,
                          heartbeat_interval_s=0.1, peer_timeout_s=1.0, **kw)  # type: ignore[arg-type]


def assert_landed(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]) -> None:
    """Every layer's K and V of src blocks arrived bit-exact in the matching dst blocks."""
    a = src[:, :, src_ids].view(torch.uint8)
    b = dst[:, :, dst_ids].view(torch.uint8)
    assert torch.equal(a, b)


def sender_with(cfg: TransferConfig, kv: torch.Tensor, transport: Any = None, **seams: Any) -> Any:
    """A started sender over `transport` (default: loopback) with the constructor's seams (`events`: an
    EventPool, e.g. of fake CUDA events; `rate`: a lookahead.WriteRate)."""
    from kvtransfer.sender import SenderEndpoint
    from kvtransfer.transports.loopback import LoopbackSendTransport

    transport = transport if transport is not None else LoopbackSendTransport()
    return SenderEndpoint(cfg, kv, transport, **seams).start()


def release_both(tx: object, rx: object, rid: str, wait: float = 10.0, leaks: bool = False) -> None:
    """Release a finished request on both sides once each may forget it (the receiver when releasable;
    the sender when terminal — it learns DONE from the receiver's Done message, which can come after its
    last write completed — with nothing in flight and its Stopped fence sent); with `leaks`, then check
    that both sides hold nothing."""
    assert rx.wait_until(lambda: rx.releasable(rid), wait)  # type: ignore[attr-defined]
    rx.release(rid)  # type: ignore[attr-defined]
    assert tx.wait_until(lambda: sender_settled(tx, rid), wait)  # type: ignore[attr-defined]
    tx.release(rid)  # type: ignore[attr-defined]
    if leaks:
        tx.check_no_leaks()  # type: ignore[attr-defined]
        rx.check_no_leaks()  # type: ignore[attr-defined]


def sender_settled(tx: Any, rid: str) -> bool:
    """The sender may forget `rid`: terminal, no request-layer in flight, no Stopped/Withdraw to send."""
    snap = tx.snapshot(rid)
    return bool(snap.status.is_terminal and snap.inflight == 0 and not snap.fence_pending)


def patient_config(worker_id: str, backend: str = "loopback", **kw: object) -> TransferConfig:
    """``config`` with peer_timeout_s 30 s: this side never gives up on its peer during a test's stall."""
    return dataclasses.replace(config(worker_id, backend, **kw), peer_timeout_s=30.0)


def stop_child(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP the child process `pid` and return once all of its threads are stopped. os.kill only
    queues the signal: each thread stops when it next passes the kernel's signal check, and on a loaded
    host some go on running for milliseconds after os.kill returned (long enough to take part in a KV
    write and acknowledge it). The parent learns of the whole group's stop from waitpid(WUNTRACED).
    Raises AssertionError if the child exits instead, or is not stopped within `timeout` seconds."""
    import os
    import signal

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        got, status = os.waitpid(pid, os.WUNTRACED | os.WNOHANG)
        if got == pid:
            assert os.WIFSTOPPED(status), f"process {pid} ended while being stopped (status {status})"
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped {timeout}s after SIGSTOP"
        time.sleep(0.001)


def stall_once(obj: object, name: str, seconds: float) -> list[float]:
    """Make ``obj.name`` sleep ``seconds`` on its first call; returns a list that receives the stall's
    end time (``time.monotonic()``) once it happened."""
    orig = getattr(obj, name)
    done: list[float] = []

    def stalled(*args: Any, **kwargs: Any) -> Any:
        if not done:
            time.sleep(seconds)
            done.append(time.monotonic())
        return orig(*args, **kwargs)
    setattr(obj, name, stalled)
    return done


@contextlib.contextmanager
def waker_and_pair(name: str) -> Iterator[tuple[Waker, zmq.Socket, zmq.Socket]]:
    """A ``Waker`` and a connected inproc PAIR ``(a, b)`` (``a`` sends, a loop naps on ``b``) for the
    wakeup.nap tests; all closed afterwards."""
    w = Waker()
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind(f"inproc://{name}")
    b.connect(f"inproc://{name}")
    try:
        yield w, a, b
    finally:
        a.close(0)
        b.close(0)
        ctx.term()
        w.close()


def loop_cost(endpoint: Any, count: Callable[[], int], window: float) -> tuple[float, int]:
    """(the endpoint's loop thread's CPU seconds / wall seconds, growth of ``count()``) over ``window``
    seconds: how hard an endpoint loop works while it should only wait (``count``: its steps, or its
    transport looks)."""
    thread_id = endpoint.stats().loop.thread_id
    assert thread_id is not None
    clock = time.pthread_getcpuclockid(thread_id)
    c0, n0, t0 = time.clock_gettime(clock), count(), time.monotonic()
    time.sleep(window)
    return (time.clock_gettime(clock) - c0) / (time.monotonic() - t0), count() - n0


def need_nixl() -> None:
    """Skip the calling test module unless nixl_cu13 imports; quiet UCX and keep its TCP on loopback
    (the CI box has no other network; setdefault: an environment that sets them wins)."""
    import os

    import pytest

    pytest.importorskip("nixl_cu13")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")


@contextlib.contextmanager
def endpoint_pair(backend: str, seed: int, sender: TransferConfig | None = None,
                  receiver: TransferConfig | None = None
                  ) -> Iterator[tuple[Any, Any, torch.Tensor, torch.Tensor]]:
    """(sender, receiver, src, dst) over `backend` with the given configs (default: the test config,
    "p0" and "d0"): src random from `seed`, dst zeros (BLOCKS blocks each); both closed on exit."""
    from kvtransfer import get_transfer_backend

    factory = get_transfer_backend(backend)
    src, dst = make_kv(seed), make_kv(None)
    tx = factory.sender(sender or config("p0", backend), src)
    rx = factory.receiver(receiver or config("d0", backend), dst)
    try:
        yield tx, rx, src, dst
    finally:
        tx.close()
        rx.close()


class FakeSender:
    """A scripted KV sender: a zmq DEALER with its own identity that speaks the control plane by hand
    (Hello, Begin, any message) to a real receiver, for what a real sender never sends (a bad notice, a
    forged Withdraw or Stopped). Close it after use."""

    def __init__(self, address: str, sender_id: str = "fake-p", epoch: int = 77,
                 kv_like: torch.Tensor | None = None, model: str = "test-model") -> None:
        from kvtransfer.compat import kv_compat
        from kvtransfer.staging import layout_of

        self.sender_id, self.epoch = sender_id, epoch
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, f"{sender_id}:{epoch}".encode())
        self.sock.connect(address)
        kv = make_kv(None) if kv_like is None else kv_like
        self.info = kv_compat(model, "loopback", layout_of(kv))
        self.got: list[Any] = []

    def send(self, msg: Any) -> None:
        from kvtransfer import wire

        self.sock.send(wire.encode(msg))

    def request(self, msg: Any, timeout: float = 5.0) -> Any:
        """Send ``msg`` and return the first reply that is not a KeepAlive."""
        from kvtransfer import wire

        self.send(msg)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                reply = wire.decode(self.sock.recv())
                self.got.append(reply)
                if not isinstance(reply, wire.KeepAlive):
                    return reply
        raise AssertionError(f"no reply to {msg!r}")

    def hello(self) -> Any:
        """Hello (loopback transport metadata); returns the HelloReply."""
        from kvtransfer import wire

        return self.request(wire.Hello(self.sender_id, self.epoch, self.info, b"fake-loopback"))

    def claim(self, request_id: str, receiver_epoch: int) -> None:
        """Hello + Begin of ``request_id``; raises AssertionError if the receiver refuses either."""
        from kvtransfer import wire

        reply = self.hello()
        assert isinstance(reply, wire.HelloReply) and not reply.mismatches, reply
        begun = self.request(wire.Begin(request_id, receiver_epoch))
        assert isinstance(begun, wire.BeginReply) and begun.ok, begun

    def drain(self) -> list[Any]:
        """Every message received so far (replies included), after reading what is waiting."""
        from kvtransfer import wire

        while self.sock.poll(0):
            self.got.append(wire.decode(self.sock.recv()))
        return self.got

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class FakeReceiver:
    """A scripted KV receiver: a zmq ROUTER that answers a sender's Hello (no mismatch) and Begin (ok)
    and can send it any message, for what a real receiver never sends. Its `address` goes into a
    KVHandle or ``connect``. Call `serve` to answer what arrived; close it after use."""

    def __init__(self, epoch: int = 4242) -> None:
        self.epoch = epoch
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.peer: bytes | None = None
        self.got: list[Any] = []

    def serve(self, timeout: float = 5.0, until: Callable[[Any], bool] | None = None) -> None:
        """Answer Hello and Begin messages as they come, and send a KeepAlive every 0.1 s once a sender
        spoke, up to ``timeout`` s or until ``until(msg)`` holds for a message."""
        from kvtransfer import wire

        deadline = time.monotonic() + timeout
        beat = 0.0
        while time.monotonic() < deadline:
            if self.peer is not None and time.monotonic() > beat:
                self.send(wire.KeepAlive(self.epoch))
                beat = time.monotonic() + 0.1
            if not self.sock.poll(20):
                continue
            ident, data = self.sock.recv_multipart()
            msg = wire.decode(data)
            self.got.append(msg)
            self.peer = ident
            if isinstance(msg, wire.Hello):
                self.send(wire.HelloReply("fake-d", self.epoch, [], b"fake-loopback"))
            elif isinstance(msg, wire.Begin):
                self.send(wire.BeginReply(msg.request_id, True))
            if until is not None and until(msg):
                return

    def send(self, msg: Any) -> None:
        """Send ``msg`` to the sender that last spoke."""
        from kvtransfer import wire

        assert self.peer is not None
        self.sock.send_multipart([self.peer, wire.encode(msg)])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
