"""Probes of a KV endpoint's loop shared by the hand-off, pipeline and send-cost tests: stall the loop
(so it takes nothing up) and record what each transport write carries."""

from __future__ import annotations

import threading


def stall_loop(tx: object, wait: float = 5.0) -> threading.Event:
    """Stall an endpoint's loop (a command that blocks it, so it takes nothing up) until the returned
    event is set (or `wait` s pass); returns once the loop is inside the stall."""
    gate, stalled = threading.Event(), threading.Event()

    def stall() -> None:
        stalled.set()
        gate.wait(wait)
    tx.run_in_loop(stall)  # type: ignore[attr-defined]
    assert stalled.wait(wait)
    return gate


def record_writes(tx: object) -> list[list[tuple[str, int]]]:
    """Wrap the sender's ``transport.post``: each write it posts appends the (request_id, layer) of the
    notices it carries to the returned list."""
    from kvtransfer import wire

    seen: list[list[tuple[str, int]]] = []
    transport = tx.transport  # type: ignore[attr-defined]
    orig = transport.post

    def recording(peer: str, pieces: list[object], notice: bytes, tag: int) -> object:
        seen.append([(n.request_id, n.layer) for n in wire.decode_notices(notice)])
        return orig(peer, pieces, notice, tag)
    transport.post = recording
    return seen
