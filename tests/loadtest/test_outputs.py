"""Outputs end to end through the CLI (`python -m loadtest` = `pdserve bench`): JSON, Markdown, PNG plots,
`compare`, environment defaults and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.cli import add_bench_arguments, main
from loadtest.report import load_json
from protocol.cli_env import OneLineParser
from tests.loadtest.fake_server import FakeState

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _bench(url: str, out: Path, *extra: str) -> list[str]:
    return ["--base-url", url, "--input-len", "fixed:8", "--output-len", "fixed:5", "--num-requests", "6",
            "--no-progress", "--leak-settle", "300ms", "--output-dir", str(out), *extra]


def test_sweep_outputs_and_compare(fake: tuple[str, FakeState], tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    url, state = fake
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(_bench(url, a, "--arrival", "constant", "--request-rate", "30,60", "--api-key", "k1")) == 0
    assert state.bodies[0]["model"] == "fake-model"  # taken from GET /v1/models
    result = load_json(a / "results.json")
    assert [r.label for r in result.runs] == ["rate=30/s", "rate=60/s"]
    assert all(len(r.records) == 6 and r.summary.completed == 6 for r in result.runs)
    assert result.config["api_key"] == "***"  # never written out
    raw = json.loads((a / "results.json").read_text())
    assert raw["runs"][0]["records"][0]["itl_s"] and "ttft_s" in raw["runs"][0]["records"][0]
    md = (a / "summary.md").read_text()
    assert "| rate=30/s | 6/6 |" in md and "| rate=60/s | 6/6 |" in md and "leaked 0" in md
    for name in ("latency_cdf.png", "timeline.png", "throughput_vs_rate.png"):
        data = (a / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
    # B: every other request (in arrival order) waits slow_ttft_s for its first token; 1 s leaves the fast
    # ones (ttft_s 0.05 s) a wide margin on a loaded machine
    state.plan, state.slow_ttft_s = ["ok", "slow"], 1.0
    assert main(_bench(url, b, "--arrival", "constant", "--request-rate", "30,60", "--model", "m2")) == 0
    capsys.readouterr()
    assert main(["compare", str(a / "results.json"), str(b / "results.json")]) == 0
    out = capsys.readouterr().out
    run_b = load_json(b / "results.json").runs[0]
    ra, rb = result.runs[0].summary, run_b.summary
    assert ra.ttft_ms is not None and rb.ttft_ms is not None
    # exactly the 3 slowed requests (whichever arrived at the fake in odd places) wait at least
    # slow_ttft_s (a sleep: never shorter, whatever the machine's load, while the ratio of two means
    # measured at different times is not); the 3 others answer in ttft_s, far below it
    ttfts = sorted(r.ttft_s for r in run_b.records if r.ttft_s is not None)
    assert len(ttfts) == 6, [r.ttft_s for r in run_b.records]
    assert ttfts[2] < state.slow_ttft_s <= ttfts[3], ttfts
    ratio = rb.ttft_ms.mean / ra.ttft_ms.mean
    assert f"| TTFT mean (ms) | {ra.ttft_ms.mean:.2f} | {rb.ttft_ms.mean:.2f} | {ratio:.3f} |" in out
    assert "## run 1: A rate=60/s vs B rate=60/s" in out


def test_closed_loop_multi_turn_cli_and_leak_exit_code(fake: tuple[str, FakeState], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    url, state = fake
    args = _bench(url, tmp_path, "--arrival", "closed", "--concurrency", "2", "--workload", "multi-turn",
                  "--prompt-format", "text", "--endpoint", "chat", "--num-turns", "3", "--model", "m")
    assert main(args) == 0
    assert not (tmp_path / "throughput_vs_rate.png").exists()  # no offered rate in a closed loop
    assert (tmp_path / "latency_cdf.png").read_bytes().startswith(PNG_MAGIC)
    capsys.readouterr()
    state.reset(plan=["leak"])
    assert main(args) == 1  # leaked KV blocks fail the run, and stderr says so
    assert "**LEAK**" in (tmp_path / "summary.md").read_text()
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert line.startswith("error: run concurrency=2: ")
    assert line.endswith(" KV blocks still used after the run")


def test_env_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_NUM_REQUESTS", "7")
    monkeypatch.setenv("PDSERVE_NO_PROGRESS", "true")
    monkeypatch.setenv("PDSERVE_FAULT", "at=1s,cmd=true")
    parser = OneLineParser()
    add_bench_arguments(parser)
    args = parser.parse_args([])
    got = (args.num_requests, args.no_progress, args.fault, args.bench_action)
    assert got == (7, True, ["at=1s,cmd=true"], "run")
    assert parser.parse_args(["compare", "x", "y"]).bench_files == ["x", "y"]


@pytest.mark.parametrize("bad, message", [
    (["--input-len", "zipf:3"], "bad length spec"),
    (["--fault", "at=1s"], "cmd="),
    (["--request-rate", "fast"], "--request-rate"),
    (["--endpoint", "chat", "--prompt-format", "tokens"], "completions endpoint"),
    (["--decode-metrics", "127.0.0.1:9000"], "--decode-metrics: URLs must start with http://"),
])
def test_bad_input_sends_nothing(fake: tuple[str, FakeState], tmp_path: Path, bad: list[str], message: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    url, state = fake
    assert main(["--base-url", url, "--no-progress", *bad]) == 2
    assert message in capsys.readouterr().err
    assert state.counter == 0 and not list(tmp_path.iterdir())


def test_compare_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bogus = tmp_path / "x.json"
    bogus.write_text('{"hello": 1}')
    assert main(["compare", str(bogus)]) == 2
    assert "exactly two" in capsys.readouterr().err
    assert main(["compare", str(bogus), str(bogus)]) == 2
    assert "not a pdserve bench result" in capsys.readouterr().err


@pytest.mark.parametrize("page", ["/decode-worker/metrics", "/decode-worker", "/decode-worker/metrics/"])
def test_decode_metrics_as_pdserve_up_prints_it_or_as_the_server(fake: tuple[str, FakeState], tmp_path: Path,
                                                                 page: str) -> None:
    """`pdserve up` prints each worker's page (http://host:port/metrics): the bench reads that page, not
    .../metrics/metrics (a 404, once reported as "not measured" with exit 0); the server's URL reads the
    same page."""
    url, _ = fake
    assert main(_bench(url, tmp_path, "--arrival", "closed", "--decode-metrics", url + page)) == 0
    [run] = load_json(tmp_path / "results.json").runs
    assert run.gateway_share is not None and run.gateway_share.error == ""
    assert run.gateway_share.worker_tokens > 0


def test_decode_metrics_unreadable_before_the_load_sends_nothing(fake: tuple[str, FakeState], tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A page asked for that cannot be read (here a 404, and the gateway's page without the histogram)
    ends the bench before its load: exit 2, the page named, no request sent, no output written."""
    url, state = fake
    for page, why in ((f"{url}/nope", "answered HTTP 404"), (url, "no vllm:inter_token_latency_seconds")):
        assert main(_bench(url, tmp_path, "--model", "m", "--decode-metrics", page)) == 2
        err = capsys.readouterr().err
        assert "--decode-metrics:" in err and why in err and "no load was sent" in err, err
    assert state.counter == 0 and not list(tmp_path.iterdir())


def test_decode_metrics_lost_during_the_run_fails_the_bench(fake: tuple[str, FakeState], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Read before the load (the check) and before the run, then HTTP 500: the results are written, the
    report says "not measured", and the exit code is 1 (a measurement asked for and not made)."""
    url, state = fake
    state.decode_page_ok_reads = 2
    args = _bench(url, tmp_path, "--arrival", "closed", "--decode-metrics", f"{url}/decode-worker/metrics")
    assert main(args) == 1
    assert "--decode-metrics not read" in capsys.readouterr().err
    assert "not measured: GET" in (tmp_path / "summary.md").read_text()
    assert load_json(tmp_path / "results.json").runs[0].summary.completed == 6
