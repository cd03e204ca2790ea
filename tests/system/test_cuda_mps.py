"""``pdserve up --cuda-mps``: a CUDA MPS control daemon of the run's own (pdserve/cuda_mps.py), here a fake
``nvidia-cuda-mps-control`` on ``PATH`` that records how it was called: started with ``-d`` in a private
directory before the workers, its two variables in every worker's environment (not the gateway's), told
to ``quit`` after them, the directory removed; a daemon that does not start stops ``up`` before any child
with one line; what cannot work is refused before anything starts. Without the flag, workers placed on one
GPU are named in a hint line."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from pdserve import cuda_mps, launcher
from pdserve.cuda_mps import LOG_VARIABLE, PIPE_VARIABLE, mps_problem, private_mps

FAKE = """#!/bin/sh
if [ "$1" = "-d" ]; then
  echo "start pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY visible=$CUDA_VISIBLE_DEVICES" \
    >> "$FAKE_MPS_RECORD"
  [ -d "$CUDA_MPS_PIPE_DIRECTORY" ] && [ -d "$CUDA_MPS_LOG_DIRECTORY" ] || exit 7
  if [ -n "$FAKE_MPS_FAIL" ]; then echo "An instance of this daemon is already running" >&2; exit 1; fi
  if [ -n "$FAKE_MPS_SLOW" ]; then (sleep 0.3; touch "$CUDA_MPS_PIPE_DIRECTORY/control") >/dev/null 2>&1 &
  else touch "$CUDA_MPS_PIPE_DIRECTORY/control"; fi
else
  line=$(cat)
  echo "command $line pipe=$CUDA_MPS_PIPE_DIRECTORY" >> "$FAKE_MPS_RECORD"
  [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || { echo "Cannot find MPS control daemon process"; exit 1; }
  if [ "$line" = get_server_list ] && [ -n "$FAKE_MPS_MUTE" ]; then
    echo "No CUDA-capable device is detected" >> "$CUDA_MPS_LOG_DIRECTORY/control.log"; exit 1
  fi
  if [ "$line" = quit ] && [ -n "$FAKE_MPS_STAY" ]; then echo "a client is still attached"; exit 1; fi
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


def test_the_daemon_starts_in_a_private_directory_and_quits_on_exit(fake_control: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Started with -d (seeing every GPU: without the launcher's CUDA_VISIBLE_DEVICES, which an MPS server
    would renumber), asked for its server list before any client, told to quit on exit."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with private_mps() as variables:
        pipe, log = Path(variables[PIPE_VARIABLE]), Path(variables[LOG_VARIABLE])
        assert pipe.parent == log.parent and pipe.parent.name.startswith("pdserve-mps-")
        assert oct(pipe.stat().st_mode & 0o777) == "0o700" and log.is_dir()
        assert fake_control.read_text().splitlines() == [f"start pipe={pipe} log={log} visible=",
                                                         f"command get_server_list pipe={pipe}"]
    assert fake_control.read_text().splitlines()[2:] == [f"command quit pipe={pipe}"]
    assert not pipe.parent.exists()


def test_a_daemon_that_listens_a_moment_after_its_start_is_waited_for(
        fake_control: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_MPS_SLOW", "1")
    with private_mps():
        asked = [line.split()[1] for line in fake_control.read_text().splitlines()[1:]]
    assert len(asked) > 1 and set(asked) == {"get_server_list"}  # refused until it listened


def test_a_daemon_that_does_not_answer_is_stopped_and_named_with_its_log(
        fake_control: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_MPS_MUTE", "1")
    with pytest.raises(RuntimeError) as info, private_mps(timeout_s=0.5):
        pytest.fail("entered without a daemon that answers")
    assert str(info.value) == ("--cuda-mps: the MPS daemon does not answer (exit code 1: no output); its "
                               "log: No CUDA-capable device is detected")
    lines = fake_control.read_text().splitlines()  # asked again until the deadline, then told to quit
    asked = [line.split()[1] for line in lines[1:]]
    assert asked[-1] == "quit" and len(asked) > 2 and set(asked[:-1]) == {"get_server_list"}
    assert not Path(lines[0].split("pipe=")[1].split()[0]).parent.exists()


def test_a_daemon_that_does_not_quit_keeps_its_directory_and_says_where(
        fake_control: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("FAKE_MPS_STAY", "1")
    with caplog.at_level("WARNING", logger="pdserve.up"), private_mps() as variables:
        pipe = Path(variables[PIPE_VARIABLE])
    assert pipe.is_dir()  # still the way to reach the daemon
    (warning,) = [r.getMessage() for r in caplog.records if "cuda_mps_quit_failed" in r.getMessage()]
    assert "a client is still attached" in warning and f"{PIPE_VARIABLE}={pipe}" in warning
    shutil.rmtree(pipe.parent)


def test_no_directory_for_the_daemon_is_one_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(**kwargs: object) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cuda_mps.tempfile, "mkdtemp", full)
    with pytest.raises(RuntimeError, match=r"^--cuda-mps: no directory for the MPS daemon: \[Errno 28\] No "
                                           r"space left on device$"), private_mps():
        pytest.fail("entered without a directory")


def test_a_daemon_that_does_not_start_is_one_error_naming_the_flag(fake_control: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    with pytest.raises(RuntimeError) as info, private_mps():
        pytest.fail("entered without a daemon")
    assert str(info.value) == (f"--cuda-mps: {cuda_mps.CONTROL} -d exited with code 1: An instance of this "
                               "daemon is already running")
    (start,) = fake_control.read_text().splitlines()
    assert not Path(start.split("pipe=")[1].split()[0]).parent.exists()


def test_mps_problem_names_what_is_missing(fake_control: Path, tmp_path: Path) -> None:
    default_pipe = tmp_path / "nvidia-mps"
    assert mps_problem(os.environ, str(default_pipe)) is None
    default_pipe.mkdir()
    (default_pipe / "control").touch()  # a daemon of the host's own, in CUDA's default pipe directory
    assert mps_problem(os.environ, str(default_pipe)) == (
        f"--cuda-mps: an MPS daemon already runs on this host ({default_pipe}/control), and these processes "
        "are its clients already: drop --cuda-mps")
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
    monkeypatch.setattr(launcher, "gpu_count", lambda: 1)  # prefill and decode share it
    return handed


def test_up_runs_its_children_between_the_daemons_start_and_quit(fake_control: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from protocol.settings import UpSettings

    handed = _up_without_children(monkeypatch)
    assert launcher.run(UpSettings(device="cuda", cuda_mps=True)) == 0
    (env,) = handed
    assert set(env) == {PIPE_VARIABLE, LOG_VARIABLE}
    assert [line.split()[0] for line in fake_control.read_text().splitlines()] == ["start", "command",
                                                                                   "children", "command"]
    assert not Path(env[PIPE_VARIABLE]).parent.exists()
    handed.clear()
    assert launcher.run(UpSettings(device="cuda")) == 0 and handed == [{}]  # no flag: no daemon, no variables
    handed.clear()
    fake_control.write_text("")
    monkeypatch.setattr(launcher, "gpu_count", lambda: 2)  # a GPU each: nothing for MPS to share
    assert launcher.run(UpSettings(device="cuda", cuda_mps=True)) == 0 and handed == [{}]
    assert fake_control.read_text().split() == ["children"]  # the control program never ran


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
        fake_control: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The hint where the flag would be taken (the control program on PATH); with the flag, a line naming
    the workers MPS runs side by side and the daemon's pipe directory, or, no GPU shared, a line saying
    MPS has nothing to do."""
    from pdserve.placement import shared_gpus
    from protocol.settings import UpSettings

    one_gpu = UpSettings(device="auto", insecure_control_plane=True)
    assert shared_gpus(one_gpu, 1) == {"cuda:0": ["prefill-0", "decode-0"]}
    assert shared_gpus(one_gpu, 2) == {}  # a GPU each
    assert shared_gpus(UpSettings(device="cuda:1", num_decode=2), 4) == {
        "cuda:1": ["prefill-0", "decode-0", "decode-1"]}
    assert shared_gpus(UpSettings(device="cpu"), 0) == {}

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
    mps_env = {PIPE_VARIABLE: "/tmp/pdserve-mps-x/pipe", LOG_VARIABLE: "/tmp/pdserve-mps-x/log"}
    assert launcher._supervise(with_mps, Sup(), [], 1.0, None, mps_env) == 0  # type: ignore[arg-type]
    assert capsys.readouterr().err.splitlines() == [
        "pdserve up: --cuda-mps: prefill-0 and decode-0 share cuda:0 through this run's MPS daemon "
        "(CUDA_MPS_PIPE_DIRECTORY=/tmp/pdserve-mps-x/pipe)"]
    monkeypatch.setattr(launcher, "gpu_count", lambda: 2)  # a GPU each
    assert launcher._supervise(with_mps, Sup(), [], 1.0, None, mps_env) == 0  # type: ignore[arg-type]
    assert capsys.readouterr().err.splitlines() == [
        "pdserve up: --cuda-mps: no two workers share a GPU here, so MPS has nothing to run side by side; "
        "no daemon started"]
    monkeypatch.setattr(launcher, "gpu_count", lambda: 1)
    monkeypatch.setenv("PATH", "/nonexistent")  # no control program: no hint to take a flag that is refused
    assert launcher._supervise(one_gpu, Sup(), [], 1.0, None) == 0  # type: ignore[arg-type]
    assert capsys.readouterr().err == ""
