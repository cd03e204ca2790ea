"""pdserve.logging: one line per event; JSON lines carry the event's fields (request_id...)."""

from __future__ import annotations

import json
import logging

import pytest

from pdserve.logging import configure_logging, log_event


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
