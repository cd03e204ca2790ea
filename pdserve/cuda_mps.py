"""A private CUDA MPS control daemon for ``pdserve up --cuda-mps``.

Without MPS, the CUDA contexts of two processes on one GPU take turns (time slicing): while a decode
worker runs its steps, a prefill worker sharing the GPU gets about half of it. Measured on an H100
(docs/gpu.md): 2048-token prefill steps of a Llama-3-8B shape took 45-49 ms alone and 98-110 ms while
another process decoded 2 or 8 sequences; under MPS, whose server runs both processes' kernels side by
side, 53-58 ms. Through ``pdserve up`` (a prefill and a decode worker on the one GPU, 8 streams of 700
prompt and 64 output tokens) MPS gave 1.15x the requests/s, 0.55-0.69x the mean TTFT and 0.91-0.94x the
TPOT; through ``bench.serving.agent_turns`` (8 sessions) TTFT p50 of turns 1 and 20 fell by 20-38 %.

``private_mps`` starts ``nvidia-cuda-mps-control -d`` with its pipe and log directories in a fresh
private temporary directory, hands back the two variables (``CUDA_MPS_PIPE_DIRECTORY``,
``CUDA_MPS_LOG_DIRECTORY``) that make a process one of its clients, and on exit tells it to quit and
removes the directory. Only the processes given those variables (``up``'s workers) use this daemon;
nothing else on the host is touched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping

CONTROL = "nvidia-cuda-mps-control"
PIPE_VARIABLE = "CUDA_MPS_PIPE_DIRECTORY"
LOG_VARIABLE = "CUDA_MPS_LOG_DIRECTORY"
TIMEOUT_S = 10.0  # how long the daemon may take to start or to take the quit command
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # where CUDA looks for a daemon when the variable is unset

log = logging.getLogger("pdserve.up")


def mps_problem(env: Mapping[str, str], default_pipe: str = DEFAULT_PIPE_DIRECTORY) -> str | None:
    """Why ``--cuda-mps`` cannot be used in a launcher whose environment is ``env`` (one line naming the
    flag), or None: the control program is not on ``PATH``, ``CUDA_MPS_PIPE_DIRECTORY`` is set, or a daemon
    listens in the default pipe directory ``default_pipe`` (either way a daemon of the user's own already
    serves these processes: CUDA connects every process of the host to the default one)."""
    if env.get(PIPE_VARIABLE):
        return (f"--cuda-mps: {PIPE_VARIABLE} is set, so an MPS daemon of your own already serves these "
                "processes: unset it or drop --cuda-mps")
    if os.path.exists(os.path.join(default_pipe, "control")):
        return (f"--cuda-mps: an MPS daemon already runs on this host ({default_pipe}/control), and these "
                "processes are its clients already: drop --cuda-mps")
    if shutil.which(CONTROL, path=env.get("PATH")) is None:
        return f"--cuda-mps: {CONTROL} is not on PATH (it comes with the NVIDIA driver)"
    return None


def _last_line(output: bytes) -> str:
    lines = output.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no output"


def _command(env: Mapping[str, str], line: str, timeout_s: float) -> str | None:
    """Send ``line`` to the control daemon of ``env``; None when it took it (exit code 0), else why not."""
    try:
        done = subprocess.run([CONTROL], input=f"{line}\n".encode(), env=dict(env), capture_output=True,
                              timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if done.returncode == 0:
        return None
    return f"exit code {done.returncode}: {_last_line(done.stderr + done.stdout)}"


def _control_log(directory: str) -> str:
    """The last line of the daemon's own log (where it writes why it did not start), or ''."""
    try:
        with open(os.path.join(directory, "log", "control.log"), "rb") as f:
            return _last_line(f.read())
    except OSError:
        return ""


@contextlib.contextmanager
def private_mps(timeout_s: float = TIMEOUT_S) -> Iterator[dict[str, str]]:
    """Start a control daemon of this run's own; yields the variables of its clients. The daemon sees every
    GPU of the host (started without ``CUDA_VISIBLE_DEVICES``: an MPS server renumbers the devices it is
    started with, so a worker's own device ids would not match it); each worker still uses only its own.

    On exit the daemon is told to ``quit`` and the directory removed; where ``quit`` is not taken (a client
    still attached, the daemon gone) the directory is kept and its path logged (``cuda_mps_quit_failed``),
    so that the daemon can still be reached: ``CUDA_MPS_PIPE_DIRECTORY=<dir>/pipe nvidia-cuda-mps-control``.

    Raises:
        RuntimeError: the daemon did not start (the directory could not be made, ``-d`` failed or passed
            ``timeout_s``, or the started daemon does not answer a ``get_server_list`` within
            ``timeout_s``); the message names ``--cuda-mps`` and the last line the program or its log
            wrote. Nothing is left behind.
    """
    try:
        directory = tempfile.mkdtemp(prefix="pdserve-mps-")
    except OSError as exc:
        raise RuntimeError(f"--cuda-mps: no directory for the MPS daemon: {exc}") from None
    variables = {PIPE_VARIABLE: os.path.join(directory, "pipe"), LOG_VARIABLE: os.path.join(directory, "log")}
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | variables
    try:
        try:
            for path in variables.values():
                os.mkdir(path, 0o700)
            done = subprocess.run([CONTROL, "-d"], env=env, capture_output=True, timeout=timeout_s,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"--cuda-mps: {CONTROL} -d did not start: {exc}") from None
        if done.returncode != 0:
            raise RuntimeError(f"--cuda-mps: {CONTROL} -d exited with code {done.returncode}: "
                               f"{_last_line(done.stderr + done.stdout)}")
        deadline = time.monotonic() + timeout_s  # the daemon -d forked may not listen yet
        while (why := _command(env, "get_server_list", timeout_s)) is not None:
            if time.monotonic() >= deadline:
                said = _control_log(directory)
                raise RuntimeError(f"--cuda-mps: the MPS daemon does not answer ({why})"
                                   + (f"; its log: {said}" if said else ""))
            time.sleep(0.1)
    except BaseException:
        if os.path.exists(os.path.join(variables[PIPE_VARIABLE], "control")):  # some daemon made its socket
            _command(env, "quit", timeout_s)
        shutil.rmtree(directory, ignore_errors=True)
        raise
    try:
        yield variables
    finally:
        if (why := _command(env, "quit", timeout_s)) is None:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            log.warning("cuda_mps_quit_failed: %s; the daemon may still run, reachable through %s=%s",
                        why, PIPE_VARIABLE, variables[PIPE_VARIABLE])
