"""Shared helpers for kvtransfer tests: random KV tensors and configs."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
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


def release_both(tx: object, rx: object, rid: str, wait: float = 10.0, leaks: bool = False) -> None:
    """Release a finished request on both sides once each may forget it (the receiver when releasable;
    the sender when terminal — it learns DONE from the receiver's Done message, which can come after its
    last write completed — with nothing in flight and its Stopped fence sent); with `leaks`, then check
    that both sides hold nothing."""
    assert rx.wait_until(lambda: rx._releasable(rx._requests[rid]), wait)  # type: ignore[attr-defined]
    rx.release(rid)  # type: ignore[attr-defined]
    st = tx._requests[rid]  # type: ignore[attr-defined]
    assert tx.wait_until(lambda: st.status.is_terminal and st.extra["inflight"] == 0  # type: ignore[attr-defined]
                         and st.extra["stop"] is None, wait)
    tx.release(rid)  # type: ignore[attr-defined]
    if leaks:
        tx.check_no_leaks()  # type: ignore[attr-defined]
        rx.check_no_leaks()  # type: ignore[attr-defined]


def patient_config(worker_id: str, backend: str = "loopback", **kw: object) -> TransferConfig:
    """``config`` with peer_timeout_s 30 s: this side never gives up on its peer during a test's stall."""
    return dataclasses.replace(config(worker_id, backend, **kw), peer_timeout_s=30.0)


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


def loop_cost(thread: threading.Thread | None, counter: list[int], window: float) -> tuple[float, int]:
    """(the loop ``thread``'s CPU seconds / wall seconds, growth of ``counter[0]``) over ``window``
    seconds: how hard an endpoint loop works while it should only wait (its steps or transport looks are
    counted in ``counter``)."""
    assert thread is not None and thread.ident is not None
    clock = time.pthread_getcpuclockid(thread.ident)
    c0, n0, t0 = time.clock_gettime(clock), counter[0], time.monotonic()
    time.sleep(window)
    return (time.clock_gettime(clock) - c0) / (time.monotonic() - t0), counter[0] - n0


def need_nixl() -> None:
    """Skip the calling test module unless nixl_cu13 imports; quiet UCX and keep its TCP on loopback
    (the CI box has no other network; setdefault: an environment that sets them wins)."""
    import os

    import pytest

    pytest.importorskip("nixl_cu13")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")


@contextlib.contextmanager
def endpoint_pair(backend: str, seed: int) -> Iterator[tuple[Any, Any, torch.Tensor, torch.Tensor]]:
    """(sender, receiver, src, dst) over `backend` with the test config ("p0", "d0"): src random from
    `seed`, dst zeros (BLOCKS blocks each); both closed on exit."""
    from kvtransfer import get_transfer_backend

    factory = get_transfer_backend(backend)
    src, dst = make_kv(seed), make_kv(None)
    tx = factory.sender(config("p0", backend), src)
    rx = factory.receiver(config("d0", backend), dst)
    try:
        yield tx, rx, src, dst
    finally:
        tx.close()
        rx.close()
