"""A worker's gateway sessions (``GatewaySessions``, real TCP on 127.0.0.1) against a CURVE gateway control
socket it cannot complete a handshake with: its own key pair (the wrong server key: libzmq retries every
~0.1 s), a key the gateway's ZAP handler refuses (not retried), or no CURVE at all (a mechanism mismatch,
not retried, or the gateway hangs up first: retried). Each is warned about once, at once,
naming the keys' flags, while the retries are not (``gateway_disconnected`` of a connection that never
completed a handshake is DEBUG); the start-up deadline's error names the failed handshake. With the
fleet's keys the worker registers as before, with no such warning. No model: a stand-in host."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from gateway.control_socket import ControlSocket
from kvtransfer.compat import KVCompat
from kvtransfer.curve import CurveKeys, FleetAuthenticator, Refusals, generate_keys, secure_server
from protocol.messages import Message, RegisterAck, RegisterWorker, WorkerLoad, decode
from workers.control_client import RegistrationError
from workers.gateway_sessions import GatewayLost, GatewaySessions
from workers.ownership import RequestOwners

WINDOW_S = 3.0  # how long the worker tries (the registration deadline of these tests)
KEYS_NAMED = "check --curve-keys / PDSERVE_CURVE_KEYS against the gateway's"


@dataclass
class _Health:
    registered: bool = False


class _Host:
    """The least of a worker that ``GatewaySessions`` needs (``GatewayHost``)."""

    worker_id, epoch = "dbad", 1

    def __init__(self) -> None:
        self.health, self.owners = _Health(), RequestOwners()

    def registration(self) -> RegisterWorker:
        compat = KVCompat(model_id="m", dtype="float32", block_size=4, num_layers=1, num_kv_heads=1,
                          head_dim=8, transfer_backend="loopback")
        return RegisterWorker(role="decode", worker_id=self.worker_id, epoch=self.epoch, model="m",
                              model_path="", compat=compat, max_model_len=64, load=WorkerLoad())

    def decode_frame(self, data: bytes, gateway: str | None = None) -> Message | None:
        return decode(data)

    def deliver(self, msg: Message | GatewayLost, gateway: str | None = None) -> None: ...
    def emit_to(self, msg: Message, gateway: str) -> None: ...
    def want_kv_snapshot(self) -> None: ...
    def wake(self) -> None: ...
    def request_stop(self) -> None: ...
    def held_ids(self) -> set[str]:
        return set()
    def drop(self, request_id: str) -> None: ...


@pytest.fixture
def keys(tmp_path: Path) -> tuple[CurveKeys, CurveKeys]:
    """The fleet's key pair and another one (two ``pdserve keygen`` directories)."""
    return generate_keys(tmp_path / "fleet"), generate_keys(tmp_path / "other")


class _ZapRefusingGateway:
    """A CURVE server with the fleet's pair whose ZAP handler accepts only ``accepted``'s key: a worker
    with the fleet's pair completes the key exchange and is then refused (HANDSHAKE_FAILED_AUTH)."""

    def __init__(self, fleet: CurveKeys, accepted: CurveKeys) -> None:
        self.ctx = zmq.Context()
        self.auth = FleetAuthenticator(self.ctx, accepted, Refusals("test gateway"))
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_server(self.sock, fleet)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"

    def close(self) -> None:
        self.sock.close(0)
        self.auth.stop()
        self.ctx.term()


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


@pytest.mark.parametrize("case", ["own key pair", "key refused by the gateway", "no CURVE"])
def test_a_failed_handshake_is_warned_about_once_and_named_at_the_deadline(
        case: str, keys: tuple[CurveKeys, CurveKeys], caplog: pytest.LogCaptureFixture) -> None:
    fleet, other = keys
    caplog.set_level(logging.DEBUG, logger="pdserve.worker")
    gateway: ControlSocket | _ZapRefusingGateway
    if case == "key refused by the gateway":
        gateway, worker_keys, says = _ZapRefusingGateway(fleet, accepted=other), fleet, KEYS_NAMED
    else:
        gateway = ControlSocket("tcp://127.0.0.1:0", fleet)
        worker_keys, says = ((other, KEYS_NAMED) if case == "own key pair"
                             else (None, "this worker runs without CURVE keys (--insecure-control-plane)"))

    async def scenario() -> tuple[float, str, int]:
        sessions = GatewaySessions(gateway.endpoint, worker_keys, _Host())
        start = time.monotonic()
        sessions.start()
        try:
            with pytest.raises(RegistrationError) as err:
                await sessions.wait_registered(WINDOW_S)
            [link] = sessions.gateways.links.values()
            return start, str(err.value), link.handshake.failures
        finally:
            sessions.close()

    try:
        start, error, failures = asyncio.run(scenario())
    finally:
        gateway.close()
    warned = _warnings(caplog, "handshake failed")
    assert len(warned) == 1, [r.getMessage() for r in warned]  # once, not once per retry
    assert says in warned[0].getMessage() and gateway.endpoint in warned[0].getMessage()
    assert warned[0].created - (time.time() - time.monotonic() + start) < 2.0  # at once
    assert _warnings(caplog, "gateway_disconnected") == []  # the retries do not flood the log
    assert f"no RegisterAck from any gateway ({gateway.endpoint}) within 3 s; likely cause: " in error
    assert says in error and "handshake failed" in error
    if case == "own key pair":  # libzmq retried many times: each one counted, none warned about again
        assert failures >= 5
        assert any("gateway_disconnected" in r.getMessage() for r in caplog.records
                   if r.levelno == logging.DEBUG)
    elif case == "key refused by the gateway":  # not retried by libzmq
        assert failures == 1


def test_the_fleet_keys_register_without_a_handshake_warning(
        keys: tuple[CurveKeys, CurveKeys], caplog: pytest.LogCaptureFixture) -> None:
    fleet, _ = keys
    caplog.set_level(logging.DEBUG, logger="pdserve.worker")

    async def scenario() -> int:
        gateway = ControlSocket("tcp://127.0.0.1:0", fleet)
        sessions = GatewaySessions(gateway.endpoint, fleet, _Host())

        async def answer() -> None:
            identity, msg = await gateway.recv()
            assert isinstance(msg, RegisterWorker)
            await gateway.send(identity, RegisterAck(worker_id=msg.worker_id, epoch=msg.epoch, accepted=True,
                                                     gateway_epoch=5))

        sessions.start()
        try:
            async with asyncio.timeout(10):
                await asyncio.gather(answer(), sessions.wait_registered(10))
            [link] = sessions.gateways.links.values()
            assert link.accepted and link.gateway_epoch == 5 and link.connected
            return link.handshake.failures
        finally:
            sessions.close()
            gateway.close()

    assert asyncio.run(scenario()) == 0
    assert _warnings(caplog, "handshake") == []
