"""Tensor-parallel process state: which tensor parallel rank this process is, and its collectives.

One process per rank. ``init_tensor_parallel`` joins the ranks with ``torch.distributed``: the device
group (NCCL on CUDA, gloo on the CPU) carries the forward's all-reduces and all-gathers, and a second gloo
group on the CPU carries the step messages rank 0 broadcasts (``engine.step_batch``), so a step message
never waits behind device work. ``TensorParallel.single()`` is the state of an engine without
``torch.distributed`` (``tensor_parallel_size=1``, today's path): its collectives are never called.

A process holds at most one initialised group (``torch.distributed``'s default group);
``TensorParallel.close`` destroys it.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

# what a rank waits for a peer in any collective before failing (torch.distributed's own timeout)
DEFAULT_TIMEOUT_S = 600.0
# the step-message group's timeout: a follower waits this long for rank 0's next step while the engine is
# idle (a rank that exits closes its sockets, which fails the peers' waits at once, so this bounds only a
# rank 0 that is alive but silent); under gloo's 2**31 ms limit
IDLE_TIMEOUT_S = 7 * 24 * 3600.0


def loopback_init_method() -> str:
    """``tcp://127.0.0.1:PORT`` with a port free on the loopback a moment ago (for ranks on one host)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among ``size`` tensor parallel ranks.

    Attributes:
        rank: this process's tensor parallel rank, ``0 <= rank < size``; rank 0 runs the scheduler.
        size: the tensor parallel size (processes sharing one model).
        distributed: True when ``torch.distributed`` is initialised for these ranks (always for
            ``size > 1``; at ``size == 1`` only when forced, to measure that path against the plain one).
        cpu_group: the gloo group of the step messages (None when not ``distributed``).
    """

    rank: int = 0
    size: int = 1
    distributed: bool = False
    cpu_group: dist.ProcessGroup | None = None

    @staticmethod
    def single() -> TensorParallel:
        """One rank, no ``torch.distributed``."""
        return TensorParallel()

    @property
    def has_followers(self) -> bool:
        """True on rank 0 of more than one rank (it broadcasts each step)."""
        return self.rank == 0 and self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (returned); ``x`` unchanged when not ``distributed``."""
        if self.distributed:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., N]`` on each rank → ``[..., size * N]``, rank ``r``'s slice at ``[r N, (r+1) N)``."""
        if not self.distributed:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (through the CPU group)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0 sends ``payload`` to every rank; the others pass None and get it. Two broadcasts on
        the CPU group (length, then bytes); waits at most the group's timeout.

        Raises:
            ValueError: rank 0 passed None, or another rank passed bytes.
            RuntimeError / DistBackendError: a peer failed or the timeout passed.
        """
        if (payload is None) == (self.rank == 0):
            raise ValueError("rank 0 passes the payload, the other ranks pass None")
        if not self.distributed:
            return payload  # type: ignore[return-value]
        length = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        dist.broadcast(length, src=0, group=self.cpu_group)
        if payload is not None:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            data = torch.empty(int(length.item()), dtype=torch.uint8)
        if data.numel():
            dist.broadcast(data, src=0, group=self.cpu_group)
        return payload if payload is not None else data.numpy().tobytes()

    def close(self) -> None:
        """Destroy the process groups (no-op when not ``distributed``)."""
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device,
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> TensorParallel:
    """Join ``size`` ranks: ``torch.distributed.init_process_group`` with NCCL when ``device`` is CUDA
    (``device`` becomes the current CUDA device first), gloo otherwise, plus a gloo group for the step
    messages. Blocks until every rank has joined or ``timeout_s`` passed.

    Args:
        rank: this process's tensor parallel rank.
        size: the number of ranks (1 is allowed: the distributed path at world size 1).
        init_method: ``tcp://host:port`` of rank 0's store (``loopback_init_method``) or ``env://``.
        device: this rank's device.
        timeout_s: the deadline of the join and of every later device collective (the step-message
            group waits ``IDLE_TIMEOUT_S``: an idle engine sends no step).

    Raises:
        ValueError: ``rank`` outside ``[0, size)``, or ``torch.distributed`` already initialised in this
            process.
        RuntimeError / DistNetworkError: the ranks did not all join in time.
    """
    if not 0 <= rank < size:
        raise ValueError(f"tensor parallel rank {rank} outside [0, {size})")
    if dist.is_initialized():
        raise ValueError("torch.distributed is already initialised in this process: one tensor parallel "
                         "engine per process")
    timeout = datetime.timedelta(seconds=timeout_s)
    idle = datetime.timedelta(seconds=max(timeout_s, IDLE_TIMEOUT_S))
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=size,
                                timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=idle)
    return TensorParallel(rank=rank, size=size, distributed=True, cpu_group=cpu_group)


def rank_device(device: torch.device, tp: TensorParallel) -> torch.device:
    """Rank ``r``'s device: ``cuda:r`` when ``device`` is CUDA without an index (``auto``/``cuda``) and
    there are several ranks; ``device`` otherwise.

    Raises:
        ValueError: an explicit CUDA index with several ranks (each rank needs its own GPU).
    """
    if device.type != "cuda" or tp.size == 1:
        return device
    if device.index is not None:
        raise ValueError(f"device {device} names one GPU but tensor_parallel_size={tp.size} needs one per "
                         "rank: use device='cuda' (rank r takes cuda:r of the visible devices)")
    return torch.device("cuda", tp.rank)
