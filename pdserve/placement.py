"""Where ``pdserve up`` runs each worker: its ``--device`` (a GPU, or the CPU with a share of the cores),
the GPUs its tensor parallel ranks own, and the ``CUDA_VISIBLE_DEVICES`` a worker child gets for them.

``worker_roles`` names the workers in start order (prefill, decode, colocated); ``placements`` decides a
``Placement`` per worker from the visible GPUs and the cores this process may use; ``shared_gpus`` says
which GPUs single-rank workers share (``pdserve up`` tells the user, and ``--cuda-mps`` serves them);
``worker_envs`` lists a worker's own GPUs first in its ``CUDA_VISIBLE_DEVICES``. ``pdserve.launcher``
turns these into the children's command lines and environments.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from protocol.settings import UpSettings


def gpu_count() -> int:
    """CUDA devices visible to this process (0 without torch's CUDA build or a GPU)."""
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def visible_gpu_ids(cuda_visible_devices: str | None, num_gpus: int) -> list[str]:
    """The ids this process's GPUs 0..``num_gpus - 1`` have in a child's ``CUDA_VISIBLE_DEVICES``: the
    entries of this process's own ``cuda_visible_devices`` (indices or UUIDs, comma-separated) when it is
    set, else ``"0" .. str(num_gpus - 1)``."""
    if cuda_visible_devices:
        ids = [part.strip() for part in cuda_visible_devices.split(",") if part.strip()]
        if len(ids) >= num_gpus:
            return ids[:num_gpus]
    return [str(i) for i in range(num_gpus)]


@dataclass(frozen=True)
class Placement:
    """Where one worker runs: ``flags`` (``--device``; on GPUs ``--kv-memory-fraction``; on the CPU
    ``--cpu-threads`` when the launcher shares its cores out) and
    ``gpus``, the indices (among this process's visible GPUs) of the GPUs its tensor parallel ranks own,
    rank r on ``gpus[r]``; empty when the worker is not given GPUs of its own (CPU, an explicit
    ``--device``, or one rank placed by ``--device cuda:i``)."""

    flags: tuple[str, ...]
    gpus: tuple[int, ...] = ()


def placements(device: str, tensor_parallel_sizes: Sequence[int], num_gpus: int,
               cpu_cores: int = 0) -> list[Placement]:
    """Where each worker runs, given each worker's tensor parallel size (one entry per worker, in start
    order). On the CPU (``--device cpu``, or ``auto`` without GPUs) with ``cpu_cores`` > 0 (the cores
    this process may run on), every worker also gets ``--cpu-threads``: an equal share of the cores per
    rank, at least 1, since ranks each with a thread per core would spin against each other (on 2 cores,
    four SmolLM2 decodes at once: 19-24 s with two threads each, 4 s with one). With ``--device
    auto|cuda`` and GPUs present: when every worker has one rank, worker i gets
    ``--device cuda:{i % num_gpus}`` (one worker per GPU when there are enough) and, where k workers
    share a GPU, a KV memory fraction of 0.85 / k of its free memory; when some worker has several ranks,
    every worker gets GPUs of its own, consecutive and never shared (``gpus``; the launcher lists them
    first in its ``CUDA_VISIBLE_DEVICES``, so its rank r takes ``cuda:r``: ``worker_envs``) and
    ``--device cuda``. Otherwise
    (no GPUs, or another ``--device``) every worker gets ``--device`` as given.

    Raises:
        ValueError: on GPUs, workers with several ranks need more GPUs than ``num_gpus`` (the sum of the
            tensor parallel sizes), or an explicit ``cuda:i`` device with several ranks (one line each,
            naming the flag).
    """
    sizes = list(tensor_parallel_sizes)
    several = any(n > 1 for n in sizes)
    if several and device.startswith("cuda:"):
        raise ValueError(f"--device {device} names one GPU but --tensor-parallel-size "
                         f"{max(sizes)} needs one per rank: use --device auto or cuda")
    if device not in ("auto", "cuda") or num_gpus == 0:
        threads = (("--cpu-threads", str(max(1, cpu_cores // sum(sizes))))
                   if cpu_cores > 0 and sizes and (device == "cpu" or num_gpus == 0) else ())
        return [Placement(("--device", device, *threads))] * len(sizes)
    if several:
        if sum(sizes) > num_gpus:
            raise ValueError(f"--tensor-parallel-size: {len(sizes)} workers need {sum(sizes)} GPUs "
                             f"({'+'.join(map(str, sizes))} ranks), {num_gpus} visible")
        firsts = [sum(sizes[:k]) for k in range(len(sizes))]
        return [Placement(("--device", "cuda", "--kv-memory-fraction", "0.9"),
                          tuple(range(first, first + n))) for first, n in zip(firsts, sizes, strict=True)]
    share = -(-len(sizes) // num_gpus)  # workers on the busiest GPU
    fraction = f"{0.85 / share:.3f}" if share > 1 else "0.9"
    return [Placement(("--device", f"cuda:{i % num_gpus}", "--kv-memory-fraction", fraction))
            for i in range(len(sizes))]


def num_workers(settings: UpSettings) -> int:
    """Workers ``pdserve up`` starts (prefill + decode + colocated)."""
    return settings.num_prefill + settings.num_decode + settings.colocated


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one, else every CPU)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def worker_roles(settings: UpSettings) -> list[tuple[str, str]]:
    """(role, child name) of each worker ``pdserve up`` starts, in start order: prefill, decode, colocated."""
    return [(role, f"{role}-{i}") for role, count in (("prefill", settings.num_prefill),
                                                      ("decode", settings.num_decode),
                                                      ("colocated", settings.colocated))
            for i in range(count)]


def worker_placements(settings: UpSettings, num_gpus: int, cpu_cores: int = 0) -> list[Placement]:
    """Each worker's ``Placement`` (in ``worker_roles`` order): every worker has ``--tensor-parallel-size``
    ranks as given to ``up``; ``cpu_cores`` as ``placements``.

    Raises:
        ValueError: the ranks do not fit the visible GPUs (``placements``).
    """
    size = settings.worker.tensor_parallel_size
    return placements(settings.device, [size] * num_workers(settings), num_gpus, cpu_cores)


def shared_gpus(settings: UpSettings, num_gpus: int) -> dict[str, list[str]]:
    """The CUDA devices (``--device`` values) that two or more single-rank workers are placed on, each with
    those workers' names (``worker_roles`` order); empty on the CPU or with a GPU per worker.

    Raises:
        ValueError: the ranks do not fit the visible GPUs (``placements``).
    """
    on: dict[str, list[str]] = {}
    for (_, name), place in zip(worker_roles(settings), worker_placements(settings, num_gpus), strict=True):
        device = place.flags[place.flags.index("--device") + 1] if "--device" in place.flags else "cpu"
        if device.startswith("cuda") and not place.gpus:
            on.setdefault("cuda:0" if device == "cuda" else device, []).append(name)
    return {device: names for device, names in on.items() if len(names) > 1}


def worker_envs(settings: UpSettings, num_gpus: int,
                cuda_visible_devices: str | None = None) -> dict[str, dict[str, str]]:
    """The environment each worker child gets on top of the launcher's, by child name: a worker with GPUs
    of its own (``Placement.gpus``) gets ``CUDA_VISIBLE_DEVICES`` listing those first, in rank order (its
    rank r takes ``cuda:r``), then every other visible GPU, as ids of the launcher's own
    ``cuda_visible_devices`` (``visible_gpu_ids``): the peers' GPUs stay visible, as CUDA IPC between the
    prefill and decode workers needs; others get nothing.

    Raises:
        ValueError: the ranks do not fit the visible GPUs (``placements``).
    """
    ids = visible_gpu_ids(cuda_visible_devices, num_gpus)

    def order(gpus: tuple[int, ...]) -> str:
        return ",".join(ids[g] for g in (*gpus, *(g for g in range(num_gpus) if g not in gpus)))

    return {name: {"CUDA_VISIBLE_DEVICES": order(place.gpus)} if place.gpus else {}
            for (_, name), place in zip(worker_roles(settings), worker_placements(settings, num_gpus),
                                        strict=True)}
