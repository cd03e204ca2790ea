"""Worker request ids stay unique when a client reuses an X-Request-Id (the bug the live suite found:
a released request's late tokens reached the next request with the same id). No processes: the gateway
service with a stand-in control socket that records what it sends."""

from __future__ import annotations

import asyncio

from gateway.handle import GenerationInput, RequestHandle
from gateway.metrics import GatewayMetrics
from gateway.router import Route
from gateway.service import GatewayService
from protocol.messages import Message, WireSamplingParams
from protocol.settings import GatewaySettings


class RecordingControl:
    """Stands in for ``ControlSocket``: records ``(identity, message)`` and reports every send delivered."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Message]] = []

    async def send(self, identity: bytes, msg: Message) -> bool:
        self.sent.append((identity, msg))
        return True


def handle(request_id: str) -> RequestHandle:
    inp = GenerationInput(request_id, [1, 2, 3], WireSamplingParams(max_tokens=4))
    h = RequestHandle(inp, Route(kind="colocated"))
    h.holders["w1"] = b"w1"
    return h


async def test_reused_id_gets_a_fresh_worker_id_until_forgotten() -> None:
    svc = GatewayService(GatewaySettings(), GatewayMetrics())
    control = RecordingControl()
    svc.control = control  # type: ignore[assignment]
    assert svc.worker_request_id("r") == "r"  # never seen: unchanged
    first = handle("r")
    svc.requests["r"] = first
    assert svc.worker_request_id("r") == "r~1"  # in flight
    svc.release(first)
    await asyncio.sleep(0)  # let the abort task run
    assert [type(m).__name__ for _, m in control.sent] == ["AbortRequest"]
    assert svc.worker_request_id("r") == "r~1"  # released, but a worker may still hold "r"
    svc.requests["r~1"] = handle("r~1")
    assert svc.worker_request_id("r") == "r~2"
    assert svc.client_request_id("r~2") == "r" and svc.client_request_id("r-0") == "r-0"
    assert svc.requests.keys() == {"r~1"} and list(svc.released) == ["r"]
