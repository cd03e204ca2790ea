"""``pdserve up`` and the ``PDSERVE_*`` variables of its environment: each child (gateway, workers) runs
with the settings ``up`` decided, whatever variables ``up``'s environment holds, and ``up`` refuses a
variable of a child's flag that it sets itself, in one line before anything starts.

The children are started through ``launcher.run`` (the model look-up and the pre-start checks stubbed):
with ``subprocess.Popen`` captured, each child's command line is parsed with the environment it was given,
as the child itself would; one test starts real child processes (a stand-in for ``pdserve.cli`` that
reports the settings it parsed and the ``PDSERVE_*`` variables it sees). Plans and placement:
test_launcher.py; other refusals of ``up``: test_up_refusals.py."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from pdserve import launcher, supervisor
from pdserve.cli import build_parser, main
from protocol.settings import GatewaySettings, Settings, UpSettings, WorkerSettings, settings_from_args

Children = dict[str, Settings | str]  # child name → its settings, or why it refused its command line


def _environ(monkeypatch: pytest.MonkeyPatch, environ: Mapping[str, str]) -> None:
    """This process's environment: no ``PDSERVE_*`` variable but those of ``environ``."""
    for name in [n for n in os.environ if n.startswith("PDSERVE_")]:
        monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)


def _stub_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """``launcher.run`` without the model look-up and the pre-start checks (no model, no torch)."""
    from engine.models import registry

    monkeypatch.setattr(registry, "resolve_model", lambda model: model)
    monkeypatch.setattr(registry, "read_model_config", lambda *a: None)
    monkeypatch.setattr(launcher, "up_refusal", lambda *a: None)


def _child_settings(argv: list[str], env: Mapping[str, str]) -> Settings | str:
    """What ``pdserve <argv>`` runs with in environment ``env``: its settings, or why it refuses them."""
    try:
        return settings_from_args(build_parser(env).parse_args(argv))
    except (ValueError, OSError) as exc:
        return f"refused: {exc}"


def _children_of_run(monkeypatch: pytest.MonkeyPatch, up: UpSettings,
                     environ: Mapping[str, str]) -> tuple[Children, Children]:
    """Run ``launcher.run(up)`` with ``environ`` as its ``PDSERVE_*`` variables, capturing each child's
    ``Popen``. Returns, by child name, what each child runs with given the environment it was handed, and
    what it would run with given only the variables ``up`` adds on purpose (its API keys in the gateway's
    ``PDSERVE_API_KEY``): its command line alone."""
    _environ(monkeypatch, environ)
    _stub_start_up(monkeypatch)
    on_purpose = {"gateway": launcher.gateway_env(up.gateway.api_keys)}
    started: dict[str, tuple[Settings | str, Settings | str]] = {}

    class Started:
        pid, returncode = 1, 0

        def __init__(self, cmd: list[str], env: Mapping[str, str], **kw: Any) -> None:
            argv = list(cmd[3:])  # after python -m pdserve.cli
            name = argv[argv.index("--worker-id") + 1][3:] if "--worker-id" in argv else argv[0]  # up-...
            # parsed now: the per-run key directory is gone once run returns
            started[name] = _child_settings(argv, env), _child_settings(argv, on_purpose.get(name, {}))

        def poll(self) -> int:
            return 0

        def wait(self, timeout: float | None = None) -> int:
            return 0

    monkeypatch.setattr(supervisor.subprocess, "Popen", Started)
    monkeypatch.setattr(launcher, "wait_ready", lambda *a, **k: "interrupted")
    assert launcher.run(up) == 0
    assert list(started) == ["gateway", "prefill-0", "decode-0"]
    return {name: got for name, (got, _) in started.items()}, {name: cl for name, (_, cl) in started.items()}


def _up(env: Mapping[str, str], argv: list[str]) -> UpSettings:
    """``pdserve up --device cpu ARGV``'s settings with ``env`` (the port: nothing binds it here)."""
    up = settings_from_args(build_parser(env).parse_args(["up", "--device", "cpu", "--port", "34080", *argv]))
    assert isinstance(up, UpSettings)
    return up


def _gateway(children: Children) -> GatewaySettings:
    gateway = children["gateway"]
    assert isinstance(gateway, GatewaySettings), gateway
    return gateway


def _workers(children: Children) -> dict[str, WorkerSettings]:
    workers = {name: child for name, child in children.items() if name != "gateway"}
    assert all(isinstance(w, WorkerSettings) for w in workers.values()), workers
    return workers  # type: ignore[return-value]


def _keys(tmp_path: Path) -> tuple[str, str]:
    (tmp_path / "first").write_text("k1\n")
    (tmp_path / "second").write_text("k2\n")
    return str(tmp_path / "first"), str(tmp_path / "second")


_INSECURE = ["--insecure-control-plane"]
_ALL = ("gateway", "prefill-0", "decode-0")

# (variables of up's environment, up's command line, the settings every child named must have): each
# variable reaches up's parser too, which takes it unless up's command line replaces it, as here
_GIVEN_TO_UP: list[tuple[dict[str, str], list[str], dict[str, Any], tuple[str, ...]]] = [
    ({"PDSERVE_MAX_QUEUE": "5"}, [*_INSECURE, "--max-queue", "1024"], {"max_queue": 1024}, ("gateway",)),
    ({"PDSERVE_ASYNC_SCHEDULING": "0"}, [*_INSECURE, "--async-scheduling", "true"],
     {"async_scheduling": True}, ("prefill-0", "decode-0")),
    ({"PDSERVE_DECODE_PREFIX_REUSE": "0"}, [*_INSECURE, "--decode-prefix-reuse", "true"],
     {"decode_prefix_reuse": True}, ("decode-0",)),
    # up's per-run keys, not the variable's insecure flag beside them (each child refused the pair)
    ({"PDSERVE_INSECURE_CONTROL_PLANE": "1"}, ["--insecure-control-plane", "false"],
     {"insecure_control_plane": False}, _ALL),
]


@pytest.mark.parametrize(("env", "argv", "want", "names"), _GIVEN_TO_UP,
                         ids=[next(iter(env)) for env, *_ in _GIVEN_TO_UP])
def test_a_flag_given_to_up_wins_over_its_variable_in_every_child(
        env: dict[str, str], argv: list[str], want: dict[str, Any], names: tuple[str, ...],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``PDSERVE_MAX_QUEUE=5 pdserve up --max-queue 1024``: up's gateway settings say 1024, a default, so
    no ``--max-queue`` reached the gateway's command line and the gateway read 5 from the environment it
    inherited (the same for the workers' ``--async-scheduling`` and ``--decode-prefix-reuse``); with
    ``PDSERVE_INSECURE_CONTROL_PLANE=1 pdserve up --insecure-control-plane false`` every child got up's
    ``--curve-keys`` and the variable's insecure flag, and refused the pair. Each child now runs as its
    command line says."""
    up = _up(env, argv)
    children, by_command_line = _children_of_run(monkeypatch, up, env)
    for name in names:
        assert {attr: getattr(children[name], attr, children[name]) for attr in want} == want, name
    assert children == by_command_line


def test_the_gateway_takes_only_the_api_keys_up_gives_it(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``PDSERVE_API_KEY_FILE=first pdserve up --api-key-file second``: up serves the second file's keys,
    but the gateway also read the first file from the variable it inherited, so a key the command line
    replaced was still accepted."""
    first, second = _keys(tmp_path)
    env = {"PDSERVE_API_KEY_FILE": first}
    up = _up(env, [*_INSECURE, "--api-key-file", second])
    assert up.gateway.api_keys == ("k2",)
    children, by_command_line = _children_of_run(monkeypatch, up, env)
    assert _gateway(children).api_keys == ("k2",)
    assert children == by_command_line
    up = _up(env, _INSECURE)  # the variable alone: its keys, once
    assert _gateway(_children_of_run(monkeypatch, up, env)[0]).api_keys == ("k1",)


# variables of a child's flag that up sets itself, with a value a child would take
_SET_BY_UP = {"PDSERVE_WORKERS": "4", "PDSERVE_CONTROL_BIND": "tcp://127.0.0.1:34999",
              "PDSERVE_GATEWAY_CONTROL": "tcp://127.0.0.1:34999", "PDSERVE_GATEWAY_RESOLVE_INTERVAL": "1.5",
              "PDSERVE_ADVERTISE_HOST": "10.9.9.9", "PDSERVE_METRICS_PORT": "34998",
              "PDSERVE_WORKER_ID": "w"}


def test_children_follow_up_whatever_variables_of_its_own_flags_its_environment_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``launcher.run`` with ``PDSERVE_WORKERS=4`` in its environment (the ``pdserve up`` command refuses it,
    as every variable of ``_SET_BY_UP``): the gateway child ran four processes while up had planned one
    control port for one, and every worker advertised ``PDSERVE_ADVERTISE_HOST`` and looked the gateway up
    every ``PDSERVE_GATEWAY_RESOLVE_INTERVAL``. The children now have up's values."""
    up = _up({}, _INSECURE)
    children, by_command_line = _children_of_run(monkeypatch, up, _SET_BY_UP)
    assert children == by_command_line
    assert _gateway(children).workers == up.gateway_workers == 1
    for name, worker in _workers(children).items():
        assert (worker.advertise_host, worker.gateway_resolve_interval) == (None, 5.0)
        assert worker.worker_id == f"up-{name}" and worker.metrics_port not in (0, 34998)


_STAND_IN = """
import dataclasses, json, os, sys
from pathlib import Path
from pdserve.cli import build_parser
from protocol.settings import settings_from_args
argv = sys.argv[1:]
name = argv[argv.index("--worker-id") + 1] if "--worker-id" in argv else argv[0]
try:
    settings = dataclasses.asdict(settings_from_args(build_parser().parse_args(argv)))
except ValueError as exc:
    settings = {"refused": str(exc)}
seen = sorted(v for v in os.environ if v.startswith("PDSERVE_"))
out = Path(os.environ["UP_ENV_TEST_OUT"], name + ".json")
out.write_text(json.dumps({"settings": settings, "seen": seen}))
"""


def test_real_children_inherit_no_variable_of_a_pdserve_flag(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Real child processes started by ``launcher.run`` (a stand-in for ``python -m pdserve.cli`` that
    parses its command line in the environment it inherited): none sees a ``PDSERVE_*`` variable of a
    pdserve flag but the gateway's ``PDSERVE_API_KEY`` from up; other variables (``PDSERVE_CACHE_DIR``)
    pass through; the gateway runs one process with up's ``--max-queue`` and API keys."""
    first, second = _keys(tmp_path)
    env = {"PDSERVE_MAX_QUEUE": "5", "PDSERVE_API_KEY_FILE": first, "PDSERVE_CACHE_DIR": str(tmp_path / "c")}
    up = _up(env, [*_INSECURE, "--max-queue", "1024", "--api-key-file", second])
    _environ(monkeypatch, {**env, **_SET_BY_UP, "PDSERVE_ASYNC_SCHEDULING": "0"})
    (tmp_path / "out").mkdir()
    monkeypatch.setenv("UP_ENV_TEST_OUT", str(tmp_path / "out"))
    _stub_start_up(monkeypatch)
    monkeypatch.setattr(launcher, "Supervisor", functools.partial(
        launcher.Supervisor, grace=5.0, command=(sys.executable, "-c", _STAND_IN)))

    def wait_exits(sup: supervisor.Supervisor, *args: Any, **kw: Any) -> str:
        for proc in sup.children.values():
            proc.wait(60)
        return "interrupted"

    monkeypatch.setattr(launcher, "wait_ready", wait_exits)
    assert launcher.run(up) == 0
    seen = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "out").iterdir()}
    assert sorted(seen) == ["gateway", "up-decode-0", "up-prefill-0"]
    gateway = seen["gateway"]["settings"]
    assert (gateway["workers"], gateway["max_queue"], gateway["api_keys"]) == (1, 1024, ["k2"])
    assert seen["gateway"]["seen"] == ["PDSERVE_API_KEY", "PDSERVE_CACHE_DIR"]
    for name in ("up-prefill-0", "up-decode-0"):
        worker = seen[name]["settings"]
        assert (worker["async_scheduling"], worker["advertise_host"]) == (True, None)
        assert worker["worker_id"] == name
        assert seen[name]["seen"] == ["PDSERVE_CACHE_DIR"]


@pytest.mark.parametrize(("variable", "line"), [
    ("PDSERVE_WORKERS", "pdserve up: PDSERVE_WORKERS is the gateway's --workers, which pdserve up sets "
                        "itself: unset it and use --gateway-workers (PDSERVE_GATEWAY_WORKERS)"),
    ("PDSERVE_CONTROL_BIND", "pdserve up: PDSERVE_CONTROL_BIND is the gateway's --control-bind, which "
                             "pdserve up sets itself"),
    ("PDSERVE_GATEWAY_CONTROL", "pdserve up: PDSERVE_GATEWAY_CONTROL is the workers' --gateway-control, "
                                "which pdserve up sets itself"),
    ("PDSERVE_GATEWAY_RESOLVE_INTERVAL", "pdserve up: PDSERVE_GATEWAY_RESOLVE_INTERVAL is the workers' "
                                         "--gateway-resolve-interval, which pdserve up sets itself"),
    ("PDSERVE_ADVERTISE_HOST", "pdserve up: PDSERVE_ADVERTISE_HOST is the workers' --advertise-host, which "
                               "pdserve up sets itself"),
    ("PDSERVE_METRICS_PORT", "pdserve up: PDSERVE_METRICS_PORT is the workers' --metrics-port, which pdserve "
                             "up sets itself"),
    ("PDSERVE_WORKER_ID", "pdserve up: PDSERVE_WORKER_ID is the workers' --worker-id, which pdserve up sets "
                          "itself"),
], ids=lambda x: x if x.startswith("PDSERVE_") else "")
def test_up_refuses_a_variable_of_a_flag_it_sets_itself(variable: str, line: str,
                                                         capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``PDSERVE_WORKERS=4 pdserve up``: up ignored the variable (its gateway processes are
    ``--gateway-workers``) while the gateway it started read it. Now up refuses each such variable, whatever
    its value, in one line naming it (and up's own flag where there is one), exit 2, before ``--help`` or
    anything starts; the command whose flag it is still takes it."""
    _environ(monkeypatch, {variable: _SET_BY_UP[variable], "PDSERVE_INSECURE_CONTROL_PLANE": "1"})
    monkeypatch.setitem(sys.modules, "pdserve.launcher", None)  # nothing may be started
    for argv in (["up"], ["up", "--help"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        [got] = capsys.readouterr().err.splitlines()
        assert got.startswith(line), got
        assert got.endswith(")" if variable == "PDSERVE_WORKERS" else ": unset it"), got
    role = "gateway" if variable in ("PDSERVE_WORKERS", "PDSERVE_CONTROL_BIND") else "decode"
    child = settings_from_args(build_parser().parse_args([role]))
    assert str(getattr(child, variable.removeprefix("PDSERVE_").lower())) == _SET_BY_UP[variable]


def test_up_refuses_every_variable_of_a_child_flag_it_does_not_take() -> None:
    """The variables ``up`` refuses are exactly those of its children's flags that are not flags of its own
    (so a new flag ``up`` sets for its children is refused too, with a reason written for it)."""
    from pdserve.cli import UP_SET_VARIABLES, flag_variables

    children = set().union(*(flag_variables(c) for c in ("gateway", "prefill", "decode", "colocated")))
    assert children - flag_variables("up") == set(UP_SET_VARIABLES) == set(_SET_BY_UP)
