"""nixl and ucx between real processes (multiprocessing spawn) on 127.0.0.1: the parent is the decode
side (receiver), a spawned child the prefill side (sender). The tests that leave their sender as they
found it (every request released, no leak, nothing killed or dropped) share one sender child per
backend (``shared_child``), each with a receiver of its own at a new address, as a prefill worker
meets a restarted decode worker; the others spawn their own."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from collections.abc import Iterator

import msgspec
import pytest

from kvtransfer import TransferStatus, get_transfer_backend
from tests.kvtransfer.helpers import LAYERS, assert_landed, config, make_kv, stop_child
from tests.kvtransfer.peer import sender_main

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
S = TransferStatus
WAIT = 10.0
SEED = 7
BACKENDS = ("nixl", "ucx")


class Child:
    """The sender process and its command pipe."""

    def __init__(self, backend: str, worker_id: str = "p0", *, wait: bool = True,
                 **kv_kwargs: object) -> None:
        """Spawn the sender; with ``wait=False`` return at once (``ready`` waits for it), so that other
        work (another child's start, a deadline) overlaps its start-up."""
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=sender_main, args=(child_conn, backend, SEED, worker_id, kv_kwargs),
                                daemon=True)
        self.proc.start()
        self.started = False
        if wait:
            self.ready()

    def ready(self) -> None:
        """Wait for the spawned sender to have made its sender (60 s deadline); at once if it has."""
        if not self.started:
            assert self.conn.poll(60), "sender process did not start"
            assert self.conn.recv() == "ready"
            self.started = True

    def __call__(self, *cmd: object, timeout: float = WAIT + 5) -> object:
        self.conn.send(cmd)
        assert self.conn.poll(timeout), f"sender process did not answer {cmd[0]}"
        return self.conn.recv()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            self.ready()  # a child started without waiting first answers "ready"
            self("close")
            self.proc.join(10)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def senders() -> Iterator[dict[str, Child]]:
    """The shared sender child of each backend (spawned by ``shared_child``: every backend's at once at
    its first use, so that their start-ups overlap), closed after the module."""
    children: dict[str, Child] = {}
    yield children
    for child in children.values():
        child.close()


@pytest.fixture
def shared_child(backend: str, senders: dict[str, Child]) -> Iterator[Child]:
    """``backend``'s shared sender child (a new one if the last died); after the test it must hold no
    request and nothing leaked, so the next test finds it as a fresh one (else it is killed, and the
    next test spawns another)."""
    if not senders:
        senders.update({name: Child(name, wait=False) for name in BACKENDS})
    if backend not in senders or not senders[backend].proc.is_alive():
        senders[backend] = Child(backend)
    child = senders[backend]
    child.ready()
    yield child
    leaks = child("leaks") if child.proc.is_alive() else "the sender process died"
    if leaks is not None:
        child.kill()
        del senders[backend]
    assert leaks is None, leaks


@pytest.fixture
def rx(backend):
    dst = make_kv(None)
    cfg = config("d0", backend, checksum=True, timeout_s=WAIT)
    receiver = get_transfer_backend(backend).receiver(cfg, dst)
    yield receiver
    receiver.close()


def add_in_child(child, rx, rid, dst_ids, src_ids, timeout_s=None):
    handle = rx.expect(rid, dst_ids, timeout_s=timeout_s)
    assert child("add", msgspec.msgpack.encode(handle), src_ids) is None


def send_layerwise(child: Child, rx, reqs: dict[str, tuple[list[int], list[int]]]) -> None:
    """Add every request (id → (source ids, destination ids)) in the sender child, send their layers
    interleaved layer by layer, and check each lands bit-exact and is released on both sides."""
    for rid, (src_ids, dst_ids) in reqs.items():
        add_in_child(child, rx, rid, dst_ids, src_ids)
    for layer in range(LAYERS):
        for rid in reqs:
            assert child("layers", rid, [layer]) is None
    for rid, (src_ids, dst_ids) in reqs.items():
        assert rx.wait(rid, WAIT) is S.DONE, rx.reason(rid)
        assert child("wait", rid, WAIT) == "DONE"
        assert_landed(make_kv(SEED), src_ids, rx.kv_buffer, dst_ids)
        release_in_both(child, rx, rid)


def release_in_both(child, rx, rid):
    assert rx.wait_until(lambda: rx.releasable(rid), WAIT)
    rx.release(rid)
    assert child("wait", rid, WAIT) in ("DONE", "FAILED", "ABORTED")
    assert child("release", rid) is None


def test_concurrent_layerwise_bit_exact(rx, shared_child):
    child = shared_child
    rng = random.Random(1)
    free = list(range(20))  # a, b: shuffled blocks below 20; c: the contiguous run 20..27
    rng.shuffle(free)
    reqs = {"a": (free[:6], rng.sample(range(32), 6)), "b": (free[6:9], rng.sample(range(32), 3)),
            "c": (list(range(20, 28)), list(range(8)))}  # c: one contiguous run
    send_layerwise(child, rx, {rid: (src, dst) for rid, (dst, src) in reqs.items()})
    assert child("leaks") is None
    rx.check_no_leaks()


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_abort_mid_transfer(rx, shared_child, side):
    child = shared_child
    add_in_child(child, rx, "a", [3, 9, 4], [0, 1, 2])
    assert child("layers", "a", [0]) is None
    assert rx.wait_until(lambda: 0 in rx.snapshot("a").layers, WAIT)
    if side == "sender":
        assert child("abort", "a") is None
    else:
        rx.abort("a")
    assert rx.wait("a", WAIT) is S.ABORTED
    assert child("wait", "a", WAIT) == "ABORTED"
    assert child("layers", "a", [1, 2, 3]) is None  # too late: must not be written
    release_in_both(child, rx, "a")
    time.sleep(0.2)
    assert rx.kv_buffer[1:].abs().sum() == 0
    assert child("leaks") is None
    rx.check_no_leaks()


def test_killed_sender_fails_within_deadline_and_restart_rehandshakes(backend, rx):
    child = Child(backend)
    add_in_child(child, rx, "a", [1, 2], [0, 1], timeout_s=4.0)
    assert child("layers", "a", [0]) is None
    assert rx.wait_until(lambda: 0 in rx.snapshot("a").layers, WAIT)
    start = time.monotonic()
    child.kill()
    assert rx.wait("a", 4.0) is S.FAILED
    assert time.monotonic() - start < 4.0 and "lost" in rx.reason("a")
    assert not rx.releasable("a")  # deadline not passed yet: a late write is still conceivable
    child = Child(backend, wait=False)  # restarted prefill worker: same id, new epoch; starts meanwhile
    try:
        assert rx.wait_until(lambda: rx.releasable("a"), WAIT)
        rx.release("a")
        child.ready()
        add_in_child(child, rx, "b", [5, 6], [2, 3])
        assert child("layers", "b", list(range(LAYERS))) is None
        assert rx.wait("b", WAIT) is S.DONE, rx.reason("b")
        assert_landed(make_kv(SEED), [2, 3], rx.kv_buffer, [5, 6])
        release_in_both(child, rx, "b")
        assert child("leaks") is None
        rx.check_no_leaks()
    finally:
        child.close()


def test_incompatible_layout_refused_at_connect(backend, rx):
    child = Child(backend, num_blocks=16, wait=False)  # fine: block count may differ
    bad = Child(backend, worker_id="p1", wait=False, dtype=__import__("torch").float16)
    try:  # both start at once
        child.ready()
        bad.ready()
        assert child("connect", rx.address) is None
        err = bad("connect", rx.address)
        assert isinstance(err, str) and err.startswith("IncompatiblePeerError") and "dtype" in err
        assert "bfloat16" in err and "float16" in err and "block_size" not in err
        assert child("leaks") is None and bad("leaks") is None
        rx.check_no_leaks()
    finally:
        child.close()
        bad.close()


def test_receiver_drops_live_sender_which_rehandshakes(backend, rx):
    """The decode side drops a prefill worker that is alive (as after a stall past peer_timeout_s)
    while a new request is on its way: the sender learns it from the receiver's Rehandshake answer and
    fails its in-flight request at once (before: TRANSFERRING until its deadline); the new request
    completes bit-exact after a fresh handshake; the dropped one's blocks stay held until its deadline."""
    child = Child(backend)
    try:
        add_in_child(child, rx, "a", [1, 2], [0, 1], timeout_s=4.0)
        assert child("layers", "a", [0]) is None
        assert rx.wait_until(lambda: 0 in rx.snapshot("a").layers, WAIT)
        assert rx.stats().senders == ("p0",)
        rx.drop_sender("p0", "dropped by test")
        assert rx.wait("a", WAIT) is S.FAILED
        add_in_child(child, rx, "b", [5, 6], [2, 3])  # its Begin reaches a receiver that no longer knows it
        assert child("wait", "a", 2.0) == "FAILED"
        assert "dropped by test" in str(child("reason", "a"))
        assert child("layers", "b", list(range(LAYERS))) is None
        assert rx.wait("b", WAIT) is S.DONE, rx.reason("b")
        assert_landed(make_kv(SEED), [2, 3], rx.kv_buffer, [5, 6])
        release_in_both(child, rx, "b")
        assert child("release", "a") is None
        assert not rx.releasable("a")  # deadline not passed: a write of the dropped sender may land
        assert rx.wait_until(lambda: rx.releasable("a"), WAIT)
        rx.release("a")
        assert rx.kv_buffer[1:, :, [1, 2]].abs().sum() == 0  # layers 1.. of "a" were never written
        assert child("leaks") is None
        rx.check_no_leaks()
    finally:
        child.close()


def test_stop_child_returns_once_every_thread_of_it_is_stopped():
    """stop_child (which the next test relies on) returns only when no thread of the child runs any
    more: os.kill(SIGSTOP) alone returns while threads of a busy child still run, for milliseconds
    on a loaded host (long enough to complete the write the next test needs held)."""
    from tests.kvtransfer.peer import busy_main

    ctx = mp.get_context("spawn")
    counts, started = ctx.RawArray("q", 4), ctx.Event()
    child = ctx.Process(target=busy_main, args=(counts, started), daemon=True)
    child.start()
    try:
        assert started.wait(60), "busy process did not start"
        stop_child(child.pid)
        states = {}
        for tid in os.listdir(f"/proc/{child.pid}/task"):
            with open(f"/proc/{child.pid}/task/{tid}/stat") as f:
                states[tid] = f.read().rsplit(")", 1)[1].split()[0]
        assert len(states) >= len(counts) and set(states.values()) == {"T"}, states
        before = list(counts)
        time.sleep(0.2)
        assert list(counts) == before
        assert child.is_alive()
    finally:
        child.kill()
        child.join(WAIT)


def test_receiver_killed_mid_write_fails_only_its_requests(backend, rx):
    """A decode worker SIGKILLed while a write to it is posted: the sender fails that request (a
    transfer error, not a crash of its loop) and goes on serving every other receiver. Before, NIXL's
    check_xfer_state raised nixlRemoteDisconnectError out of the sender's loop, which died: every later
    transfer of the worker stayed PENDING."""
    from kvtransfer import KVHandle
    from tests.kvtransfer.peer import receiver_main

    big = 2048  # blocks of the dying receiver: one write of 4 layers x 2 x 2048 x 128 B = 2 MiB
    tx = get_transfer_backend(backend).sender(config("p0", backend, timeout_s=WAIT), make_kv(SEED, big))
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    dying = ctx.Process(target=receiver_main, args=(child_conn, backend, "d1", big), daemon=True)
    dying.start()
    try:
        assert conn.poll(60), "receiver process did not start"
        tx.connect(conn.recv(), timeout=WAIT)
        conn.send(("expect", "big", list(range(big)), WAIT))
        assert conn.poll(WAIT)
        tx.add_request(msgspec.msgpack.decode(conn.recv(), type=KVHandle), list(range(big)))
        assert tx.wait_until(lambda: tx.snapshot("big").begun, WAIT)
        # every thread stopped, not merely signalled (under load a thread of it can run on for ms after
        # os.kill and complete the write): it can no longer take part in (or acknowledge) the write
        stop_child(dying.pid)
        tx.send_layers("big", None)
        posted = tx.wait_until(lambda: tx.stats().writes > 0, WAIT)  # posted, and cannot complete
        assert posted, (tx.status("big"), tx.reason("big"), tx.stats())
        time.sleep(0.2)
        assert tx.status("big") is S.TRANSFERRING, tx.reason("big")
        os.kill(dying.pid, signal.SIGKILL)
        dying.join(WAIT)
        assert tx.wait("big", WAIT) is S.FAILED
        assert "crashed" not in tx.reason("big")
        assert tx.stats().loop.alive, tx.stats().loop.error
        # the live receiver still gets its KV, bit-exact
        handle = rx.expect("after", [3, 7], timeout_s=WAIT)
        tx.add_request(handle, [10, 11])
        tx.send_layers("after", None)
        assert rx.wait("after", WAIT) is S.DONE, rx.reason("after")
        assert_landed(make_kv(SEED, big), [10, 11], rx.kv_buffer, [3, 7])
        assert tx.wait("after", WAIT) is S.DONE
        assert rx.wait_until(lambda: rx.releasable("after"), WAIT)
        rx.release("after")
        for rid in ("big", "after"):
            assert tx.wait_until(lambda rid=rid: tx.snapshot(rid).inflight == 0, WAIT)
            tx.release(rid)
        tx.check_no_leaks()
        rx.check_no_leaks()
    finally:
        if dying.is_alive():
            dying.kill()
        tx.close()
