"""Backend selection by name (`get_transfer_backend`); transports are imported only when chosen."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvtransfer.receiver import ReceiverEndpoint
    from kvtransfer.sender import SenderEndpoint
    from kvtransfer.types import TransferConfig

BACKENDS = ("nixl", "ucx", "loopback")


@dataclass(frozen=True)
class TransferBackend:
    """Factory of senders and receivers for one transport `name` ("nixl" | "ucx" | "loopback")."""

    name: str

    def sender(self, config: TransferConfig, kv_buffer: torch.Tensor) -> SenderEndpoint:
        """A started sender (api.KVSender) over this backend (config.backend must equal the name)."""
        from kvtransfer.sender import SenderEndpoint
        from kvtransfer.transports.base import SendTransport

        self._check(config)
        transport: SendTransport
        if self.name == "nixl":
            from kvtransfer.transports.nixl import NixlSendTransport

            transport = NixlSendTransport(f"{config.worker_id}-send-{os.getpid()}-{id(kv_buffer):x}",
                                          config.nixl_error_handling)
        elif self.name == "ucx":
            from kvtransfer.transports.ucx import UcxSendTransport

            transport = UcxSendTransport(kv_buffer.device)
        else:
            from kvtransfer.transports.loopback import LoopbackSendTransport

            transport = LoopbackSendTransport()
        return SenderEndpoint(config, kv_buffer, transport).start()

    def receiver(self, config: TransferConfig, kv_buffer: torch.Tensor) -> ReceiverEndpoint:
        """A started receiver (api.KVReceiver) over this backend, bound at config.host:config.port."""
        from kvtransfer.receiver import ReceiverEndpoint
        from kvtransfer.transports.base import RecvTransport

        self._check(config)
        transport: RecvTransport
        if self.name == "nixl":
            from kvtransfer.transports.nixl import NixlRecvTransport

            name = f"{config.worker_id}-recv-{os.getpid()}-{id(kv_buffer):x}"
            transport = NixlRecvTransport(name, kv_buffer, config.nixl_error_handling)
        elif self.name == "ucx":
            from kvtransfer.transports.ucx import UcxRecvTransport

            transport = UcxRecvTransport(kv_buffer)
        else:
            from kvtransfer.transports.loopback import LoopbackRecvTransport

            transport = LoopbackRecvTransport(kv_buffer)
        return ReceiverEndpoint(config, kv_buffer, transport).start()

    def _check(self, config: TransferConfig) -> None:
        if config.backend != self.name:
            raise ValueError(f"config.backend={config.backend!r} but backend is {self.name!r}")


def get_transfer_backend(name: str) -> TransferBackend:
    """The backend called `name`; raises ValueError naming the valid choices for anything else."""
    if name not in BACKENDS:
        raise ValueError(f"unknown transfer backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return TransferBackend(name)
