"""pdserve CLI: subcommands, flags from env PDSERVE_*, settings validation, lazy dispatch."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from pdserve.cli import SETTINGS_COMMANDS, _EnvAdder, _OneLineParser, build_parser, main
from protocol.settings import GatewaySettings, UpSettings, WorkerSettings, settings_from_args

OPEN = {"PDSERVE_INSECURE_CONTROL_PLANE": "1"}  # settings tests about other flags: no key directory


def test_gateway_defaults_and_flags() -> None:
    s = settings_from_args(build_parser(OPEN).parse_args(["gateway"]))
    assert s == GatewaySettings(insecure_control_plane=True)
    args = build_parser(OPEN).parse_args(["gateway", "--port", "9001", "--api-key", "a", "--api-key", "b",
                                        "--public-metrics", "false", "--allow-local-prefill"])
    s = settings_from_args(args)
    assert isinstance(s, GatewaySettings)
    assert (s.port, s.api_keys, s.public_metrics, s.allow_local_prefill) == (9001, ("a", "b"), False, True)


def test_every_flag_reads_env(tmp_path: Path) -> None:
    keyfile = tmp_path / "keys"
    keyfile.write_text("k1\n# comment\nk2\n")
    env = {"PDSERVE_PORT": "8123", "PDSERVE_HEARTBEAT_TIMEOUT": "2.5", "PDSERVE_API_KEY": "x,y",
           "PDSERVE_API_KEY_FILE": str(keyfile), "PDSERVE_PUBLIC_HEALTH": "no",
           "PDSERVE_LOG_FORMAT": "json", "PDSERVE_BLOCK_SIZE": "32", "PDSERVE_NUM_DECODE": "3", **OPEN}
    parser = build_parser(env)
    s = settings_from_args(parser.parse_args(["gateway"]))
    assert isinstance(s, GatewaySettings)
    assert (s.port, s.heartbeat_timeout, s.public_health, s.log_format) == (8123, 2.5, False, "json")
    assert s.api_keys == ("x", "y", "k1", "k2")
    w = settings_from_args(parser.parse_args(["decode", "--worker-id", "d0"]))
    assert isinstance(w, WorkerSettings) and (w.role, w.block_size, w.worker_id) == ("decode", 32, "d0")
    up = settings_from_args(parser.parse_args(["up"]))
    assert isinstance(up, UpSettings)
    assert (up.num_decode, up.port, up.log_format) == (3, 8123, "json")
    # the gateway's and the workers' flags reach `up` too (it passes them on)
    assert (up.gateway.heartbeat_timeout, up.gateway.public_health, up.gateway.api_keys) == (
        2.5, False, ("x", "y", "k1", "k2"))
    assert up.worker.block_size == 32
    assert up.insecure_control_plane
    # the command line wins over env
    assert settings_from_args(parser.parse_args(["gateway", "--port", "1"])).port == 1  # type: ignore[union-attr]


def test_bad_env_value_names_the_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser({"PDSERVE_PORT": "eighty"}).parse_args(["gateway"])
    assert exc.value.code == 2  # as a bad flag value
    assert capsys.readouterr().err.startswith("pdserve gateway: bad value for PDSERVE_PORT (--port): ")


@pytest.mark.parametrize(("env", "argv", "line"), [
    ({"PDSERVE_PORT": "99999"}, ["gateway"],
     "pdserve gateway: bad value for PDSERVE_PORT (--port): must be in [0, 65535], got 99999"),
    ({"PDSERVE_MAX_NUM_SEQS": "-1"}, ["up"],
     "pdserve up: bad value for PDSERVE_MAX_NUM_SEQS (--max-num-seqs): must be >= 1"),
    ({}, ["gateway", "--port", "99999"], "pdserve gateway: --port: must be in [0, 65535], got 99999"),
    ({"PDSERVE_PORT": "80"}, ["gateway", "--port=99999"],  # the command line's value was refused
     "pdserve gateway: --port: must be in [0, 65535], got 99999"),
])
def test_a_variable_out_of_range_is_named(env: dict[str, str], argv: list[str], line: str,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A value in range of its type but refused by the settings' checks names the variable it came from
    (as a value of the wrong type does), and only the flag when the command line gave it."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == line


# (variable, its flag, the commands that read it): each of these refuses a bad value, every other command
# neither checks nor applies it. `up` refuses the variables of the flags it sets itself for its children
# (--workers, --metrics-port) whatever their value (tests/system/test_up_environment.py).
_ENV_READERS = [
    ("PDSERVE_ADMISSION_BUDGET", "--admission-budget", {"gateway", "up"}),
    ("PDSERVE_WORKERS", "--workers", {"gateway", "up"}),
    ("PDSERVE_DECODE_PREFIX_REUSE", "--decode-prefix-reuse", {"decode", "up"}),
    ("PDSERVE_BLOCK_SIZE", "--block-size", {"prefill", "decode", "colocated", "up"}),
    ("PDSERVE_METRICS_PORT", "--metrics-port", {"prefill", "decode", "colocated", "up"}),
    ("PDSERVE_NUM_PREFILL", "--num-prefill", {"up"}),
    ("PDSERVE_EXIST_OK", "--exist-ok", {"keygen"}),
    ("PDSERVE_LOG_LEVEL", "--log-level", {"up", "gateway", "prefill", "decode", "colocated"}),
    ("PDSERVE_TRANSFER_BACKEND", "--transfer-backend", {"up", "prefill", "decode"}),
    ("PDSERVE_NUM_REQUESTS", "--num-requests", {"bench"}),
    ("PDSERVE_IGNORE_EOS", "--ignore-eos", {"bench"}),
]
_COMMANDS = {"up": ["up"], "gateway": ["gateway"], "prefill": ["prefill"], "decode": ["decode"],
             "colocated": ["colocated"], "keygen": ["keygen", "some-dir"], "bench": ["bench"]}


@pytest.mark.parametrize(("variable", "flag", "readers"), _ENV_READERS)
def test_a_bad_env_value_concerns_only_the_commands_that_take_its_flag(
        variable: str, flag: str, readers: set[str], capsys: pytest.CaptureFixture[str]) -> None:
    """``PDSERVE_ADMISSION_BUDGET=banana pdserve prefill`` exited 2: every subcommand's env defaults were
    read and converted up front. Now a command refuses (one line naming the variable and the flag, exit
    2, before ``--help`` or anything else) only a value it would read; another command ignores it."""
    dest = flag.lstrip("-").replace("-", "_")
    for command, argv in _COMMANDS.items():
        if command in readers:
            with pytest.raises(SystemExit) as exc:
                build_parser({variable: "banana"}).parse_known_args([*argv, "--help"])
            assert exc.value.code == 2, command
            [line] = capsys.readouterr().err.splitlines()
            refused = command == "up" and variable in ("PDSERVE_WORKERS", "PDSERVE_METRICS_PORT")
            want = f"{variable} is the " if refused else f"bad value for {variable} ({flag}"
            assert line.startswith(f"pdserve {command}: {want}"), line
        else:
            args, unknown = build_parser({variable: "banana"}).parse_known_args(argv)
            assert args.command == command and unknown == [] and not hasattr(args, dest), command
            assert capsys.readouterr().err == ""


def test_a_bad_env_value_of_another_commands_flag_stops_nothing(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``main``: ``keygen`` and a worker run with a bad decode-only and gateway-only variable set."""
    monkeypatch.setenv("PDSERVE_DECODE_PREFIX_REUSE", "maybe")
    monkeypatch.setenv("PDSERVE_ADMISSION_BUDGET", "banana")
    assert main(["keygen", str(tmp_path / "keys")]) == 0
    seen: list[object] = []
    fake = types.ModuleType("prefill_worker.main")
    fake.run = seen.append  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "prefill_worker.main", fake)
    assert main(["prefill", "--worker-id", "p0", "--insecure-control-plane"]) == 0
    assert isinstance(seen[0], WorkerSettings) and seen[0].decode_prefix_reuse is True


_LEVELS = "'debug', 'info', 'warning', 'error', 'critical'"


@pytest.mark.parametrize(("variable", "value", "flag", "choices", "commands"), [
    ("PDSERVE_LOG_LEVEL", "verbose", "--log-level", _LEVELS, SETTINGS_COMMANDS),
    ("PDSERVE_LOG_FORMAT", "xml", "--log-format", "'text', 'json'", SETTINGS_COMMANDS),
    ("PDSERVE_TRANSFER_BACKEND", "foo", "--transfer-backend", "'nixl', 'ucx', 'loopback'",
     ("up", "prefill", "decode")),
    ("PDSERVE_DTYPE", "int8", "--dtype", "'auto', 'float32', 'bfloat16', 'float16'", ("up", "decode")),
    ("PDSERVE_KV_CACHE_DTYPE", "fp4", "--kv-cache-dtype", "'auto', 'fp8'", ("colocated",)),
])
def test_an_env_value_outside_the_flags_choices_is_refused_in_one_line(
        variable: str, value: str, flag: str, choices: str, commands: tuple[str, ...],
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse checks ``choices`` against a command-line value only, never against a default (where a
    variable's value goes), so ``_EnvAdder`` checks them: through ``main``, before ``configure_logging``
    or any process starts, one line naming the variable and the flag, exit 2 (an upper-case log level is
    refused as ``--log-level INFO`` is)."""
    monkeypatch.setenv(variable, value)
    for command in commands:
        with pytest.raises(SystemExit) as exc:
            main([command, "--insecure-control-plane"])
        assert exc.value.code == 2, command
        assert capsys.readouterr().err == (f"pdserve {command}: bad value for {variable} ({flag}): invalid "
                                           f"choice: {value!r} (choose from {choices})\n")


def test_env_values_among_the_choices_are_taken() -> None:
    env = {"PDSERVE_LOG_LEVEL": "debug", "PDSERVE_LOG_FORMAT": "json", "PDSERVE_TRANSFER_BACKEND": "loopback",
           "PDSERVE_QUANTIZATION": "fp8", **OPEN}
    args = build_parser(env).parse_args(["decode"])
    assert (args.log_level, args.log_format, args.transfer_backend, args.quantization) == (
        "debug", "json", "loopback", "fp8")


def test_choices_are_checked_after_the_type_and_per_entry_of_a_repeatable_flag() -> None:
    """``_EnvAdder``: a value is converted first, then checked against ``choices``; each entry of a
    repeatable flag's comma-separated list is checked."""
    env = {"PDSERVE_N": "3", "PDSERVE_ITEM": "a,c", "PDSERVE_OK": "2", "PDSERVE_OK_ITEM": "b,a"}
    parser = _OneLineParser(prog="t")
    add = _EnvAdder(parser, env)
    add("--n", type=int, default=1, choices=[1, 2])
    add("--item", action="append", default=None, choices=["a", "b"])
    add("--ok", type=int, default=1, choices=[1, 2])
    add("--ok-item", action="append", default=None, choices=["a", "b"])
    assert parser.env_problems == {"PDSERVE_N": ("--n", "invalid choice: 3 (choose from 1, 2)"),
                                   "PDSERVE_ITEM": ("--item", "invalid choice: 'c' (choose from 'a', 'b')")}
    parser.env_problems.clear()
    args = parser.parse_args([])
    assert (args.n, args.item, args.ok, args.ok_item) == (1, None, 2, ["b", "a"])


def test_settings_validation_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--heartbeat-timeout"):
        GatewaySettings(heartbeat_timeout=0, insecure_control_plane=True)
    with pytest.raises(ValueError, match="--block-size"):
        WorkerSettings(role="decode", block_size=0, insecure_control_plane=True)
    with pytest.raises(ValueError, match="--transfer-backend"):
        WorkerSettings(role="prefill", transfer_backend="carrier-pigeon", insecure_control_plane=True)
    with pytest.raises(ValueError, match="--num-prefill"):
        UpSettings(num_prefill=0, colocated=0)
    assert WorkerSettings(role="colocated", insecure_control_plane=True).worker_id  # default hostname-pid


def test_worker_dispatch_is_lazy(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[object] = []
    fake = types.ModuleType("prefill_worker.main")
    def run(settings: object) -> int:
        seen.append(settings)
        return 0

    fake.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "prefill_worker.main", fake)
    assert main(["prefill", "--worker-id", "p7", "--block-size", "8", "--insecure-control-plane"]) == 0
    assert isinstance(seen[0], WorkerSettings) and seen[0].worker_id == "p7" and seen[0].block_size == 8


def test_missing_runner_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pdserve.launcher", None)  # makes the import fail
    with pytest.raises(SystemExit, match=r"pdserve\.launcher is not available"):
        main(["up"])


def test_invalid_settings_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gateway", "--max-queue", "0", "--insecure-control-plane"]) == 2
    assert "--max-queue" in capsys.readouterr().err


def test_retry_and_migration_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    s = settings_from_args(build_parser({"PDSERVE_MAX_MIGRATIONS": "0", **OPEN}).parse_args(
        ["gateway", "--max-retries", "5"]))
    assert isinstance(s, GatewaySettings) and (s.max_retries, s.max_migrations) == (5, 0)
    default = GatewaySettings(insecure_control_plane=True)
    assert (default.max_retries, default.max_migrations) == (2, 1)
    for flag in ("--max-retries", "--max-migrations"):
        assert main(["gateway", flag, "-1", "--insecure-control-plane"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{flag}: must be >= 0, got -1" in err


def test_bench_wired_to_loadtest(monkeypatch: pytest.MonkeyPatch) -> None:
    import loadtest.cli

    calls: list[object] = []

    def run_bench(args: object) -> int:
        calls.append(args)
        return 3

    monkeypatch.setattr(loadtest.cli, "run_bench", run_bench)
    assert main(["bench", "--base-url", "http://127.0.0.1:9"]) == 3
    assert calls and calls[0].base_url == "http://127.0.0.1:9"  # type: ignore[attr-defined]


@pytest.mark.parametrize(("variable", "value", "line"), [
    ("PDSERVE_NUM_REQUESTS", "abc", "bad value for PDSERVE_NUM_REQUESTS (--num-requests): invalid int value: "
                                    "'abc'"),
    ("PDSERVE_IGNORE_EOS", "maybe", "bad value for PDSERVE_IGNORE_EOS (--ignore-eos): expected true or "
                                    "false, got 'maybe'"),
    ("PDSERVE_WORKLOAD", "foo", "bad value for PDSERVE_WORKLOAD (--workload): invalid choice: 'foo' (choose "
                                "from 'random', 'sharegpt', 'multi-turn', 'agent')"),
    ("PDSERVE_KV_DTYPE", "int4", "bad value for PDSERVE_KV_DTYPE (--kv-dtype): invalid choice: 'int4' "
                                 "(choose from 'float32', 'bfloat16', 'float16')"),
])
@pytest.mark.parametrize("argv", [["bench"], ["bench", "--help"], ["bench", "--base-url", "http://127.0.0.1:1"]])
def test_bench_refuses_a_bad_variable_as_the_other_commands_do(
        variable: str, value: str, line: str, argv: list[str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A new-user trial (D6): ``pdserve bench`` read its variables itself: ``PDSERVE_NUM_REQUESTS=abc`` was
    reported as ``argument --num-requests: invalid int value`` (no variable named) and ``--help`` exited 0,
    ``PDSERVE_IGNORE_EOS=maybe`` silently meant false, ``PDSERVE_WORKLOAD=foo`` listed the choices without
    ``agent``. Now one line naming the variable and the flag, exit 2, before ``--help`` or any request."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert capsys.readouterr() == ("", f"pdserve bench: {line}\n")


def test_bench_variables_are_converted_as_the_other_commands_do() -> None:
    """A store_true flag's variable is a bool (``parse_bool``); the variable of ``--fault`` or ``--system``
    holds one entry, commas included; the command line replaces a repeatable flag's variable."""
    env = {"PDSERVE_IGNORE_EOS": "yes", "PDSERVE_NO_PROGRESS": "off", "PDSERVE_FAULT": "at=1s,cmd=true",
           "PDSERVE_SYSTEM": "label=a,url=http://h:1", "PDSERVE_NUM_REQUESTS": "7"}
    args = build_parser(env).parse_args(["bench"])
    got = (args.ignore_eos, args.no_progress, args.fault, args.system, args.num_requests)
    assert got == (True, False, ["at=1s,cmd=true"], ["label=a,url=http://h:1"], 7)
    assert build_parser(env).parse_args(["bench", "--fault", "at=2s,cmd=x"]).fault == ["at=2s,cmd=x"]


def test_async_scheduling_and_pdl_reach_the_engine_config() -> None:
    """``--async-scheduling`` / ``PDSERVE_ASYNC_SCHEDULING`` → ``SchedulerConfig.async_scheduling`` and
    ``--pdl`` / ``PDSERVE_PDL`` → ``ModelConfig.pdl`` (both on by default; ``false`` turns them off)."""
    from workers.setup import engine_config_from_settings

    def config_of(env: dict[str, str], *argv: str) -> tuple[bool, bool]:
        s = settings_from_args(build_parser({**env, **OPEN}).parse_args(["decode", *argv]))
        assert isinstance(s, WorkerSettings)
        cfg = engine_config_from_settings(s)
        return cfg.scheduler.async_scheduling, cfg.model.pdl

    assert config_of({}) == (True, True)
    assert config_of({}, "--async-scheduling", "false", "--pdl", "off") == (False, False)
    assert config_of({"PDSERVE_ASYNC_SCHEDULING": "off", "PDSERVE_PDL": "0"}) == (False, False)
    assert config_of({"PDSERVE_ASYNC_SCHEDULING": "off"}, "--async-scheduling") == (True, True)


def test_max_model_len_reaches_the_engine_config() -> None:
    from workers.setup import engine_config_from_settings

    for argv, want in (([], None), (["--max-model-len", "512"], 512)):
        s = settings_from_args(build_parser(OPEN).parse_args(["prefill", *argv]))
        assert isinstance(s, WorkerSettings)
        assert engine_config_from_settings(s).model.max_model_len == want


def test_seconds_flags_take_durations_like_pdserve_bench(capsys: pytest.CaptureFixture[str]) -> None:
    """``PDSERVE_REQUEST_TIMEOUT=30s`` means 30 s to the gateway too (it was a float-only flag there, so
    a value set for ``pdserve bench`` stopped the gateway: "could not convert string to float")."""
    s = settings_from_args(build_parser({"PDSERVE_REQUEST_TIMEOUT": "30s", **OPEN}).parse_args(
        ["gateway", "--heartbeat-timeout", "1500ms"]))
    assert isinstance(s, GatewaySettings) and (s.request_timeout, s.heartbeat_timeout) == (30.0, 1.5)
    two = settings_from_args(build_parser(OPEN).parse_args(["gateway", "--request-timeout", "2m"]))
    assert isinstance(two, GatewaySettings) and two.request_timeout == 120.0
    with pytest.raises(SystemExit) as exc:
        build_parser({"PDSERVE_REQUEST_TIMEOUT": "soon"}).parse_args(["gateway"])
    assert exc.value.code == 2
    assert "bad value for PDSERVE_REQUEST_TIMEOUT (--request-timeout)" in capsys.readouterr().err


def test_admission_budget_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """``--admission-budget`` takes a duration (default 30 s, 0 turns the queue check off); a bad value is
    one line naming the flag."""
    s = settings_from_args(build_parser(OPEN).parse_args(["gateway", "--admission-budget", "1500ms"]))
    assert isinstance(s, GatewaySettings) and s.admission_budget == 1.5
    default = settings_from_args(build_parser(OPEN).parse_args(["gateway"]))
    assert isinstance(default, GatewaySettings) and default.admission_budget == 30.0
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["gateway", "--admission-budget", "-1"])
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("pdserve gateway: error")]
    assert "argument --admission-budget" in line
    with pytest.raises(SystemExit) as exc:
        build_parser({"PDSERVE_ADMISSION_BUDGET": "soon"}).parse_args(["gateway"])
    assert exc.value.code == 2
    assert "bad value for PDSERVE_ADMISSION_BUDGET (--admission-budget)" in capsys.readouterr().err


def test_up_takes_the_gateway_and_worker_flags_and_checks_them_first() -> None:
    args = build_parser({}).parse_args(["up", "--host", "0.0.0.0", "--port", "8001", "--model-name", "m1",
                                        "--api-key", "secret", "--dtype", "float32", "--max-num-seqs", "8",
                                        "--max-model-len", "512", "--async-scheduling", "false"])
    up = settings_from_args(args)
    assert isinstance(up, UpSettings)
    assert (up.host, up.port, up.gateway.model_name) == ("0.0.0.0", 8001, "m1")
    assert up.gateway.api_keys == ("secret",)
    assert (up.worker.dtype, up.worker.max_num_seqs, up.worker.max_model_len) == ("float32", 8, 512)
    assert up.worker.async_scheduling is False
    for bad, flag in ((["--port", "99999"], "--port"), (["--max-num-seqs", "0"], "--max-num-seqs"),
                      (["--max-model-len", "1"], "--max-model-len"),
                      (["--max-retries", "-1"], "--max-retries"), (["--api-key", "a,b"], "--api-key")):
        with pytest.raises(ValueError, match=flag):
            settings_from_args(build_parser({}).parse_args(["up", *bad]))


def test_up_with_a_bad_port_is_one_line_before_anything_starts(capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pdserve.launcher", None)  # nothing may be started
    assert main(["up", "--port", "99999"]) == 2
    err = capsys.readouterr().err
    assert err == "pdserve up: --port: must be in [1, 65535], got 99999\n"
    # 0 too: the gateway would serve on a port up never polls (found by a new-user trial: no ready line,
    # and a worker killed later stopped everything as if still starting)
    assert main(["up", "--port", "0"]) == 2
    assert capsys.readouterr().err == (
        "pdserve up: --port: must be a fixed port (up waits for /ready on it and prints its URL; 0 would let "
        "the gateway pick one up cannot learn)\n")


def _assert_one_line_exit_2(argv: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``main(argv)`` exits 2 with one stderr line starting with ``line``."""
    code: int | str | None
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors exit from inside parse_known_args
        code = exc.code
    assert code == 2
    [got] = capsys.readouterr().err.strip().splitlines()
    assert got.startswith(line), got


@pytest.mark.parametrize(("argv", "line"), [
    (["up", "--dtype", "float64"], "pdserve up: error: argument --dtype: invalid choice: 'float64'"),
    (["up", "--attention-backend", "xformers"],
     "pdserve up: error: argument --attention-backend: invalid choice: 'xformers'"),
    (["up", "--no-such-flag"], "pdserve up: error: unrecognized arguments: --no-such-flag (see pdserve up "
                               "--help)"),
    (["decode", "--model-name"], "pdserve decode: error: unrecognized arguments: --model-name"),
    (["gateway", "--port"], "pdserve gateway: error: argument --port: expected one argument"),
    (["up", "--device", "tpu"], "pdserve up: --device: must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    (["prefill", "--device", "cuda:x", "--insecure-control-plane"],
     "pdserve prefill: --device: must be auto, cpu, cuda or cuda:N, got 'cuda:x'"),
])
def test_a_usage_error_is_one_line_and_exit_2(argv: list[str], line: str, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A new-user trial: a bad choice printed the whole usage first (47 lines for ``pdserve up``), an unknown
    flag the top-level usage, and ``--device tpu`` started every process before the workers failed."""
    monkeypatch.setitem(sys.modules, "pdserve.launcher", None)  # nothing may be started
    _assert_one_line_exit_2(argv, line, capsys)


@pytest.mark.parametrize("variable", [False, True])
def test_a_refused_value_is_one_json_line_with_json_logs(variable: bool, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``--log-format json`` (or ``PDSERVE_LOG_FORMAT=json``, the Kubernetes and docker-compose
    default) a value refused before anything starts is one JSON log line, like every other line of the
    process, carrying the same words as the text line."""
    import json

    from pdserve.cli import main

    monkeypatch.setitem(sys.modules, "pdserve.launcher", None)  # nothing may be started
    argv = ["prefill", "--device", "cuda:x", "--insecure-control-plane"]
    if variable:
        monkeypatch.setenv("PDSERVE_LOG_FORMAT", "json")
    else:
        argv += ["--log-format", "json"]
    try:
        assert main(argv) == 2
    finally:
        from protocol.logging import configure_logging

        configure_logging("info", "text")
    [line] = capsys.readouterr().err.strip().splitlines()
    event = json.loads(line)
    assert (event["logger"], event["level"], event["msg"], event["refused"]) == (
        "pdserve.prefill", "error", "--device: must be auto, cpu, cuda or cuda:N, got 'cuda:x'", "prefill")


def test_parser_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """``--tool-call-parser`` and ``--reasoning-parser`` (default auto) on the gateway and ``up``; a value
    outside the choices is one line naming the flag, from the command line, the environment or a
    settings object."""
    for command in ("gateway", "up"):
        s = settings_from_args(build_parser(OPEN).parse_args([command]))
        g = s.gateway if isinstance(s, UpSettings) else s
        assert isinstance(g, GatewaySettings)
        assert (g.tool_call_parser, g.reasoning_parser) == ("auto", "auto")
        s = settings_from_args(build_parser({**OPEN, "PDSERVE_REASONING_PARSER": "qwen3"}).parse_args(
            [command, "--tool-call-parser", "mistral"]))
        g = s.gateway if isinstance(s, UpSettings) else s
        assert isinstance(g, GatewaySettings)
        assert (g.tool_call_parser, g.reasoning_parser) == ("mistral", "qwen3")
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["gateway", "--tool-call-parser", "xml"])
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("pdserve gateway: error")]
    assert "argument --tool-call-parser" in line
    with pytest.raises(ValueError, match="--reasoning-parser"):
        GatewaySettings(reasoning_parser="o1", insecure_control_plane=True)
    with pytest.raises(ValueError, match="--tool-call-parser"):
        GatewaySettings(tool_call_parser="xml", insecure_control_plane=True)


def test_control_plane_needs_keys_or_the_explicit_insecure_flag(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Neither --curve-keys nor --insecure-control-plane: one line naming the flag, exit 2, nothing
    starts; both: refused; a key directory without a key pair: refused naming the file; keygen makes
    one (0700 directory, 0600 secret) that every role accepts."""
    from kvtransfer.curve import KEY_FILE

    for role in ("gateway", "prefill", "decode", "colocated"):
        assert main([role]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--curve-keys: required" in err
    assert main(["gateway", "--insecure-control-plane", "--curve-keys", str(tmp_path)]) == 2
    assert "--insecure-control-plane: cannot be combined with --curve-keys" in capsys.readouterr().err
    assert main(["gateway", "--curve-keys", str(tmp_path)]) == 2
    assert f"no CURVE key pair at {tmp_path / KEY_FILE}" in capsys.readouterr().err
    keys = tmp_path / "fleet"
    assert main(["keygen", str(keys)]) == 0
    assert (keys.stat().st_mode & 0o777, (keys / KEY_FILE).stat().st_mode & 0o777) == (0o700, 0o600)
    assert main(["keygen", str(keys)]) == 2  # never overwrites a key pair
    (keys / "broken").mkdir()
    (keys / "broken" / KEY_FILE).write_text("not a key\n")
    assert main(["gateway", "--curve-keys", str(keys / "broken")]) == 2
    assert "is not a CURVE key pair" in capsys.readouterr().err
    s = settings_from_args(build_parser({}).parse_args(["decode", "--curve-keys", str(keys)]))
    assert isinstance(s, WorkerSettings) and s.curve_keys == str(keys) and not s.insecure_control_plane
    up = settings_from_args(build_parser({}).parse_args(["up"]))
    assert isinstance(up, UpSettings) and up.curve_keys is None and not up.insecure_control_plane


def test_kv_cache_dtype_reaches_every_worker_of_up_and_is_checked_first() -> None:
    """``--kv-cache-dtype fp8`` given to ``up`` reaches each worker's argv and its ``CacheConfig``; a bad
    value, or fp8 with the flash_attn backend, is refused naming ``--kv-cache-dtype`` before anything
    starts."""
    from pdserve.launcher import plan
    from workers.setup import engine_config_from_settings

    up = settings_from_args(build_parser({}).parse_args(
        ["up", "--kv-cache-dtype", "fp8", "--insecure-control-plane"]))
    assert isinstance(up, UpSettings)
    workers = plan(up, control_port=7777)[1:]
    assert [name for name, _ in workers] == ["prefill-0", "decode-0"]
    for _, argv in workers:
        child = settings_from_args(build_parser({}).parse_args(argv))
        assert isinstance(child, WorkerSettings)
        assert engine_config_from_settings(child).cache.kv_cache_dtype == "fp8"
    default = settings_from_args(build_parser(OPEN).parse_args(["decode"]))
    assert isinstance(default, WorkerSettings)
    assert engine_config_from_settings(default).cache.kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):  # argparse's choices
        build_parser({}).parse_args(["decode", "--kv-cache-dtype", "fp8_e5m2"])
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        WorkerSettings(role="decode", kv_cache_dtype="int8", insecure_control_plane=True)
    with pytest.raises(ValueError, match=r"--kv-cache-dtype.*flash_attn"):
        settings_from_args(build_parser(OPEN).parse_args(
            ["up", "--kv-cache-dtype", "fp8", "--attention-backend", "flash_attn"]))


@pytest.mark.parametrize(("argv", "line"), [
    # a new-user trial: inf and nan said "must be >= 0 GiB ... got inf"
    (["up", "--kv-host-cache-gib", "inf"],
     "pdserve up: --kv-host-cache-gib: must be a finite number of GiB >= 0 (0: no host KV tier), got inf"),
    (["up", "--kv-host-cache-gib", "nan"],
     "pdserve up: --kv-host-cache-gib: must be a finite number of GiB >= 0 (0: no host KV tier), got nan"),
    (["prefill", "--kv-host-cache-gib", "inf", "--insecure-control-plane"],
     "pdserve prefill: --kv-host-cache-gib: must be a finite number of GiB >= 0"),
    (["up", "--kv-memory-fraction", "nan"], "pdserve up: --kv-memory-fraction: must be in (0, 1], got nan"),
    (["up", "--kv-canary-mib", "inf"],
     "pdserve up: --kv-canary-mib: must be in [0, 1024] MiB (0: one block), got inf"),
    (["up", "--request-timeout", "9" * 400], "pdserve up: error: argument --request-timeout: bad duration "
                                             f"'{'9' * 400}': too large (not a finite number of seconds)"),
])
def test_a_float_flag_that_is_not_finite_is_named_so(argv: list[str], line: str,
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pdserve.launcher", None)  # nothing may be started
    for module in ("prefill_worker.main", "decode_worker.main", "workers.colocated"):
        monkeypatch.setitem(sys.modules, module, None)
    _assert_one_line_exit_2(argv, line, capsys)


def test_a_duration_that_is_not_finite_is_refused_by_the_parser_and_the_settings() -> None:
    """``parse_duration`` of 400 digits was inf, which a bare ``> 0`` took (``--request-timeout``,
    ``--heartbeat-timeout``, ``--kv-canary-timeout``) and ``>= 0`` checks named as "got inf"; a settings
    object given nan said "must be > 0 seconds". Each duration field now says it wants a finite number."""
    from protocol.durations import parse_duration

    with pytest.raises(ValueError, match="too large"):
        parse_duration("9" * 400)
    gateway_fields = ("request_timeout", "heartbeat_timeout", "admission_budget", "kv_canary_period",
                      "kv_canary_timeout")
    for name in gateway_fields:
        for bad in (float("inf"), float("nan")):
            with pytest.raises(ValueError, match=rf"^--{name.replace('_', '-')}: must be a finite number of "
                                                 rf"seconds [>]=? ?0.*, got {bad}$"):
                GatewaySettings(insecure_control_plane=True, **{name: bad})  # type: ignore[arg-type]
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match=rf"^--engine-stall-timeout: must be a finite number of seconds "
                                             rf"> 0, got {bad}$"):
            WorkerSettings(role="decode", insecure_control_plane=True, engine_stall_timeout=bad)


@pytest.mark.parametrize(("argv", "env", "line"), [
    (["up", "--api-key", ""], {}, "pdserve up: --api-key: a key must not be empty"),
    (["gateway", "--api-key", ""], {}, "pdserve gateway: --api-key: a key must not be empty"),
    (["gateway", "--api-key", "  "], {}, "pdserve gateway: --api-key: a key must not be empty"),
    (["up"], {"PDSERVE_API_KEY": ""},
     "pdserve up: bad value for PDSERVE_API_KEY (--api-key): a key must not be empty"),
    (["gateway"], {"PDSERVE_API_KEY": ""},
     "pdserve gateway: bad value for PDSERVE_API_KEY (--api-key): a key must not be empty"),
    (["gateway"], {"PDSERVE_API_KEY": "k1,"},
     "pdserve gateway: bad value for PDSERVE_API_KEY (--api-key): a key must not be empty"),
    (["up", "--api-key-file", ""], {}, "pdserve up: --api-key-file: must not be empty"),
    (["gateway"], {"PDSERVE_API_KEY_FILE": ""},
     "pdserve gateway: bad value for PDSERVE_API_KEY_FILE (--api-key-file): must not be empty"),
])
def test_an_empty_api_key_is_refused_not_an_open_server(argv: list[str], env: dict[str, str], line: str,
                                                        capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A new-user trial: ``pdserve up --api-key "$KEY"`` with KEY unset started a server that asked for no
    key at all (an empty key meant "none"), while the ready banner still showed the Authorization header."""
    monkeypatch.setitem(sys.modules, "pdserve.launcher", None)  # nothing may be started
    monkeypatch.setattr("pdserve.cli._run_gateway", lambda settings: pytest.fail("the gateway started"))
    for name in ("PDSERVE_API_KEY", "PDSERVE_API_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _assert_one_line_exit_2([*argv, "--insecure-control-plane"], line, capsys)


def test_an_api_key_file_without_a_key_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A key file of blank lines and comments (an emptied Secret) would serve without a key: refused."""
    monkeypatch.setitem(sys.modules, "pdserve.launcher", None)
    monkeypatch.setattr("pdserve.cli._run_gateway", lambda settings: pytest.fail("the gateway started"))
    keys = tmp_path / "keys"
    keys.write_text("# one key per line\n\n   \n  # an indented comment is no key either\n")
    for command in ("up", "gateway"):
        _assert_one_line_exit_2([command, "--api-key-file", str(keys), "--insecure-control-plane"],
                                f"pdserve {command}: --api-key-file: {keys} holds no key", capsys)
    keys.write_text("# one key per line\n\n k1 \n")
    s = settings_from_args(build_parser(OPEN).parse_args(["gateway", "--api-key-file", str(keys)]))
    assert isinstance(s, GatewaySettings) and s.api_keys == ("k1",)


def test_an_empty_api_key_in_the_environment_concerns_only_the_roles_that_read_it() -> None:
    """``PDSERVE_API_KEY=`` reaches every child of ``pdserve up``: the workers, which have no such flag,
    start as before; the gateway's settings refuse it (the launcher itself never passes an empty one:
    tests/system/test_launcher.py)."""
    env = {"PDSERVE_API_KEY": "", **OPEN}
    worker = settings_from_args(build_parser(env).parse_args(["decode", "--worker-id", "d0"]))
    assert isinstance(worker, WorkerSettings)
    with pytest.raises(ValueError, match="--api-key: a key must not be empty"):
        settings_from_args(build_parser(env).parse_args(["gateway"]))
    with pytest.raises(ValueError, match="--api-key: a key must not be empty"):
        GatewaySettings(api_keys=("k1", ""), insecure_control_plane=True)
    # no variable: no key, as before
    assert settings_from_args(build_parser(OPEN).parse_args(["gateway"])).api_keys == ()  # type: ignore[union-attr]


def test_api_keys_on_the_command_line_replace_those_of_the_environment() -> None:
    """Every flag's command-line value wins over ``PDSERVE_<FLAG>``; the repeatable ``--api-key`` added the
    two instead (``PDSERVE_API_KEY=a pdserve gateway --api-key b`` accepted ``a`` too)."""
    env = {"PDSERVE_API_KEY": "a1,a2", **OPEN}
    keys = settings_from_args(build_parser(env).parse_args(["gateway", "--api-key", "b", "--api-key", "c"]))
    assert isinstance(keys, GatewaySettings) and keys.api_keys == ("b", "c")
    from_env = settings_from_args(build_parser(env).parse_args(["gateway"]))
    assert isinstance(from_env, GatewaySettings) and from_env.api_keys == ("a1", "a2")
    up = settings_from_args(build_parser(env).parse_args(["up", "--api-key", "b"]))
    assert "b" in str(up) and "a1" not in str(up)
    with pytest.raises(ValueError, match=r"--api-key: a key must not hold whitespace .* got ' k2'"):
        settings_from_args(build_parser({"PDSERVE_API_KEY": "k1, k2", **OPEN}).parse_args(["gateway"]))
    with pytest.raises(ValueError, match=r"--api-key: a key must not hold whitespace .* got 'a b'"):
        GatewaySettings(api_keys=("a b",), insecure_control_plane=True)
    empty_env = {"PDSERVE_API_KEY": "", **OPEN}  # an empty variable is replaced too, not an error
    given = settings_from_args(build_parser(empty_env).parse_args(["gateway", "--api-key", "k1"]))
    assert isinstance(given, GatewaySettings) and given.api_keys == ("k1",)


def test_the_kubernetes_placeholder_api_key_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/k8s/base/secret.yaml ships ``REPLACE-ME-WITH-A-REAL-KEY`` (a new-user trial served the API with
    it): from a key file (the file named) or from --api-key, ``up`` and ``gateway`` refuse it."""
    from protocol.settings import PLACEHOLDER_API_KEY

    monkeypatch.setitem(sys.modules, "pdserve.launcher", None)
    monkeypatch.setattr("pdserve.cli._run_gateway", lambda settings: pytest.fail("the gateway started"))
    keys = tmp_path / "api-keys"
    keys.write_text(f"# one key per line\nreal-key\n{PLACEHOLDER_API_KEY}\n")
    for command in ("up", "gateway"):
        _assert_one_line_exit_2([command, "--api-key-file", str(keys), "--insecure-control-plane"],
                                f"pdserve {command}: --api-key-file: {keys} holds the placeholder key "
                                f"{PLACEHOLDER_API_KEY} (deploy/k8s/base/secret.yaml), known to anyone: "
                                "replace it with a key of your own", capsys)
        _assert_one_line_exit_2([command, "--api-key", PLACEHOLDER_API_KEY, "--insecure-control-plane"],
                                f"pdserve {command}: --api-key: {PLACEHOLDER_API_KEY} is the placeholder",
                                capsys)


def test_log_level_takes_any_case_on_the_command_line_and_from_the_environment() -> None:
    cases = (({}, ["gateway", "--log-level", "WARNING"], "warning"),
             ({"PDSERVE_LOG_LEVEL": "Debug"}, ["decode"], "debug"))
    for env, argv, level in cases:
        assert build_parser(env).parse_args(argv).log_level == level


@pytest.mark.parametrize(("argv", "env", "line"), [
    (["gateway", "--api-key-file", "/nonexistent"], {},
     "pdserve gateway: --api-key-file /nonexistent: cannot read it (No such file or directory)"),
    (["up", "--api-key-file", "/nonexistent"], {},
     "pdserve up: --api-key-file /nonexistent: cannot read it (No such file or directory)"),
    (["up", "--api-key-file", "/"], {}, "pdserve up: --api-key-file /: cannot read it (Is a directory)"),
    (["up", "--request-timeout", "abc"], {}, "pdserve up: error: argument --request-timeout: bad duration "
     "'abc': use a number with ms, s or m (e.g. 5s) (see pdserve up --help)"),
    (["gateway", "--admission-budget", "-1"], {}, "pdserve gateway: error: argument --admission-budget: bad "
     "duration '-1': must not be negative (see pdserve gateway --help)"),
    (["up"], {"PDSERVE_ADMISSION_BUDGET": "-1"}, "pdserve up: bad value for PDSERVE_ADMISSION_BUDGET "
     "(--admission-budget): bad duration '-1': must not be negative"),
    (["up"], {"PDSERVE_NUM_DECODE": "0"}, "pdserve up: bad value for PDSERVE_NUM_DECODE (--num-decode): need "
     "at least one prefill and one decode worker, or --colocated >= 1 (got --num-prefill 1, --num-decode 0, "
     "--colocated 0)"),
    (["up", "--num-prefill", "0"], {}, "pdserve up: --num-prefill: need at least one prefill and one decode "
     "worker, or --colocated >= 1 (got --num-prefill 0, --num-decode 1, --colocated 0)"),
])
def test_a_refused_value_names_its_flag_without_internals(argv: list[str], env: dict[str, str], line: str,
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A new-user trial (D8): ``--api-key-file /nonexistent`` said ``[Errno 2] No such file or directory:
    '/nonexistent'``, ``--request-timeout abc`` ``invalid parse_duration value: 'abc'``,
    ``PDSERVE_NUM_DECODE=0`` named ``--num-prefill``. One line naming the flag, exit 2, nothing started."""
    monkeypatch.setitem(sys.modules, "pdserve.launcher", None)  # nothing may be started
    monkeypatch.setattr("pdserve.cli._run_gateway", lambda settings: pytest.fail("the gateway started"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code: int | str | None
    try:
        code = main([*argv, "--insecure-control-plane"])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert capsys.readouterr().err == line + "\n"


def test_keygen_says_which_path_it_cannot_use(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A new-user trial (D8): ``pdserve keygen FILE`` said ``[Errno 17] File exists: 'FILE'``, a directory it
    cannot write ``[Errno 13] Permission denied``. One line naming the path and why, exit 2."""
    import kvtransfer.curve

    afile = tmp_path / "afile"
    afile.write_text("")
    for argv in ([str(afile)], [str(afile), "--exist-ok"]):
        assert main(["keygen", *argv]) == 2
        assert capsys.readouterr().err == (f"pdserve keygen: {afile} is not a directory (give a directory to "
                                           "write the key pair in)\n")
    assert main(["keygen", str(afile / "keys")]) == 2
    assert capsys.readouterr().err == f"pdserve keygen: cannot write {afile / 'keys'}: Not a directory\n"

    def denied(directory: str) -> None:  # as mkdir in a directory this user may not write (tests run as root)
        raise PermissionError(13, "Permission denied", directory)

    monkeypatch.setattr(kvtransfer.curve, "generate_keys", denied)
    assert main(["keygen", str(tmp_path / "ro" / "keys")]) == 2
    denied_dir = tmp_path / "ro" / "keys"
    assert capsys.readouterr().err == f"pdserve keygen: cannot write {denied_dir}: Permission denied\n"


@pytest.mark.parametrize("argv, usage", [
    (["bench", "compare", "--help"], "usage: pdserve bench compare [-h] A.json B.json\n"),
    (["bench", "compare", "-h"], "usage: pdserve bench compare [-h] A.json B.json\n"),
    (["bench", "compare", "a.json", "--help"], "usage: pdserve bench compare [-h] A.json B.json\n"),
    (["bench", "--help"], "usage: pdserve bench [-h] [--base-url BASE_URL]"),
    (["bench", "run", "--help"], "usage: pdserve bench [-h] [--base-url BASE_URL]"),  # run: bench's flags
    *[([name, "--help"], f"usage: pdserve {name} [-h]") for name in (*SETTINGS_COMMANDS, "keygen")],
])
def test_help_after_a_subcommand_is_that_subcommands(argv: list[str], usage: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` (``-h``) prints the usage of the innermost command before it and exits 0: after
    ``bench compare``, compare's (two result files, none of the load run's flags), not the load run's."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert out.startswith(usage)
    assert ("--base-url" in out) == (argv[:2] in (["bench", "--help"], ["bench", "run"]))


def test_python_m_loadtest_compare_help(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m loadtest compare --help``: compare's usage, as ``pdserve bench compare --help``."""
    from loadtest.cli import main as loadtest_main

    with pytest.raises(SystemExit) as exc:
        loadtest_main(["compare", "--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m loadtest compare [-h] A.json B.json\n")
