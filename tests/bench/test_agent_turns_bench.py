"""bench/serving/agent_turns.py without starting systems: its per-device defaults, the workload it builds,
the KV bytes per token of the H200 model, and the goal lines it prints from a result."""

from __future__ import annotations

import msgspec
import pytest

from bench.serving import agent_turns
from engine.models.registry import resolve_model
from loadtest.agent_records import AgentResult, AgentSystemResult, TurnStats
from loadtest.config import SLOConfig
from loadtest.kv_size import kv_bytes_per_token, load_model_config
from loadtest.metrics import latency_stats, summarize
from loadtest.records import KVScrape


def test_defaults_per_device_and_the_workload() -> None:
    gpu = agent_turns.parse_args(["--device", "cuda"])
    assert (gpu.model, gpu.dtype, gpu.num_blocks, gpu.turns, gpu.max_context) == ("llama3-8b", "bfloat16",
                                                                                 12000, 20, 16384)
    assert gpu.off_flags == "--enable-prefix-caching false" and gpu.on_flags == ""
    cpu = agent_turns.parse_args(["--device", "cpu", "--num-blocks", "64", "--slo-ttft-ms", "10"])
    assert (cpu.model, cpu.dtype, cpu.num_blocks, cpu.slo_ttft_ms) == ("smollm2-135m", "float32", 64, 10.0)
    cfg = agent_turns.agent_config(cpu, 46080)
    assert (cfg.endpoint, cfg.sessions, cfg.turns, cfg.kv_bytes_per_token) == ("chat", 8, 20, 46080)
    # Llama-3-8B: 32 layers x 8 KV heads x head_dim 128 x K and V x 2 bytes = 128 KiB per token
    assert kv_bytes_per_token(load_model_config(resolve_model("llama3-8b")), "bfloat16") == 131072


def _system(label: str, ttft_ms: list[float], ratios: list[float | None]) -> AgentSystemResult:
    turns = [TurnStats(turn=i, sent=1, completed=1, ttft_ms=latency_stats([t / 1000]),
                       prompt_tokens_mean=1000.0 * (i + 1), kv_over_suffix=r)
             for i, (t, r) in enumerate(zip(ttft_ms, ratios, strict=True))]
    summary = summarize([], 1.0, SLOConfig())
    return AgentSystemResult(label=label, url="http://x", records=[], turns=turns, summary=summary,
                             ttft_last_over_first=ttft_ms[-1] / ttft_ms[0])


def test_goal_lines() -> None:
    result = AgentResult(config={}, systems=[_system("reuse-on", [100.0, 110.0, 120.0], [1.1, 1.0, 1.3]),
                                             _system("reuse-off", [100.0, 300.0, 500.0], [None, None, None])])
    on, off = agent_turns.goal_lines(result)
    assert on.startswith("reuse-on: TTFT p50 turn 3 / turn 1 = 1.20x (context 3000 tokens")
    assert "median 1.15x, max 1.30x over turns 2..3" in on  # turn 1 is left out: its new tokens are all
    assert "5.00x" in off and "KV moved / new tokens' KV: not measured" in off


def test_dummy_alias_gets_its_own_words_and_a_raised_position_limit(tmp_path) -> None:
    import json

    args = agent_turns.parse_args(["--device", "cpu", "--model", "tiny-llama", "--max-context", "8192",
                                   "--position-limit", "9000"])
    model, flags, words = agent_turns.prepare_model(args, tmp_path)
    assert model == str(tmp_path / "model") and flags == ["--load-format", "dummy"]
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["max_position_embeddings"] == 9000 and config["num_hidden_layers"] == 2
    assert (tmp_path / "model" / "tokenizer.json").exists()
    assert words is not None and words[0] == "t100" and len(words) == 16384 - 100  # ids below vocab_size
    args = agent_turns.parse_args(["--device", "cpu", "--model", "tiny-llama", "--max-context", "2048"])
    assert agent_turns.prepare_model(args, tmp_path / "b")[:2] == ("tiny-llama", [])  # fits: the alias
    args = agent_turns.parse_args(["--device", "cpu"])
    assert agent_turns.prepare_model(args, tmp_path / "c") == ("smollm2-135m", [], None)


@pytest.mark.parametrize(("flag", "value"), [
    ("--warmup-turns", "-1"), ("--sessions", "0"), ("--turns", "0"), ("--turns", "-3"), ("--num-blocks", "0"),
    ("--max-model-len", "0"), ("--position-limit", "0"), ("--max-context", "-5"), ("--slo-ttft-ms", "0"),
    ("--slo-tpot-ms", "-1"), ("--ready-timeout", "0"), ("--ready-timeout", "nan"), ("--sessions", "2.5"),
    ("--think-time", "-1s"), ("--think-time", "1h"), ("--request-timeout", "0s"),
])
def test_out_of_range_numbers_are_refused_by_argparse_naming_the_flag(
        flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        agent_turns.parse_args(["--device", "cpu", flag, value])
    assert exc.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_zero_warmup_turns_and_think_time_are_allowed_and_durations_are_seconds() -> None:
    args = agent_turns.parse_args(["--device", "cpu", "--warmup-turns", "0", "--think-time", "0s",
                                   "--request-timeout", "90s"])
    assert (args.warmup_turns, args.think_time, args.request_timeout) == (0, 0.0, 90.0)
    cfg = agent_turns.agent_config(args, 46080)
    assert (cfg.think_time_s, cfg.request_timeout_s) == (0.0, 90.0)
    defaults = agent_turns.parse_args(["--device", "cpu"])
    assert (defaults.think_time, defaults.request_timeout) == (1.0, 300.0)


def test_repeats_summary_line_gives_median_and_range_of_the_reuse_on_runs() -> None:
    result = AgentResult(config={}, systems=[_system("reuse-on", [100.0, 150.0], [1.0, 1.0]),
                                             _system("reuse-on-2", [100.0, 130.0], [1.0, 1.0]),
                                             _system("reuse-on-3", [100.0, 170.0], [1.0, 1.0]),
                                             _system("reuse-off", [100.0, 900.0], [None, None])])
    lines = agent_turns.goal_lines(result)
    assert len(lines) == 5 and lines[1].startswith("reuse-on-2: TTFT p50 turn 2 / turn 1 = 1.30x")
    assert lines[-1] == ("reuse-on over 3 runs on one system: TTFT p50 last turn / turn 1 median 1.50x "
                         "(min 1.30x, max 1.70x; each: 1.50x, 1.30x, 1.70x)")
    one = agent_turns.goal_lines(AgentResult(config={}, systems=result.systems[:1]))
    assert len(one) == 1  # no summary for a single run


def test_repeats_run_on_one_system_with_fresh_texts_and_reuse_on_alone(monkeypatch, tmp_path) -> None:
    import contextlib

    started: list[str] = []
    runs: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def fake_live_system(kind, work, **kwargs):
        started.append(work.name)
        yield type("S", (), {"url": "http://x", "metrics_urls": {"prefill": "http://p", "decode": "http://d"}})()

    async def fake_first_model(url, key):
        return "served"

    async def fake_run_system(cfg, target):
        runs.append((target.label, cfg.seed))
        assert cfg.model == "served"
        done = _system(target.label, [100.0, 120.0], [1.0, 1.0])
        done.kv = KVScrape(before=0.0, after=0.0, leaked=0.0)
        done.summary = msgspec.structs.replace(done.summary, completed=1)  # main's exit code counts it
        return done

    monkeypatch.setattr(agent_turns, "live_system", fake_live_system)
    monkeypatch.setattr(agent_turns, "first_model", fake_first_model)
    monkeypatch.setattr(agent_turns, "run_system", fake_run_system)
    monkeypatch.setattr(agent_turns, "kv_bytes_per_token", lambda config, dtype: 100)
    assert agent_turns.main(["--device", "cpu", "--repeats", "3", "--systems", "reuse-on", "--warmup-turns",
                             "0", "--work-dir", str(tmp_path)]) == 0
    assert started == ["reuse-on"]  # one system, no reuse-off
    step = agent_turns.REPEAT_SEED_OFFSET
    assert runs == [("reuse-on", 0), ("reuse-on-2", step), ("reuse-on-3", 2 * step)]
    assert "reuse-on over 3 runs on one system" in (tmp_path / "report.md").read_text()
    runs.clear()
    started.clear()
    assert agent_turns.main(["--device", "cpu", "--warmup-turns", "0", "--work-dir", str(tmp_path)]) == 0
    assert started == ["reuse-on", "reuse-off"] and [r[0] for r in runs] == ["reuse-on", "reuse-off"]
