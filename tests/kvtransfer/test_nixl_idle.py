"""An idle NIXL receiver on DRAM does not burn a CPU core (regression: NIXL's progress thread spins — its
Python binding sets the thread's delay to 0 — and on a 2-core machine it starved the prefill worker until
a 5000-token prompt missed its KV deadline)."""

from __future__ import annotations

import os
import time

import pytest
import torch

pytest.importorskip("nixl_cu13")


def test_idle_dram_receiver_uses_almost_no_cpu():
    from kvtransfer.transports.nixl import NixlRecvTransport

    rx = NixlRecvTransport(f"idle-rx-{os.getpid()}", torch.zeros(1 << 20, dtype=torch.uint8))
    try:
        time.sleep(0.2)  # let any thread the agent starts get going
        cpu0, wall0 = time.process_time(), time.monotonic()
        time.sleep(1.0)
        cpu = time.process_time() - cpu0
        wall = time.monotonic() - wall0
    finally:
        rx.close()
    assert cpu < 0.25 * wall, f"idle receiver used {cpu:.2f} s of CPU in {wall:.2f} s"
