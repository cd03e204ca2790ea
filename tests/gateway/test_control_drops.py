"""Which ends of control connections the gateway treats as a dropped worker connection (a log line and a
``Probe`` to every worker): only those of connections that completed a handshake. A peer without the
fleet's CURVE keys reconnecting every 100 ms, a client with an unknown key and a port scan are refused
and counted, and never make the gateway probe its fleet. A real ``GatewayService`` with a CURVE control
socket on 127.0.0.1 (an OS-chosen port), intruders as raw zmq / TCP clients."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from gateway.metrics import GatewayMetrics
from gateway.service import GatewayService
from kvtransfer.compat import KVCompat
from kvtransfer.curve import generate_keys, load_keys
from protocol.messages import Heartbeat, Message, Probe, RegisterWorker, WorkerLoad, encode
from protocol.settings import GatewaySettings


def _curve_client(ctx: zmq.asyncio.Context, endpoint: str, public: bytes, secret: bytes,
                  server: bytes) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server
    sock.connect(endpoint)
    return sock


async def test_refused_peers_are_no_dropped_connections_a_workers_end_is(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys_dir, other_dir = tmp_path / "keys", tmp_path / "other"
    generate_keys(keys_dir)
    generate_keys(other_dir)
    fleet, other = load_keys(keys_dir), load_keys(other_dir)
    svc = GatewayService(GatewaySettings(control_bind="tcp://127.0.0.1:*", curve_keys=str(keys_dir),
                                         heartbeat_timeout=60.0), GatewayMetrics(),
                         text=object())  # type: ignore[arg-type]
    probes: list[bytes] = []
    real_send = svc.send

    async def send(identity: bytes, msg: Message) -> bool:
        if isinstance(msg, Probe):
            probes.append(identity)
        return await real_send(identity, msg)

    svc.send = send  # type: ignore[method-assign]
    ctx = zmq.asyncio.Context()
    caplog.set_level(logging.INFO, logger="pdserve.gateway")
    await svc.start()
    try:
        assert svc.control is not None
        endpoint = svc.control.endpoint
        compat = KVCompat(dtype="float32", block_size=4, transfer_backend="loopback")
        # a registered worker (as if over its own connection), so a probe round has someone to probe
        await svc.on_control_message(b"d1", RegisterWorker(role="decode", worker_id="d1", epoch=1, model="m",
                                                           model_path="", compat=compat, load=WorkerLoad()))
        # intruders: own key pair (expects its own public key as the server's: the handshake fails, and it
        # reconnects every 100 ms), a key of its own that knows the fleet's public key (the ZAP handler
        # denies it), and TCP connections that close without a word
        own = _curve_client(ctx, endpoint, other.public, other.secret, other.public)
        unknown_public, unknown_secret = zmq.curve_keypair()
        unknown = _curve_client(ctx, endpoint, unknown_public, unknown_secret, fleet.public)
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        for _ in range(3):
            with socket.create_connection((host, int(port))):
                pass
        await asyncio.sleep(2.0)
        counts = svc.control.refusals.counts()
        assert counts["unknown_key"] >= 1 and counts["handshake"] + counts["no_handshake"] >= 5
        assert probes == []
        assert not [r for r in caplog.records if "control_connection_dropped" in r.getMessage()]
        own.close(0)
        unknown.close(0)
        # a client with the fleet's keys completes its handshake, speaks, and hangs up: that is a drop
        member = _curve_client(ctx, endpoint, fleet.public, fleet.secret, fleet.public)
        await member.send(encode(Heartbeat(worker_id="d2", epoch=1, load=WorkerLoad())))
        assert await member.poll(5000)  # the gateway answered (a ReRegister): the handshake is done
        member.close(0)
        for _ in range(100):
            if probes:
                break
            await asyncio.sleep(0.05)
        assert probes and set(probes) == {b"d1"}
        dropped = [r for r in caplog.records if r.getMessage() == "control_connection_dropped"]
        assert len(dropped) == 1 and getattr(dropped[0], "workers", None) == 1
    finally:
        await svc.stop()
        ctx.destroy(linger=0)  # closes the clients an assertion left open
