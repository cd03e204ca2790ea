"""Serve an ASGI app with uvicorn in a thread of the test process (shared by the in-process gateway and
the load tester's fake OpenAI server)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn


@contextmanager
def serve_in_thread(app: Any, what: str, lifespan: str = "auto") -> Iterator[str]:
    """Start ``app`` on 127.0.0.1 (a free port); yield its base URL; stop it (graceful, 1 s) on exit.

    Raises RuntimeError naming ``what`` if it does not start within 10 s.
    """
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical", lifespan=lifespan,
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
