"""The machine a benchmark ran on: CPU (/proc/cpuinfo, /proc/meminfo), OS, Python, load and, where
``nvidia-smi`` exists, each GPU (name, memory, driver) and the GPU interconnect matrix (``topo -m``)."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
from pathlib import Path


def _nvidia_smi(*args: str) -> str | None:
    """stdout of ``nvidia-smi *args`` (stripped), or None without the tool or when it fails/hangs."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=20, check=True)
        return done.stdout.strip()
    return None


def gpu_count() -> int:
    """GPUs listed by ``nvidia-smi -L`` (0 without the tool); no CUDA context is created."""
    listing = _nvidia_smi("-L")
    return sum(line.startswith("GPU ") for line in listing.splitlines()) if listing else 0


def gpu_info() -> dict[str, str]:
    """``gpus`` (one ``name, memory, driver`` entry per GPU, ``; ``-joined) and ``gpu topology`` (the
    GPU0–GPU1 link from ``nvidia-smi topo -m``, e.g. ``NV18``); empty without nvidia-smi."""
    out: dict[str, str] = {}
    gpus = _nvidia_smi("--query-gpu=name,memory.total,driver_version", "--format=csv,noheader")
    if gpus:
        out["gpus"] = "; ".join(line.strip() for line in gpus.splitlines() if line.strip())
    topo = _nvidia_smi("topo", "-m")
    if topo:
        rows = [line.split() for line in topo.splitlines() if line.startswith("GPU0")]
        if rows and len(rows[0]) > 2:
            out["gpu topology"] = f"GPU0-GPU1 {rows[0][2]}"
    return out


def machine_info() -> dict[str, str]:
    """nproc, CPU model, RAM (GiB), OS, Python, load average (1/5/15 min) and the GPUs (``gpu_info``)."""
    cpu, ram = platform.processor() or "unknown", "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    return {"nproc": str(len(os.sched_getaffinity(0))), "cpu": cpu, "ram": ram,
            "os": platform.platform(), "python": platform.python_version(),
            "load average (1/5/15 min)": " / ".join(f"{x:.2f}" for x in os.getloadavg()), **gpu_info()}
