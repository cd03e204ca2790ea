"""A worker asked to stop drains: its ``run()`` against an in-process gateway ROUTER (CURVE, real TCP).

At the first SIGTERM the worker tells the gateway at once (a heartbeat whose load says ``draining``),
still serves what it holds and what the gateway sent before it knew, and stops by itself once it holds
nothing (``WorkerShutdown`` last); ``--drain-timeout`` bounds the wait (what is still held then is
dropped, blocks freed); a second signal, or ``--drain-timeout 0``, stops at once; an idle worker stops at
the first signal. A gateway that says it leaves (``GatewayShutdown``) is let go without a failure: its
requests are dropped and the worker serves on. Every wait has a deadline; each ends with the leak check.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from kvtransfer.curve import generate_keys
from pdserve.ports import free_ports
from protocol.messages import (
    ColocatedRequest,
    GatewayShutdown,
    Heartbeat,
    NextToken,
    RequestFinished,
    WorkerShutdown,
)
from tests.workers.fake_gateway import FakeGateway, secure, serving
from tests.workers.helpers import assert_clean, colocated_worker, wire
from workers.colocated import ColocatedWorker


def _worker(model_dir: Path, tmp_path: Path, drain_timeout: float) -> tuple[ColocatedWorker, str]:
    generate_keys(tmp_path / "keys")
    [port] = free_ports(1)
    ep = f"tcp://127.0.0.1:{port}"
    # 1024 blocks of 4 tokens: a 4000-token request runs for seconds, past every deadline tested here
    colo = colocated_worker(model_dir, gateway_control=ep, num_blocks=1024)
    colo.settings = dataclasses.replace(colo.settings, drain_timeout=drain_timeout)
    secure(colo, tmp_path / "keys")
    return colo, ep


def _serve(colo: ColocatedWorker, ep: str, tmp_path: Path,
           scenario: Callable[[FakeGateway, asyncio.Task[None]], Awaitable[None]]) -> None:
    """Run ``colo`` against a fake gateway at ``ep`` through ``scenario(gateway, run task)``; the worker is
    stopped afterwards if the scenario left it running, and checked for leaks."""
    async def main() -> None:
        async with serving(colo, ep, tmp_path / "keys") as (gw, task):
            await gw.pump(lambda: bool(gw.identity))
            async with asyncio.timeout(10):
                while not colo.sessions.gateways.links[ep].accepted:
                    await asyncio.sleep(0.02)
            await scenario(gw, task)

    asyncio.run(main())
    assert_clean(colo)
    gc.collect()


def _req(rid: str, max_tokens: int) -> ColocatedRequest:
    return ColocatedRequest(request_id=rid, prompt_token_ids=list(range(50, 63)),
                            sampling=wire(max_tokens, ignore_eos=True))


def _tokens(gw: FakeGateway, rid: str) -> int:
    return sum(1 for m in gw.got if isinstance(m, NextToken) and m.request_id == rid)


def _draining_beats(gw: FakeGateway) -> list[Heartbeat]:
    return [m for m in gw.got if isinstance(m, Heartbeat) and m.load.draining]


def test_sigterm_drains_the_requests_held_then_stops(model_dir: Path, tmp_path: Path) -> None:
    colo, ep = _worker(model_dir, tmp_path, drain_timeout=60.0)

    async def scenario(gw: FakeGateway, task: asyncio.Task[None]) -> None:
        await gw.send(_req("long", 150))
        await gw.pump(lambda: _tokens(gw, "long") >= 3)
        os.kill(os.getpid(), signal.SIGTERM)  # the worker's own handler (run() installed it) takes it
        signalled = time.monotonic()
        await gw.pump(lambda: bool(_draining_beats(gw)), timeout=5)
        assert time.monotonic() - signalled < 2  # told at once, not at the next periodic heartbeat
        assert _tokens(gw, "long") < 150  # the drain began while the request was still running
        await gw.send(_req("late", 5))  # routed before the gateway saw the drain: still served
        await gw.pump(lambda: task.done() and any(isinstance(m, WorkerShutdown) for m in gw.got), timeout=60)
        finished = {m.request_id: m.num_output_tokens for m in gw.got if isinstance(m, RequestFinished)}
        assert finished == {"long": 150, "late": 5}
        last = gw.got.index(next(m for m in gw.got if isinstance(m, WorkerShutdown)))
        assert all(not isinstance(m, NextToken) for m in gw.got[last:])  # nothing after it leaves

    _serve(colo, ep, tmp_path, scenario)


def test_the_drain_timeout_bounds_the_wait(model_dir: Path, tmp_path: Path) -> None:
    colo, ep = _worker(model_dir, tmp_path, drain_timeout=0.5)

    async def scenario(gw: FakeGateway, task: asyncio.Task[None]) -> None:
        await gw.send(_req("endless", 4000))
        await gw.pump(lambda: _tokens(gw, "endless") >= 3)
        colo.on_stop_signal()
        signalled = time.monotonic()
        await gw.pump(lambda: task.done() and any(isinstance(m, WorkerShutdown) for m in gw.got), timeout=20)
        assert 0.4 < time.monotonic() - signalled < 5
        assert not any(isinstance(m, RequestFinished) for m in gw.got)  # cut at the deadline, not finished
        assert _draining_beats(gw)

    _serve(colo, ep, tmp_path, scenario)


def test_a_second_signal_or_no_drain_timeout_stops_at_once(model_dir: Path, tmp_path: Path) -> None:
    for drain_timeout, signals in ((60.0, 2), (0.0, 1)):
        colo, ep = _worker(model_dir, tmp_path / str(drain_timeout), drain_timeout)

        async def scenario(gw: FakeGateway, task: asyncio.Task[None], signals: int = signals,
                           colo: ColocatedWorker = colo) -> None:
            await gw.send(_req("endless", 4000))
            await gw.pump(lambda: _tokens(gw, "endless") >= 3)
            start = time.monotonic()
            for _ in range(signals):
                colo.on_stop_signal()
                await asyncio.sleep(0.1)
            await gw.pump(lambda: task.done() and any(isinstance(m, WorkerShutdown) for m in gw.got),
                          timeout=10)
            assert time.monotonic() - start < 3
            assert not any(isinstance(m, RequestFinished) for m in gw.got)

        _serve(colo, ep, tmp_path / str(drain_timeout), scenario)


def test_an_idle_worker_stops_at_the_first_signal(model_dir: Path, tmp_path: Path) -> None:
    colo, ep = _worker(model_dir, tmp_path, drain_timeout=60.0)

    async def scenario(gw: FakeGateway, task: asyncio.Task[None]) -> None:
        start = time.monotonic()
        colo.on_stop_signal()
        await gw.pump(lambda: task.done() and any(isinstance(m, WorkerShutdown) for m in gw.got), timeout=10)
        assert time.monotonic() - start < 3
        assert not _draining_beats(gw)  # nothing to drain: it never said draining

    _serve(colo, ep, tmp_path, scenario)


def test_a_worker_asked_to_stop_while_it_registers_stops_at_once(model_dir: Path, tmp_path: Path) -> None:
    """No gateway answers (nothing listens at its address): the first signal ends the wait for a
    registration at once, instead of after the 60 s registration timeout."""
    colo, _ = _worker(model_dir, tmp_path, drain_timeout=60.0)

    async def main() -> None:
        task = asyncio.create_task(colo.run())
        await asyncio.sleep(0.5)
        assert not task.done()  # waiting for a registration
        start = time.monotonic()
        colo.on_stop_signal()
        async with asyncio.timeout(10):
            await task
        assert time.monotonic() - start < 2

    asyncio.run(main())
    assert_clean(colo)


def test_a_gateway_that_says_it_leaves_is_let_go_without_a_failure(model_dir: Path, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    colo, ep = _worker(model_dir, tmp_path, drain_timeout=60.0)

    async def scenario(gw: FakeGateway, task: asyncio.Task[None]) -> None:
        await gw.send(_req("cut", 4000))
        await gw.pump(lambda: _tokens(gw, "cut") >= 3)
        with caplog.at_level(logging.INFO, logger="pdserve.worker"):
            await gw.send(GatewayShutdown(gateway_epoch=1))
            async with asyncio.timeout(10):
                while colo.request_ids():  # the leaving gateway's request is dropped
                    await asyncio.sleep(0.02)
            gw.sock.close(linger=0)  # its connection then drops
            await asyncio.sleep(0.5)
        link = colo.sessions.gateways.links[ep]
        assert not link.accepted and link.left and not task.done()  # the worker serves on
        left = [r for r in caplog.records if "gateway_left" in r.getMessage()]
        assert [r.levelno for r in left] == [logging.WARNING]  # it dropped a request: worth a warning
        assert not [r for r in caplog.records if "gateway_lost" in r.getMessage()]
        dropped = [r for r in caplog.records if "gateway_disconnected" in r.getMessage()]
        assert all(r.levelno == logging.DEBUG for r in dropped)

    _serve(colo, ep, tmp_path, scenario)
