"""CPU pinning for ``bench.gateway.overhead --gateway-processes ... --pin-cpus``: which cores each gateway
process gets and which the load side (client processes, fake workers, the bench itself) shares
(``assign_cores``, pure; the host's SMT siblings from ``physical_cores``), and pinning every thread of a
running process to a set (``pin_process``).

Assignment (``assign_cores``): the CPUs are ordered by physical core (SMT siblings, as Linux lists them in
``/sys/devices/system/cpu/cpu<N>/topology/thread_siblings_list``, side by side, so that a gateway process's
2 CPUs are one core's two threads rather than a thread beside a load-side process), then the gateway
processes of the largest N asked get CPUs of their own from the top of that order (the low-numbered cores,
where the kernel tends to place interrupt work, stay with the load side); every other CPU is the load
side's, shared by all its processes (the scheduler balances them). Each gateway process gets 2 CPUs (its
event loop and zmq's I/O thread, which shares its process's set) when that leaves the load side at least
half the CPUs (``4 * N <= CPUs``), else 1; ``cores_per_process`` (``--gateway-cores``) sets it instead (1:
more CPUs left to a load side that would otherwise limit the largest N). On a host with SMT each gateway
process gets a physical core of its own, its first 1 or 2 threads; with 1, the sibling thread idles
(a load-side process beside it would share the core). The same plan serves every level of
a run: at a smaller N the CPUs of the absent processes stay idle, so the load side has the same CPUs at
every N and only the gateway's capacity changes. Fewer CPUs than N + 1 (one per gateway process and one for
the load side) is refused: overlapping would measure the scheduler, not the gateway.

Pinning (``pin_process``): Linux ``sched_setaffinity`` acts on one thread, so every thread of the
process (``/proc/<pid>/task``) is pinned, repeated until no new thread appears; threads started later
inherit their creator's set. Linux only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

FLAG = "--pin-cpus"


@dataclass(frozen=True)
class CorePlan:
    """Where each process of a ``--gateway-processes`` run may run (CPU ids as the kernel numbers them).

    ``gateway[i]``: gateway process i's cores (i < the largest N of the run); ``load``: the cores the
    client processes, fake workers and the bench share, disjoint from every ``gateway[i]``; ``smt``: some
    CPUs given were SMT siblings of one physical core (kept together by the order); ``probe``: the core of
    the clock probe (``--clock-probe``: one physical core taken from the load side; empty without it).
    """

    gateway: tuple[frozenset[int], ...]
    load: frozenset[int]
    smt: bool = False
    probe: frozenset[int] = frozenset()

    @property
    def gateway_union(self) -> frozenset[int]:
        """All gateway processes' cores (the pool's parent process runs there)."""
        return frozenset[int]().union(*self.gateway)

    def describe(self) -> str:
        """One line for the report header: each gateway process's cores, then the load side's."""
        parts = [f"gateway process {i}: cores {format_cpus(c)}" for i, c in enumerate(self.gateway)]
        smt = " (SMT: a physical core's threads kept together)" if self.smt else ""
        load = f"clients, fake workers and the bench: cores {format_cpus(self.load)}{smt}"
        probe = [f"clock probe: cores {format_cpus(self.probe)}"] if self.probe else []
        return "; ".join([*parts, load, *probe])


def format_cpus(cpus: Iterable[int]) -> str:
    """CPU ids as ranges, as ``taskset -c`` takes them: ``{0, 1, 2, 5}`` -> ``0-2,5``."""
    ids = sorted(cpus)
    runs: list[str] = []
    start = prev = ids[0] if ids else 0
    for c in [*ids[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(runs) if ids else ""


def parse_cpus(text: str) -> frozenset[int]:
    """A kernel CPU list (``0-2,5``, as in sysfs and ``taskset -c``) as a set.

    Raises ValueError if malformed."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


def physical_cores(cpus: Iterable[int], sysfs: str = "/sys/devices/system/cpu") -> dict[int, int]:
    """CPU id -> its physical core's key (the lowest CPU id among its SMT siblings, from
    ``<sysfs>/cpu<N>/topology/thread_siblings_list``); a CPU whose file is missing is its own core."""
    out: dict[int, int] = {}
    for c in cpus:
        try:
            with open(f"{sysfs}/cpu{c}/topology/thread_siblings_list") as f:
                siblings = parse_cpus(f.read())
        except (OSError, ValueError):
            siblings = frozenset({c})
        out[c] = min(siblings | {c})
    return out


def assign_cores(cpus: Sequence[int], max_processes: int,
                 core_of: Mapping[int, int] | None = None, probe: bool = False,
                 cores_per_process: int | None = None) -> CorePlan:
    """The plan for a run whose largest gateway level is ``max_processes`` on the CPUs ``cpus`` (this
    process's affinity, ``os.sched_getaffinity(0)``), ``core_of`` mapping a CPU to its physical core's key
    (``physical_cores``; None or a missing CPU: its own core); see the module docstring for the rule. With
    ``probe`` the load side's highest physical core (all its CPUs) becomes the clock probe's; the load
    side keeps the rest and must keep at least one CPU. ``cores_per_process`` (1 or 2; None: the rule of
    the module docstring): CPUs per gateway process.

    Raises ValueError naming ``--pin-cpus`` when ``max_processes`` < 1, ``cpus`` repeats an id, or there
    are fewer than ``max_processes + 1`` CPUs, or the probe would leave the load side none; naming
    ``--gateway-cores`` when ``cores_per_process`` is not 1 or 2 or leaves the load side no CPU.
    """
    if cores_per_process not in (None, 1, 2):
        raise ValueError(f"--gateway-cores: must be 1 or 2, got {cores_per_process}")
    if max_processes < 1:
        raise ValueError(f"{FLAG}: the largest gateway level must be >= 1, got {max_processes}")
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"{FLAG}: CPU ids repeat in {list(cpus)}")
    if len(cpus) < max_processes + 1:
        raise ValueError(f"{FLAG}: {len(cpus)} CPUs ({format_cpus(cpus)}) are too few for {max_processes} "
                         f"gateway processes on cores of their own plus 1 core for the clients and fake "
                         f"workers; need >= {max_processes + 1} (or run without {FLAG})")
    core = dict(core_of or {})
    ordered = sorted(cpus, key=lambda c: (core.get(c, c), c))
    per = cores_per_process or (2 if 4 * max_processes <= len(ordered) else 1)
    smt = len({core.get(c, c) for c in cpus}) < len(cpus)
    if smt:  # a physical core per gateway process, its first ``per`` threads; a sibling left over idles
        groups: dict[int, list[int]] = {}
        for c in ordered:
            groups.setdefault(core.get(c, c), []).append(c)
        physical = list(groups.values())
        if max_processes >= len(physical):
            raise ValueError(f"{FLAG}: {max_processes} gateway processes on physical cores of their own "
                             f"leave none of {len(physical)} for the clients and fake workers")
        gateway = tuple(frozenset(g[:per]) for g in physical[len(physical) - max_processes:])
        load = [c for g in physical[:len(physical) - max_processes] for c in g]
    else:
        if per * max_processes >= len(ordered):
            raise ValueError(f"--gateway-cores {per}: {max_processes} gateway processes x {per} leave no CPU "
                             f"of {len(ordered)} for the clients and fake workers")
        top = ordered[len(ordered) - per * max_processes:]
        gateway = tuple(frozenset(top[i * per:(i + 1) * per]) for i in range(max_processes))
        load = ordered[:len(ordered) - per * max_processes]
    probe_cpus: list[int] = []
    if probe:
        last = core.get(load[-1], load[-1])
        probe_cpus = [c for c in load if core.get(c, c) == last]
        load = [c for c in load if c not in probe_cpus]
        if not load:
            raise ValueError(f"{FLAG} --clock-probe: {len(cpus)} CPUs ({format_cpus(cpus)}) leave no core "
                             f"for the clients and fake workers once {max_processes} gateway processes and "
                             "the probe have theirs")
    return CorePlan(gateway=gateway, load=frozenset(load), smt=smt, probe=frozenset(probe_cpus))


def thread_ids(pid: int) -> set[int]:
    """The thread ids of process ``pid`` (``/proc/<pid>/task``). Raises FileNotFoundError if it is gone."""
    return {int(t) for t in os.listdir(f"/proc/{pid}/task")}


def pin_process(pid: int, cpus: frozenset[int]) -> int:
    """Pin every thread of process ``pid`` to ``cpus`` and check each took it; returns how many threads.

    Threads that exit meanwhile are skipped. Raises RuntimeError naming ``--pin-cpus`` on a platform
    without ``os.sched_setaffinity`` or when a thread's affinity reads back different;
    FileNotFoundError when the process is gone.
    """
    if not hasattr(os, "sched_setaffinity"):
        raise RuntimeError(f"{FLAG} needs Linux (os.sched_setaffinity)")
    done: set[int] = set()
    while todo := thread_ids(pid) - done:  # until a pass finds no thread started meanwhile
        for tid in todo:
            try:
                os.sched_setaffinity(tid, cpus)
                got = os.sched_getaffinity(tid)
            except ProcessLookupError:
                continue
            if got != cpus:
                raise RuntimeError(f"{FLAG}: thread {tid} of process {pid} runs on cores {format_cpus(got)}, "
                                   f"asked {format_cpus(cpus)}")
        done |= todo
    return len(done & thread_ids(pid))
