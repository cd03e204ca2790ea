"""A fake gateway control socket for tests that run a worker's ``run()`` over real TCP with CURVE,
``serving``, which runs a worker against one, and ``secure``, which gives a test worker the fleet's
keys."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import zmq
import zmq.asyncio

from kvtransfer.curve import load_keys, secure_server
from protocol.messages import Message, OutputBatch, RegisterAck, RegisterWorker, decode, encode
from workers.gateway_links import GatewayLinks
from workers.loop import WorkerLoop


def secure(worker: WorkerLoop, keys_dir: Path) -> None:
    """Make ``worker`` (built with ``--insecure-control-plane``) use the CURVE key pair in ``keys_dir`` on
    its gateway links, as ``--curve-keys keys_dir`` would."""
    worker.settings = dataclasses.replace(worker.settings, curve_keys=str(keys_dir),
                                          insecure_control_plane=False)
    old = worker.sessions.gateways
    worker.keys = load_keys(keys_dir)
    worker.sessions.gateways = GatewayLinks(worker.settings.gateway_control, worker.keys)
    old.close()


@contextlib.asynccontextmanager
async def serving(worker: WorkerLoop, endpoint: str,
                  keys_dir: Path) -> AsyncIterator[tuple[FakeGateway, asyncio.Task[None]]]:
    """A ``FakeGateway`` at ``endpoint`` and ``worker.run()`` as a task, both yielded; on exit the worker is
    asked to stop if it still runs, its task awaited (at most 10 s; its exception raised) and the gateway
    closed."""
    gw = FakeGateway(endpoint, keys_dir, 1)
    task = asyncio.create_task(worker.run())
    try:
        yield gw, task
    finally:
        if not task.done():
            worker.request_stop()
        async with asyncio.timeout(10):
            await task
        gw.close()


class FakeGateway:
    """A ROUTER at ``endpoint`` answering like a gateway's control socket, recording what it receives."""

    def __init__(self, endpoint: str, keys_dir: Path, epoch: int) -> None:
        self.endpoint, self.epoch = endpoint, epoch
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_server(self.sock, load_keys(keys_dir))
        self.sock.bind(endpoint)
        self.identity = b""
        self.got: list[Message] = []

    async def pump(self, until: Callable[[], bool], timeout: float = 20.0) -> None:
        """Receive (answering each ``RegisterWorker``) until ``until()`` holds.
        Raises TimeoutError after ``timeout`` s."""
        async with asyncio.timeout(timeout):
            while not until():
                if not await self.sock.poll(50):
                    continue
                identity, frame = await self.sock.recv_multipart()
                msg = decode(frame)
                if isinstance(msg, OutputBatch):
                    self.got.extend(msg.messages)
                else:
                    self.got.append(msg)
                if isinstance(msg, RegisterWorker):
                    self.identity = identity
                    await self.sock.send_multipart([identity, encode(RegisterAck(
                        worker_id=msg.worker_id, epoch=msg.epoch, accepted=True, gateway_epoch=self.epoch))])

    async def send(self, msg: Message) -> None:
        await self.sock.send_multipart([self.identity, encode(msg)])

    def ids(self) -> set[str]:
        return {m.request_id for m in self.got if hasattr(m, "request_id")}

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
