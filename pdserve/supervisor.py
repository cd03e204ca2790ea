"""Child processes of ``pdserve up`` (and of the gateway pool, the live test systems and benches): a
``Supervisor`` starts each ``python -m pdserve.cli`` child in a process group of its own and stops them all
(SIGTERM, SIGKILL after a grace period); ``supervise`` watches them, restarting a worker that exits per a
``RestartPolicy`` (backoff doubling up to a ceiling, given up on after ``max_exits`` exits within a window)
and returning when the gateway exits, a stop signal came, or a worker was given up on and the workers
left can no longer serve (no prefill and decode worker, and no colocated worker).

A child stops when its parent is gone, even one killed with SIGKILL (an OOM kill, a process manager's kill
after its stop timeout): on Linux each child asks the kernel, between fork and exec, for SIGTERM when the
thread that started it ends (``prctl(PR_SET_PDEATHSIG)``), and exits at once if its parent was already
gone by then. The signal follows the starting *thread*, not the process, so a ``Supervisor`` must start
and restart its children from a thread that lives as long as the children should (``pdserve up`` does
all of it from its main thread). The request is a ``preexec_fn``, which Python warns may deadlock in a
process with threads: it only calls ``prctl`` (looked up before the fork), ``os.getppid`` and
``os._exit``. Elsewhere (macOS, ...) no such request exists: the children of a
``Supervisor`` killed with SIGKILL keep running until stopped by hand.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from protocol.logging import log_event, say

log = logging.getLogger("pdserve.up")
PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOP_MARGIN_S = 10.0  # beyond --drain-timeout, seconds a draining process gets before SIGKILL
STOP_TICK_S = 0.05  # seconds between looks at children being stopped (and at further stop signals)


def parent_death_hook(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` (it runs in the child between fork and exec) that makes the
    kernel send the child ``signum`` when the thread of this process that started it ends
    (``prctl(PR_SET_PDEATHSIG)``); should this process have ended before the request took effect (the
    child's parent is no longer this process), the child exits (code 128 + ``signum``) instead of
    starting. None where there is no such request (not Linux, or no ``prctl`` in the C library).

    The function is looked up here, in the parent, so that the child only calls it: no import or lookup
    between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request: no signal will come
            os._exit(128 + signum)

    return hook


@dataclass(frozen=True)
class RestartPolicy:
    """How ``pdserve up`` restarts a worker that exited: after ``backoff_s`` seconds, doubled for each
    earlier exit within ``window_s`` seconds, at most ``max_backoff_s``; the ``max_exits``-th exit
    within ``window_s`` seconds gives up on the worker."""

    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_exits: int = 5
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if (self.backoff_s < 0 or self.max_backoff_s < self.backoff_s or self.max_exits < 1
                or self.window_s <= 0):
            raise ValueError(f"bad restart policy {self}")

    def delay(self, recent_exits: int) -> float:
        """Seconds to wait before the restart that follows ``recent_exits`` exits (>= 1) in the window."""
        return float(min(self.max_backoff_s, self.backoff_s * 2 ** (recent_exits - 1)))


@dataclass
class _ChildRestarts:
    """One worker's exits (``time.monotonic()`` seconds), pending restart time and whether it was given
    up on."""

    exits: list[float] = field(default_factory=list)
    restart_at: float | None = None
    given_up: bool = False


@dataclass
class Supervisor:
    """Starts children and stops them all; ``grace`` is seconds between SIGTERM and SIGKILL. A child is
    ``command`` + its args; ``args`` and ``log_paths`` remember how each was started (``restart``).
    ``unset_env``: variables of this process's environment that no child inherits. ``parent_death_signal``:
    what each child gets when the thread that started it ends (the module docstring; None: nothing).
    ``announce``: called with a line and its fields for each child started (``say_up`` under ``pdserve
    up``); None: an info log event ``child_started``."""

    grace: float = 10.0
    command: tuple[str, ...] = (sys.executable, "-m", "pdserve.cli")
    unset_env: frozenset[str] = frozenset()
    parent_death_signal: int | None = signal.SIGTERM
    children: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    args: dict[str, list[str]] = field(default_factory=dict)
    log_paths: dict[str, str | None] = field(default_factory=dict)
    envs: dict[str, dict[str, str]] = field(default_factory=dict)
    announce: Callable[..., None] | None = None

    def start(self, name: str, args: list[str], log_path: str | None = None,
              env: dict[str, str] | None = None, verb: str = "started") -> None:
        """Start ``command`` (``python -m pdserve.cli``) ``*args`` as child ``name`` in a new process group
        (signals sent to the terminal's foreground group do not reach it: only ``stop_all`` stops it); its
        output goes to ``log_path`` (a file, appended) or, by default, to this process's stdout/stderr.
        Its environment is this process's without ``unset_env``, with ``env`` added. On Linux it gets
        ``parent_death_signal`` when the calling thread ends (``parent_death_hook``). ``announce`` is told
        ``"<verb> <name> (pid N)"``."""
        cmd = [*self.command, *args]
        self.args[name], self.log_paths[name], self.envs[name] = list(args), log_path, dict(env or {})
        child_env = {**{k: v for k, v in os.environ.items() if k not in self.unset_env}, **self.envs[name]}
        hook = parent_death_hook(self.parent_death_signal) if self.parent_death_signal is not None else None
        if log_path is None:
            self.children[name] = subprocess.Popen(cmd, env=child_env, process_group=0, preexec_fn=hook)
        else:
            with open(log_path, "ab") as out:
                self.children[name] = subprocess.Popen(cmd, env=child_env, stdout=out, preexec_fn=hook,
                                                       stderr=subprocess.STDOUT, process_group=0)
        pid = self.children[name].pid
        if self.announce is not None:
            self.announce(f"{verb} {name} (pid {pid})", child=name, pid=pid)
        else:
            log_event(log, f"child_{verb}", child=name, pid=pid)

    def _say(self, line: str) -> None:
        """``line`` through ``announce`` (a log event ``supervisor`` without one)."""
        if self.announce is not None:
            self.announce(line)
        else:
            log_event(log, "supervisor", message=line)

    def restart(self, name: str) -> None:
        """Start child ``name`` again, as it was started (its earlier process has exited).

        Raises:
            RuntimeError: the child is still running. KeyError: no child of that name was started.
        """
        if self.children[name].poll() is None:
            raise RuntimeError(f"{name} is still running")
        self.start(name, self.args[name], self.log_paths[name], self.envs[name], verb="restarted")

    def dead(self) -> list[tuple[str, int]]:
        """(name, exit code) of every child that has exited."""
        return [(n, p.returncode) for n, p in self.children.items() if p.poll() is not None]

    def stop_all(self, gateway_grace: float | None = None,
                 signals: list[int] | None = None) -> list[tuple[str, int, str]]:
        """Stop every live child in two rounds, each SIGTERM, a wait, SIGKILL for stragglers: the gateway
        first, which drains (it takes no new request and lets those in flight finish on the workers, which
        still run, for up to its ``--drain-timeout``: gateway/server.py) within ``gateway_grace`` seconds
        (default ``grace``), then the workers, which by then hold no request of it, within ``grace``.
        A signal added to ``signals`` meanwhile (a second Ctrl-C or SIGTERM) is passed on to the children
        being stopped as another SIGTERM, which stops each at once.

        Returns ``(name, pid, "stopped" | "killed")`` for each child that was still running (children
        that had already exited are not listed), in stop order; every child has been reaped on return."""
        gateway = [n for n in self.children if n == "gateway"]
        workers = [n for n in self.children if n != "gateway"]
        signals = [] if signals is None else signals
        seen = [max(len(signals), 1)]  # signals passed on, both rounds (the first one: the stop itself)
        first = self._stop(gateway, self.grace if gateway_grace is None else gateway_grace, signals, seen)
        return first + self._stop(workers, self.grace, signals, seen)

    def _stop(self, names: list[str], grace: float, signals: list[int],
              seen: list[int]) -> list[tuple[str, int, str]]:
        """SIGTERM the live children among ``names``, and again when ``signals`` holds more than ``seen[0]``
        (a further stop signal, also one that came during an earlier round: passed on at once, a child
        stops at its second SIGTERM), wait up to ``grace`` s, SIGKILL the rest; reap all."""
        live = [n for n in names if self.children[n].poll() is None]
        for name in live:
            self.children[name].send_signal(signal.SIGTERM)
        if len(signals) > 1:  # a second stop signal came before this round: its children stop at once
            time.sleep(STOP_TICK_S)  # two SIGTERMs at once may reach a child as one
            seen[0] = 0
        deadline, done = time.monotonic() + grace, []
        while any(self.children[n].poll() is None for n in live) and time.monotonic() < deadline:
            if len(signals) > seen[0]:
                if seen[0]:  # a new signal, not the one this round started with
                    self._say("another stop signal: stopping at once (the requests in flight are cut)")
                seen[0] = len(signals)
                for name in live:
                    if self.children[name].poll() is None:
                        self.children[name].send_signal(signal.SIGTERM)
            time.sleep(STOP_TICK_S)
        for name in names:
            proc, how = self.children[name], "stopped"
            try:
                proc.wait(0)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s: killing it", name, grace)
                proc.kill()
                proc.wait()
                how = "killed"
            if name in live:
                done.append((name, proc.pid, how))
        return done


ROLES = ("prefill", "decode", "colocated")


def serving_problem(roles: Mapping[str, str], given_up: Collection[str]) -> str | None:
    """Why the workers of ``roles`` (child name -> ``prefill``, ``decode`` or ``colocated``) not in
    ``given_up`` can no longer serve, or None: they can while a prefill and a decode worker, or a
    colocated worker, are left. The reason names each role that ``roles`` has but none of whose workers
    is left (``no decode worker left``, ``no decode or colocated worker left``)."""
    left = Counter(role for name, role in roles.items() if name not in given_up)
    if left["colocated"] or (left["prefill"] and left["decode"]):
        return None
    started = set(roles.values())
    missing = [role for role in ROLES if role in started and not left[role]]
    if not missing:  # roles names no worker that serves
        return "no prefill and decode pair or colocated worker left"
    return f"no {' or '.join(missing)} worker left"


def supervise(sup: Supervisor, stop: list[int], policy: RestartPolicy, roles: Mapping[str, str],
              tick_s: float = 0.2) -> int:
    """Watch the children every ``tick_s`` seconds until ``stop`` is non-empty (returns 0), the child
    ``gateway`` exits (returns 1), or a worker is given up on and the workers left cannot serve
    (``serving_problem`` over ``roles``, child name -> role of each worker; returns 1). A worker that
    exits is restarted per ``policy``; one that exits ``policy.max_exits`` times within
    ``policy.window_s`` seconds is given up on while the rest keep running, as long as the workers left
    can serve. One line for each exit, restart and give-up (``say_up``): a give-up line names the worker,
    its exits and last exit code, and either how many workers of its role are left or why the rest
    stop. A worker not in ``roles`` counts for no role."""
    state: dict[str, _ChildRestarts] = {}
    while not stop:
        now = time.monotonic()
        for name, code in sup.dead():
            if name == "gateway":
                say_up(f"gateway exited with code {code}; stopping the rest", logging.ERROR, child=name,
                       exit_code=code)
                return 1
            st = state.setdefault(name, _ChildRestarts())
            if st.given_up or st.restart_at is not None:
                continue
            st.exits = [t for t in st.exits if now - t < policy.window_s] + [now]
            if len(st.exits) >= policy.max_exits:
                st.given_up = True
                given_up = [n for n, s in state.items() if s.given_up]
                why = (f"{name} given up (exited {len(st.exits)} times within {policy.window_s:g} s, last "
                       f"exit code {code})")
                problem = serving_problem(roles, given_up)
                if problem is not None:
                    say_up(f"{why}; {problem}: stopping everything", logging.ERROR, child=name,
                           exits=len(st.exits), exit_code=code)
                    return 1
                role = roles.get(name)
                if role is None:
                    say_up(f"{why}: the rest keep serving", logging.ERROR, child=name, exits=len(st.exits),
                           exit_code=code)
                else:
                    left = sum(1 for n, r in roles.items() if r == role and n not in given_up)
                    say_up(f"{why}; {left} {role} worker{'' if left == 1 else 's'} left: the rest keep "
                           "serving", logging.ERROR, child=name, exits=len(st.exits), exit_code=code,
                           role=role, left=left)
                continue
            delay = policy.delay(len(st.exits))
            st.restart_at = now + delay
            say_up(f"{name} exited with code {code}; restarting it in {delay:g} s", logging.WARNING,
                   child=name, exit_code=code, restart_in_s=delay)
        for name, st in state.items():
            if st.restart_at is not None and now >= st.restart_at and not stop:
                st.restart_at = None
                sup.restart(name)  # said by the supervisor's ``announce``
        time.sleep(tick_s)
    return 0


def say_up(line: str, level: int = logging.INFO, **fields: Any) -> None:
    """``line`` for the user of ``pdserve up``: ``pdserve up: line`` on stderr, or with ``--log-format
    json`` a log event of logger ``pdserve.up`` at ``level`` whose message is ``line`` and whose fields
    are ``fields`` (``child``, ``pid``, ``exit_code``...: what the line says, as keys a log pipeline
    reads; ``protocol.logging.say``)."""
    say(log, line, f"pdserve up: {line}", level, **fields)
