"""The per-token path of the gateway: one ``OutputBatch`` frame carrying several requests' messages is
applied message by message (a finish, an abort meanwhile, a failure, tokens for others), and a stream's
text-only chunks, built from a pre-encoded template, are byte for byte the response structs' encoding."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar, cast

import pytest

from engine.sampling_params import SamplingParams
from gateway.control_socket import SendOutcome
from gateway.metrics import GatewayMetrics
from gateway.prepare import ChoiceInput, Prepared
from gateway.render import chunk_choice, sse_chunk
from gateway.request_state import GenerationFailed, GenerationInput
from gateway.service import GatewayService
from gateway.serving import _ChunkWriter
from gateway.stream import Delta, text_deltas
from gateway.text import TextProcessor
from kvtransfer.compat import KVCompat
from protocol.messages import (
    AbortRequest,
    DecodeRequest,
    FirstToken,
    KVReserved,
    Message,
    NextToken,
    OutputBatch,
    OutputMessage,
    PrefillRequest,
    RegisterWorker,
    RequestFailed,
    RequestFinished,
    WorkerLoad,
)
from protocol.settings import GatewaySettings

M = TypeVar("M")


class _Control:
    """A control socket that records every send and delivers it."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Message]] = []

    async def send(self, identity: bytes, msg: Message) -> bool:
        return await self.send_outcome(identity, msg) is SendOutcome.SENT

    async def send_outcome(self, identity: bytes, msg: Message) -> SendOutcome:
        self.sent.append((identity, msg))
        return SendOutcome.SENT

    def take(self, kind: type[M]) -> list[tuple[bytes, M]]:
        """Remove and return the sends of messages of type ``kind``."""
        out = [(i, m) for i, m in self.sent if isinstance(m, kind)]
        self.sent = [(i, m) for i, m in self.sent if not isinstance(m, kind)]
        return cast(list[tuple[bytes, M]], out)


async def _until(cond: Callable[[], bool], timeout: float = 2.0) -> None:
    """Let background tasks run until ``cond`` holds; AssertionError after ``timeout`` s."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        await asyncio.sleep(0.001)


def _register(wid: str, role: str) -> RegisterWorker:
    compat = KVCompat(dtype="float32", block_size=16, transfer_backend="loopback")
    return RegisterWorker(role=role, worker_id=wid, epoch=1, model="m", model_path="",  # type: ignore[arg-type]
                          compat=compat, transfer_address=f"tcp://127.0.0.1:1/{wid}",
                          load=WorkerLoad(num_total_blocks=64, num_free_blocks=64))


async def test_one_batch_carries_several_requests_one_finishing_one_aborted_one_failing(
        tokenizer_dir: Path) -> None:
    text = TextProcessor.from_dir(tokenizer_dir)
    settings = GatewaySettings(heartbeat_timeout=60.0, insecure_control_plane=True)
    svc = GatewayService(settings, GatewayMetrics(), text=text)
    control = _Control()
    svc.control = control  # type: ignore[assignment]
    for wid, role in (("p1", "prefill"), ("d1", "decode")):
        await svc.on_control_message(wid.encode(), _register(wid, role))
    orch = svc.orchestrator
    reply = text.encode(" Hello world, again")
    limits = {"a": 4, "b": 2, "c": 4, "e": 4}
    reqs = {rid: await orch.submit(GenerationInput(rid, [1, 2, 3], SamplingParams(max_tokens=n)))
            for rid, n in limits.items()}
    deltas = {rid: text_deltas(orch, text, req) for rid, req in reqs.items()}

    # the decode worker's reservations, one frame; then the prefill worker's first tokens, one frame
    await svc.on_control_message(b"d1", OutputBatch(worker_id="d1", messages=[
        KVReserved(request_id=rid, worker_id="d1", kv_handle=b"h") for rid in limits]))
    firsts: list[OutputMessage] = [FirstToken(request_id=rid, worker_id="p1", token_id=reply[0])
                                   for rid in limits]
    await svc.on_control_message(b"p1", OutputBatch(worker_id="p1", messages=firsts))
    got = {rid: await anext(d) for rid, d in deltas.items()}  # the PrefillRequests go out on the way
    assert {rid: (g.text, g.num_tokens, g.finish_reason) for rid, g in got.items()} == {
        rid: (" Hello", 1, None) for rid in limits}
    assert sorted(m.request_id for _, m in control.take(PrefillRequest)) == sorted(limits)
    assert sorted(m.request_id for _, m in control.take(DecodeRequest)) == sorted(limits)

    orch.release(reqs["c"])  # c's client went away meanwhile: d1 is told to abort it
    await deltas["c"].aclose()  # type: ignore[attr-defined]
    await _until(lambda: any(isinstance(m, AbortRequest) for _, m in control.sent))
    assert [(i, m.request_id) for i, m in control.take(AbortRequest)] == [(b"d1", "c")]

    # one decode step: a token for every running request, b's last, e failed, c's late token
    await svc.on_control_message(b"d1", OutputBatch(worker_id="d1", messages=[
        NextToken(request_id="a", worker_id="d1", token_id=reply[1]),
        NextToken(request_id="b", worker_id="d1", token_id=reply[1]),
        RequestFinished(request_id="b", worker_id="d1", finish_reason="length", num_prompt_tokens=3,
                        num_output_tokens=2),
        NextToken(request_id="c", worker_id="d1", token_id=reply[1]),
        RequestFailed(request_id="e", worker_id="d1", error="boom"),
        NextToken(request_id="a", worker_id="d1", token_id=reply[2])]))
    # the late token of c, released, is answered with an abort at once; nothing else is sent
    aborts = [(i, m.request_id, m.reason) for i, m in control.take(AbortRequest)]
    assert aborts == [(b"d1", "c", "unknown request")]
    assert [await anext(deltas["a"]) for _ in range(2)] == [Delta(" world", 1), Delta(",", 1)]
    assert await anext(deltas["b"]) == Delta(" world", 1, "length")
    with pytest.raises(StopAsyncIteration):
        await anext(deltas["b"])
    with pytest.raises(GenerationFailed, match="boom"):
        await anext(deltas["e"])
    await svc.on_control_message(b"d1", OutputBatch(worker_id="d1", messages=[
        NextToken(request_id="a", worker_id="d1", token_id=reply[3]),
        RequestFinished(request_id="a", worker_id="d1", finish_reason="length", num_prompt_tokens=3,
                        num_output_tokens=4)]))
    last = await anext(deltas["a"])
    assert (last.num_tokens, last.finish_reason) == (1, "length")
    assert text.decode(reply) == " Hello world, again"
    for req in reqs.values():
        orch.release(req)
    # leak check: nothing in flight, no worker holding a request
    await _until(lambda: not orch.requests and all(not w.requests for w in svc.registry.live()))


@pytest.mark.parametrize("chat", [True, False])
def test_text_chunk_from_template_is_the_structs_encoding(tokenizer_dir: Path, chat: bool) -> None:
    text = TextProcessor.from_dir(tokenizer_dir)

    class Svc:
        def text(self) -> TextProcessor:
            return text

    inp = GenerationInput("r", [1], SamplingParams(max_tokens=4))
    p = Prepared(request_id="r\"q", model="m/é", chat=chat, include_usage=False,
                 choices=(ChoiceInput(0, inp), ChoiceInput(3, inp, echo_text="E")), num_prompt_tokens=1,
                 logprobs=None, n=2)
    writer = _ChunkWriter(Svc(), p)  # type: ignore[arg-type]
    for content in ["plain", 'quote " and \\ back', "new\nline\ttab", "é 日本 🎉", "\x00\x1f", "\u2028"]:
        for pos in (0, 1):
            choice = chunk_choice(p, text, p.choices[pos].index, content, None, [], 0)
            want = sse_chunk(p, writer.created, choice)
            got = writer._text_event(pos, content)
            assert got == want
            body = json.loads(got.removeprefix(b"data: ").removesuffix(b"\n\n"))
            piece = body["choices"][0]["delta"]["content"] if chat else body["choices"][0]["text"]
            assert piece == content and body["choices"][0]["index"] == p.choices[pos].index
