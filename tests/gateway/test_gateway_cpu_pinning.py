"""``bench.gateway.cpu_pinning``: the core plan of ``--pin-cpus`` (pure: which cores each gateway process
and the load side get, refusal with too few) and pinning every thread of a live process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gateway.cpu_pinning import (
    assign_cores,
    format_cpus,
    parse_cpus,
    physical_cores,
    pin_process,
    thread_ids,
)


def test_sixteen_cores_four_processes_get_two_cores_each() -> None:
    plan = assign_cores(range(16), 4)
    assert plan.gateway == (frozenset({8, 9}), frozenset({10, 11}), frozenset({12, 13}), frozenset({14, 15}))
    assert plan.load == frozenset(range(8))
    assert plan.gateway_union == frozenset(range(8, 16))
    assert plan.describe() == ("gateway process 0: cores 8-9; gateway process 1: cores 10-11; "
                               "gateway process 2: cores 12-13; gateway process 3: cores 14-15; "
                               "clients, fake workers and the bench: cores 0-7")


def test_fewer_than_four_cores_per_process_gives_one_each() -> None:
    plan = assign_cores(list(range(12)), 4)  # 2 each would leave the load side 4 of 12
    assert plan.gateway == (frozenset({8}), frozenset({9}), frozenset({10}), frozenset({11}))
    assert plan.load == frozenset(range(8))
    two = assign_cores([0, 1], 1)
    assert (two.gateway, two.load) == ((frozenset({1}),), frozenset({0}))


def test_gateway_cores_sets_the_cpus_per_process() -> None:
    one = assign_cores(range(16), 4, probe=True, cores_per_process=1)
    assert one.gateway == (frozenset({12}), frozenset({13}), frozenset({14}), frozenset({15}))
    assert one.probe == frozenset({11}) and one.load == frozenset(range(11))
    two = assign_cores(range(12), 4, cores_per_process=2)  # the default rule would give 1 each here
    assert two.gateway[0] == frozenset({4, 5}) and two.load == frozenset(range(4))
    with pytest.raises(ValueError, match="--gateway-cores 2: 4 gateway processes x 2 leave no CPU of 8"):
        assign_cores(range(8), 4, cores_per_process=2)
    with pytest.raises(ValueError, match="--gateway-cores: must be 1 or 2, got 3"):
        assign_cores(range(16), 4, cores_per_process=3)


def test_plan_follows_the_cpu_ids_given_not_their_count() -> None:
    plan = assign_cores([14, 0, 2, 4, 6, 8, 10, 12], 2)  # an affinity mask with holes, unsorted
    assert plan.gateway == (frozenset({8, 10}), frozenset({12, 14}))
    assert plan.load == frozenset({0, 2, 4, 6})


def test_smt_siblings_stay_together() -> None:
    # 8 physical cores, 2 threads each, Linux's usual numbering: CPU i and i + 8 share core i
    core_of = {c: c % 8 for c in range(16)}
    plan = assign_cores(list(range(16)), 4, core_of)
    assert plan.gateway == (frozenset({4, 12}), frozenset({5, 13}), frozenset({6, 14}), frozenset({7, 15}))
    assert plan.load == frozenset({0, 1, 2, 3, 8, 9, 10, 11})  # no physical core shared with a gateway
    assert plan.smt and "SMT" in plan.describe()
    assert not assign_cores(list(range(16)), 4).smt


def test_one_cpu_per_process_on_smt_takes_a_physical_core_and_idles_its_sibling() -> None:
    """With one CPU each, two gateway processes were put on one physical core's two threads."""
    core_of = {c: c // 2 for c in range(16)}  # siblings (0, 1), (2, 3), ...
    plan = assign_cores(range(16), 4, core_of, probe=True, cores_per_process=1)
    assert plan.gateway == (frozenset({8}), frozenset({10}), frozenset({12}), frozenset({14}))
    assert plan.probe == frozenset({6, 7}) and plan.load == frozenset(range(6))
    assert {9, 11, 13, 15}.isdisjoint(plan.load | plan.probe | plan.gateway_union)  # the siblings idle
    with pytest.raises(ValueError, match="8 gateway processes on physical cores of their own leave none"):
        assign_cores(range(16), 8, core_of, cores_per_process=1)


def test_clock_probe_takes_the_load_sides_top_core() -> None:
    plan = assign_cores(list(range(16)), 4, probe=True)
    assert plan.gateway_union == frozenset(range(8, 16))
    assert (plan.load, plan.probe) == (frozenset(range(7)), frozenset({7}))
    assert plan.describe().endswith("clients, fake workers and the bench: cores 0-6; clock probe: cores 7")
    smt = assign_cores(list(range(16)), 4, {c: c % 8 for c in range(16)}, probe=True)
    assert smt.probe == frozenset({3, 11})  # both threads of one physical core
    assert smt.load == frozenset({0, 1, 2, 8, 9, 10})
    assert assign_cores(list(range(16)), 4).probe == frozenset()
    with pytest.raises(ValueError, match=r"^--pin-cpus --clock-probe: 2 CPUs \(0-1\) leave no core"):
        assign_cores([0, 1], 1, probe=True)


def test_physical_cores_reads_thread_siblings(tmp_path: Path) -> None:
    for cpu, siblings in [(0, "0,2\n"), (1, "1,3\n"), (2, "0,2\n"), (3, "1,3\n"), (4, "4\n")]:
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(siblings)
    assert physical_cores([0, 1, 2, 3, 4, 5], str(tmp_path)) == {0: 0, 1: 1, 2: 0, 3: 1, 4: 4, 5: 5}
    assert parse_cpus("0-2,5,8-9\n") == frozenset({0, 1, 2, 5, 8, 9})
    with pytest.raises(ValueError):
        parse_cpus("a-b")


@pytest.mark.parametrize("cores", [2, 3, 5, 8, 9, 16, 64])
def test_plan_is_disjoint_and_covers_every_core(cores: int) -> None:
    for n in range(1, cores):
        plan = assign_cores(list(range(cores)), n)
        sets = [*plan.gateway, plan.load]
        assert len(plan.gateway) == n and plan.load
        assert sum(len(s) for s in sets) == cores and frozenset().union(*sets) == frozenset(range(cores))
        assert len({len(g) for g in plan.gateway}) == 1  # every gateway process alike


@pytest.mark.parametrize(("cpus", "n", "why"), [
    ([0, 1, 2, 3], 4, "4 CPUs \\(0-3\\) are too few for 4 gateway processes.*need >= 5"),
    ([0], 1, "1 CPUs \\(0\\) are too few"),
    ([0, 1], 0, "the largest gateway level must be >= 1"),
    ([0, 1, 1], 1, "CPU ids repeat")])
def test_too_few_cores_is_refused_naming_the_flag(cpus: list[int], n: int, why: str) -> None:
    with pytest.raises(ValueError, match=f"^--pin-cpus: {why}"):
        assign_cores(cpus, n)


def test_format_cpus_gives_taskset_ranges() -> None:
    assert format_cpus({5, 0, 1, 2}) == "0-2,5"
    assert format_cpus([3]) == "3"
    assert format_cpus([1, 3, 4, 7, 8, 9]) == "1,3-4,7-9"
    assert format_cpus([]) == ""


CHILD = """
import os, sys, threading, time
stop = threading.Event()
for _ in range(3):
    threading.Thread(target=stop.wait, daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()  # the parent has pinned us: a thread started now must inherit the set
out = []
t = threading.Thread(target=lambda: out.append(sorted(os.sched_getaffinity(0))))
t.start(); t.join()
print(",".join(map(str, out[0])), flush=True)
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and 2 CPUs")
def test_pin_process_pins_every_thread_and_later_threads_inherit() -> None:
    cpu = max(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        tids = thread_ids(proc.pid)
        assert len(tids) >= 4  # main + 3 threads started before pinning
        assert pin_process(proc.pid, frozenset({cpu})) == len(tids)
        assert all(os.sched_getaffinity(t) == {cpu} for t in tids)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == str(cpu)
    finally:
        proc.kill()
        proc.wait()
