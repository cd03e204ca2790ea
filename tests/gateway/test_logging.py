"""protocol.logging: one line per event; JSON lines carry the event's fields (request_id...); the gateway
logs a clean worker shutdown at INFO, a lost worker at WARNING."""

from __future__ import annotations

import json
import logging

import pytest

from gateway.metrics import GatewayMetrics
from gateway.service import GatewayService
from kvtransfer.compat import KVCompat
from protocol.logging import configure_logging, log_event
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
