"""Worker start-up and the warm-up: the --engine-warmup flag and env, boot warming up per setting, a
cleanly failed warm-up skipped, an unclean one refusing to start. Engine helpers from test_warmup.py."""

from __future__ import annotations

import pytest

from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.warmup import WarmupConfig, WarmupReport, warmup
from pdserve.cli import build_parser
from protocol.settings import WorkerSettings, settings_from_args
from tests.engine.test_warmup import SMALL, fail_at_step, make_core
from workers.boot import probe_core, warm_up_core

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def worker_settings(env: dict[str, str], argv: list[str]) -> WorkerSettings:
    open_env = {**env, "PDSERVE_INSECURE_CONTROL_PLANE": "1"}  # no key directory: about other flags
    settings = settings_from_args(build_parser(open_env).parse_args(argv))
    assert isinstance(settings, WorkerSettings)
    return settings


def test_engine_warmup_flag_and_env_reach_worker_settings(capsys):
    assert worker_settings({"PDSERVE_ENGINE_WARMUP": "on"}, ["prefill"]).engine_warmup == "on"
    assert worker_settings({}, ["colocated", "--engine-warmup", "off"]).engine_warmup == "off"
    assert worker_settings({"PDSERVE_ENGINE_WARMUP": "on"}, ["decode", "--engine-warmup", "off"]
                           ).engine_warmup == "off"  # the command line wins
    assert worker_settings({}, ["decode"]).engine_warmup == "auto"
    with pytest.raises(SystemExit) as exc:  # not one of the flag's choices: refused as the parser parses
        worker_settings({"PDSERVE_ENGINE_WARMUP": "maybe"}, ["decode"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == ("pdserve decode: bad value for PDSERVE_ENGINE_WARMUP "
                                       "(--engine-warmup): invalid choice: 'maybe' (choose from 'auto', "
                                       "'on', 'off')\n")
    with pytest.raises(ValueError, match="--engine-warmup"):  # the settings check it too
        WorkerSettings(role="decode", engine_warmup="maybe", insecure_control_plane=True)
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["decode", "--engine-warmup", "maybe"])


def test_boot_warms_up_per_setting(tiny_dummy_dir, monkeypatch):
    import engine.warmup

    calls: list[EngineCore] = []

    def small_warmup(core: EngineCore, config: WarmupConfig | None = None) -> WarmupReport:
        calls.append(core)
        return warmup(core, SMALL)

    monkeypatch.setattr(engine.warmup, "warmup", small_warmup)
    core = make_core(tiny_dummy_dir)
    on = WorkerSettings(role="colocated", model=str(tiny_dummy_dir), engine_warmup="on", worker_id="w",
                        insecure_control_plane=True)
    report = warm_up_core(on, core)
    assert calls == [core] and isinstance(report, WarmupReport) and report.completed and report.steps
    auto = WorkerSettings(role="colocated", model=str(tiny_dummy_dir), worker_id="w",
                          insecure_control_plane=True)
    assert warm_up_core(auto, core) is None and calls == [core]  # CPU: auto skips
    core.check_no_leaks()


# (boot step, the engine.warmup function it calls, what the step is called in its errors, its warning)
OPTIONAL_STEPS = [(warm_up_core, "warmup", "warm-up", "warmup_failed"),
                  (probe_core, "probe_prefill", "prefill probe", "prefill_probe_failed")]


@pytest.mark.parametrize(("step", "function", "what", "event"), OPTIONAL_STEPS)
def test_boot_serves_without_an_optional_step_that_fails_cleanly(tiny_dummy_dir, monkeypatch, caplog, step,
                                                                 function, what, event):
    core = make_core(tiny_dummy_dir)
    calls = fail_at_step(core, monkeypatch, 3 if step is warm_up_core else 1)
    on = WorkerSettings(role="colocated", model=str(tiny_dummy_dir), engine_warmup="on", worker_id="w",
                        insecure_control_plane=True)
    import engine.warmup

    monkeypatch.setattr(engine.warmup, "warmup", lambda c, config=None: warmup(c, SMALL))
    with caplog.at_level("WARNING", logger="pdserve.worker"):
        assert step(on, core) is None
    assert len(calls) == (3 if step is warm_up_core else 1) and event in caplog.text
    assert f"boom in step {len(calls)}" in caplog.text
    core.check_no_leaks()


@pytest.mark.parametrize(("step", "function", "what", "event"), OPTIONAL_STEPS)
def test_boot_refuses_to_start_when_an_optional_step_leaves_the_engine_unclean(tiny_dummy_dir, monkeypatch,
                                                                                step, function, what, event):
    core = make_core(tiny_dummy_dir)
    import engine.warmup

    def leaky(c: EngineCore, *args: object) -> None:
        c.add_request("stuck", [5, 6, 7], SamplingParams(max_tokens=2))
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.warmup, function, leaky)
    on = WorkerSettings(role="prefill", model=str(tiny_dummy_dir), engine_warmup="on", worker_id="w",
                        insecure_control_plane=True)
    with pytest.raises(RuntimeError, match=f"{what} failed .* left the engine unclean"):
        step(on, core)
