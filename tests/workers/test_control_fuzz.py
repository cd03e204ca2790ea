"""Control-plane fuzz of the sockets a worker reads, bounded for CI (the 10,000-message run is
``python -m bench.fuzz.control_plane --targets prefill,decode,colocated,kv-sender``): mutated and
truncated frames of every gateway → worker message type from a fake gateway holding the fleet's keys,
to a real prefill, decode and colocated worker loop; and of every receiver → sender message type from a
fake KV receiver, to a KV sender. No crash, no hang (every send taken within 5 s), each still serves
afterwards, and nothing is leaked (bench/fuzz/worker_sockets.py says what is checked)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.fuzz.control_plane import message_types
from bench.fuzz.worker_sockets import GATEWAY_TO_WORKER, RECEIVER_TO_SENDER, fuzz_kv_sender, fuzz_worker
from kvtransfer import wire
from kvtransfer.curve import generate_keys
from protocol import messages

pytestmark = pytest.mark.timeout(120)
FRAMES = 300  # per socket: a few seconds on a loaded 2-core machine


def test_fuzzed_types_are_every_type_sent_to_a_worker_and_to_a_sender() -> None:
    to_worker = {t for t in message_types(messages.Message) if (t.__doc__ or "").startswith("Gateway →")}
    assert set(GATEWAY_TO_WORKER) == to_worker and len(to_worker) == 12
    # the KV plane: the receiver sends these; the sender sends the rest (Hello, Begin, notices, ...)
    from_sender = {wire.Hello, wire.Begin, wire.LayerNotice, wire.LayerNotices, wire.Stopped, wire.Withdraw}
    assert set(RECEIVER_TO_SENDER) == set(message_types(wire.Message)) - from_sender


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_worker_control_socket_survives_fuzz(role: str, tmp_path: Path) -> None:
    generate_keys(tmp_path / "keys")
    result = fuzz_worker(role, FRAMES, 5, tmp_path / "keys", tmp_path)
    assert (result.sent, result.after) == (FRAMES, "ok"), result


def test_kv_sender_socket_survives_fuzz(tmp_path: Path) -> None:
    result = fuzz_kv_sender(FRAMES, 5, generate_keys(tmp_path / "keys"))
    assert (result.sent, result.after) == (FRAMES, "ok"), result
