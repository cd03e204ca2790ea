"""Workloads, arrivals, fault specs, phases, the /metrics parser and config validation (pure, fast)."""

from __future__ import annotations

import itertools
import json
import random
import statistics
from pathlib import Path

import pytest

from loadtest.arrivals import arrival_times
from loadtest.config import BenchConfig, SLOConfig, WorkloadConfig
from loadtest.conversation import Conversation
from loadtest.faults import FaultSpec, phase_report
from loadtest.lengths import LengthDist
from loadtest.records import FaultResult, RequestRecord
from loadtest.scrape import kv_blocks_used
from loadtest.workload import Turn, load_sharegpt, make_sessions
from protocol.cli_env import OneLineParser
from protocol.durations import parse_duration


def test_length_dists() -> None:
    rng = random.Random(0)
    assert LengthDist.parse("128").sample(rng) == 128
    uni = [LengthDist.parse("uniform:5,9").sample(rng) for _ in range(500)]
    assert min(uni) == 5 and max(uni) == 9
    norm = [LengthDist.parse("normal:100,10").sample(rng) for _ in range(2000)]
    assert statistics.mean(norm) == pytest.approx(100, abs=1.5)  # std of the mean = 10/sqrt(2000) = 0.22
    assert min(LengthDist("normal", 1, 50).sample(rng) for _ in range(200)) == 1  # clipped
    for bad in ("uniform:9,5", "normal:1", "fixed:0", "zipf:3", "fixed:x"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_arrivals_rates_and_seed() -> None:
    n = 4000
    poisson = list(itertools.islice(arrival_times("poisson", 10.0, seed=1), n))
    assert poisson == sorted(poisson)
    assert poisson[-1] / n == pytest.approx(0.1, rel=0.05)  # mean gap 1/rate; rel. s.e. 1/sqrt(n)=1.6%
    assert poisson == list(itertools.islice(arrival_times("poisson", 10.0, seed=1), n))
    bursty = list(itertools.islice(arrival_times("gamma", 10.0, seed=1, burstiness=0.25), n))
    gaps = [b - a for a, b in itertools.pairwise(bursty)]
    # gamma(k, 1/(rate k)): mean 1/rate, coefficient of variation 1/sqrt(k) = 2
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.12)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(2.0, rel=0.15)
    assert list(itertools.islice(arrival_times("constant", 4.0, seed=0), 3)) == [0.0, 0.25, 0.5]
    assert list(itertools.islice(arrival_times("poisson", float("inf"), seed=0), 3)) == [0.0] * 3
    with pytest.raises(ValueError, match="arrival kind"):
        arrival_times("closed", 1.0, 0)


def test_random_token_workload_is_seeded() -> None:
    cfg = WorkloadConfig(input_len=LengthDist("uniform", 3, 6), output_len=LengthDist("fixed", 7))
    a = list(itertools.islice(make_sessions(cfg, 5), 20))
    assert a == list(itertools.islice(make_sessions(cfg, 5), 20))
    assert a != list(itertools.islice(make_sessions(cfg, 6), 20))
    for s in a:
        (turn,) = s.turns
        assert isinstance(turn.prompt, tuple) and 3 <= len(turn.prompt) <= 6
        assert all(100 <= t < 10000 for t in turn.prompt) and turn.max_tokens == 7


def test_sharegpt_loader(tmp_path: Path) -> None:
    data = [
        {"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "a b c d e f"},
                           {"from": "human", "value": "more"}, {"from": "gpt", "value": "x"}]},
        {"conversations": [{"from": "gpt", "value": "no human here"}]},
        {"id": "broken"},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    assert load_sharegpt(path, 1) == [[("hi there", 8)]]  # ceil(6 words * 4/3)
    assert load_sharegpt(path, 5) == [[("hi there", 8), ("more", 2)]]
    cfg = WorkloadConfig(kind="sharegpt", prompt_format="text", dataset_path=str(path), num_turns=2)
    s = next(make_sessions(cfg, 0))
    assert s.turns == (Turn("hi there", 8), Turn("more", 2))
    path.write_text(json.dumps([{"id": 1}]))
    with pytest.raises(ValueError, match="no ShareGPT conversation"):
        load_sharegpt(path, 1)
    path.write_text("{}")
    with pytest.raises(ValueError, match="JSON list"):
        load_sharegpt(path, 1)


@pytest.mark.parametrize(("content", "message"), [
    (None, r"^--dataset-path {path}: cannot read it \(No such file or directory\)$"),
    ("[{", r"^--dataset-path {path}: not JSON \("),
    ("{}", r"^--dataset-path {path}: a ShareGPT file is a JSON list of conversations$"),
    ('[{"id": 1}]', r"^--dataset-path {path}: no ShareGPT conversation with a human turn found$"),
])
def test_a_dataset_that_cannot_be_used_is_named_by_its_flag(content: str | None, message: str,
                                                            tmp_path: Path) -> None:
    """A new-user trial: ``--dataset-path /nonexistent`` said only ``[Errno 2] No such file or
    directory``, without naming the flag."""
    path = tmp_path / "sg.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises((OSError, ValueError), match=message.format(path=path)):
        load_sharegpt(path, 1)


@pytest.mark.parametrize(("argv", "line"), [
    (["--num-requests", "-3"], "error: --num-requests must be >= 1, got -3"),
    (["--num-requests", "0"], "error: --num-requests must be >= 1, got 0"),
    (["--arrival", "closed", "--concurrency", "0"], "error: --concurrency must be >= 1, got 0"),
    (["--arrival", "gamma", "--burstiness", "0"], "error: --burstiness must be a finite number > 0, got 0.0"),
    (["--concurrency", "4"], "error: --concurrency applies to --arrival closed and to the --warmup requests "
                             "only (got --arrival poisson and no warm-up: requests are sent at "
                             "--request-rate)"),
    (["--arrival", "closed", "--request-rate", "5"],
     "error: --request-rate does not apply to --arrival closed (its --concurrency sessions send back to "
     "back)"),
    (["--arrival", "constant", "--burstiness", "0.5"], "error: --burstiness applies to --arrival gamma only "
                                                       "(got --arrival constant)"),
    (["--warmup", "-1"], "error: --warmup must be >= 0, got -1"),
    (["--workload", "sharegpt", "--prompt-format", "text", "--dataset-path", "/nonexistent"],
     "error: --dataset-path /nonexistent: no such file"),
    (["--workload", "sharegpt", "--prompt-format", "text", "--dataset-path", "/"],
     "error: --dataset-path /: a directory, not a file"),
    (["--request-rate", "-1"], "error: --request-rate values must be > 0 requests/s, got -1"),
    (["--request-rate", "2,0"], "error: --request-rate values must be > 0 requests/s, got 0"),
    (["--input-len", "fixed:0"], "error: --input-len: fixed length must be an integer >= 1, got 0"),
    (["--output-len", "uniform:0,3"], "error: --output-len: uniform length bounds need 1 <= low <= high, got "
                                      "0, 3"),
    (["--duration", "5x"], "error: --duration: bad duration '5x': use a number with ms, s or m (e.g. 5s)"),
    (["--leak-settle", "abc"], "error: --leak-settle: bad duration 'abc': use a number with ms, s or m (e.g. "
                               "5s)"),
    (["--request-timeout=-1s"], "error: --request-timeout: bad duration '-1s': must not be negative"),
    (["--fault", "at=5x,cmd=true"], "error: bad --fault 'at=5x,cmd=true': bad duration '5x': use a number "
                                    "with ms, s or m (e.g. 5s)"),
])
def test_each_bad_bench_flag_is_named_alone(argv: list[str], line: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A new-user trial: ``--num-requests -3`` said "num_requests must be >= 1 and duration_s > 0" and
    ``--arrival closed --concurrency 0`` said "burstiness (--burstiness) must be ... and concurrency >= 1,
    got 1.0 and 0": field names, and the flag that was fine. Each is one line naming only the flag that
    is wrong, exit 2, before any request (the base URL is never reached)."""
    from loadtest.cli import main

    assert main(["--model", "m", "--base-url", "http://127.0.0.1:1", *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [line]


def test_conversation_grows_prefix() -> None:
    chat = Conversation("chat")
    t1, t2 = Turn("hello", 4), Turn("again", 4)
    assert chat.body(t1, "m", ignore_eos=True, temperature=0.0)["messages"] == [
        {"role": "user", "content": "hello"}]
    chat.add_reply(t1, " hi!")
    body = chat.body(t2, "m", ignore_eos=False, temperature=0.0)
    assert body["messages"][-2:] == [{"role": "assistant", "content": " hi!"},
                                     {"role": "user", "content": "again"}]
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and "ignore_eos" not in body
    comp = Conversation("completions")
    comp.add_reply(t1, " hi!")
    assert comp.body(t2, "m", ignore_eos=True, temperature=0.5)["prompt"] == "hello hi!\nagain"
    tokens = Conversation("completions")
    tokens.add_reply(Turn((5, 6), 2), " x")  # regression: raised for token-id turns
    assert tokens.body(Turn((5, 6), 2), "m", ignore_eos=True, temperature=0)["prompt"] == [5, 6]
    with pytest.raises(ValueError, match="chat"):
        chat.body(Turn((5, 6), 2), "m", ignore_eos=False, temperature=0)


def test_fault_spec_parse() -> None:
    assert parse_duration("500ms") == pytest.approx(0.5) and parse_duration("2m") == 120
    spec = FaultSpec.parse("at=1.5s,timeout=2s,cmd=echo a,b; true")
    assert spec == FaultSpec(1.5, "echo a,b; true", 2.0)
    assert FaultSpec.parse("at=3,cmd=x").timeout_s == 30.0
    for bad, msg in [("at=1s", "cmd="), ("cmd=ls", "at="), ("at=soon,cmd=x", "bad duration"),
                     ("when=1,cmd=x", "unknown field")]:
        with pytest.raises(ValueError, match=msg):
            FaultSpec.parse(bad)
    # one wording, no internals: the flag and the spec as given
    with pytest.raises(ValueError) as zero:
        FaultSpec.parse("at=1s,timeout=0,cmd=true")
    assert str(zero.value) == "bad --fault 'at=1s,timeout=0,cmd=true': timeout must be > 0 s"
    with pytest.raises(ValueError) as unknown:
        FaultSpec.parse("when=1,cmd=x")
    assert str(unknown.value).startswith("bad --fault 'when=1,cmd=x': unknown field")


@pytest.mark.parametrize(("text", "why"), [("-5s", "must not be negative"), ("-1", "must not be negative"),
                                           ("-abc", "use a number with ms, s or m"),
                                           ("-5h", "use a number with ms, s or m")])
def test_a_leading_minus_is_called_negative_only_before_a_duration(text: str, why: str) -> None:
    with pytest.raises(ValueError) as bad:
        parse_duration(text)
    assert str(bad.value).startswith(f"bad duration {text!r}: {why}")


def test_phase_report_splits_at_faults() -> None:
    def r(start: float, ok: bool, kind: str | None = None) -> RequestRecord:
        return RequestRecord(index=0, session_id=0, turn=0, start_s=start, success=ok, error_kind=kind)

    records = [r(0.1, True), r(0.9, True), r(1.2, False, "http_status"), r(1.5, False, "timeout"),
               r(2.5, True)]
    faults = [FaultResult(at_s=1.0, cmd="a", status="ran", started_s=1.0),
              FaultResult(at_s=2.0, cmd="b", status="ran", started_s=2.0),
              FaultResult(at_s=9.0, cmd="c", status="skipped")]
    phases = phase_report(records, faults)
    assert [(p.name, p.completed, p.failed, p.timed_out) for p in phases] == [
        ("before fault 1", 2, 0, 0), ("after fault 1", 0, 2, 1), ("after fault 2", 1, 0, 0)]
    assert [(p.start_s, p.end_s) for p in phases] == [(0.0, 1.0), (1.0, 2.0), (2.0, None)]
    assert [p.name for p in phase_report(records, [])] == ["all"]


def test_kv_gauge_sums_labels() -> None:
    page = ('# TYPE pdserve_kv_blocks_used gauge\npdserve_kv_blocks_used{worker="a"} 3\n'
            'pdserve_kv_blocks_used{worker="b"} 4.5\n# TYPE x gauge\nx 100\n')
    assert kv_blocks_used(page) == 7.5
    assert kv_blocks_used("# TYPE x gauge\nx 1\n") is None


def test_config_validation_names_the_problem() -> None:
    url = "http://127.0.0.1:1"
    with pytest.raises(ValueError, match="completions endpoint"):
        BenchConfig(url, "m", endpoint="chat")
    with pytest.raises(ValueError, match="set --num-requests or --duration"):
        BenchConfig(url, "m", num_requests=None, arrival="closed")
    with pytest.raises(ValueError, match="--request-rate inf sends everything at once: set --num-requests"):
        BenchConfig(url, "m", num_requests=None, duration_s=5.0)
    with pytest.raises(ValueError, match="--base-url"):
        BenchConfig("127.0.0.1:8000", "m")
    with pytest.raises(ValueError, match="--request-rate values must be > 0"):
        BenchConfig(url, "m", rates=(0.0,))
    with pytest.raises(ValueError, match="--workload sharegpt needs --dataset-path"):
        WorkloadConfig(kind="sharegpt", prompt_format="text")
    with pytest.raises(ValueError, match=r"^--dataset-path: only read by --workload sharegpt \(got "
                                         r"--workload multi-turn\)$"):
        WorkloadConfig(kind="multi-turn", prompt_format="text", dataset_path="sg.json")
    with pytest.raises(ValueError, match="prompt-format text"):
        WorkloadConfig(kind="multi-turn")
    with pytest.raises(ValueError, match="SLOs"):
        SLOConfig(ttft_ms=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_bench_float_flags_that_are_not_finite_are_refused(bad: float) -> None:
    """``--burstiness nan`` passed ``burstiness <= 0`` (nan fails every comparison) and was only refused by
    the arrival generator mid-run; ``inf``, ``--temperature nan|inf`` and a nan SLO were taken as given."""
    url = "http://127.0.0.1:1"
    with pytest.raises(ValueError, match=rf"^--burstiness must be a finite number > 0, got {bad}$"):
        BenchConfig(url, "m", burstiness=bad)
    with pytest.raises(ValueError, match=rf"^--temperature must be in \[0, 2\], got {bad}$"):
        BenchConfig(url, "m", temperature=bad)
    with pytest.raises(ValueError, match=r"SLOs \(--slo-ttft-ms, --slo-tpot-ms\) must be finite numbers"):
        SLOConfig(tpot_ms=bad)


@pytest.mark.parametrize("temperature", [-1.0, 2.5])
def test_a_temperature_the_gateway_refuses_is_refused_before_load(temperature: float) -> None:
    """``pdserve bench --temperature -1`` was taken, and every request then got the gateway's 400 (the
    OpenAI range is [0, 2]); the benchmark and the agent benchmark now refuse it before sending anything;
    the range's ends are taken."""
    from loadtest.agent_config import AgentConfig, SystemTarget

    systems = (SystemTarget("a", "http://127.0.0.1:1"),)
    with pytest.raises(ValueError, match=rf"^--temperature must be in \[0, 2\], got {temperature}$"):
        BenchConfig("http://127.0.0.1:1", "m", temperature=temperature, num_requests=1)
    with pytest.raises(ValueError, match=r"^--temperature must be in \[0, 2\]"):
        AgentConfig(model="m", systems=systems, temperature=temperature)
    for ok in (0.0, 2.0):
        assert BenchConfig("http://127.0.0.1:1", "m", temperature=ok, num_requests=1).temperature == ok
        assert AgentConfig(model="m", systems=systems, temperature=ok).temperature == ok


@pytest.mark.parametrize(("workload", "exists"), [
    ("random", False), ("random", True), ("multi-turn", True), ("agent", True)])
def test_a_dataset_path_that_the_workload_does_not_read_is_refused(
        workload: str, exists: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Only ``--workload sharegpt`` reads ``--dataset-path``: with another workload it was checked for
    existence (``--workload random --dataset-path /nonexistent``: "no such file") or silently unused. It is
    refused in one line naming both flags, exit 2, before any request (the base URL is never reached)."""
    from loadtest.cli import main

    path = tmp_path / "sg.json"
    if exists:
        path.write_text('[{"conversations": [{"from": "human", "value": "hi"}]}]')
    text = [] if workload == "random" else ["--prompt-format", "text"]
    argv = ["--model", "m", "--base-url", "http://127.0.0.1:1", "--workload", workload, *text,
            "--dataset-path", str(path)]
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --dataset-path: only read by --workload sharegpt (got --workload {workload})"]


def test_a_dataset_path_from_the_environment_is_a_default_only_sharegpt_reads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``PDSERVE_DATASET_PATH``, like every ``PDSERVE_*`` value, is a default: a workload that does not read
    the dataset neither checks nor keeps it (as the agent workload's flags that do not apply)."""
    from loadtest.agent_cli import check_flags
    from loadtest.cli import add_bench_arguments, config_from_args

    monkeypatch.setenv("PDSERVE_DATASET_PATH", "/nonexistent")
    parser = OneLineParser()
    add_bench_arguments(parser)
    args = parser.parse_args(["--workload", "random"])
    check_flags(args)
    assert config_from_args(args, "m").workload.dataset_path is None
    sharegpt = parser.parse_args(["--workload", "sharegpt", "--prompt-format", "text"])
    check_flags(sharegpt)
    with pytest.raises(ValueError, match=r"^--dataset-path /nonexistent: no such file$"):
        config_from_args(sharegpt, "m")
