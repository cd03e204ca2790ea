"""Endpoint life cycle: one loop thread per endpoint, whatever the caller does with start() and close().

A second start() used to spawn a second loop thread on the same zmq sockets (the sender's) or on a
fresh context while the first thread still polled the old one (the receiver's); at close() both threads
tore down and terminated the context twice: `ZMQError: Bad address` in the loop threads, and often a
libzmq assertion (signaler.cpp, fq.cpp, ctx.cpp) that aborted the process.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvtransfer import TransferError, TransferStatus, get_transfer_backend
from kvtransfer.receiver import ReceiverEndpoint
from kvtransfer.transports.loopback import LoopbackRecvTransport
from tests.kvtransfer.helpers import assert_landed, config, make_kv, release_both

ROOT = Path(__file__).resolve().parents[2]
WAIT = 10.0
CYCLES = 30

# Many rapid start/close cycles in a child process, so that an abort inside libzmq is a failure with
# its output rather than the end of the test run. The backends return started endpoints: the extra
# start() is the call that used to spawn a second loop thread.
CYCLE_SCRIPT = """
import sys, threading
from kvtransfer import get_transfer_backend
from tests.kvtransfer.helpers import config, make_kv
crashed = []
threading.excepthook = lambda args: crashed.append(repr(args.exc_value))
b = get_transfer_backend("loopback")
src, dst = make_kv(2), make_kv(None)
for i in range(int(sys.argv[1])):
    tx = b.sender(config("p0", "loopback"), src).start()
    rx = b.receiver(config("d0", "loopback"), dst).start()
    if i % 2:
        tx.close(); rx.close()
    else:
        rx.close(); tx.close()
    assert not crashed, crashed
print("ok", i + 1)
"""


def _loop_threads(name: str) -> int:
    return sum(t.name == name and t.is_alive() for t in threading.enumerate())


def test_a_second_start_keeps_one_loop_thread() -> None:
    """start() on the started endpoints the backend returns changes nothing: one loop thread each, the
    receiver keeps its address, and a transfer between them lands bit-exact."""
    b = get_transfer_backend("loopback")
    src, dst = make_kv(3), make_kv(None)
    tx = b.sender(config("p-twice", "loopback"), src)
    rx = b.receiver(config("d-twice", "loopback"), dst)
    address = rx.address
    try:
        assert tx.start() is tx and rx.start() is rx
        assert _loop_threads("kv-sender-p-twice") == 1
        assert _loop_threads("kv-receiver-d-twice") == 1
        assert rx.address == address
        handle = rx.expect("r0", [5, 6, 7])
        tx.add_request(handle, [1, 2, 3])
        tx.send_layers("r0")
        assert rx.wait("r0", WAIT) is TransferStatus.DONE
        assert tx.wait("r0", WAIT) is TransferStatus.DONE
        assert_landed(src, [1, 2, 3], dst, [5, 6, 7])
        release_both(tx, rx, "r0", leaks=True)
    finally:
        tx.close()
        rx.close()
    assert _loop_threads("kv-sender-p-twice") == 0
    assert _loop_threads("kv-receiver-d-twice") == 0


def test_start_after_close_raises() -> None:
    """A closed endpoint released its sockets and transport: start() raises instead of running a loop
    that tears them down a second time. close() stays idempotent."""
    b = get_transfer_backend("loopback")
    tx = b.sender(config("p-closed", "loopback"), make_kv(2))
    rx = b.receiver(config("d-closed", "loopback"), make_kv(None))
    tx.close()
    rx.close()
    for ep in (tx, rx):
        with pytest.raises(TransferError, match="was closed: it cannot start again"):
            ep.start()
        ep.close()
    assert _loop_threads("kv-sender-p-closed") == 0
    assert _loop_threads("kv-receiver-d-closed") == 0


def test_close_before_start_then_start_raises() -> None:
    """close() of a receiver that never started binds nothing, and a later start() raises (no socket is
    bound, no thread started)."""
    rx = ReceiverEndpoint(config("d-never", "loopback"), make_kv(None), LoopbackRecvTransport(make_kv(None)))
    rx.close()
    with pytest.raises(TransferError, match="was closed"):
        rx.start()
    assert rx.address == ""
    assert _loop_threads("kv-receiver-d-never") == 0


def test_rapid_start_close_cycles_do_not_crash() -> None:
    """CYCLES start/close cycles of a sender and a receiver (each started twice) in one process: no
    exception in any loop thread, no libzmq abort."""
    out = subprocess.run([sys.executable, "-c", CYCLE_SCRIPT, str(CYCLES)], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, f"rc={out.returncode}\n{out.stderr[-4000:]}"
    assert out.stdout.split() == ["ok", str(CYCLES)], out.stdout
    assert "Traceback" not in out.stderr and "Assertion failed" not in out.stderr, out.stderr[-4000:]
