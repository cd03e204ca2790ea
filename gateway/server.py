"""``pdserve gateway``: run the app under uvicorn."""

from __future__ import annotations

import uvicorn

from gateway.app import create_app
from protocol.settings import GatewaySettings


def serve(settings: GatewaySettings) -> None:
    """Serve until interrupted. Raises OSError when the HTTP or control address cannot be bound."""
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                access_log=False, log_config=None)
