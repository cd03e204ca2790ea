"""NIXL transport (nixl_cu13, UCX backend): one-sided WRITE from the sender's staging buffer into the
receiver's registered kv_buffer, or (direct path) straight from the sender's own registered kv_buffer;
the LayerNotice rides on the transfer as its notification, so the receiver sees it only after the data
(NIXL notif semantics). DRAM on CPU, VRAM on GPU (CUDA IPC within a host): the same code.

API flow (NIXL Python API, nixl_cu13._api.nixl_agent): register_memory → get_agent_metadata, exchanged in
the Hello/HelloReply handshake → add_remote_agent; a direct request's descriptor lists (every layer's
pieces, local and remote) are prepared once with prep_xfer_dlist when its Begin is answered, and each
post is make_prepped_xfer("WRITE", ..., indices of the ready layers) → transfer() → check_xfer_state;
staged writes (and batches mixing requests) build descriptor lists per post (get_xfer_descs /
initialize_xfer), merging pieces contiguous on both sides first. The target reads notifications with
get_new_notifs(). On CPU (nixl_cu13 1.5.1, DRAM) make_prepped_xfer merges index-adjacent descriptors
contiguous on both sides (64 × 4 KiB: 38 µs), initialize_xfer does not (138 µs). Over CMA `transfer()`
completes the copy before returning: it runs on the sender's loop thread, never on an event loop.

Errors: NIXL's Python API raises its own exceptions (e.g. nixlRemoteDisconnectError from
check_xfer_state once the receiver of a posted WRITE died). Every call on a write's path turns them into
TransferError, which fails the requests of that write only; an exception escaping to the sender's loop
would end the loop, and with it every later transfer of the worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import cast

import msgspec
import torch

from kvtransfer.transports.base import KV, STAGING, RecvTransport, SendTransport, SourcePiece
from kvtransfer.transports.nixl_peers import AgentPeers
from kvtransfer.transports.nixl_prep import Desc, Entry, PreppedRequest, merge_descs, part_descs
from kvtransfer.types import TransferError

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
log = logging.getLogger(__name__)
_Prepared = tuple[Entry, Desc, Desc]  # prepare(): (peer entry, local, remote)
_Layer = tuple[PreppedRequest, int]  # prepare_layers() part: (prepared request, layer)


class NixlRecvMeta(msgspec.Struct, frozen=True):
    """What a NIXL receiver hands a sender in its HelloReply (its transport metadata)."""

    agent: bytes  # NIXL agent metadata
    base: int  # kv_buffer.data_ptr()
    device: int  # CUDA device index, 0 for DRAM
    mem: str  # "DRAM" | "VRAM"


def make_agent(name: str, progress_thread: bool = False, error_handling: str = "peer") -> object:
    """A NIXL agent with its UCX backend; `error_handling`: the backend's ucx_error_handling_mode
    (TransferConfig.nixl_error_handling: "peer", NIXL's default, or "none")."""
    from nixl_cu13._api import nixl_agent, nixl_agent_config

    # NIXL's progress thread spins (delay 0 from Python): a core per agent, idle or not. A GPU target
    # keeps it; on DRAM it is off (on a 2-core host it starves the prefill worker), so large DRAM
    # WRITEs progress only when the receiver polls (about 4x slower at 16 MiB per layer).
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=[]))
    params = agent.get_plugin_params("UCX")  # type: ignore[attr-defined]
    params["ucx_error_handling_mode"] = error_handling
    agent.create_backend("UCX", params)  # type: ignore[attr-defined]
    return agent


def _forget_agent(agent: object, name: str | bytes) -> None:
    """remove_remote_agent, whose failure (the peer died mid-transfer) leaves nothing for us to undo:
    logged, never raised into an endpoint's loop."""
    try:
        agent.remove_remote_agent(name)  # type: ignore[attr-defined]
    except Exception as exc:
        log.warning("NIXL could not remove remote agent %r: %r", name, exc)


def _mem(t: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", t.device.index or 0) if t.is_cuda else ("DRAM", 0)


class NixlRecvTransport(RecvTransport):
    """Registers `kv_buffer` with a NIXL agent named `name` (must be unique among peers)."""

    def __init__(self, name: str, kv_buffer: torch.Tensor, error_handling: str = "peer") -> None:
        self.agent = make_agent(name, progress_thread=kv_buffer.is_cuda, error_handling=error_handling)
        self.kv_buffer = kv_buffer
        self._reg = self.agent.register_memory(kv_buffer)  # type: ignore[attr-defined]
        mem, dev = _mem(kv_buffer)
        self._meta = NixlRecvMeta(self.agent.get_agent_metadata(), kv_buffer.data_ptr(), dev, mem)  # type: ignore[attr-defined]
        self._peers = AgentPeers()

    def metadata(self) -> bytes:
        return msgspec.msgpack.encode(self._meta)

    def add_peer(self, peer: str, remote: bytes) -> None:
        self._peers.add(peer, self.agent.add_remote_agent(remote))  # type: ignore[attr-defined]

    def remove_peer(self, peer: str) -> None:
        name = self._peers.remove(peer)
        if name is not None:
            _forget_agent(self.agent, name)

    def poll(self) -> tuple[list[tuple[str, bytes]], list[int]]:
        return self._peers.attribute(self.agent.get_new_notifs()), []  # type: ignore[attr-defined]

    def close(self) -> None:
        self.agent.deregister_memory(self._reg)  # type: ignore[attr-defined]


class NixlSendTransport(SendTransport):
    """WRITEs pieces of the staging ring or (direct path) of the sender's kv_buffer, one NIXL transfer per
    batch. Both regions are registered once (the ring again when it grows); bases, memory type and each
    peer's agent name, base and device are cached. A direct request's lists are prepared once: its post
    is make_prepped_xfer by index + transfer; other posts build merged lists, initialize_xfer, transfer."""

    write_per_request = True

    def __init__(self, name: str, error_handling: str = "peer") -> None:
        self.agent = make_agent(name, error_handling=error_handling)
        self._bases = [0, 0]  # data_ptr of the STAGING and KV regions (0 = not registered)
        self._regs: list[object] = [None, None]
        self._mem, self._dev = "DRAM", 0
        self._peers: dict[str, Entry] = {}  # peer → (agent name, base, device, mem)
        self._preps: dict[str, list[PreppedRequest]] = {}  # peer → its requests' prepared lists

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()  # type: ignore[attr-defined,no-any-return]

    def _register(self, region: int, t: torch.Tensor) -> None:
        if self._regs[region] is not None:
            self.agent.deregister_memory(self._regs[region])  # type: ignore[attr-defined]
        self._regs[region] = self.agent.register_memory(t)  # type: ignore[attr-defined]
        self._bases[region] = t.data_ptr()
        self._mem, self._dev = _mem(t)

    def set_staging(self, staging: object) -> None:
        self._register(STAGING, cast(torch.Tensor, staging))

    def register_kv(self, kv_buffer: object) -> None:
        """Register kv_buffer (VRAM on a GPU, DRAM on CPU) for direct writes; must be contiguous."""
        assert isinstance(kv_buffer, torch.Tensor) and kv_buffer.is_contiguous()
        self._register(KV, kv_buffer)

    def add_peer(self, peer: str, remote: bytes) -> None:
        meta = msgspec.msgpack.decode(remote, type=NixlRecvMeta)
        name = self.agent.add_remote_agent(meta.agent)  # type: ignore[attr-defined]
        self._peers[peer] = (name, meta.base, meta.device, meta.mem)

    def remove_peer(self, peer: str) -> None:
        """Forget the peer: its prepared lists are released first (they name its agent)."""
        for req in self._preps.pop(peer, []):
            self._release(req)
        entry = self._peers.pop(peer, None)
        if entry is not None:
            _forget_agent(self.agent, entry[0])

    def prepare(self, peer: str, pieces: list[SourcePiece]) -> object:
        """The (peer entry, local (addr, bytes, device) tuples, remote tuples) of a later WRITE of
        `pieces`. Raises TransferError for an unknown peer or an unregistered source region."""
        entry = self._entry(peer)
        if any(not self._bases[r] for r, _, _, _ in pieces):
            raise TransferError("NIXL write from a source region that is not registered")
        _, rbase, rdev, _ = entry
        bases, dev = self._bases, self._dev
        return (entry, [(bases[r] + s, n, dev) for r, s, _, n in pieces],
                [(rbase + d, n, rdev) for _, _, d, n in pieces])

    def prepare_layers(self, peer: str, layers: list[list[SourcePiece]]) -> list[object]:
        """Both descriptor lists of every layer prepared once (prep_xfer_dlist, local and remote);
        part l = (request, l). Raises TransferError (unknown peer, unregistered region, NIXL refused)."""
        preps = [cast(_Prepared, self.prepare(peer, pieces)) for pieces in layers]
        entry = self._entry(peer)
        loc = [p[1] for p in preps]
        rem = [p[2] for p in preps]
        try:
            local = self.agent.prep_xfer_dlist("", [d for x in loc for d in x], self._mem)  # type: ignore[attr-defined]
            remote = self.agent.prep_xfer_dlist(entry[0], [d for x in rem for d in x], entry[3])  # type: ignore[attr-defined]
        except Exception as exc:
            raise TransferError(f"NIXL could not prepare descriptor lists for {peer}: {exc}") from exc
        req = PreppedRequest(entry, local, remote, loc, rem)
        self._preps.setdefault(peer, []).append(req)
        return [(req, layer) for layer in range(len(layers))]

    def release_prepared(self, parts: list[object]) -> None:
        """Release the prepared lists behind prepare_layers' `parts` (idempotent)."""
        reqs = {id(p[0]): p[0] for p in parts if isinstance(p, tuple) and isinstance(p[0], PreppedRequest)}
        for req in reqs.values():
            self._release(req)
            for peer, held in list(self._preps.items()):
                if req in held:
                    held.remove(req)
                    if not held:
                        del self._preps[peer]

    def prepared_count(self) -> int:
        return sum(len(v) for v in self._preps.values())

    def _release(self, req: PreppedRequest) -> None:
        req.release(self.agent)

    def _entry(self, peer: str) -> Entry:
        entry = self._peers.get(peer)
        if entry is None:
            raise TransferError(f"no NIXL connection to {peer}")
        return entry

    def post(self, peer: str, pieces: list[SourcePiece], notice: bytes, tag: int) -> object:
        """One NIXL WRITE (one descriptor per piece) carrying `notice` as its notification; returns its
        xfer handle without waiting (over CMA the copy has already happened when this returns)."""
        return self.post_prepared(peer, [self.prepare(peer, pieces)], notice, tag)

    def post_prepared(self, peer: str, parts: list[object], notice: bytes, tag: int) -> object:
        """One NIXL WRITE of several prepare()/prepare_layers() parts: by index from prepared lists when
        every part is a layer of the same request, else from descriptor lists built now. Raises
        TransferError if the peer changed (or its lists were released) since a part was prepared, or if
        the write cannot start."""
        entry = self._entry(peer) if parts else None
        if entry is None:
            raise TransferError("empty NIXL write")
        self._mark("post:build", len(parts))
        first = parts[0]
        if isinstance(first[0], PreppedRequest) and all(p[0] is first[0] for p in parts):  # type: ignore[index]
            req: PreppedRequest = first[0]  # type: ignore[index]
            if req.entry is not entry or req.released:
                raise TransferError(f"NIXL connection to {peer} changed since the write was prepared")
            idx: list[int] = []
            for part in parts:
                idx += req.idx[cast(_Layer, part)[1]]
            self._mark("post:descs", len(idx))
            try:
                handle = self.agent.make_prepped_xfer("WRITE", req.local, idx, req.remote, idx, notice)  # type: ignore[attr-defined]
            except Exception as exc:
                raise TransferError(f"NIXL write to {peer} could not be made: {exc!r}") from exc
        else:
            handle = self._initialize(entry, peer, parts, notice)
        self._mark("post:init", -1)
        return self._start(handle, peer)

    def _initialize(self, entry: Entry, peer: str, parts: list[object], notice: bytes) -> object:
        try:
            local, remote = merge_descs(*part_descs(parts, entry, self.agent))
        except ValueError as exc:
            raise TransferError(f"NIXL connection to {peer} changed since the write was prepared") from exc
        try:
            descs = (self.agent.get_xfer_descs(local, self._mem),  # type: ignore[attr-defined]
                     self.agent.get_xfer_descs(remote, entry[3]))  # type: ignore[attr-defined]
            self._mark("post:descs", len(local))
            return self.agent.initialize_xfer("WRITE", descs[0], descs[1], entry[0], notice)  # type: ignore[attr-defined]
        except Exception as exc:
            raise TransferError(f"NIXL write to {peer} could not be made: {exc!r}") from exc

    def _start(self, handle: object, peer: str) -> object:
        try:
            state = self.agent.transfer(handle)  # type: ignore[attr-defined]
        except Exception as exc:
            self.cancel(handle)
            raise TransferError(f"NIXL write to {peer} could not start: {exc!r}") from exc
        self._mark("post:transfer", -1)
        if state == "ERR":
            self.cancel(handle)
            raise TransferError(f"NIXL write to {peer} failed to start")
        return handle

    def _mark(self, what: str, n: int) -> None:
        if self.trace is not None:
            self.trace.append((time.perf_counter(), what, "", n))

    def test(self, handle: object) -> bool:
        """Whether the write completed (its handle then released). Raises TransferError if it failed,
        whether NIXL says "ERR" or raises (nixlRemoteDisconnectError: the receiver is gone); the handle is
        released then too."""
        try:
            state = self.agent.check_xfer_state(handle)  # type: ignore[attr-defined]
        except Exception as exc:
            self.cancel(handle)
            raise TransferError(f"NIXL write failed: {exc!r}") from exc
        if state == "PROC":
            return False
        self.cancel(handle)
        if state != "DONE":
            raise TransferError(f"NIXL write failed ({state})")
        return True

    def cancel(self, handle: object) -> None:
        """release_xfer_handle aborts a transfer still in progress (NIXL nixlAgent::releaseXferReq)."""
        with contextlib.suppress(Exception):  # a failed abort leaves nothing for us to undo
            self.agent.release_xfer_handle(handle)  # type: ignore[attr-defined]

    def close(self) -> None:
        for peer in list(self._preps):
            for req in self._preps.pop(peer):
                self._release(req)
        for region, reg in enumerate(self._regs):
            if reg is not None:
                self.agent.deregister_memory(reg)  # type: ignore[attr-defined]
                self._regs[region], self._bases[region] = None, 0
