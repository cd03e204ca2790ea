"""Producer slowdown caused by the KV sender's loop thread (GIL hand-overs per layer).

A producer (this process's main thread, standing in for the prefill worker's forward thread) does a
fixed amount of pure-Python arithmetic per "layer" (`--work-us`), then a GIL-releasing call
(`select.select([], [], [], 0)`, ~1 µs, standing in for the `torch.cuda.Event.record` of send_layer
on a GPU; `time.sleep(0)` takes ~80 µs on the 2-core development VM), then `send_layer` for one request being
transferred; 32 layers per round. The same producer loop
without any sender (rounds before the sender is created and after it is closed, same run) is the
baseline. Printed: the producer's slowdown (median round time with the sender / without), the
transfer's end-to-end time (first send_layer → the sender sees DONE) and its tail (last send_layer →
DONE), and the sender loop thread's CPU time per round (its per-thread CPU clock).

On CPU a NIXL DRAM write (or a loopback one) completes inside the call that posts it and send_layer
records no CUDA event, so nothing would stay in flight. As on a GPU (which runs behind the thread that
launches its work), `--event-latency-us` gives each send_layer a fake event that completes that long
after send_layer (the layer is written only then), and `--write-latency-us` makes each write complete
only that long after its post: what the loop waits for.

    .venv/bin/python -m bench.kvtransfer.gil [--backend nixl|loopback] [--tokens 64]
        [--work-us 200] [--event-latency-us 1000] [--write-latency-us 100] [--depth 4] [--rounds 30]
        [--busy-wait-us N] [--no-pin]

The receiver lives in a spawned process (nixl) or, for loopback (used when nixl is absent), in this
one. Runs against whichever `kvtransfer` is importable (PYTHONPATH), so before/after figures come from
two checkouts (--busy-wait-us needs TransferConfig.busy_wait_s).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import multiprocessing as mp
import os
import platform
import select
import statistics
import sys
import time
from typing import Any

import msgspec
import torch

from bench.kvtransfer.transfer import BS, LAYERS, _finish, _kv, receiver_main
from kvtransfer.transports.base import SendTransport

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("UCX_NET_DEVICES", "lo")


class DelayedTransport(SendTransport):
    """Wraps a sender transport: a write counts as complete only once the inner write completed and
    `latency_s` seconds passed since its post. Handles are (inner handle, post time s)."""

    def __init__(self, inner: SendTransport, latency_s: float) -> None:
        self.inner, self.latency_s = inner, latency_s
        self.one_sided, self.write_per_request = inner.one_sided, inner.write_per_request

    def metadata(self) -> bytes:
        return self.inner.metadata()

    def set_staging(self, staging: object) -> None:
        self.inner.set_staging(staging)

    def register_kv(self, kv_buffer: object) -> None:
        self.inner.register_kv(kv_buffer)

    def add_peer(self, peer: str, remote: bytes) -> None:
        self.inner.add_peer(peer, remote)

    def remove_peer(self, peer: str) -> None:
        self.inner.remove_peer(peer)

    def post(self, peer: str, pieces: list[tuple[int, int, int, int]], notice: bytes, tag: int) -> object:
        return (self.inner.post(peer, pieces, notice, tag), time.perf_counter())

    def prepare(self, peer: str, pieces: list[tuple[int, int, int, int]]) -> object:
        return self.inner.prepare(peer, pieces)

    def prepare_layers(self, peer: str, layers: list[list[tuple[int, int, int, int]]]) -> list[object]:
        return self.inner.prepare_layers(peer, layers)

    def release_prepared(self, parts: list[object]) -> None:
        self.inner.release_prepared(parts)

    def prepared_count(self) -> int:
        return self.inner.prepared_count()

    def post_prepared(self, peer: str, parts: list[object], notice: bytes, tag: int) -> object:
        return (self.inner.post_prepared(peer, parts, notice, tag), time.perf_counter())

    def test(self, handle: object) -> bool:
        inner: object = handle[0]  # type: ignore[index]
        posted: float = handle[1]  # type: ignore[index]
        return time.perf_counter() - posted >= self.latency_s and self.inner.test(inner)

    def cancel(self, handle: object) -> None:
        self.inner.cancel(handle[0])  # type: ignore[index]

    def progress(self) -> None:
        self.inner.progress()

    def close(self) -> None:
        self.inner.close()


class LateEvent:
    """Stands for send_layer's torch.cuda.Event: complete `latency_s` seconds after record()."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s, self.at = latency_s, 0.0

    def record(self, stream: object) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return time.perf_counter() - self.at >= self.latency_s


def _work(n: int) -> int:
    acc = 0
    for i in range(n):
        acc = (acc * 31 + i) % 1000003
    return acc


def _calibrate(work_us: float) -> int:
    """Iterations of _work taking about work_us µs (best of 5)."""
    n = 20000
    best = min(_timed(lambda: _work(n)) for _ in range(5))
    return max(1, int(n * work_us * 1e-6 / best))


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _produce(layers: int, n_iter: int, send: Any = None) -> tuple[float, float, float, float, float]:
    """The producer loop; returns (start, first send_layer, end) perf_counter seconds, the producer
    thread's CPU seconds and its seconds in the per-layer hand-off (GIL-releasing call + send_layer:
    what the H200 trace saw as 36.5 µs per send_layer)."""
    cpu = time.thread_time()
    t0 = time.perf_counter()
    first = t0
    handoff = 0.0
    for layer in range(layers):
        _work(n_iter)
        t = time.perf_counter()
        if layer == 0:
            first = t
        select.select([], [], [], 0)  # releases the GIL, as torch.cuda.Event.record does
        if send is not None:
            send(layer)
        handoff += time.perf_counter() - t
    return t0, first, time.perf_counter(), time.thread_time() - cpu, handoff


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="", choices=["", "nixl", "loopback"],
                   help="default: nixl if importable")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--work-us", type=float, default=200.0)
    p.add_argument("--event-latency-us", type=float, default=1000.0)
    p.add_argument("--write-latency-us", type=float, default=100.0)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--busy-wait-us", type=float, default=None)
    p.add_argument("--no-pin", action="store_true",
                   help="leave CPU affinity alone (default: this process on CPU 0, the receiver on CPU 1)")
    return p.parse_args()


def _pick_backend(name: str) -> str:
    if name:
        return name
    try:
        import nixl_cu13  # noqa: F401
    except ImportError:
        return "loopback"
    return "nixl"


def _sender(args: argparse.Namespace, backend: str, src: torch.Tensor) -> Any:
    from kvtransfer import TransferConfig
    from kvtransfer.sender import SenderEndpoint

    extra = {} if args.busy_wait_us is None else {"busy_wait_s": args.busy_wait_us * 1e-6}
    if args.busy_wait_us is not None and args.busy_wait_us < 5:  # fine_wait_s (5 us) must not exceed it
        extra["fine_wait_s"] = args.busy_wait_us * 1e-6
    config = TransferConfig(worker_id="gil-p", model_id="llama-3-8b-shape", backend=backend, timeout_s=120,
                            max_inflight_layers=args.depth, **extra)  # type: ignore[arg-type]
    inner: SendTransport
    if backend == "nixl":
        from kvtransfer.transports.nixl import NixlSendTransport
        inner = NixlSendTransport(f"gil-p-send-{os.getpid()}")
    else:
        from kvtransfer.transports.loopback import LoopbackSendTransport
        inner = LoopbackSendTransport()
    events = None
    if args.event_latency_us > 0:  # as the sender does for a CUDA kv_buffer, with fake events
        from kvtransfer.events import EventPool
        events = EventPool(0, lambda: LateEvent(args.event_latency_us * 1e-6), lambda device: None)
    transport = DelayedTransport(inner, args.write_latency_us * 1e-6)
    return SenderEndpoint(config, src, transport, events=events).start()


class _LocalConn:
    """bench/kvtransfer/transfer.py's receiver commands (expect, wait), answered by a receiver in this
    process."""

    def __init__(self, rx: Any) -> None:
        self.rx = rx
        self._out: Any = None

    def send(self, cmd: tuple[Any, ...]) -> None:
        if cmd[0] == "expect":
            self._out = msgspec.msgpack.encode(self.rx.expect(cmd[1], cmd[2]))
        elif cmd[0] == "wait":
            status = self.rx.wait(cmd[1], 120)  # answered as transfer.receiver_main: (status, landed at)
            self._out = (status.name if status.name == "DONE" else f"{status.name}: {self.rx.reason(cmd[1])}",
                         self.rx.ended_at(cmd[1]))
            if status.name == "DONE":
                self.rx.release(cmd[1])

    def recv(self) -> Any:
        return self._out


def _rounds(args: argparse.Namespace, tx: Any, conn: Any, n_iter: int) -> dict[str, list[float]]:
    """`args.rounds` transfers (after one warm-up): producer seconds, e2e and tail seconds, loop CPU s."""
    from kvtransfer import KVHandle, TransferStatus

    n = args.tokens // BS
    clock = time.pthread_getcpuclockid(tx.stats().loop.thread_id)
    out: dict[str, list[float]] = {k: [] for k in ("producer", "e2e", "tail", "loop_cpu", "producer_cpu",
                                                    "steps", "handoff")}
    for i in range(args.rounds + 1):
        rid = f"g{i}"
        conn.send(("expect", rid, list(range(n))))
        handle = msgspec.msgpack.decode(conn.recv(), type=KVHandle)
        tx.add_request(handle, list(range(n)))
        assert tx.wait_until(lambda rid=rid: tx.snapshot(rid).answered, 30), "no Begin answer"
        cpu0, steps0 = time.clock_gettime(clock), tx.stats().loop.steps
        send = functools.partial(tx.send_layer, rid)
        t0, first, end, pcpu, hand = _produce(LAYERS, n_iter, send)
        cpu, nsteps = time.clock_gettime(clock) - cpu0, tx.stats().loop.steps - steps0
        status = tx.wait(rid, 120)
        done = time.perf_counter()
        _finish(tx, conn, rid, status, "direct", TransferStatus.DONE)
        if i:
            for key, v in (("producer", end - t0), ("e2e", done - first), ("tail", done - end),
                           ("loop_cpu", cpu), ("producer_cpu", pcpu), ("steps", nsteps), ("handoff", hand)):
                out[key].append(v)
    return out


def _baseline(rounds: int, n_iter: int) -> dict[str, list[float]]:
    """`rounds` producer loops without a sender: wall, producer CPU and hand-off seconds of each."""
    out: dict[str, list[float]] = {"producer": [], "producer_cpu": [], "handoff": []}
    for _ in range(rounds):
        t0, _, end, cpu, hand = _produce(LAYERS, n_iter)
        for key, v in (("producer", end - t0), ("producer_cpu", cpu), ("handoff", hand)):
            out[key].append(v)
    return out


def main() -> int:
    args = _args()
    backend = _pick_backend(args.backend)
    n = args.tokens // BS
    n_iter = _calibrate(args.work_us)
    proc: Any = None
    if backend == "nixl":
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=receiver_main, args=(child, backend, n, "cpu", False, 2.0),
                           daemon=True)
        proc.start()
        conn.recv()
        if not args.no_pin and len(os.sched_getaffinity(0)) > 1:  # the receiver's busy poll (while
            cpus = sorted(os.sched_getaffinity(0))  # TRANSFERRING) must not take the producer's core
            os.sched_setaffinity(proc.pid, {cpus[1]})
            os.sched_setaffinity(0, {cpus[0]})  # this thread; the sender's threads, started later, inherit
    else:
        from kvtransfer import TransferConfig, get_transfer_backend
        rx = get_transfer_backend("loopback").receiver(
            TransferConfig(worker_id="gil-d", model_id="llama-3-8b-shape", backend="loopback"), _kv(n, "cpu"))
        conn = _LocalConn(rx)  # type: ignore[assignment]
    base = _baseline(args.rounds, n_iter)
    tx = _sender(args, backend, torch.randn(LAYERS, 2, n, BS, 8, 128).to(torch.bfloat16))
    try:
        got = _rounds(args, tx, conn, n_iter)
    finally:
        tx.close()
    for key, more in _baseline(args.rounds, n_iter).items():
        base[key] += more
    if proc is not None:
        conn.send(("close",))
        conn.recv()
        proc.join(30)
    else:
        rx.close()
    _report(args, backend, base, got)
    return 0


def _report(args: argparse.Namespace, backend: str, base: dict[str, list[float]],
            got: dict[str, list[float]]) -> None:
    med = statistics.median
    import kvtransfer
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} "
          f"CPUs, python {sys.version.split()[0]}, kvtransfer from {os.path.dirname(kvtransfer.__file__)}")
    print(f"# backend {backend}, {args.tokens} tokens, {LAYERS} layers, work {args.work_us:.0f} us/layer, "
          f"event latency {args.event_latency_us:.0f} us, write latency {args.write_latency_us:.0f} us, "
          f"depth {args.depth}, rounds {args.rounds}, "
          f"busy_wait_us {args.busy_wait_us}, pinned {not args.no_pin}")
    b, g = med(base["producer"]), med(got["producer"])
    print(f"producer without sender: {b * 1e3:.2f} ms/round ({b / LAYERS * 1e6:.0f} us/layer), "
          f"with sender: {g * 1e3:.2f} ms/round")
    print(f"slowdown (median with / median without): {g / b:.3f}  "
          f"[min/min {min(got['producer']) / min(base['producer']):.3f}]")
    print(f"hand-off per layer (GIL-releasing call + send_layer): {med(got['handoff']) / LAYERS * 1e6:.1f} "
          "us "
          f"with sender, {med(base['handoff']) / LAYERS * 1e6:.1f} us without (the call alone)")
    print(f"producer thread CPU: {med(base['producer_cpu']) * 1e3:.2f} ms/round without sender, "
          f"{med(got['producer_cpu']) * 1e3:.2f} with (the rest of its wall time: waiting for the GIL or "
          "a core)")
    print(f"transfer e2e (first send_layer -> DONE): {med(got['e2e']) * 1e3:.2f} ms, "
          f"tail (last send_layer -> DONE): {med(got['tail']) * 1e3:.2f} ms")
    print(f"sender loop CPU during the producer loop: {med(got['loop_cpu']) * 1e3:.2f} ms/round "
          f"({med(got['loop_cpu']) / g * 100:.0f} % of its wall time), {med(got['steps']):.0f} loop steps")


if __name__ == "__main__":
    raise SystemExit(main())
