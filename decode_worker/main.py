"""``pdserve decode``: start a decode worker (see ``decode_worker.worker`` for its queues and states)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protocol.settings import WorkerSettings


def run(settings: WorkerSettings) -> int:
    """Load the model, bind the KV receiver, serve until SIGTERM; returns the exit status."""
    from decode_worker.worker import DecodeWorker
    from workers.boot import serve_worker

    return serve_worker(settings, DecodeWorker)
