"""Worker request ids stay unique when a client reuses an X-Request-Id, so a released request's late
tokens never reach the next request with the same id. No processes: the gateway's orchestrator with a
stand-in send that records what it sends."""

from __future__ import annotations

import asyncio

from engine.sampling_params import SamplingParams
from gateway.metrics import GatewayMetrics
from gateway.orchestrator import Orchestrator
from gateway.prefix_index import PrefixIndex
from gateway.registry import WorkerRegistry
from gateway.request_state import GenerationInput
from gateway.router import Router
from kvtransfer.compat import KVCompat
from protocol.messages import Message, RegisterWorker


class RecordingControl:
    """Stands in for ``ControlSocket``: records ``(identity, message)`` and reports every send delivered."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Message]] = []

    async def send(self, identity: bytes, msg: Message) -> bool:
        self.sent.append((identity, msg))
        return True


def orchestrator() -> tuple[Orchestrator, RecordingControl]:
    """An orchestrator over a registry holding one colocated worker ``w1`` (zmq identity ``b"w1"``)."""
    registry = WorkerRegistry(heartbeat_timeout=5.0)
    registry.register(RegisterWorker(role="colocated", worker_id="w1", epoch=1, model="m", model_path="",
                                     compat=KVCompat(dtype="float32", block_size=4)), b"w1")
    control = RecordingControl()
    return Orchestrator(Router(registry, PrefixIndex()), GatewayMetrics(), control.send, max_queue=8,
                        request_timeout=5.0), control


def generation(request_id: str) -> GenerationInput:
    return GenerationInput(request_id, [1, 2, 3], SamplingParams(max_tokens=4))


async def test_reused_id_gets_a_fresh_worker_id_until_forgotten() -> None:
    orch, control = orchestrator()
    assert orch.worker_request_id("r") == "r"  # never seen: unchanged
    first = await orch.submit(generation("r"))
    assert orch.worker_request_id("r") == "r~1"  # in flight
    control.sent.clear()
    orch.release(first)
    await asyncio.sleep(0)  # let the abort task run
    assert [type(m).__name__ for _, m in control.sent] == ["AbortRequest"]
    assert orch.worker_request_id("r") == "r~1"  # released, but a worker may still hold "r"
    await orch.submit(generation("r~1"))
    assert orch.worker_request_id("r") == "r~2"
    assert orch.client_request_id("r~2") == "r" and orch.client_request_id("r-0") == "r-0"
    assert orch.requests.keys() == {"r~1"} and list(orch.released) == ["r"]
