"""The GGUF conversion logs its routine progress at INFO, never WARNING (warnings are for real
problems). Found by a new-user trial: every first start printed two WARNING lines for a normal,
expected one-time conversion. The dequantizing writer is replaced by a stand-in (no model needed)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine.models import gguf_convert


def _fake_writer(gguf_path: Path, out: Path, dtype: str) -> None:
    (out / "config.json").write_text("{}")


def test_conversion_progress_is_info_and_a_converted_dir_logs_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(gguf_convert, "_write_hf_dir", _fake_writer)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "converted"
    with caplog.at_level(logging.DEBUG, logger=gguf_convert.logger.name):
        assert gguf_convert.convert_gguf_to_hf(gguf, out, "bfloat16") == out
    ours = [r for r in caplog.records if r.name == gguf_convert.logger.name]
    assert [r.levelno for r in ours] == [logging.INFO, logging.INFO]
    assert ours[0].getMessage() == f"pdserve: converting m.gguf → {out} (bfloat16, once; ~25 s)"
    assert ours[1].getMessage().startswith("pdserve: conversion done in ")
    assert (out / "config.json").read_text() == "{}"
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=gguf_convert.logger.name):
        assert gguf_convert.convert_gguf_to_hf(gguf, out, "bfloat16") == out  # already there: silent
    assert [r for r in caplog.records if r.name == gguf_convert.logger.name] == []
