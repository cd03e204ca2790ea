"""A worker's ``run()`` against two in-process gateway ROUTER sockets (CURVE, real TCP): it registers with
both and serves once one accepts, streams each gateway only its own requests, and when one gateway's
socket closes mid-stream (its connection drops) drops that gateway's request, blocks freed, while the
other gateway's request streams on to its end; it registers again when a new gateway binds the address.
Every wait has a deadline; ends with the leak check."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path

import zmq
import zmq.asyncio

from kvtransfer.curve import generate_keys
from pdserve.ports import free_ports
from protocol.messages import (
    ColocatedRequest,
    RequestFinished,
    WorkerShutdown,
    decode,
)
from tests.workers.fake_gateway import FakeGateway, secure, serving
from tests.workers.helpers import assert_clean, colocated_worker, prefill_worker, wire

PROMPT = list(range(50, 63))


def _req(rid: str, max_tokens: int) -> ColocatedRequest:
    return ColocatedRequest(request_id=rid, prompt_token_ids=PROMPT,
                            sampling=wire(max_tokens, ignore_eos=True))


def test_run_serves_two_gateways_and_survives_one_dropping(model_dir: Path, tmp_path: Path) -> None:
    generate_keys(tmp_path / "keys")
    port_a, port_b = free_ports(2)
    ep_a, ep_b = f"tcp://127.0.0.1:{port_a}", f"tcp://127.0.0.1:{port_b}"
    colo = colocated_worker(model_dir, gateway_control=f"{ep_a},{ep_b}", num_blocks=64)
    secure(colo, tmp_path / "keys")

    async def scenario() -> None:
        gw_a, gw_b = FakeGateway(ep_a, tmp_path / "keys", 1), FakeGateway(ep_b, tmp_path / "keys", 2)
        task = asyncio.create_task(colo.run())
        try:
            await asyncio.gather(gw_a.pump(lambda: bool(gw_a.identity)),
                                 gw_b.pump(lambda: bool(gw_b.identity)))
            async with asyncio.timeout(10):
                while not all(link.accepted for link in colo.sessions.gateways.links.values()):
                    await asyncio.sleep(0.02)
            await gw_a.send(_req("a-long", 400))
            await gw_b.send(_req("b-short", 12))
            await gw_a.pump(lambda: "a-long" in gw_a.ids())  # a-long is streaming
            gw_a.close()  # gateway a's connection drops mid-stream
            await gw_b.pump(lambda: any(isinstance(m, RequestFinished) for m in gw_b.got))
            assert gw_b.ids() == {"b-short"}  # nothing of a's ever reached b
            [done] = [m for m in gw_b.got if isinstance(m, RequestFinished)]
            assert done.num_output_tokens == 12
            async with asyncio.timeout(10):
                while colo.request_ids():  # a-long dropped long before its 400 tokens
                    await asyncio.sleep(0.02)
            assert not colo.sessions.gateways.links[ep_a].accepted and colo.health.registered

            gw_a2 = FakeGateway(ep_a, tmp_path / "keys", 3)  # a new gateway at a's address
            try:
                await gw_a2.pump(lambda: bool(gw_a2.identity))
                async with asyncio.timeout(10):
                    while not colo.sessions.gateways.links[ep_a].accepted:
                        await asyncio.sleep(0.02)
                assert colo.sessions.gateways.links[ep_a].gateway_epoch == 3
            finally:
                gw_a2.close()
        finally:
            colo.request_stop()
            async with asyncio.timeout(10):
                await task
            gw_b.close()

    asyncio.run(scenario())
    assert_clean(colo)
    # collect now: without it, CPython 3.11.7 was seen failing a later compile() in this session (pytest's
    # assertion rewriting at session end) with "AST constructor recursion depth mismatch"
    gc.collect()


def test_try_send_never_leaves_the_reader_asleep() -> None:
    """Sends that never wait and an asyncio reader share one socket: a reply that arrives while the
    event loop is busy, followed by a send, still wakes the reader (a send through a second, plain handle
    of the socket consumes the file-descriptor edge the reader waits for: the reply would sit unread)."""
    from protocol.messages import Heartbeat, WorkerLoad
    from workers.control_client import ControlClient

    async def ping_pong() -> None:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        client = ControlClient(f"tcp://127.0.0.1:{port}")
        beat = Heartbeat(worker_id="w", epoch=1, load=WorkerLoad())
        try:
            async with asyncio.timeout(10):
                while not client.try_send(beat):  # connecting
                    await asyncio.sleep(0.005)
            for k in range(20):
                async with asyncio.timeout(5):
                    identity, frame = await router.recv_multipart()
                reader = asyncio.create_task(client.recv_frame())
                await asyncio.sleep(0)  # the reader waits on the socket
                await router.send_multipart([identity, frame])
                time.sleep(0.02)  # the reply reaches the worker's socket while the event loop is busy
                assert client.try_send(beat)  # a send in between
                assert decode(await asyncio.wait_for(reader, 2)) == beat, k
        finally:
            client.close()
            router.close(linger=0)
            ctx.term()

    asyncio.run(ping_pong())


def test_worker_stops_when_its_kv_loop_dies(model_dir: Path, tmp_path: Path) -> None:
    """A prefill worker whose KV sender loop thread died can never send KV again: it must not stay
    registered (it would take requests and hang them). It says WorkerShutdown to its gateway, stops,
    and names the cause (``fatal``, from which ``pdserve prefill`` exits 1)."""
    generate_keys(tmp_path / "keys")
    [port] = free_ports(1)
    ep = f"tcp://127.0.0.1:{port}"
    worker = prefill_worker(model_dir, gateway_control=ep)
    secure(worker, tmp_path / "keys")

    def boom() -> None:
        raise RuntimeError("injected by the test")

    async def scenario() -> None:
        async with serving(worker, ep, tmp_path / "keys") as (gw, task):
            await gw.pump(lambda: bool(gw.identity))
            assert worker.kv_endpoint_error() is None
            worker.sender.run_in_loop(boom)
            await gw.pump(lambda: any(isinstance(m, WorkerShutdown) for m in gw.got), timeout=10)
            async with asyncio.timeout(10):
                await task

    asyncio.run(scenario())
    assert worker.fatal is not None and "injected by the test" in worker.fatal
    assert "RuntimeError" in str(worker.kv_endpoint_error())
