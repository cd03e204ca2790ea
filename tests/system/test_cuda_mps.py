"""``pdserve up --cuda-mps``: a CUDA MPS control daemon of the run's own (pdserve/cuda_mps.py), here a fake
``nvidia-cuda-mps-control`` on ``PATH`` that records how it was called: started with ``-d`` in a private
directory before the workers, its two variables in every worker's environment (not the gateway's), told
to ``quit`` after them, the directory removed; a daemon that does not start stops ``up`` before any child
with one line; what cannot work is refused before anything starts. Without the flag, workers placed on one
GPU are named in a hint line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from pdserve import cuda_mps, launcher
from pdserve.cuda_mps import LOG_VARIABLE, PIPE_VARIABLE, mps_problem, private_mps

FAKE = """#!/bin/sh
if [ "$1" = "-d" ]; then
  echo "start pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> "$FAKE_MPS_RECORD"
  [ -d "$CUDA_MPS_PIPE_DIRECTORY" ] && [ -d "$CUDA_MPS_LOG_DIRECTORY" ] || exit 7
  if [ -n "$FAKE_MPS_FAIL" ]; then echo "An instance of this daemon is already running" >&2; exit 1; fi
else
  echo "command $(cat) pipe=$CUDA_MPS_PIPE_DIRECTORY" >> "$FAKE_MPS_RECORD"
fi
"""


@pytest.fixture
def fake_control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake control program first on PATH; returns the file it records its calls in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / cuda_mps.CONTROL
    program.write_text(FAKE)
    program.chmod(0o755)
    record = tmp_path / "record"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_RECORD", str(record))
    monkeypatch.delenv(PIPE_VARIABLE, raising=False)
    return record


def test_the_daemon_starts_in_a_private_directory_and_quits_on_exit(fake_control: Path) -> None:
    with private_mps() as variables:
        pipe, log = Path(variables[PIPE_VARIABLE]), Path(variables[LOG_VARIABLE])
        assert pipe.parent == log.parent and pipe.parent.name.startswith("pdserve-mps-")
        assert oct(pipe.stat().st_mode & 0o777) == "0o700" and log.is_dir()
        assert fake_control.read_text().splitlines() == [f"start pipe={pipe} log={log}"]
    assert fake_control.read_text().splitlines()[1:] == [f"command quit pipe={pipe}"]
    assert not pipe.parent.exists()


def test_a_daemon_that_does_not_start_is_one_error_naming_the_flag(fake_control: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    with pytest.raises(RuntimeError) as info, private_mps():
        pytest.fail("entered without a daemon")
    assert str(info.value) == (f"--cuda-mps: {cuda_mps.CONTROL} -d exited with code 1: An instance of this "
                               "daemon is already running")
    (start,) = fake_control.read_text().splitlines()
    assert not Path(start.split("pipe=")[1].split()[0]).parent.exists()


def test_mps_problem_names_what_is_missing(fake_control: Path) -> None:
    assert mps_problem(os.environ) is None
    assert mps_problem({**os.environ, PIPE_VARIABLE: "/tmp/theirs"}) == (
        f"--cuda-mps: {PIPE_VARIABLE} is set, so an MPS daemon of your own already serves these processes: "
        "unset it or drop --cuda-mps")
    assert mps_problem({"PATH": "/nonexistent"}) == (
        f"--cuda-mps: {cuda_mps.CONTROL} is not on PATH (it comes with the NVIDIA driver)")


def test_up_with_cuda_mps_on_the_cpu_is_refused_before_anything_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.cli import main

    assert main(["up", "--cuda-mps", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cuda-mps" in err[0] and "needs CUDA devices" in err[0], err


def _up_without_children(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """``launcher.run`` with the model check, the refusals and the children replaced: what
    ``_supervise`` was handed, and (from the fake's record) when."""
    handed: list[dict[str, Any]] = []

    def supervise(settings: Any, sup: Any, stop: Any, ready_timeout: Any, keys_dir: Any,
                  mps_env: dict[str, str]) -> int:
        handed.append(dict(mps_env))
        with open(os.environ["FAKE_MPS_RECORD"], "a") as record:
            record.write("children\n")
        return 0

    import engine.models.registry as registry

    monkeypatch.setattr(registry, "read_model_config", lambda *a: {})
    monkeypatch.setattr(launcher, "up_refusal", lambda *a: None)
    monkeypatch.setattr(launcher, "_supervise", supervise)
    return handed


def test_up_runs_its_children_between_the_daemons_start_and_quit(fake_control: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from protocol.settings import UpSettings

    handed = _up_without_children(monkeypatch)
    assert launcher.run(UpSettings(device="cuda", cuda_mps=True)) == 0
    (env,) = handed
    assert set(env) == {PIPE_VARIABLE, LOG_VARIABLE}
    assert [line.split()[0] for line in fake_control.read_text().splitlines()] == ["start", "children",
                                                                                   "command"]
    assert not Path(env[PIPE_VARIABLE]).parent.exists()
    handed.clear()
    assert launcher.run(UpSettings(device="cuda")) == 0 and handed == [{}]  # no flag: no daemon, no variables


def test_up_stops_before_any_child_when_the_daemon_does_not_start(fake_control: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from protocol.settings import UpSettings

    handed = _up_without_children(monkeypatch)
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    assert launcher.run(UpSettings(device="cuda", cuda_mps=True)) == 1
    assert handed == []
    assert capsys.readouterr().err.strip().splitlines() == [
        f"pdserve up: --cuda-mps: {cuda_mps.CONTROL} -d exited with code 1: An instance of this daemon is "
        "already running"]


def test_every_worker_gets_the_daemons_variables_and_the_gateway_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``_supervise`` starts: each worker's environment has the MPS variables on top of its own."""
    from protocol.settings import UpSettings

    started: dict[str, dict[str, str]] = {}

    class Sup:
        def start(self, name: str, args: list[str], env: dict[str, str]) -> None:
            started[name] = env

    monkeypatch.setattr(launcher, "wait_ready", lambda *a: "interrupted")
    monkeypatch.setattr(launcher, "gpu_count", lambda: 2)
    own = {"prefill-0": {"CUDA_VISIBLE_DEVICES": "0,1"}, "decode-0": {"CUDA_VISIBLE_DEVICES": "1,0"}}
    monkeypatch.setattr(launcher, "worker_envs", lambda *a: own)
    mps_env = {PIPE_VARIABLE: "/p", LOG_VARIABLE: "/l"}
    settings = UpSettings(device="cuda", cuda_mps=True, insecure_control_plane=True)
    assert launcher._supervise(settings, Sup(), [], 1.0, None, mps_env) == 0  # type: ignore[arg-type]
    assert set(started) == {"gateway", "prefill-0", "decode-0"}
    assert PIPE_VARIABLE not in started["gateway"]
    for name in ("prefill-0", "decode-0"):
        assert started[name][PIPE_VARIABLE] == "/p" and started[name][LOG_VARIABLE] == "/l"
        assert started[name]["CUDA_VISIBLE_DEVICES"] == own[name]["CUDA_VISIBLE_DEVICES"]  # its own kept


def test_workers_sharing_a_gpu_are_named_with_the_hint_unless_mps_is_on(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from protocol.settings import UpSettings

    one_gpu = UpSettings(device="auto", insecure_control_plane=True)
    assert launcher.shared_gpus(one_gpu, 1) == {"cuda:0": ["prefill-0", "decode-0"]}
    assert launcher.shared_gpus(one_gpu, 2) == {}  # a GPU each
    assert launcher.shared_gpus(UpSettings(device="cuda:1", num_decode=2), 4) == {
        "cuda:1": ["prefill-0", "decode-0", "decode-1"]}
    assert launcher.shared_gpus(UpSettings(device="cpu"), 0) == {}

    class Sup:
        def start(self, name: str, args: list[str], env: dict[str, str]) -> None:
            pass

    monkeypatch.setattr(launcher, "wait_ready", lambda *a: "interrupted")
    monkeypatch.setattr(launcher, "gpu_count", lambda: 1)
    assert launcher._supervise(one_gpu, Sup(), [], 1.0, None) == 0  # type: ignore[arg-type]
    assert capsys.readouterr().err.splitlines() == [
        "pdserve up: prefill-0 and decode-0 share cuda:0: --cuda-mps would run their kernels side by side "
        "instead of taking turns (docs/gpu.md)"]
    with_mps = UpSettings(device="auto", insecure_control_plane=True, cuda_mps=True)
    assert launcher._supervise(with_mps, Sup(), [], 1.0, None, {}) == 0  # type: ignore[arg-type]
    assert capsys.readouterr().err == ""
