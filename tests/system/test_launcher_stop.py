"""Ctrl-C on ``pdserve up`` while the workers are still importing (torch takes seconds): the launcher
stops every child quietly — one line per child stopped, no traceback, exit code 130 — and no child
process outlives it. Found by a new-user trial: the terminal's SIGINT reached the children too (one
process group), each died with a KeyboardInterrupt traceback from inside ``import torch``.

The gateway is the real one and serving when the Ctrl-C comes; the workers are stand-ins slow to
import: ``prefill_worker`` / ``decode_worker`` packages in the launcher's working directory (first on a
``python -m`` child's ``sys.path``) whose ``main`` module sleeps at import time and marks that it does.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import free_ports

ROOT = Path(__file__).resolve().parents[2]
SLOW_MAIN = '''import os, pathlib, time
pathlib.Path(os.environ["MARK_DIR"], "{role}").write_text(str(os.getpid()))
time.sleep(120)  # stands in for `import torch` on a slow machine


def run(settings):
    return 0
'''


def _slow_workers(cwd: Path) -> None:
    for role in ("prefill", "decode"):
        pkg = cwd / f"{role}_worker"
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        (pkg / "main.py").write_text(SLOW_MAIN.format(role=role))


def _serving(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)  # each child leads its own process group: nothing of it may remain
    except ProcessLookupError:
        return True
    return False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig, whole_group, code", [
    (signal.SIGINT, True, 130),  # Ctrl-C in a terminal: SIGINT to the whole foreground process group
    (signal.SIGTERM, False, 143),  # `kill PID`, `docker stop`: SIGTERM to the launcher alone
])
def test_stop_signal_during_worker_import_stops_children_quietly(tmp_path: Path, sig: signal.Signals,
                                                                 whole_group: bool, code: int) -> None:
    cwd, marks = tmp_path / "cwd", tmp_path / "marks"
    cwd.mkdir()
    marks.mkdir()
    _slow_workers(cwd)
    env = {**os.environ, "MARK_DIR": str(marks), "PDSERVE_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT)}
    port = free_ports(1)[0]
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--model", "tiny-llama", "--device", "cpu",
           "--port", str(port), "--transfer-backend", "loopback"]
    # a new session: the launcher leads its own process group, as a shell job in a terminal does
    up = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(list(marks.iterdir())) < 2 or not _serving(port):  # the gateway answers, workers import
            assert up.poll() is None, up.communicate()
            assert time.monotonic() < deadline, "workers never started importing"
            time.sleep(0.05)
        if whole_group:
            os.killpg(up.pid, sig)
        else:
            os.kill(up.pid, sig)
        _, err = up.communicate(timeout=30)
    finally:
        if up.poll() is None:  # the test failed before the launcher exited: let it stop its children
            up.terminate()
            try:
                up.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()
    text = err.decode()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert up.returncode == code, text
    stopped = re.findall(r"^pdserve up: stopped (\S+) \(pid (\d+)\)$", text, re.MULTILINE)
    assert sorted(name for name, _ in stopped) == ["decode-0", "gateway", "prefill-0"], text
    pids = {name: int(pid) for name, pid in stopped}
    for role in ("prefill", "decode"):  # the stand-ins that were mid-import are the ones reported
        assert int((marks / role).read_text()) == pids[f"{role}-0"]
    assert all(_gone(pid) for pid in pids.values())  # leak check: no child or grandchild outlives `up`


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_during_the_model_conversion_ends_up_as_ctrl_c_does(
        sig: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    """SIGTERM or SIGHUP while ``up`` converts the embedded model (before any child): the conversion
    unwinds and removes its partial directory (a second signal during its clean-up does not break it),
    ``up`` says "interrupted" and returns 128 + the signal, and the previous handlers are back. Found by
    a new-user trial: the signal's default action killed the launcher silently and left the conversion's
    temporary directory behind."""
    import engine.models.registry as registry
    from pdserve import launcher
    from protocol.settings import UpSettings

    partial = tmp_path / ".smollm2-135m.partial"

    def converting(model: str) -> Path:  # stands in for the GGUF conversion (engine/models/gguf_convert.py)
        partial.mkdir()
        try:
            os.kill(os.getpid(), sig)
            time.sleep(10)  # the handler raises before this returns
        except BaseException:
            os.kill(os.getpid(), sig)  # a second signal while it cleans up: only recorded
            partial.rmdir()
            raise
        raise AssertionError("the signal did not stop the conversion")

    monkeypatch.setattr(registry, "resolve_model", converting)
    inherited = signal.signal(sig, signal.SIG_DFL)  # as in a terminal (under nohup SIGHUP is ignored)
    try:
        started = time.monotonic()
        assert launcher.run(UpSettings(device="cpu")) == 128 + sig
        assert time.monotonic() - started < 5
        assert not partial.exists()
        assert capsys.readouterr().err.splitlines() == ["pdserve up: interrupted"]
        assert signal.getsignal(sig) is signal.SIG_DFL  # put back
    finally:
        signal.signal(sig, inherited)


def test_under_nohup_sighup_stays_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGHUP ``up`` inherits as ignored (``nohup pdserve up``) stays ignored: closing the terminal is
    not a stop, during the conversion or after."""
    import engine.models.registry as registry
    from pdserve import launcher
    from protocol.settings import UpSettings

    seen = []

    def converting(model: str) -> Path:
        seen.append(signal.getsignal(signal.SIGHUP))
        raise FileNotFoundError("no such model")  # ends up with a refusal: nothing more to start

    monkeypatch.setattr(registry, "resolve_model", converting)
    inherited = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert launcher.run(UpSettings(device="cpu")) == 2
        assert seen == [signal.SIG_IGN] and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, inherited)


def test_a_stop_signal_during_the_checks_after_the_conversion_ends_up_before_any_child(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Between the conversion and the first child (``up_refusal`` imports torch, counts GPUs, loads the
    tokenizer: seconds) a SIGTERM is recorded and ends ``up`` with "interrupted" and 143 before any child
    starts, not by the signal's default action."""
    import engine.models.registry as registry
    from pdserve import launcher
    from pdserve.supervisor import Supervisor
    from protocol.settings import UpSettings

    monkeypatch.setattr(registry, "resolve_model", lambda model: Path("/nonexistent"))
    monkeypatch.setattr(registry, "read_model_config", lambda path, quantization: object())

    def checking(settings: UpSettings, config: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        return None

    def no_child(*args: object, **kwargs: object) -> None:
        raise AssertionError("a child was started after the stop signal")

    monkeypatch.setattr(launcher, "up_refusal", checking)
    monkeypatch.setattr(Supervisor, "start", no_child)
    assert launcher.run(UpSettings(device="cpu")) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.splitlines() == ["pdserve up: interrupted"]
