"""The peer ``bench.gateway.overhead`` measures the gateway against: a bare FastAPI/uvicorn SSE endpoint
that streams OpenAI-shaped completion chunks and does nothing else."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI


def baseline_app(num_chunks: int) -> FastAPI:
    """A FastAPI app whose ``POST /v1/completions`` streams ``num_chunks`` completions chunks, a usage
    chunk and ``[DONE]`` as SSE, doing no other work (the no-gateway peer)."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    async def events() -> AsyncIterator[str]:
        for i in range(num_chunks):
            chunk = {"id": "cmpl-b", "object": "text_completion", "created": 0, "model": "baseline",
                     "choices": [{"index": 0, "text": f" w{i}", "logprobs": None, "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n"
        usage = {"prompt_tokens": 1, "completion_tokens": num_chunks, "total_tokens": num_chunks + 1}
        yield f"data: {json.dumps({'id': 'cmpl-b', 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions() -> StreamingResponse:
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/ready")
    async def ready() -> dict[str, str]:
        return {"status": "ok"}

    return app
