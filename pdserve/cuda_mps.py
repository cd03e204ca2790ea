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
from collections.abc import Iterator, Mapping

CONTROL = "nvidia-cuda-mps-control"
PIPE_VARIABLE = "CUDA_MPS_PIPE_DIRECTORY"
LOG_VARIABLE = "CUDA_MPS_LOG_DIRECTORY"
TIMEOUT_S = 10.0  # how long the daemon may take to start or to take the quit command

log = logging.getLogger("pdserve.up")


def mps_problem(env: Mapping[str, str]) -> str | None:
    """Why ``--cuda-mps`` cannot be used in a launcher whose environment is ``env`` (one line naming the
    flag), or None: the control program is not on ``PATH``, or ``CUDA_MPS_PIPE_DIRECTORY`` is set (a daemon
    of the user's own already serves this environment)."""
    if env.get(PIPE_VARIABLE):
        return (f"--cuda-mps: {PIPE_VARIABLE} is set, so an MPS daemon of your own already serves these "
                "processes: unset it or drop --cuda-mps")
    if shutil.which(CONTROL, path=env.get("PATH")) is None:
        return f"--cuda-mps: {CONTROL} is not on PATH (it comes with the NVIDIA driver)"
    return None


def _last_line(output: bytes) -> str:
    lines = output.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no output"


@contextlib.contextmanager
def private_mps(timeout_s: float = TIMEOUT_S) -> Iterator[dict[str, str]]:
    """Start a control daemon of this run's own; yields the variables of its clients.

    Raises:
        RuntimeError: the daemon did not start (exit code, or ``timeout_s`` passed, or the program could
            not be run); the message names ``--cuda-mps`` and the program's last line of output. Nothing
            is left behind.
    """
    directory = tempfile.mkdtemp(prefix="pdserve-mps-")
    variables = {PIPE_VARIABLE: os.path.join(directory, "pipe"), LOG_VARIABLE: os.path.join(directory, "log")}
    for path in variables.values():
        os.mkdir(path, 0o700)
    env = {**os.environ, **variables}
    try:
        done = subprocess.run([CONTROL, "-d"], env=env, capture_output=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        shutil.rmtree(directory, ignore_errors=True)
        raise RuntimeError(f"--cuda-mps: {CONTROL} -d did not start: {exc}") from None
    if done.returncode != 0:
        shutil.rmtree(directory, ignore_errors=True)
        raise RuntimeError(f"--cuda-mps: {CONTROL} -d exited with code {done.returncode}: "
                           f"{_last_line(done.stderr + done.stdout)}")
    try:
        yield variables
    finally:
        try:
            done = subprocess.run([CONTROL], input=b"quit\n", env=env, capture_output=True, timeout=timeout_s,
                                  check=False)
            if done.returncode != 0:
                log.warning("cuda_mps_quit_failed exit_code=%d: %s", done.returncode,
                            _last_line(done.stderr + done.stdout))
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("cuda_mps_quit_failed: %s", exc)
        shutil.rmtree(directory, ignore_errors=True)
