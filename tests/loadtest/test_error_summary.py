"""Failed requests are summarised by kind with counts and one example message each, so the printed
summary says *why* requests failed. Found by a new-user trial: ``pdserve bench --model nope`` printed
only ``http_status=20``; the gateway's "model does not exist" was only in results.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.cli import main
from loadtest.client import error_fields
from loadtest.metrics import error_groups, error_label
from loadtest.records import ErrorGroup, RequestRecord
from loadtest.report import load_json
from tests.gateway.inprocess import inprocess_gateway


def failed(i: int, kind: str, status: int | None = None, code: str | None = None,
           msg: str = "") -> RequestRecord:
    return RequestRecord(index=i, session_id=i, turn=0, start_s=0.0, error_kind=kind, http_status=status,
                         error_code=code, error=msg)


def test_error_fields_openai_vllm_and_plain_bodies() -> None:
    openai_body = {"error": {"message": "The model 'x' does not exist", "type": "invalid_request_error",
                             "param": "model", "code": "model_not_found"}}
    want = ("model_not_found", "The model 'x' does not exist")
    assert error_fields(json.dumps(openai_body).encode()) == want
    vllm_body = {"error": {"message": "no such model", "type": "NotFoundError", "param": None, "code": 404}}
    assert error_fields(json.dumps(vllm_body).encode()) == ("NotFoundError", "no such model")
    assert error_fields(b'{"error": {"message": "boom"}}') == (None, "boom")
    assert error_fields(b'{"detail": "Not Found"}') == (None, '{"detail": "Not Found"}')
    assert error_fields(b"Bad Gateway") == (None, "Bad Gateway")
    assert error_fields(b"x" * 1000)[1] == "x" * 300


def test_error_groups_count_label_and_first_example() -> None:
    records = [
        RequestRecord(index=0, session_id=0, turn=0, start_s=0.0, success=True),
        failed(4, "http_status", 404, "model_not_found", "model b"),
        failed(1, "http_status", 404, "model_not_found", "model a"),
        failed(2, "timeout", msg="no complete answer within 1.0 s"),
        failed(3, "http_status", 500, None, "internal boom"),
        failed(5, "http_status", 503, "no_worker", "no prefill worker"),
        failed(6, "http_status", 503, "no_worker", "no decode worker"),
        failed(7, "http_status", 404, "model_not_found", "model c"),
    ]
    assert error_label(records[1]) == "404 model_not_found" and error_label(records[4]) == "500"
    assert error_groups(records) == [
        ErrorGroup("404 model_not_found", 3, "model a"),  # the lowest index's message
        ErrorGroup("503 no_worker", 2, "no prefill worker"),
        ErrorGroup("500", 1, "internal boom"),
        ErrorGroup("timeout", 1, "no complete answer within 1.0 s"),
    ]
    assert error_groups(records[:1]) == []


def test_bench_against_gateway_with_bad_model_prints_why(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The real gateway (no workers needed: it knows its model from --model-name) answers 404."""
    with inprocess_gateway("served-model") as base:
        code = main(["--base-url", base, "--model", "nope", "--num-requests", "5", "--input-len", "fixed:4",
                     "--output-len", "fixed:2", "--no-progress", "--metrics-path", "", "--output-dir",
                     str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1  # no request completed
    row = "| 404 model_not_found | 5 | The model 'nope' does not exist |"
    assert "## Errors (rate=inf/s)" in out and row in out
    assert row in (tmp_path / "summary.md").read_text()
    summary = load_json(tmp_path / "results.json").runs[0].summary
    assert summary.failed == 5 and summary.errors_by_kind == {"http_status": 5}
    assert summary.error_groups == [ErrorGroup("404 model_not_found", 5, "The model 'nope' does not exist")]


def test_old_result_files_without_error_groups_still_load(tmp_path: Path) -> None:
    """Result files written before ``error_groups`` existed decode with an empty list (``compare`` works)."""
    with inprocess_gateway("served-model") as base:
        assert main(["--base-url", base, "--model", "nope", "--num-requests", "2", "--no-progress",
                     "--metrics-path", "", "--output-dir", str(tmp_path)]) == 1
    raw = json.loads((tmp_path / "results.json").read_text())
    del raw["runs"][0]["summary"]["error_groups"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(raw))
    assert load_json(old).runs[0].summary.error_groups == []
    assert main(["compare", str(old), str(tmp_path / "results.json")]) == 0


def test_bench_against_a_keyed_gateway_without_the_key_says_pass_api_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A new-user trial: without --api-key, asking a keyed server for its model said ``pass --model``, which
    only let every request fail with 401; the hint is --api-key (a wrong key: pass one it accepts)."""
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    flags = ["--num-requests", "1", "--no-progress", "--metrics-path", "", "--output-dir", str(tmp_path)]
    with inprocess_gateway("served-model", api_keys=("sekrit",)) as base:
        assert main(["--base-url", base, *flags]) == 2
        assert capsys.readouterr().err == (f"error: GET {base}/v1/models answered HTTP 401; the server asks "
                                           "for an API key: pass --api-key (or PDSERVE_API_KEY)\n")
        assert main(["--base-url", base, "--api-key", "wrong", *flags]) == 2
        assert capsys.readouterr().err == (f"error: GET {base}/v1/models answered HTTP 401; it refused the "
                                           "--api-key given: pass one the server accepts\n")
    assert not (tmp_path / "results.json").exists()


def test_compare_refuses_the_load_runs_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``compare`` reads two result files only: a load-run flag given with it is refused in one line
    naming it (exit 2), not ignored; the same flags left at their defaults are fine."""
    old = tmp_path / "old.json"
    old.write_text("{}")
    assert main(["compare", str(old), str(old), "--concurrency", "4", "--seed", "3"]) == 2
    assert "not the load run's --concurrency, --seed" in capsys.readouterr().err
