"""bench.kvtransfer.gil runs end to end on CPU with the in-process loopback receiver, and with a busy wait
below the default fine_wait_s (its loopback path once crashed unpacking the receiver's answer, and a
--busy-wait-us under 5 was refused by TransferConfig)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kv_gil_bench_loopback_with_a_short_busy_wait():
    run = subprocess.run([sys.executable, "-m", "bench.kvtransfer.gil", "--backend", "loopback",
                          "--rounds", "2", "--busy-wait-us", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "transfer e2e (first send_layer -> DONE)" in run.stdout
    assert "busy_wait_us 2.0" in run.stdout
