"""In-process transport for unit tests of everything above the wire: a write is a torch copy straight
into the receiver's tensor, and the notice is queued, with the sender's name, for the receiver's poll() (so
it follows the data; poll() names its sender by the peer key add_peer gave that name, like NIXL's)."""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvtransfer.transports.base import RecvTransport, SendTransport, SourcePiece
from kvtransfer.types import TransferError


class LoopbackRecvTransport(RecvTransport):
    """Exposes `kv_buffer` to loopback senders of the same process."""

    _registry: ClassVar[weakref.WeakValueDictionary[str, LoopbackRecvTransport]] = (
        weakref.WeakValueDictionary())
    _ids: ClassVar[Iterator[int]] = itertools.count(1)

    def __init__(self, kv_buffer: torch.Tensor) -> None:
        self.kv_bytes = kv_buffer.view(-1).view(torch.uint8)
        self.key = f"loopback-{next(self._ids)}"
        self.inbox: deque[tuple[str, bytes]] = deque()  # (sender name, notice)
        self._peers: dict[str, str] = {}  # sender name → peer key
        self.lock = threading.Lock()
        self._registry[self.key] = self

    def metadata(self) -> bytes:
        return self.key.encode()

    def add_peer(self, peer: str, remote: bytes) -> None:
        self._peers[remote.decode()] = peer

    def remove_peer(self, peer: str) -> None:
        self._peers = {name: p for name, p in self._peers.items() if p != peer}

    def poll(self) -> tuple[list[tuple[str, bytes]], list[int]]:
        """(peer key, notice) of each queued notice; those of a sender that is no peer are dropped."""
        out = []
        while self.inbox:
            name, notice = self.inbox.popleft()
            if name in self._peers:
                out.append((self._peers[name], notice))
        return out, []

    def close(self) -> None:
        self._registry.pop(self.key, None)


@dataclass
class _Write:
    target: LoopbackRecvTransport
    pieces: list[SourcePiece]
    notice: bytes
    done: bool = False


class LoopbackSendTransport(SendTransport):
    """Copies staging or kv_buffer pieces into an in-process LoopbackRecvTransport. Tests clear `deliver`
    (a threading.Event, set by default) to keep posted writes in flight until it is set again; a write
    in flight reads its source only when delivered (like a real transport's late read)."""

    _ids: ClassVar[Iterator[int]] = itertools.count(1)

    def __init__(self) -> None:
        self.name = f"loopback-send-{next(self._ids)}"
        self.deliver = threading.Event()
        self.deliver.set()
        self._peers: dict[str, str] = {}
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._kv = torch.empty(0, dtype=torch.uint8)

    def metadata(self) -> bytes:
        return self.name.encode()

    def set_staging(self, staging: object) -> None:
        assert isinstance(staging, torch.Tensor)
        self._staging = staging

    def register_kv(self, kv_buffer: object) -> None:
        assert isinstance(kv_buffer, torch.Tensor)
        self._kv = kv_buffer.view(-1).view(torch.uint8)

    def source(self, region: int) -> torch.Tensor:
        """The flat byte view of source region STAGING or KV as registered (tests corrupt it)."""
        return (self._staging, self._kv)[region]

    def add_peer(self, peer: str, remote: bytes) -> None:
        self._peers[peer] = remote.decode()

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def post(self, peer: str, pieces: list[SourcePiece], notice: bytes, tag: int) -> object:
        """Copy now (or, while `deliver` is cleared, when test() first finds it set) and queue the notice."""
        target = LoopbackRecvTransport._registry.get(self._peers.get(peer, ""))
        if target is None:
            raise TransferError(f"loopback peer {peer} is gone")
        write = _Write(target, pieces, notice)
        if self.deliver.is_set():
            self._deliver(write)
        return write

    def test(self, handle: object) -> bool:
        assert isinstance(handle, _Write)
        if not handle.done and self.deliver.is_set():
            self._deliver(handle)
        return handle.done

    def cancel(self, handle: object) -> None:
        assert isinstance(handle, _Write)
        handle.done = True  # never delivered

    def _deliver(self, w: _Write) -> None:
        regions = (self._staging, self._kv)
        for region, src, dst, size in w.pieces:
            w.target.kv_bytes[dst:dst + size].copy_(regions[region][src:src + size])
        w.target.inbox.append((self.name, w.notice))
        w.done = True
