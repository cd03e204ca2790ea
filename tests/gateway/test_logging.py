"""protocol.logging: one line per event; JSON lines carry the event's fields (request_id...); libraries
that print through a handler of their own (NIXL, transformers) come out in the chosen format too, and in
JSON no progress bar is drawn; the gateway logs a clean worker shutdown at INFO, a lost worker at WARNING.
A whole ``pdserve up --log-format json``: tests/system/test_up_json_logs.py."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.metrics import GatewayMetrics
from gateway.service import GatewayService
from kvtransfer.compat import KVCompat
from protocol.logging import configure_logging, log_event, say
from protocol.messages import RegisterAck, RegisterWorker, WorkerLoad, WorkerShutdown
from protocol.settings import GatewaySettings
from tests.gateway.test_metric_names import _FakeControl


def test_json_and_text_lines(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        configure_logging("info", "json")
        log_event(logging.getLogger("pdserve.test"), "request_routed", request_id="r-1", kind="colocated")
        line = capsys.readouterr().err.strip()
        assert "\n" not in line
        obj = json.loads(line)
        assert (obj["msg"], obj["request_id"], obj["kind"], obj["level"]) == (
            "request_routed", "r-1", "colocated", "info")
        configure_logging("warning", "text")
        log_event(logging.getLogger("pdserve.test"), "dropped", request_id="r-2")
        log_event(logging.getLogger("pdserve.test"), "worker_lost", logging.WARNING, worker_id="d1")
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "worker_lost worker_id=d1" in err[0]
        with pytest.raises(ValueError, match="log format"):
            configure_logging("info", "xml")
        with pytest.raises(ValueError, match="unknown log level"):
            configure_logging("loud", "text")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


# what nixl_cu13's logging.py does when NIXL is imported: logger "nixl" gets a stdout handler of its own
# and does not propagate
NIXL_LIKE = textwrap.dedent('''
    import logging, logging.config
    logging.config.dictConfig({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"simple": {"format": "%(asctime)s NIXL %(levelname)-7s %(message)s"}},
        "handlers": {"console": {"class": "logging.StreamHandler", "level": "INFO", "formatter": "simple",
                                 "stream": "ext://sys.stdout"}},
        "loggers": {"nixl": {"level": "INFO", "handlers": ["console"], "propagate": False}},
    })
''')


@pytest.fixture
def nixl_stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A package ``nixl`` (the name the real one imports under) configuring its logger as NIXL does, first
    on ``sys.path``; afterwards the module is forgotten and logger ``nixl`` is as it was."""
    (tmp_path / "nixl").mkdir()
    (tmp_path / "nixl" / "__init__.py").write_text(NIXL_LIKE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    logger = logging.getLogger("nixl")
    saved = (logger.handlers[:], logger.propagate, logger.level)
    yield
    sys.modules.pop("nixl", None)
    logger.handlers[:] = saved[0]
    logger.propagate = saved[1]
    logger.setLevel(saved[2])


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_a_library_imported_after_configure_logging_logs_through_the_root_handler(
        nixl_stand_in: None, capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    """NIXL is imported late (when a KV transport is made), after ``configure_logging``: its records go to
    the root handler (stderr, the chosen format), not to its own stdout handler."""
    configure_logging("info", fmt)
    import nixl  # noqa: F401  # the stand-in

    logging.getLogger("nixl.nixl_cu13._api").info("Initialized NIXL agent: %s", "up-decode-0-recv")
    out, err = capsys.readouterr()
    assert out == ""
    if fmt == "json":
        obj = json.loads(err)
        assert (obj["logger"], obj["level"], obj["msg"]) == ("nixl.nixl_cu13._api", "info",
                                                             "Initialized NIXL agent: up-decode-0-recv")
    else:
        [line] = err.splitlines()
        assert line.endswith("INFO    nixl.nixl_cu13._api Initialized NIXL agent: up-decode-0-recv")


def test_two_rehoming_finders_do_not_recurse(nixl_stand_in: None, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A second re-homing finder on ``sys.meta_path`` (as after a reload of protocol.logging) does not make
    the two ask each other forever: the import works, and the library still logs through the root."""
    from protocol.logging import _RehomeAfterImport

    configure_logging("info", "json")
    monkeypatch.setattr(sys, "meta_path", [_RehomeAfterImport(), *sys.meta_path])
    import nixl  # noqa: F401  # the stand-in

    logging.getLogger("nixl").info("up")
    out, err = capsys.readouterr()
    assert out == "" and json.loads(err)["msg"] == "up"


def test_a_library_imported_before_configure_logging_is_rehomed_too(
        nixl_stand_in: None, capsys: pytest.CaptureFixture[str]) -> None:
    import nixl  # noqa: F401  # the stand-in

    configure_logging("info", "json")
    logging.getLogger("nixl.nixl_cu13._api").warning("Backend UCX was instantiated")
    out, err = capsys.readouterr()
    assert out == "" and json.loads(err)["msg"] == "Backend UCX was instantiated"


TRANSFORMERS_SCRIPT = textwrap.dedent('''
    import sys, warnings
    from protocol.logging import configure_logging
    configure_logging("info", sys.argv[1])
    import transformers
    from transformers.utils import logging as tl
    tl.get_logger("transformers.modeling_utils").warning("Some weights were not used")
    for _ in tl.tqdm(range(3), desc="Loading weights"):
        pass
    warnings.warn("a library warns")
''')


@pytest.mark.slow
def test_transformers_logs_warnings_and_progress_bars_follow_the_log_format() -> None:
    """transformers, imported after ``configure_logging`` as a worker imports it: in JSON every line on
    stdout and stderr is a JSON object (its logger's line, Python's warning as ``py.warnings``) and the
    weight-loading bar is not drawn; in text its line is a text line and the bar is drawn."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    runs = {fmt: subprocess.run([sys.executable, "-c", TRANSFORMERS_SCRIPT, fmt], capture_output=True,
                                text=True, env=env, timeout=120) for fmt in ("json", "text")}
    for done in runs.values():
        assert done.returncode == 0, done.stderr
    lines = (runs["json"].stdout + runs["json"].stderr).splitlines()
    objs = [json.loads(line) for line in lines]  # every line: a JSON object
    assert [(o["logger"], o["level"]) for o in objs] == [("transformers.modeling_utils", "warning"),
                                                         ("py.warnings", "warning")], lines
    assert objs[0]["msg"] == "Some weights were not used" and "a library warns" in objs[1]["msg"]
    text = runs["text"].stderr
    assert "WARNING transformers.modeling_utils Some weights were not used" in text
    assert "Loading weights" in text and "UserWarning: a library warns" in text


def test_say_prints_text_or_logs_one_json_event(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``say``: the text as given (on the stream asked for) in the text format, a log event with its
    fields in JSON."""
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    up = logging.getLogger("pdserve.up")
    configure_logging("info", "text")
    say(up, "ready", "pdserve is ready at http://h:1\nTry: curl", stream=sys.stdout, url="http://h:1")
    say(up, "stopped gateway (pid 7)", "pdserve up: stopped gateway (pid 7)")
    assert capsys.readouterr() == ("pdserve is ready at http://h:1\nTry: curl\n",
                                   "pdserve up: stopped gateway (pid 7)\n")
    configure_logging("info", "json")
    say(up, "ready", "pdserve is ready at http://h:1\nTry: curl", stream=sys.stdout, url="http://h:1")
    say(up, "gateway exited with code 1", "pdserve up: gateway exited with code 1", logging.ERROR)
    out, err = capsys.readouterr()
    objs = [json.loads(line) for line in err.splitlines()]
    assert out == "" and [(o["logger"], o["level"], o["msg"]) for o in objs] == [
        ("pdserve.up", "info", "ready"), ("pdserve.up", "error", "gateway exited with code 1")]
    assert objs[0]["url"] == "http://h:1"
    # --log-level warning hides log events below it, not what the command tells its user (text prints it)
    configure_logging("warning", "json")
    say(up, "ready", "pdserve is ready at http://h:1", url="http://h:1")
    [line] = capsys.readouterr().err.splitlines()
    assert (json.loads(line)["msg"], json.loads(line)["level"]) == ("ready", "info")


async def test_clean_worker_shutdown_is_logged_at_info(caplog: pytest.LogCaptureFixture) -> None:
    """A worker that announces its shutdown holding no request is no incident (INFO); one the gateway
    declares lost is (WARNING)."""
    svc = GatewayService(GatewaySettings(insecure_control_plane=True), GatewayMetrics(), text=object())  # type: ignore[arg-type]
    svc.control = _FakeControl()  # type: ignore[assignment]
    compat = KVCompat(dtype="float32", block_size=16, transfer_backend="loopback")
    for wid in ("d0", "d1"):
        register = RegisterWorker(role="decode", worker_id=wid, epoch=1, model="m", model_path="",
                                  compat=compat, load=WorkerLoad())
        await svc.on_control_message(wid.encode(), register)
    with caplog.at_level(logging.INFO):
        await svc.on_control_message(b"d0", WorkerShutdown(worker_id="d0", epoch=1))
        entry = svc.registry.get("d1")
        assert entry is not None
        svc.worker_gone(entry, "no heartbeat for 5 s")
    levels = {getattr(r, "worker_id", None): r.levelno for r in caplog.records
              if r.getMessage() == "worker_lost"}
    assert levels == {"d0": logging.INFO, "d1": logging.WARNING}


async def test_register_ack_carries_this_gateway_incarnation() -> None:
    """Every RegisterAck names the gateway process's epoch, a new one per process, so a worker can tell
    a restarted gateway from a ReRegister of the same one (tests/workers/test_gateway_change.py)."""
    compat = KVCompat(dtype="float32", block_size=16, transfer_backend="loopback")
    epochs = []
    for _ in range(2):
        svc = GatewayService(GatewaySettings(insecure_control_plane=True), GatewayMetrics(), text=object())  # type: ignore[arg-type]
        control = _FakeControl()
        svc.control = control  # type: ignore[assignment]
        register = RegisterWorker(role="decode", worker_id="d0", epoch=1, model="m", model_path="",
                                  compat=compat, load=WorkerLoad())
        await svc.on_control_message(b"d0", register)
        await svc.on_control_message(b"d0", register)  # answering a ReRegister: the same gateway epoch
        acks = [m for _, m in control.sent if isinstance(m, RegisterAck)]
        assert len(acks) == 2 and acks[0].gateway_epoch == acks[1].gateway_epoch == svc.epoch > 0
        epochs.append(svc.epoch)
    assert epochs[1] > epochs[0]
