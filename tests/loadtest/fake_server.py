"""A fake OpenAI-compatible streaming server with known token timings, for the load-test harness's tests.

Each request gets the next behaviour of ``FakeState.plan`` (cycled in arrival order):
``ok``: first token after ``ttft_s``, then one token every ``itl_s`` up to ``max_tokens``, then usage
(when ``stream_options.include_usage``) and ``[DONE]``; ``slow``: the same with ``slow_ttft_s``;
``500``: HTTP 500 with an OpenAI error body; ``midstream``: 3 tokens, then an error event;
``drop``: 3 tokens, then the connection breaks; ``hang``: no token for ``hang_s``; ``nousage``: like ok
without a usage chunk; ``leak``: like ok but its KV blocks are never freed.
While ``fault_file`` exists every request is answered 503; ``faulted`` keeps those requests' bodies (what
the flag really failed, whenever the client sent them).
``GET /metrics`` exposes ``pdserve_kv_blocks_used`` for two workers: each request holds
ceil(prompt_tokens / 16) + 1 blocks on ``decode-0`` while it streams; ``stale_blocks`` more are shown on
``prefill-0`` until ``stale_until`` (``time.monotonic()``), like a gauge a heartbeat behind earlier work.
``GET /decode-worker/metrics`` is a decode worker's page: ``vllm:inter_token_latency_seconds`` with
``engine_itl_s`` observed for every streamed token after a request's first (the engine's part of the
``itl_s`` the client sees); after ``decode_page_ok_reads`` readings (None: never) it answers HTTP 500, a
worker lost during the run.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tests.uvicorn_thread import serve_in_thread


@dataclass
class FakeState:
    ttft_s: float = 0.05
    itl_s: float = 0.01
    slow_ttft_s: float = 0.3
    hang_s: float = 20.0
    plan: list[str] = field(default_factory=lambda: ["ok"])
    fault_file: Path | None = None
    counter: int = 0
    kv_used: dict[str, int] = field(default_factory=lambda: {"prefill-0": 0, "decode-0": 0})
    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    faulted: list[dict[str, Any]] = field(default_factory=list)
    stale_blocks: int = 0
    stale_until: float = 0.0
    engine_itl_s: float = 0.008
    engine_itl_sum_s: float = 0.0
    engine_itl_count: int = 0
    decode_page_reads: int = 0
    decode_page_ok_reads: int | None = None

    def reset(self, **kw: Any) -> None:
        fresh = FakeState(**kw)
        self.__dict__.update(fresh.__dict__)


def _prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(m["content"].split()) for m in body["messages"])
    prompt = body["prompt"]
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())


def _chunk(chat: bool, text: str, finish: str | None = None) -> str:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    return "data: " + json.dumps({"id": "x", "choices": [choice]}) + "\n\n"


async def _stream(state: FakeState, body: dict[str, Any], behaviour: str, chat: bool) -> AsyncIterator[str]:
    n_prompt, n_out = _prompt_tokens(body), int(body["max_tokens"])
    blocks = math.ceil(n_prompt / 16) + 1
    state.kv_used["decode-0"] += blocks
    try:
        if chat:  # a role-only first delta, as OpenAI sends: not a token
            yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
        first = {"slow": state.slow_ttft_s, "hang": state.hang_s}.get(behaviour, state.ttft_s)
        await asyncio.sleep(first)
        for i in range(n_out):
            if i:
                await asyncio.sleep(state.itl_s)
            if i == 3 and behaviour == "midstream":
                yield "data: " + json.dumps({"error": {"message": "worker died", "code": 500}}) + "\n\n"
                return
            if i == 3 and behaviour == "drop":
                raise RuntimeError("fake connection drop")
            if i:
                state.engine_itl_sum_s += state.engine_itl_s
                state.engine_itl_count += 1
            yield _chunk(chat, f" t{i}")
        yield _chunk(chat, "", "length")
        if body.get("stream_options", {}).get("include_usage") and behaviour != "nousage":
            usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
            yield "data: " + json.dumps({"id": "x", "choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if behaviour != "leak":
            state.kv_used["decode-0"] -= blocks


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    async def handle(request: Request, chat: bool) -> Response:
        body = await request.json()
        state.bodies.append(body)
        state.auth.append(request.headers.get("authorization"))
        state.paths.append(request.url.path)
        behaviour = state.plan[state.counter % len(state.plan)]
        state.counter += 1
        if state.fault_file is not None and state.fault_file.exists():
            state.faulted.append(body)
            return JSONResponse({"error": {"message": "fault injected"}}, status_code=503)
        if behaviour == "500":
            return JSONResponse({"error": {"message": "internal boom"}}, status_code=500)
        return StreamingResponse(_stream(state, body, behaviour, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        lines = ["# HELP pdserve_kv_blocks_used KV blocks in use", "# TYPE pdserve_kv_blocks_used gauge"]
        stale = state.stale_blocks if time.monotonic() < state.stale_until else 0
        used = {w: n + (stale if w == "prefill-0" else 0) for w, n in state.kv_used.items()}
        lines += [f'pdserve_kv_blocks_used{{worker="{w}"}} {n}' for w, n in used.items()]
        lines += ["# TYPE other_gauge gauge", "other_gauge 7"]
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.get("/decode-worker/metrics")
    async def decode_worker_metrics() -> PlainTextResponse:
        state.decode_page_reads += 1
        if state.decode_page_ok_reads is not None and state.decode_page_reads > state.decode_page_ok_reads:
            return PlainTextResponse("worker gone\n", status_code=500)
        name = "vllm:inter_token_latency_seconds"
        return PlainTextResponse(
            f"# TYPE {name} histogram\n"
            f'{name}_bucket{{le="+Inf",model_name="fake-model"}} {state.engine_itl_count}\n'
            f'{name}_count{{model_name="fake-model"}} {state.engine_itl_count}\n'
            f'{name}_sum{{model_name="fake-model"}} {state.engine_itl_sum_s}\n')

    return app


@contextmanager
def serve(state: FakeState) -> Iterator[str]:
    """Run the fake server on 127.0.0.1 (a free port) in a thread; yield its base URL."""
    with serve_in_thread(make_app(state), "fake server", lifespan="off") as url:
        yield url
