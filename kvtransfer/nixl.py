"""NIXL transport (nixl_cu13, UCX backend): one-sided WRITE from the sender's staging buffer into the
receiver's registered kv_buffer; the LayerNotice rides on the transfer as its notification, so the
receiver sees it only after the data (NIXL notif semantics). DRAM on CPU, VRAM on GPU (CUDA IPC within a
host): the same code, the memory type comes from the tensor's device.

API flow (NIXL Python API, nixl_cu13._api.nixl_agent): register_memory → get_agent_metadata, exchanged in
the Hello/HelloReply handshake → add_remote_agent → get_xfer_descs / initialize_xfer("WRITE") →
transfer() → check_xfer_state; the target reads notifications with get_new_notifs(). The sender posts
a WRITE per request-layer and tests it later (several in flight, each from its own staging slot).
Over CMA `transfer()` completes the copy before returning: it runs on the sender's loop thread, never
on an event loop.
"""

from __future__ import annotations

import contextlib
import os

import msgspec
import torch

from kvtransfer.runs import Piece
from kvtransfer.transport import RecvTransport, SendTransport
from kvtransfer.types import TransferError

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


class _RecvMeta(msgspec.Struct, frozen=True):
    agent: bytes  # NIXL agent metadata
    base: int  # kv_buffer.data_ptr()
    device: int  # CUDA device index, 0 for DRAM
    mem: str  # "DRAM" | "VRAM"


def _agent(name: str, progress_thread: bool = False) -> object:
    from nixl_cu13._api import nixl_agent, nixl_agent_config

    # The target needs a progress thread: large WRITEs use UCX rendezvous, which stalls between the
    # receiver loop's polls (measured 0.3 → 1.4 GB/s at 16 MiB per layer on 2 cores). The initiator
    # progresses while it polls check_xfer_state, so it runs without one (facts.md: faster on 2 cores).
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))


def _mem(t: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", t.device.index or 0) if t.is_cuda else ("DRAM", 0)


class NixlRecvTransport(RecvTransport):
    """Registers `kv_buffer` with a NIXL agent named `name` (must be unique among peers)."""

    def __init__(self, name: str, kv_buffer: torch.Tensor) -> None:
        self.agent = _agent(name, progress_thread=True)
        self.kv_buffer = kv_buffer
        self._reg = self.agent.register_memory(kv_buffer)  # type: ignore[attr-defined]
        mem, dev = _mem(kv_buffer)
        self._meta = _RecvMeta(self.agent.get_agent_metadata(), kv_buffer.data_ptr(), dev, mem)  # type: ignore[attr-defined]
        self._peers: dict[str, str] = {}

    def metadata(self) -> bytes:
        return msgspec.msgpack.encode(self._meta)

    def add_peer(self, peer: str, remote: bytes) -> None:
        self._peers[peer] = self.agent.add_remote_agent(remote)  # type: ignore[attr-defined]

    def remove_peer(self, peer: str) -> None:
        name = self._peers.pop(peer, None)
        if name is not None and name not in self._peers.values():
            self.agent.remove_remote_agent(name)  # type: ignore[attr-defined]

    def poll(self) -> tuple[list[bytes], list[int]]:
        notifs = self.agent.get_new_notifs()  # type: ignore[attr-defined]
        return [n for msgs in notifs.values() for n in msgs], []

    def close(self) -> None:
        self.agent.deregister_memory(self._reg)  # type: ignore[attr-defined]


class NixlSendTransport(SendTransport):
    """WRITEs staging pieces with one NIXL transfer (one descriptor per piece) per request-layer; the
    staging ring is registered once (again only when it grows)."""

    def __init__(self, name: str) -> None:
        self.agent = _agent(name)
        self._staging: torch.Tensor | None = None
        self._reg: object = None
        self._peers: dict[str, tuple[str, _RecvMeta]] = {}

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()  # type: ignore[attr-defined,no-any-return]

    def set_staging(self, staging: object) -> None:
        assert isinstance(staging, torch.Tensor)
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)  # type: ignore[attr-defined]
        self._staging, self._reg = staging, self.agent.register_memory(staging)  # type: ignore[attr-defined]

    def add_peer(self, peer: str, remote: bytes) -> None:
        meta = msgspec.msgpack.decode(remote, type=_RecvMeta)
        self._peers[peer] = (self.agent.add_remote_agent(meta.agent), meta)  # type: ignore[attr-defined]

    def remove_peer(self, peer: str) -> None:
        entry = self._peers.pop(peer, None)
        if entry is not None:
            self.agent.remove_remote_agent(entry[0])  # type: ignore[attr-defined]

    def post(self, peer: str, pieces: list[Piece], notice: bytes, tag: int) -> object:
        """One NIXL WRITE (one descriptor per piece) carrying `notice` as its notification; returns its
        xfer handle without waiting (over CMA the copy has already happened when this returns)."""
        if peer not in self._peers or self._staging is None:
            raise TransferError(f"no NIXL connection to {peer}")
        name, meta = self._peers[peer]
        mem, dev = _mem(self._staging)
        base = self._staging.data_ptr()
        local = self.agent.get_xfer_descs([(base + s, n, dev) for s, _, n in pieces], mem)  # type: ignore[attr-defined]
        remote = self.agent.get_xfer_descs([(meta.base + d, n, meta.device) for _, d, n in pieces], meta.mem)  # type: ignore[attr-defined]
        handle = self.agent.initialize_xfer("WRITE", local, remote, name, notice)  # type: ignore[attr-defined]
        try:
            state = self.agent.transfer(handle)  # type: ignore[attr-defined]
        except Exception as exc:
            self.agent.release_xfer_handle(handle)  # type: ignore[attr-defined]
            raise TransferError(f"NIXL write to {peer} could not start: {exc}") from exc
        if state == "ERR":
            self.agent.release_xfer_handle(handle)  # type: ignore[attr-defined]
            raise TransferError(f"NIXL write to {peer} failed to start")
        return handle

    def test(self, handle: object) -> bool:
        state = self.agent.check_xfer_state(handle)  # type: ignore[attr-defined]
        if state == "PROC":
            return False
        self.agent.release_xfer_handle(handle)  # type: ignore[attr-defined]
        if state != "DONE":
            raise TransferError(f"NIXL write failed ({state})")
        return True

    def cancel(self, handle: object) -> None:
        """release_xfer_handle aborts a transfer still in progress (NIXL nixlAgent::releaseXferReq)."""
        with contextlib.suppress(Exception):  # a failed abort leaves nothing for us to undo
            self.agent.release_xfer_handle(handle)  # type: ignore[attr-defined]

    def close(self) -> None:
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)  # type: ignore[attr-defined]
            self._reg = None
