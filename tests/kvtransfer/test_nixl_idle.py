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
    from kvtransfer.nixl import NixlRecvTransport

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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sender_agent_progress_thread_only_for_gpu_memory(device, monkeypatch):
    """The sender's NIXL agent runs NIXL's progress thread when its kv_buffer is on a GPU (a WRITE's
    notification then leaves when the data is written, not at the loop's next poll), never on DRAM."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import kvtransfer.nixl as nixl_mod
    from kvtransfer import get_transfer_backend
    from tests.kvtransfer.helpers import config

    seen: list[bool] = []
    real = nixl_mod._agent
    monkeypatch.setattr(nixl_mod, "_agent", lambda name, progress_thread=False:
                        seen.append(progress_thread) or real(name, progress_thread))
    kv = torch.zeros(2, 2, 4, 16, 2, 8, dtype=torch.bfloat16, device=device)
    tx = get_transfer_backend("nixl").sender(config("p-idle", "nixl"), kv)
    tx.close()
    assert seen == [device == "cuda"]
