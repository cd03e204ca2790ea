"""``pdserve prefill``: start a prefill worker (see ``prefill_worker.worker`` for its queues and states)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.settings import WorkerSettings


def run(settings: WorkerSettings) -> int:
    """Load the model (prefill-only engine), connect the KV sender, serve until SIGTERM; exit status."""
    from engine.serve.boot import serve_worker
    from prefill_worker.worker import PrefillWorker

    return serve_worker(settings, PrefillWorker, prefill_only=True)
