"""ucxx transport: two-sided tag send/receive, endpoints created from worker addresses exchanged in
the Hello/HelloReply handshake (not ucxx's listener: its forced peer-failure handling excludes UCX's
shared-memory transports, so two processes of one host would talk TCP). The sender announces each
request-layer with a LayerNotice on the control plane, then tag-sends one message per piece (tags
tag..tag+n-1) from its staging slot without waiting for earlier request-layers (several are in flight,
each from its own slot); the receiver posts tag receives straight into the destination runs of
kv_buffer (no receiver staging) and reports the layer when all have completed. CPU buffers go as uint8
numpy views, CUDA tensors through __cuda_array_interface__. API: ucxx._lib.libucxx (UCXContext,
UCXWorker, UCXEndpoint, tag_send/tag_recv).
"""

from __future__ import annotations

import os

import torch

from kvtransfer.transports.base import RecvTransport, SendTransport, SourcePiece
from kvtransfer.types import TransferError

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def _worker(device: torch.device) -> tuple[object, object]:
    """(context, worker): the caller keeps the context alive as long as the worker. For CUDA buffers
    the device's primary context must exist before UCX starts (so cuda_ipc/cuda_copy are usable)."""
    import ucxx._lib.libucxx as u

    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)

    ctx = u.UCXContext({}, feature_flags=(u.Feature.TAG,))
    return ctx, u.UCXWorker(ctx, enable_delayed_submission=False, enable_python_future=False)


def _endpoint(worker: object, address: bytes) -> object:
    import ucxx._lib.libucxx as u

    return u.UCXEndpoint.create_from_worker_address(worker, u.UCXAddress.create_from_buffer(address), False)


def _array(t: torch.Tensor) -> object:
    from ucxx._lib.arr import Array

    return Array(t if t.is_cuda else t.numpy())


def _tag(value: int) -> object:
    from ucxx.types import Tag

    return Tag(value)


class UcxSendTransport(SendTransport):
    """Tag-sends pieces of the staging ring or (direct path) of kv_buffer over ucxx endpoints: CPU
    slices as uint8 numpy views, CUDA slices through __cuda_array_interface__ (no copy either way)."""

    one_sided = False

    def __init__(self, device: torch.device) -> None:
        self.context, self.worker = _worker(device)
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._kv = torch.empty(0, dtype=torch.uint8)
        self._eps: dict[str, object] = {}

    def metadata(self) -> bytes:
        return self.worker.address.tobytes()  # type: ignore[attr-defined,no-any-return]

    def set_staging(self, staging: object) -> None:
        assert isinstance(staging, torch.Tensor)
        self._staging = staging

    def register_kv(self, kv_buffer: object) -> None:
        assert isinstance(kv_buffer, torch.Tensor)
        self._kv = kv_buffer.view(-1).view(torch.uint8)

    def add_peer(self, peer: str, remote: bytes) -> None:
        self._eps[peer] = _endpoint(self.worker, remote)

    def remove_peer(self, peer: str) -> None:
        ep = self._eps.pop(peer, None)
        if ep is not None:
            ep.close()  # type: ignore[attr-defined]

    def post(self, peer: str, pieces: list[SourcePiece], notice: bytes, tag: int) -> object:
        """Tag-send each piece (tags tag, tag+1, ...) without waiting; returns the ucxx requests."""
        ep = self._eps.get(peer)
        if ep is None:
            raise TransferError(f"no ucxx endpoint to {peer}")
        regions = (self._staging, self._kv)
        return [ep.tag_send(_array(regions[r][s:s + n]), _tag(tag + i))  # type: ignore[attr-defined]
                for i, (r, s, _, n) in enumerate(pieces)]

    def test(self, handle: object) -> bool:
        assert isinstance(handle, list)
        if not all(r.completed for r in handle):
            return False
        for r in handle:
            try:
                r.check_error()
            except Exception as exc:
                raise TransferError(f"ucxx send failed: {exc}") from exc
        return True

    def cancel(self, handle: object) -> None:
        """ucxx requests cannot be cancelled one by one: they end with their endpoint (remove_peer).
        A send still reading a reused staging slot only reads, so nothing else is harmed."""

    def progress(self) -> None:
        self.worker.progress()  # type: ignore[attr-defined]

    def close(self) -> None:
        for peer in list(self._eps):
            self.remove_peer(peer)


class UcxRecvTransport(RecvTransport):
    """Posts tag receives into `kv_buffer` (flat byte view; must be contiguous)."""

    one_sided = False

    def __init__(self, kv_buffer: torch.Tensor) -> None:
        self.context, self.worker = _worker(kv_buffer.device)
        self.kv_bytes = kv_buffer.view(-1).view(torch.uint8)
        self._eps: dict[str, object] = {}
        self._posts: dict[int, tuple[str, list[object]]] = {}

    def metadata(self) -> bytes:
        return self.worker.address.tobytes()  # type: ignore[attr-defined,no-any-return]

    def add_peer(self, peer: str, remote: bytes) -> None:
        self._eps[peer] = _endpoint(self.worker, remote)

    def remove_peer(self, peer: str) -> None:
        ep = self._eps.pop(peer, None)
        if ep is not None:
            ep.close()  # type: ignore[attr-defined]  # cancels receives posted on it
        self._posts = {k: v for k, v in self._posts.items() if v[0] != peer}

    def post(self, peer: str, key: int, pieces: list[tuple[int, int]], tag: int) -> None:
        from ucxx.types import TagMaskFull

        ep = self._eps[peer]
        reqs = [ep.tag_recv(_array(self.kv_bytes[d:d + n]), _tag(tag + i), TagMaskFull)  # type: ignore[attr-defined]
                for i, (d, n) in enumerate(pieces)]
        self._posts[key] = (peer, reqs)

    def poll(self) -> tuple[list[tuple[str, bytes]], list[int]]:
        self.worker.progress()  # type: ignore[attr-defined]
        done = [k for k, (_, reqs) in self._posts.items() if all(r.completed for r in reqs)]  # type: ignore[attr-defined]
        for k in done:
            del self._posts[k]
        return [], done

    def close(self) -> None:
        for peer in list(self._eps):
            self.remove_peer(peer)
