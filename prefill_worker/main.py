"""``pdserve prefill``: start a prefill worker (see ``prefill_worker.worker`` for its queues and states)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protocol.settings import WorkerSettings


def run(settings: WorkerSettings) -> int:
    """Load the model (prefill-only engine), connect the KV sender, serve until SIGTERM; exit status."""
    from prefill_worker.worker import PrefillWorker
    from workers.boot import serve_worker

    return serve_worker(settings, PrefillWorker, prefill_only=True)
