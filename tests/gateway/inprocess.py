"""Run the real gateway app (``gateway.app.create_app``) under uvicorn in a thread of the test process.

No workers: with ``--model-name`` set the gateway knows its model, so requests are validated (404 for
another model, 503 for a served one) without any worker process. Starts in well under a second.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gateway.app import create_app
from protocol.settings import GatewaySettings
from tests.gateway.conftest import free_ports
from tests.uvicorn_thread import serve_in_thread


@contextmanager
def inprocess_gateway(model_name: str = "served-model", **settings_kw: Any) -> Iterator[str]:
    """Start the gateway on free 127.0.0.1 ports; yield its base URL; stop it (lifespan shutdown) on exit.
    ``settings_kw``: more ``GatewaySettings`` fields (e.g. ``api_keys``).

    Raises RuntimeError if it does not start within 10 s.
    """
    control = free_ports(1)[0]
    settings = GatewaySettings(port=0, control_bind=f"tcp://127.0.0.1:{control}", model_name=model_name,
                               insecure_control_plane=True, **settings_kw)  # no worker ever connects to it
    with serve_in_thread(create_app(settings), "in-process gateway") as url:
        yield url
