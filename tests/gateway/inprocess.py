"""Run the real gateway app (``gateway.app.create_app``) under uvicorn in a thread of the test process.

No workers: with ``--model-name`` set the gateway knows its model, so requests are validated (404 for
another model, 503 for a served one) without any worker process. Starts in well under a second.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from gateway.app import create_app
from pdserve.settings import GatewaySettings
from tests.gateway.conftest import free_ports


@contextmanager
def inprocess_gateway(model_name: str = "served-model") -> Iterator[str]:
    """Start the gateway on free 127.0.0.1 ports; yield its base URL; stop it (lifespan shutdown) on exit.

    Raises RuntimeError if it does not start within 10 s.
    """
    control = free_ports(1)[0]
    settings = GatewaySettings(port=0, control_bind=f"tcp://127.0.0.1:{control}", model_name=model_name)
    config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=0, log_level="critical",
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("in-process gateway did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
