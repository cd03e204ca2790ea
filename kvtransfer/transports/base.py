"""The data-plane interface every backend implements (loopback.py, nixl.py, ucx.py).

A sender transport writes byte pieces of one of its two registered source regions, the staging ring
(STAGING) or its own kv_buffer (KV, the direct path), into a peer's KV tensor; a receiver
transport exposes its KV tensor. Control messages never go through it (see wire.py), except the
layer notice of one-sided transports, which travels with the data (NIXL notif) so that it can only
arrive after the data. All methods are called from one thread (the sender's or receiver's loop).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

STAGING, KV = 0, 1  # source regions of a write piece
SourcePiece = tuple[int, int, int, int]  # (STAGING | KV, source byte offset, destination byte offset, bytes)
TraceEvent = tuple[float, str, str, int]  # (time.perf_counter() s, what, request_id, layer or count)


class SendTransport(ABC):
    """Sender side. `one_sided` transports carry the notice with the data; two-sided ones need the
    receiver to post receives after a LayerNotice on the control plane."""

    one_sided: bool = True
    # post the direct layers of each request as their own write (prepare_layers made them cheap to
    # post by index); else one write per peer carries every ready request-layer
    write_per_request: bool = False
    # a list to append TraceEvents of the post path to (bench --trace), or None (off)
    trace: list[TraceEvent] | None = None

    @abstractmethod
    def metadata(self) -> bytes:
        """What the receiver needs to reach us (sent in Hello)."""

    @abstractmethod
    def set_staging(self, staging: object) -> None:
        """Use (and register) this flat uint8 torch tensor as the staging buffer."""

    @abstractmethod
    def register_kv(self, kv_buffer: object) -> None:
        """Use (and register, once) the sender's contiguous torch kv_buffer as the KV source region."""

    @abstractmethod
    def add_peer(self, peer: str, remote: bytes) -> None:
        """Connect to a receiver from its HelloReply metadata."""

    @abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forget a receiver (dead, restarted or closed)."""

    @abstractmethod
    def post(self, peer: str, pieces: list[SourcePiece], notice: bytes, tag: int) -> object:
        """Start copying `pieces` (source region, source offset, destination offset, bytes) to `peer`;
        do not wait. Two-sided transports send piece i under tag + i.

        Returns a handle for test()/cancel(). Several posts may be in flight at once (each from its own
        staging slot or kv_buffer range). Raises TransferError if the write cannot be started (unknown
        peer, unregistered source region).
        """

    def prepare(self, peer: str, pieces: list[SourcePiece]) -> object:
        """What a post of `pieces` to `peer` needs in this transport's own form (NIXL: the local and
        remote descriptor tuples), computed once per request-layer ahead of its post. Valid until the
        peer is removed or re-added, or the staging ring is replaced. Raises TransferError for an
        unknown peer or an unregistered source region. Default: the pieces themselves."""
        return list(pieces)

    def prepare_layers(self, peer: str, layers: list[list[SourcePiece]]) -> list[object]:
        """prepare() of every layer of one direct request (layers[l]: layer l's pieces), once, when its
        Begin is answered; part l goes to post_prepared like a prepare() result. NIXL prepares both
        descriptor lists once here (prep_xfer_dlist) so that a post is make_prepped_xfer by index.
        Release with release_prepared. Raises TransferError as prepare() does."""
        return [self.prepare(peer, pieces) for pieces in layers]

    def release_prepared(self, parts: list[object]) -> None:  # noqa: B027 (optional hook)
        """Free what prepare_layers holds for `parts` (idempotent; also done by remove_peer/close).
        Call once no post of them can follow (the request is terminal, nothing in flight)."""

    def prepared_count(self) -> int:
        """prepare_layers results still held (leak checks); 0 for transports that hold nothing."""
        return 0

    def post_prepared(self, peer: str, parts: list[object], notice: bytes, tag: int) -> object:
        """post() of the concatenation of several prepare() results (one write, one notice): the
        sender's hot path, list concatenation plus the transport call. Raises TransferError as post()
        does, and if `peer` was removed or re-added since a part was prepared."""
        return self.post(peer, [p for part in parts for p in part], notice, tag)  # type: ignore[attr-defined]

    @abstractmethod
    def test(self, handle: object) -> bool:
        """True once the posted write completed (its handle is then released); False while in flight.

        Raises TransferError (handle released) if the write failed.
        """

    def cancel(self, handle: object) -> None:  # noqa: B027 (optional hook)
        """Give up a posted write that has not completed (deadline passed, peer gone): release its
        handle, aborting it if the transport can."""

    def progress(self) -> None:  # noqa: B027 (optional hook)
        """Make progress on posted writes (called by the sender loop while any are in flight)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release transport resources."""


class RecvTransport(ABC):
    """Receiver side, owning the registered KV tensor."""

    one_sided: bool = True

    @abstractmethod
    def metadata(self) -> bytes:
        """What a sender needs to write into our KV tensor (sent in HelloReply)."""

    @abstractmethod
    def add_peer(self, peer: str, remote: bytes) -> None:
        """Accept a sender from its Hello metadata."""

    @abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forget a sender; cancels receives posted for it."""

    def post(self, peer: str, key: int, pieces: list[tuple[int, int]], tag: int) -> None:
        """Two-sided only: receive (destination offset, bytes) pieces under tags tag, tag+1, ...;
        `key` is reported by poll() once all have landed."""
        raise NotImplementedError

    @abstractmethod
    def poll(self) -> tuple[list[tuple[str, bytes]], list[int]]:
        """Make progress; return ((peer key, notice) of each notice that arrived with data, as add_peer
        named its sender; keys of completed posts). A notice whose sender is no peer is dropped here."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release transport resources."""
