"""``bench.engine.prefill --chunked-ab`` on CPU (tiny model, Triton's interpreter): the prompt runs in
chunks on both sides of the comparison, every timing is reported, no cuDNN graph is warmed where cuDNN
cannot run, and another attention backend is refused before anything runs. Timing needs a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.engine.prefill import main
from engine.attention.triton_backend import TritonAttentionBackend


def test_chunked_ab_reports_both_sides(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    original = TritonAttentionBackend._cudnn_prefill

    def record(self: TritonAttentionBackend, *args: object) -> bool:
        seen.append(self.cudnn_paged_prefill)
        return original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(TritonAttentionBackend, "_cudnn_prefill", record)
    out = tmp_path / "ab.json"
    assert main(["--device", "cpu", "--model", "tiny", "--dtype", "float32", "--attention-backend", "triton",
                 "--tokens", "40", "--chunked-ab", "16", "--repeats", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["chunk"] == 16 and res["tokens"] == 40 and res["warmed_graphs"] == 0
    assert len(res["cudnn_s"]) == 2 and len(res["triton_s"]) == 2
    assert min(res["cudnn_s"] + res["triton_s"]) > 0
    assert res["cudnn_over_triton_median"] == pytest.approx(res["cudnn"]["median"] / res["triton"]["median"])
    assert "40 tokens in 16-token chunks" in capsys.readouterr().out
    # every layer of every chunk reached the backend with the switch on for one side, off for the other
    assert seen.count(True) == seen.count(False) > 0


def test_chunked_ab_refuses_another_backend(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--device", "cpu", "--model", "tiny", "--attention-backend", "torch", "--chunked-ab", "16"])
    assert exc.value.code == 2
    assert "--chunked-ab needs --attention-backend triton" in capsys.readouterr().err
