"""A KV sender in a separate process, driven over a multiprocessing Pipe (for the nixl/ucx tests).

Commands (tuples): ("connect", address) → None or error text; ("add", handle_bytes, src_ids) → None;
("layers", request_id, [layers]) → None (one send_layer call each); ("send_layers", request_id,
[layers] or None) → None (one send_layers call); ("abort", request_id) → None; ("wait", request_id,
timeout) → status name; ("reason", request_id) → reason text; ("release", request_id) → None;
("leaks",) → None or error text; ("posted",) → request-layers posted by path {"staged": n, "direct": n};
("close",) → exits. A command that raises answers "<ExceptionName>: <message>".
kv_kwargs may hold "direct_max_pieces" (a TransferConfig field). receiver_main: a KV receiver driven
the same way; busy_main: a process of busy threads (for helpers.stop_child's test).
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from typing import Any

import msgspec


def sender_main(conn: Connection, backend: str, seed: int, worker_id: str, kv_kwargs: dict) -> None:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    from kvtransfer import KVHandle, get_transfer_backend
    from tests.kvtransfer.helpers import config, make_kv

    extra = {k: kv_kwargs.pop(k) for k in ("direct_max_pieces",) if k in kv_kwargs}
    tx = get_transfer_backend(backend).sender(config(worker_id, backend, checksum=True, **extra),
                                              make_kv(seed, **kv_kwargs))
    conn.send("ready")
    while True:
        cmd = conn.recv()
        op = cmd[0]
        try:
            if op == "close":
                tx.close()
                conn.send(None)
                return
            if op == "connect":
                tx.connect(cmd[1], timeout=10.0)
            elif op == "add":
                tx.add_request(msgspec.msgpack.decode(cmd[1], type=KVHandle), cmd[2])
            elif op == "layers":
                for layer in cmd[2]:
                    tx.send_layer(cmd[1], layer)
            elif op == "send_layers":
                tx.send_layers(cmd[1], cmd[2])
            elif op == "abort":
                tx.abort(cmd[1])
            elif op == "wait":
                conn.send(tx.wait(cmd[1], cmd[2]).name)
                continue
            elif op == "release":
                tx.release(cmd[1])
            elif op == "reason":
                conn.send(tx.reason(cmd[1]))
                continue
            elif op == "posted":
                conn.send(dict(tx.stats().posted))
                continue
            elif op == "leaks":
                tx.check_no_leaks()
            conn.send(None)
        except Exception as exc:  # reported to the test, which asserts on it
            conn.send(f"{type(exc).__name__}: {exc}")


def receiver_main(conn: Connection, backend: str, worker_id: str, num_blocks: int) -> None:
    """A KV receiver over `num_blocks` zeroed blocks, driven like sender_main: ("expect", request_id,
    [block ids], timeout_s) → encoded KVHandle; ("close",) → exits. Sends its control address first."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    from kvtransfer import get_transfer_backend
    from tests.kvtransfer.helpers import config, make_kv

    rx = get_transfer_backend(backend).receiver(config(worker_id, backend), make_kv(None, num_blocks))
    conn.send(rx.address)
    while True:
        cmd = conn.recv()
        if cmd[0] == "close":
            rx.close()
            conn.send(None)
            return
        try:
            conn.send(msgspec.msgpack.encode(rx.expect(cmd[1], cmd[2], timeout_s=cmd[3])))
        except Exception as exc:  # reported to the test, which asserts on it
            conn.send(f"{type(exc).__name__}: {exc}")


def busy_main(counts: Any, started: Any) -> None:
    """`len(counts)` threads (this one included), each adding 1 to its own slot of `counts` (a
    multiprocessing RawArray) without pause; `started` (an Event) is set once every slot moved."""
    import threading
    import time

    def spin(i: int) -> None:
        while True:
            counts[i] += 1

    for i in range(1, len(counts)):
        threading.Thread(target=spin, args=(i,), daemon=True).start()
    while not all(counts[i] for i in range(1, len(counts))):
        counts[0] += 1
        time.sleep(0)
    started.set()
    spin(0)
