"""Where this worker's KV cache lives (``KVPlacement``), sent with its registration so the gateway can
tell which data path a pair's KV transfer should take."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from protocol.messages import KVPlacement

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
RDMA_DEVICES = Path("/sys/class/infiniband")


@functools.cache
def host_identity() -> str:
    """The kernel's boot id: the same for every process and container of one host, different across
    hosts (and across reboots); "" where the file does not exist (not Linux)."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


@functools.cache
def has_rdma() -> bool:
    """True when the host shows an RDMA device (InfiniBand or RoCE: /sys/class/infiniband not empty)."""
    try:
        return any(os.scandir(RDMA_DEVICES))
    except OSError:
        return False


def kv_placement(device_type: str) -> KVPlacement:
    """The placement of a KV cache on a torch device of type ``device_type`` ("cuda" or "cpu")."""
    return KVPlacement(host=host_identity(), device=device_type, rdma=has_rdma())
