"""``pdserve up``'s supervisor over stand-in children: a clean stop that kills a child ignoring SIGTERM,
restarts with backoff, giving up on a crash loop (the rest keep serving while the workers left can, else
everything stops), stopping everything when the gateway exits, the
environment each child gets (``unset_env``), and children that stop when their parent is killed with
SIGKILL (Linux)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pdserve.supervisor import (
    RestartPolicy,
    Supervisor,
    parent_death_hook,
    say_up,
    serving_problem,
    supervise,
)

ROOT = Path(__file__).resolve().parents[2]


def test_stop_all_kills_a_child_that_ignores_sigterm() -> None:
    sup = Supervisor(grace=0.5)
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); " \
           "time.sleep(60)"
    sup.children["stubborn"] = proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    start = time.monotonic()
    sup.stop_all()
    assert proc.poll() is not None and proc.returncode < 0  # killed by a signal, not exited
    assert time.monotonic() - start < 5
    assert sup.dead() == [("stubborn", proc.returncode)]


def test_stop_all_stops_the_gateway_before_the_workers(tmp_path) -> None:
    """The gateway gets SIGTERM first and the workers keep running while it drains (the requests in
    flight finish on them); each worker gets SIGTERM only once the gateway has exited: the stand-in
    gateway records whether the worker was alive when its SIGTERM came, the worker whether the gateway
    was gone when its own came."""
    sup = Supervisor(grace=5.0)
    worker_pid, gateway_pid = tmp_path / "worker.pid", tmp_path / "gateway.pid"
    seen_by_gateway, seen_by_worker = tmp_path / "seen-gateway", tmp_path / "seen-worker"
    child = ("import os, pathlib, signal, sys, time\n"
             "other, seen = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])\n"
             "def on_term(*a):\n"
             "    time.sleep(0.5)  # a drain\n"
             "    try:\n"
             "        os.kill(int(other.read_text()), 0); alive = 'other alive'\n"
             "    except ProcessLookupError:\n"
             "        alive = 'other gone'\n"
             "    seen.write_text(alive); sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, on_term)\n"
             "print('up', flush=True); time.sleep(60)\n")
    sup.children["decode-0"] = w = subprocess.Popen(
        [sys.executable, "-c", child, str(gateway_pid), str(seen_by_worker)], stdout=subprocess.PIPE)
    sup.children["gateway"] = g = subprocess.Popen(
        [sys.executable, "-c", child, str(worker_pid), str(seen_by_gateway)], stdout=subprocess.PIPE)
    worker_pid.write_text(str(w.pid))
    gateway_pid.write_text(str(g.pid))
    assert w.stdout is not None and g.stdout is not None
    assert w.stdout.readline() == b"up\n" and g.stdout.readline() == b"up\n"
    done = sup.stop_all()
    assert [(name, how) for name, _, how in done] == [("gateway", "stopped"), ("decode-0", "stopped")]
    assert seen_by_gateway.read_text() == "other alive"
    assert seen_by_worker.read_text() == "other gone"


def test_a_second_signal_during_the_gateway_drain_is_passed_on(tmp_path) -> None:
    """The stand-in gateway drains (keeps running) at its first SIGTERM and exits at its second: a stop
    signal added to ``signals`` while ``stop_all`` waits reaches it as that second SIGTERM, long before
    ``gateway_grace`` runs out; without one it is killed at the end of the grace."""
    gateway = ("import signal, sys, time\n"
               "terms = []\n"
               "def on_term(*a):\n"
               "    terms.append(1)\n"
               "    if len(terms) > 1:\n"
               "        sys.exit(0)\n"
               "signal.signal(signal.SIGTERM, on_term)\n"
               "print('up', flush=True)\n"
               "while True:\n"
               "    time.sleep(0.05)\n")
    # (a second signal comes, the stop began with a signal): a stop begun without one (a child died) takes
    # the first signal that comes as that stop's, not as a second one
    for second, first in ((True, True), (False, True), (False, False)):
        sup = Supervisor(grace=5.0)
        g = subprocess.Popen([sys.executable, "-c", gateway], stdout=subprocess.PIPE)
        sup.children["gateway"] = g
        assert g.stdout is not None and g.stdout.readline() == b"up\n"
        signals: list[int] = [signal.SIGTERM] if first else []
        if second or not first:
            threading.Timer(0.5, signals.append, (signal.SIGINT,)).start()
        start = time.monotonic()
        done = sup.stop_all(gateway_grace=2.0 if not second else 30.0, signals=signals)
        took = time.monotonic() - start
        if second:
            assert [(name, how) for name, _, how in done] == [("gateway", "stopped")]
            assert g.returncode == 0 and 0.4 < took < 5
        else:
            assert [(name, how) for name, _, how in done] == [("gateway", "killed")]
            assert g.returncode == -signal.SIGKILL and 1.9 < took < 5


# a stand-in child: `crash` exits with code 3 at once; `once:<file>` exits with 3 the first time (when
# <file> is missing, creating it), then stays up; anything else stays up
STAND_IN = '''import pathlib, sys, time
what = sys.argv[1]
if what == "crash":
    sys.exit(3)
if what.startswith("once:"):
    mark = pathlib.Path(what[5:])
    if not mark.exists():
        mark.write_text("x")
        sys.exit(3)
time.sleep(60)
'''


def _supervise_in_thread(sup: Supervisor, policy: RestartPolicy,
                         roles: dict[str, str]) -> tuple[list[int], list[int], threading.Thread]:
    stop: list[int] = []
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(supervise(sup, stop, policy, roles, tick_s=0.02)))
    thread.start()
    return stop, result, thread


def _until(cond: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_supervise_restarts_an_exited_worker_and_gives_up_on_a_crash_loop(tmp_path, capfd) -> None:
    """A worker that exits is restarted (after its backoff) while the others keep running; one that keeps
    crashing is given up on after max_exits exits within the window, in one line saying how many of its
    role are left; with a prefill and a decode worker left, the rest keep serving and only the stop signal
    ends supervision (0)."""
    sup = Supervisor(grace=2.0, command=(sys.executable, "-c", STAND_IN), announce=say_up)  # as up makes it
    policy = RestartPolicy(backoff_s=0.05, max_backoff_s=0.2, max_exits=3, window_s=60.0)
    sup.start("gateway", ["serve"])
    sup.start("prefill-0", ["serve"])
    sup.start("decode-0", [f"once:{tmp_path / 'mark'}"])
    sup.start("decode-1", ["crash"])
    first = sup.children["decode-0"].pid
    roles = {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}
    stop, result, thread = _supervise_in_thread(sup, policy, roles)
    err = ""

    def gave_up() -> bool:
        nonlocal err
        err += capfd.readouterr().err
        return "given up" in err

    try:
        _until(lambda: sup.children["decode-0"].pid != first and sup.children["decode-0"].poll() is None)
        _until(gave_up)
        time.sleep(0.3)  # a given-up worker is not started again
        err += capfd.readouterr().err
        assert sup.children["decode-1"].poll() == 3 and sup.children["gateway"].poll() is None
        assert sup.children["decode-0"].poll() is None and result == []
    finally:
        stop.append(15)
        thread.join(10)
        sup.stop_all()
    assert result == [0]
    assert "pdserve up: decode-0 exited with code 3; restarting it in 0.05 s" in err
    assert "pdserve up: restarted decode-0 (pid" in err
    assert [line for line in err.splitlines() if "given up" in line] == [
        "pdserve up: decode-1 given up (exited 3 times within 60 s, last exit code 3); 1 decode worker "
        "left: the rest keep serving"]
    assert "stopping" not in err
    assert err.count("restarted decode-1") == 2  # after its first and second exit, not its third


def test_supervise_stops_everything_when_the_last_worker_of_a_role_is_given_up(capfd) -> None:
    """The only decode worker keeps crashing: once it is given up on, no prefill/decode pair and no
    colocated worker is left, so supervision ends (1: ``pdserve up`` stops every child and exits 1, for a
    process manager to restart it) with one line naming the worker and why; the others were not stopped
    by ``supervise`` itself."""
    sup = Supervisor(grace=2.0, command=(sys.executable, "-c", STAND_IN), announce=say_up)  # as up makes it
    policy = RestartPolicy(backoff_s=0.05, max_backoff_s=0.2, max_exits=3, window_s=60.0)
    sup.start("gateway", ["serve"])
    sup.start("prefill-0", ["serve"])
    sup.start("decode-0", ["crash"])
    stop, result, thread = _supervise_in_thread(sup, policy, {"prefill-0": "prefill", "decode-0": "decode"})
    try:
        thread.join(20)
        assert result == [1]
        assert sup.children["gateway"].poll() is None and sup.children["prefill-0"].poll() is None
    finally:
        stop.append(15)
        thread.join(10)
        sup.stop_all()
    err = capfd.readouterr().err
    assert err.count("restarted decode-0") == 2
    assert [line for line in err.splitlines() if "given up" in line] == [
        "pdserve up: decode-0 given up (exited 3 times within 60 s, last exit code 3); no decode worker "
        "left: stopping everything"]


def test_serving_problem_needs_a_prefill_and_decode_pair_or_a_colocated_worker() -> None:
    """Whether the workers ``pdserve up`` still runs can serve, and the reason naming each role of those
    it started that has no worker left."""
    pd = {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}
    assert serving_problem(pd, []) is None
    assert serving_problem(pd, ["decode-0"]) is None
    assert serving_problem(pd, ["decode-0", "decode-1"]) == "no decode worker left"
    assert serving_problem(pd, ["prefill-0"]) == "no prefill worker left"
    mixed = {**pd, "colocated-0": "colocated"}
    assert serving_problem(mixed, ["prefill-0"]) is None  # the colocated worker serves alone
    assert serving_problem(mixed, ["colocated-0"]) is None  # so does the pair
    assert serving_problem(mixed, ["colocated-0", "prefill-0"]) == "no prefill or colocated worker left"
    assert serving_problem({"colocated-0": "colocated"}, ["colocated-0"]) == "no colocated worker left"
    assert serving_problem({}, []) == "no prefill and decode pair or colocated worker left"


def test_supervise_stops_when_the_gateway_exits(capfd) -> None:
    sup = Supervisor(grace=2.0, command=(sys.executable, "-c", STAND_IN), announce=say_up)  # as up makes it
    sup.start("decode-0", ["serve"])
    sup.start("gateway", ["crash"])
    _, result, thread = _supervise_in_thread(sup, RestartPolicy(backoff_s=0.05), {"decode-0": "decode"})
    thread.join(20)
    sup.stop_all()
    assert result == [1] and "gateway exited with code 3; stopping the rest" in capfd.readouterr().err


def test_a_child_that_exits_during_start_up_is_reported_with_the_end_of_its_log(tmp_path) -> None:
    """A live test system whose worker exits while starting fails with the end of that worker's log in
    the error: on CI the log directory is gone with the machine, and the error is all that is kept."""
    import pytest

    from pdserve.live_system import LiveSystem, wait_ready

    sup = Supervisor(grace=1.0, command=(sys.executable, "-c"))
    code = ("import sys; print('\\n'.join(f'line {i}' for i in range(40))); print('boom: port in use'); "
            "sys.exit(3)")
    sup.start("decode", [code], log_path=str(tmp_path / "decode.log"))
    sup.children["decode"].wait(timeout=30)
    system = LiveSystem(url="http://127.0.0.1:9", sup=sup, logs=tmp_path)
    with pytest.raises(RuntimeError) as info:
        wait_ready([system], timeout_s=30)
    message = str(info.value)
    assert message.startswith(f"child exited during start-up: [('decode', 3)]; logs in {tmp_path}")
    assert message.endswith("line 39\nboom: port in use") and "\nline 16\n" in message
    assert "\nline 15\n" not in message  # the last 25 lines only


def test_a_child_inherits_no_unset_variable_when_started_or_restarted(tmp_path, monkeypatch) -> None:
    """``unset_env`` (``pdserve up``: the ``PDSERVE_*`` variables of pdserve's flags) leaves the child's
    environment at its start and at each restart; other variables and the child's ``env`` reach it."""
    monkeypatch.setenv("PDSERVE_MAX_QUEUE", "5")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    sup = Supervisor(grace=1.0, command=(sys.executable, "-c"), unset_env=frozenset({"PDSERVE_MAX_QUEUE"}))
    code = ("import os, sys; names = ('PDSERVE_MAX_QUEUE', 'PDSERVE_CACHE_DIR', 'PDSERVE_API_KEY'); "
            "open(sys.argv[1], 'a').write(repr([os.environ.get(n) for n in names]) + '\\n')")
    sup.start("gateway", [code, str(tmp_path / "seen")], env={"PDSERVE_API_KEY": "k"})
    sup.children["gateway"].wait(timeout=30)
    sup.restart("gateway")
    sup.children["gateway"].wait(timeout=30)
    assert (tmp_path / "seen").read_text().splitlines() == [repr([None, str(tmp_path), "k"])] * 2


# a supervisor-like parent: starts one child through ``Supervisor`` (the child writes its pid to argv[1]
# and sleeps), says so, and sleeps
PARENT = '''import sys, time
from pdserve.supervisor import Supervisor
sup = Supervisor(command=(sys.executable, "-c"))
child = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)"
sup.start("gateway", [child, sys.argv[1]])
print("started", flush=True)
time.sleep(120)
'''


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (an orphan that exited is reaped by whatever
    adopted it, which in a container may never happen)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(60)
def test_a_child_stops_when_its_parent_is_killed_with_sigkill(tmp_path: Path) -> None:
    """``kill -9`` of the supervising process (an OOM kill, a process manager's kill after its stop
    timeout) leaves no child serving on: the child gets SIGTERM from the kernel and exits."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(pid_file)], stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    child = None
    try:
        assert parent.stdout is not None and parent.stdout.readline() == b"started\n"
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.02)
        child = int(pid_file.read_text())
        assert _running(child)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(child), "the child outlived its parent's SIGKILL"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child is not None and _running(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_whose_parent_died_before_the_request_does_not_start(tmp_path: Path) -> None:
    """The parent may die between fork and the child's ``prctl``: no signal would come then, so the child
    checks that its parent is still the process that made the hook and exits (128 + SIGTERM) if not. Here
    the hook is made in one process and run in a grandchild of it, whose parent is another process."""
    script = ("import os, sys\n"
              "from pdserve.supervisor import parent_death_hook\n"
              "hook = parent_death_hook()\n"
              "if os.fork() == 0:\n"
              "    if os.fork() == 0:\n"
              "        hook()\n"
              "        os._exit(0)\n"
              "    _, status = os.wait()\n"
              "    os._exit(os.waitstatus_to_exitcode(status))\n"
              "_, status = os.wait()\n"
              "print(os.waitstatus_to_exitcode(status))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == str(128 + signal.SIGTERM), out.stderr
    hook = parent_death_hook()
    assert hook is not None
    ran = subprocess.run([sys.executable, "-c", "print('ran')"], preexec_fn=hook, capture_output=True,
                         text=True, timeout=30)  # the parent alive: the child starts
    assert ran.stdout == "ran\n" and ran.returncode == 0


def test_up_lines_carry_their_numbers_as_json_fields(capfd) -> None:
    """With ``--log-format json`` each line of ``pdserve up`` about a child is one event of logger
    ``pdserve.up`` whose fields hold what the message says (child, pid, exit code, restart delay), so a
    log pipeline need not parse the message."""
    import json

    from protocol.logging import configure_logging

    configure_logging("info", "json")
    sup = Supervisor(grace=2.0, command=(sys.executable, "-c", STAND_IN), announce=say_up)
    sup.start("decode-0", ["crash"])
    _, result, thread = _supervise_in_thread(sup, RestartPolicy(max_exits=2, backoff_s=0.05),
                                             {"decode-0": "decode"})
    thread.join(20)
    sup.stop_all()
    assert result == [1]  # the only decode worker given up: nothing left can serve
    events = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    up = [e for e in events if e["logger"] == "pdserve.up"]
    first_pid = up[0]["pid"]
    assert up[0] == {**up[0], "msg": f"started decode-0 (pid {first_pid})", "child": "decode-0"}
    exited = next(e for e in up if e["msg"].startswith("decode-0 exited with code 3"))
    assert (exited["level"], exited["child"], exited["exit_code"], exited["restart_in_s"]) == (
        "warning", "decode-0", 3, 0.05)
    [restarted] = [e for e in up if e["msg"].startswith("restarted decode-0")]  # one line per restart
    assert restarted["pid"] != first_pid and restarted["child"] == "decode-0"
    assert sum(e["msg"].startswith("started decode-0") for e in up) == 1
    given_up = next(e for e in up if "given up" in e["msg"])
    assert (given_up["level"], given_up["child"], given_up["exits"], given_up["exit_code"]) == (
        "error", "decode-0", 2, 3)
