"""The multi-turn agent benchmark (``pdserve bench --workload agent``) against the fake server, and its
pieces: the ``--system`` spec, the KV size of a token, the counters' parsing, the per-turn arithmetic,
the flags it refuses. The fake server counts a chat prompt's tokens as the words of its messages, so every
turn's prompt size is known exactly."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from loadtest.agent_config import AgentConfig, SystemTarget
from loadtest.agent_records import AgentResult, TurnStats
from loadtest.agent_report import _split, agent_markdown, load_agent_json, save_agent_json
from loadtest.agent_runner import run_agent, suffix_tokens, ttft_growth, turn_stats
from loadtest.cli import main
from loadtest.kv_size import kv_bytes_per_token, load_model_config
from loadtest.lengths import LengthDist
from loadtest.records import RequestRecord
from loadtest.worker_counters import Counters, SideCounters, page_totals
from protocol.cli_env import OneLineParser
from tests.loadtest.fake_server import FakeState

USER, TOOL, OUT = 5, 9, 3
HEADER_WORDS = 2  # "[tool result]"


def _cfg(url: str, **kw: object) -> AgentConfig:
    base: dict[str, object] = dict(
        model="m", systems=(SystemTarget("a", url), SystemTarget("b", url)), sessions=2, turns=3,
        user_tokens=LengthDist("fixed", USER), tool_tokens=LengthDist("fixed", TOOL),
        output_len=LengthDist("fixed", OUT), think_time_s=0.01, ignore_eos=True, progress=False,
        leak_settle_s=0.5, request_timeout_s=10.0)
    base.update(kw)
    return AgentConfig(**base)  # type: ignore[arg-type]


def test_sessions_grow_turn_by_turn_on_every_system(fake: tuple[str, object]) -> None:
    url, _ = fake
    gc.unfreeze()
    result = asyncio.run(run_agent(_cfg(url, kv_bytes_per_token=10)))
    assert gc.get_freeze_count() > 0  # the heap alive before the load is out of the collector's way
    assert [s.label for s in result.systems] == ["a", "b"]
    added = USER + TOOL + HEADER_WORDS
    for system in result.systems:
        assert [(t.turn, t.sent, t.completed) for t in system.turns] == [(0, 2, 2), (1, 2, 2), (2, 2, 2)]
        by_turn = {(r.session_id, r.turn): r.prompt_tokens for r in system.records}
        for session in range(2):  # turn k carries turns 0..k and the k replies before it
            assert [by_turn[(session, k)] for k in range(3)] == [added, 2 * added + OUT, 3 * added + 2 * OUT]
        assert [t.suffix_tokens for t in system.turns] == [2 * added, 2 * (added + OUT), 2 * (added + OUT)]
        grown = [2 * added, 2 * (added + OUT), 2 * (added + OUT)]
        assert [t.suffix_kv_bytes for t in system.turns] == [10 * g for g in grown]
        assert all(t.kv_bytes is None and t.counters is None for t in system.turns)  # no worker pages
        assert system.counters_error == "no worker metrics pages given"
        assert system.summary.completed == 6 and system.kv.leaked == 0
        assert system.ttft_last_over_first is not None
    # the same content on both systems (same seed): the same prompt sizes
    a, b = result.systems
    assert [r.prompt_tokens for r in a.records] == [r.prompt_tokens for r in b.records]


def test_max_context_ends_sessions_before_a_turn_could_pass_it(fake: tuple[str, object]) -> None:
    url, _ = fake
    added = USER + TOOL + HEADER_WORDS
    # turn 0 fits (0 + 14 words + 32 slack + 3 <= 60), turn 1 would not (16 + 3 + 14 + 32 + 3 > 60)
    result = asyncio.run(run_agent(_cfg(url, systems=(SystemTarget("a", url),), max_context=60)))
    [system] = result.systems
    assert [t.turn for t in system.turns] == [0] and added == 16
    assert system.sessions_ended_by_context == 2


def test_worker_pages_are_read_per_turn(fake: tuple[str, object]) -> None:
    """The fake server's own /metrics stands in for a worker page: it has none of the counters, so every
    turn's change is read (0 bytes) and no side has a hit rate."""
    url, _ = fake
    target = SystemTarget("a", url, prefill_metrics=(url,), decode_metrics=(url,))
    cfg = _cfg(url, systems=(target,), kv_bytes_per_token=4, settle_s=0.3)
    [system] = asyncio.run(run_agent(cfg)).systems
    assert system.counters_error == ""
    assert [t.kv_bytes for t in system.turns] == [0.0, 0.0, 0.0]
    assert [t.kv_over_suffix for t in system.turns] == [0.0, 0.0, 0.0]
    assert all(t.prefill_hit_rate is None and t.decode_hit_rate is None for t in system.turns)
    assert system.run_counters is not None


def test_unreadable_worker_page_is_reported_not_fatal(fake: tuple[str, object]) -> None:
    url, _ = fake
    target = SystemTarget("a", url, prefill_metrics=("http://127.0.0.1:1",))
    [system] = asyncio.run(run_agent(_cfg(url, systems=(target,), turns=1))).systems
    assert "127.0.0.1:1/metrics failed" in system.counters_error
    assert system.summary.completed == 2 and system.run_counters is None


def _rec(session: int, turn: int, prompt: int | None, ttft: float = 0.1, ok: bool = True) -> RequestRecord:
    return RequestRecord(index=turn * 10 + session, session_id=session, turn=turn, start_s=0.0, success=ok,
                         ttft_s=ttft if ok else None, e2e_s=0.5 if ok else None, output_tokens=5,
                         prompt_tokens=prompt)


def test_turn_arithmetic_from_counters() -> None:
    records = [_rec(0, 0, 100, 0.1), _rec(1, 0, 120, 0.3), _rec(0, 1, 250, 0.2), _rec(1, 1, None, 0.2),
               _rec(0, 2, 300, ok=False)]
    assert suffix_tokens(records) == {(0, 0): 100, (1, 0): 120, (0, 1): 150}
    prefill = SideCounters(hits={"gpu": 96.0}, queries={"gpu": 250.0}, kv_sent_bytes=9.0)
    counters = {1: Counters(prefill=prefill, decode=SideCounters(kv_received_bytes=8.0))}
    cfg = AgentConfig(model="m", systems=(SystemTarget("a", "http://x"),), kv_bytes_per_token=2)
    turns = turn_stats(records, counters, cfg)
    assert [(t.turn, t.sent, t.completed) for t in turns] == [(0, 2, 2), (1, 2, 2), (2, 1, 0)]
    assert turns[0].suffix_tokens == 220 and turns[0].kv_bytes is None and turns[0].kv_over_suffix is None
    one = turns[1]
    assert (one.suffix_tokens, one.suffix_kv_bytes, one.kv_bytes) == (150, 300, 8.0)
    assert one.kv_over_suffix == pytest.approx(8 / 300)
    assert one.prefill_hit_rate == pytest.approx(96 / 250) and one.decode_hit_rate is None
    assert turn_stats(records, counters, cfg, decode_side=False)[1].kv_bytes == 9.0
    assert ttft_growth(turns) == pytest.approx(200 / 200)  # p50 of turn 1 (0.2) over turn 0 (0.2)


def test_counters_parse_and_subtract() -> None:
    page = ('# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{model_name="m"} 32.0\n'
            '# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{model_name="m"} 80.0\n'
            '# TYPE pdserve_worker_kv_sent_bytes counter\n'
            'pdserve_worker_kv_sent_bytes_total{engine="0"} 7.0\n')
    totals = page_totals(page)
    assert totals["vllm:prefix_cache_hits_total"] == 32
    assert totals["pdserve_worker_kv_received_bytes_total"] == 0
    later = SideCounters(hits={"gpu": 48.0}, queries={"gpu": 100.0}, kv_sent_bytes=10.0)
    earlier = SideCounters(hits={"gpu": 32.0}, queries={"gpu": 80.0}, kv_sent_bytes=7.0)
    delta = later.minus(earlier)
    assert (delta.hits, delta.queries, delta.kv_sent_bytes) == ({"gpu": 16.0}, {"gpu": 20.0}, 3.0)
    assert delta.hit_rate() == pytest.approx(0.8) and SideCounters().hit_rate() is None


def test_queue_and_prefill_seconds_from_histograms() -> None:
    reg = CollectorRegistry()
    queue = Histogram("vllm:request_queue_time_seconds", "q", ["model_name"], registry=reg).labels("m")
    prefill = Histogram("vllm:request_prefill_time_seconds", "p", ["model_name"], registry=reg).labels("m")
    for q, p in ((0.25, 0.5), (0.75, 1.5)):
        queue.observe(q)
        prefill.observe(p)
    totals = page_totals(generate_latest(reg).decode())
    side = SideCounters(queue_s=totals["vllm:request_queue_time_seconds_sum"],
                        prefill_s=totals["vllm:request_prefill_time_seconds_sum"],
                        timed=totals["vllm:request_prefill_time_seconds_count"])
    assert (side.queue_s, side.prefill_s, side.timed) == (1.0, 2.0, 2.0)
    delta = side.minus(SideCounters(queue_s=0.25, prefill_s=0.5, timed=1.0))
    assert delta.mean_ms() == pytest.approx((750.0, 1500.0))
    assert SideCounters().mean_ms() is None
    turn = TurnStats(turn=0, sent=1, completed=1, counters=Counters(prefill=delta, decode=SideCounters()))
    assert "750 + 1500" in _split(turn)


def test_kv_bytes_per_token_from_a_model_config(tmp_path: Path) -> None:
    llama8b = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "hidden_size": 4096}
    assert kv_bytes_per_token(llama8b, "bfloat16") == 2 * 32 * 8 * 128 * 2  # 131072: 128 KiB per token
    (tmp_path / "config.json").write_text(json.dumps({**llama8b, "head_dim": 64}))
    assert kv_bytes_per_token(load_model_config(tmp_path), "float32") == 2 * 32 * 8 * 64 * 4
    with pytest.raises(ValueError, match="num_hidden_layers"):
        kv_bytes_per_token({"num_attention_heads": 4, "hidden_size": 64}, "float32")
    with pytest.raises(ValueError, match="KV dtype"):
        kv_bytes_per_token(llama8b, "int3")


def test_system_spec() -> None:
    spec = SystemTarget.parse("label=on,url=http://g:8000/,prefill=http://p:1+http://p:2,decode=http://d:1")
    assert spec == SystemTarget("on", "http://g:8000", ("http://p:1", "http://p:2"), ("http://d:1",))
    assert SystemTarget.parse("url=http://g,label=x").has_counters is False
    for bad, match in (("label=x", "needs label"), ("label=x,url=http://g,cache=1", "unknown or repeated"),
                       ("label=x,url=g", "http://"), ("label=x,label=y,url=http://g", "repeated")):
        with pytest.raises(ValueError, match=match):
            SystemTarget.parse(bad)


def test_report_and_json_round_trip(fake: tuple[str, object], tmp_path: Path) -> None:
    url, _ = fake
    result = asyncio.run(run_agent(_cfg(url, turns=2)))
    text = agent_markdown(result)
    assert "## a (" in text and "## b (" in text and "## Side by side" in text
    assert text.count("\n| 1 |") >= 3 and "KV bytes per token: unknown" in text
    save_agent_json(result, tmp_path / "r.json")
    back = load_agent_json(tmp_path / "r.json")
    assert isinstance(back, AgentResult) and back.systems[1].turns == result.systems[1].turns


def test_one_turn_reports_no_ttft_growth_rather_than_dash_x(fake: tuple[str, object]) -> None:
    """A new-user trial (D10): ``--turns 1`` printed ``TTFT p50 last turn / turn 1: -x``. With one turn
    there is no growth to report, and the report says so, in the run line and the side-by-side table."""
    url, _ = fake
    result = asyncio.run(run_agent(_cfg(url, turns=1)))
    text = agent_markdown(result)
    assert all(s.ttft_last_over_first is None for s in result.systems)
    assert text.count("; TTFT p50 last turn / turn 1: n/a (one turn)\n") == 2
    assert "| a | n/a (one turn) |" in text and "| b | n/a (one turn) |" in text
    assert "-x" not in text
    two = asyncio.run(run_agent(_cfg(url, turns=2)))
    assert all(s.ttft_last_over_first is not None for s in two.systems)
    assert "n/a" not in agent_markdown(two)


@pytest.mark.parametrize(("argv", "message"), [
    (["--workload", "agent", "--arrival", "closed"], "--arrival does not apply to --workload agent"),
    (["--workload", "agent", "--num-requests", "5"], "--num-requests does not apply"),
    (["--turns", "3"], "--turns applies to --workload agent only"),
    (["--workload", "agent", "--system", "label=a,url=http://x", "--base-url", "http://y"],
     "--base-url and --system"),
    (["--workload", "agent", "--model-config", "/nonexistent"], "--model-config and --kv-dtype go together"),
    (["--workload", "agent", "--kv-bytes-per-token", "4", "--model-config", "c", "--kv-dtype", "float32"],
     "give one of them"),
    (["--workload", "agent", "--system", "label=a"], "needs label=NAME and url=URL"),
    (["--workload", "agent", "--sessions", "0"], "--sessions must be >= 1, got 0"),
    (["--workload", "agent", "--turns", "-1"], "--turns must be >= 1, got -1"),
    (["--workload", "agent", "--decode-metrics", "http://x"], "--decode-metrics does not apply"),
])
def test_flags_that_do_not_apply_are_refused(argv: list[str], message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "m", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_run_writes_outputs(fake: tuple[str, object], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = fake
    code = main(["--model", "m", "--workload", "agent", "--endpoint", "chat",
                 "--system", f"label=x,url={url}", "--sessions", "2", "--turns", "2", "--user-tokens", "3",
                 "--tool-tokens", "4", "--output-len", "fixed:2", "--think-time", "10ms",
                 "--kv-bytes-per-token", "8", "--no-progress", "--leak-settle", "500ms",
                 "--output-dir", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    data = json.loads((tmp_path / "results.json").read_text())
    assert [t["completed"] for t in data["systems"][0]["turns"]] == [2, 2]
    assert data["config"]["kv_bytes_per_token"] == 8
    assert "multi-turn agent sessions" in (tmp_path / "summary.md").read_text()


def _agent_args(*argv: str) -> argparse.Namespace:
    from loadtest.cli import add_bench_arguments

    parser = OneLineParser()
    add_bench_arguments(parser)
    return parser.parse_args(["--workload", "agent", *argv])


@pytest.mark.parametrize(("argv", "line"), [
    (["--word-list", "/nonexistent"], "error: --word-list /nonexistent: cannot read it (No such file or "
                                      "directory)"),
    (["--word-list", "/"], "error: --word-list /: cannot read it (Is a directory)"),
    (["--model-config", "/nonexistent", "--kv-dtype", "float16"],
     "error: --model-config /nonexistent: cannot read /nonexistent (No such file or directory)"),
    (["--think-time", "1x"], "error: --think-time: bad duration '1x': use a number with ms, s or m (e.g. "
                             "5s)"),
    (["--user-tokens", "fixed:1.5"], "error: --user-tokens: fixed length must be an integer >= 1, got 1.5"),
    (["--tool-tokens", "normal:0,1"], "error: --tool-tokens: normal length needs mean >= 1 and std >= 0, got "
                                      "0, 1"),
])
def test_a_bad_agent_flag_is_one_line_naming_it(argv: list[str], line: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A new-user trial (D8): ``--word-list /nonexistent`` and ``--model-config /nonexistent`` said
    ``error: [Errno 2] No such file or directory: '/nonexistent'``; a bad duration or length did not name
    its flag. One line naming the flag, exit 2, before any request (the base URL is never reached)."""
    assert main(["--model", "m", "--workload", "agent", "--base-url", "http://127.0.0.1:1", *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [line]


def test_a_max_context_no_first_turn_fits_is_refused_before_any_request(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A new-user trial: ``pdserve bench --workload agent --max-context 10`` printed a header, an empty
    table and ``Run: 0/0 completed``, exit 1, nothing saying why: every session ended before its first
    turn. The first turn's size is known before any request (100 user + 600 tool words, 32 of chat
    template, 64 max tokens by default: 796); a limit below it is one line naming --max-context, exit 2
    (the base URL is never reached)."""
    from loadtest.agent_cli import agent_config_from_args
    from loadtest.agent_runner import first_turn_tokens

    assert main(["--model", "m", "--workload", "agent", "--base-url", "http://127.0.0.1:1",
                 "--max-context", "10"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --max-context 10: no session's first turn fits (the smallest could reach 796 tokens: its "
        "user words and tool result (--user-tokens, --tool-tokens), 32 of chat template and its max tokens "
        "(--output-len)); give at least 796"]
    assert agent_config_from_args(_agent_args("--max-context", "796"), "m").max_context == 796
    # lengths drawn per session: refused only when even the smallest first turn does not fit
    drawn = ("--user-tokens", "uniform:1,50", "--tool-tokens", "uniform:1,50", "--sessions", "8")
    sizes = first_turn_tokens(agent_config_from_args(_agent_args(*drawn), "m"))
    assert len(set(sizes)) > 1
    with pytest.raises(ValueError, match=f"the smallest could reach {min(sizes)} tokens"):
        agent_config_from_args(_agent_args(*drawn, "--max-context", str(min(sizes) - 1)), "m")
    assert agent_config_from_args(_agent_args(*drawn, "--max-context", str(min(sizes))), "m")


def test_first_turn_sizes_are_what_the_run_compares_with_max_context(fake: tuple[str, object]) -> None:
    """``first_turn_tokens`` is the estimate the sessions use: a limit at a session's size lets its first
    turn run, one token below ends it before the turn."""
    from loadtest.agent_runner import first_turn_tokens

    url, _ = fake
    cfg = _cfg(url, systems=(SystemTarget("a", url),), turns=1, sessions=3,
               user_tokens=LengthDist("uniform", 1, 20))
    sizes = first_turn_tokens(cfg)
    assert sizes == [USER_WORDS + TOOL + 32 + OUT for USER_WORDS in _first_user_words(cfg)]
    limit = sorted(sizes)[1]
    [system] = asyncio.run(run_agent(_cfg(url, systems=(SystemTarget("a", url),), turns=1, sessions=3,
                                          user_tokens=LengthDist("uniform", 1, 20),
                                          max_context=limit))).systems
    assert system.summary.completed == sum(n <= limit for n in sizes)
    assert system.sessions_ended_by_context == sum(n > limit for n in sizes)


def _first_user_words(cfg: AgentConfig) -> list[int]:
    from loadtest.agent_runner import TOOL_HEADER, turn_text

    return [len(turn_text(cfg.seed, s, 0, cfg)[0].split(TOOL_HEADER)[0].split()) for s in range(cfg.sessions)]


def test_an_exit_code_of_1_says_why(fake: tuple[str, object], capsys: pytest.CaptureFixture[str]) -> None:
    url, state = fake
    state.plan = ["500"]  # type: ignore[attr-defined]
    code = main(["--model", "m", "--workload", "agent", "--endpoint", "chat",
                 "--system", f"label=x,url={url}", "--sessions", "1", "--turns", "1", "--user-tokens", "3",
                 "--tool-tokens", "4", "--output-len", "fixed:2", "--no-progress", "--leak-settle", "0s"])
    assert code == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == ["error: system x: no request completed"]


def test_texts_come_from_the_word_list_the_same_on_every_call(tmp_path: Path) -> None:
    from loadtest.agent_cli import agent_config_from_args
    from loadtest.agent_runner import TOOL_HEADER, turn_text
    from loadtest.cli import add_bench_arguments

    (tmp_path / "words").write_text("t101 t102\nt103\n")
    parser = OneLineParser()
    add_bench_arguments(parser)
    args = parser.parse_args(["--workload", "agent", "--word-list", str(tmp_path / "words"),
                              "--user-tokens", "4", "--tool-tokens", "6"])
    cfg = agent_config_from_args(args, "m")
    assert cfg.words == ("t101", "t102", "t103")
    text, words = turn_text(0, 1, 2, cfg)
    user, tool = text.split(TOOL_HEADER)
    assert words == 10 and len(user.split()) == 4 and len(tool.split()) == 6
    assert set(user.split()) | set(tool.split()) <= set(cfg.words)
    assert turn_text(0, 1, 2, cfg) == (text, words) and turn_text(0, 0, 2, cfg) != (text, words)
    (tmp_path / "empty").write_text(" \n")
    empty = parser.parse_args(["--workload", "agent", "--word-list", str(tmp_path / "empty")])
    with pytest.raises(ValueError, match="no word"):
        agent_config_from_args(empty, "m")


def test_decode_hit_rate_is_reused_over_reused_plus_received_blocks() -> None:
    """A decode worker counts no token queries: its hit rate per turn comes from the prompt KV blocks it
    reused from its own prefix cache against those it received (6 reused, 2 received in turn 1: 75 %)."""
    page = ('# TYPE pdserve_worker_kv_reused_blocks counter\n'
            'pdserve_worker_kv_reused_blocks_total{engine="0"} 10.0\n'
            '# TYPE pdserve_worker_kv_received_blocks counter\n'
            'pdserve_worker_kv_received_blocks_total{engine="0"} 5.0\n')
    totals = page_totals(page)
    assert (totals["pdserve_worker_kv_reused_blocks_total"],
            totals["pdserve_worker_kv_received_blocks_total"]) == (10.0, 5.0)
    earlier = SideCounters(kv_reused_blocks=4.0, kv_received_blocks=3.0)
    later = SideCounters(kv_reused_blocks=10.0, kv_received_blocks=5.0)
    delta = later.minus(earlier)
    assert (delta.kv_reused_blocks, delta.kv_received_blocks) == (6.0, 2.0)
    assert delta.block_hit_rate() == pytest.approx(0.75)
    assert SideCounters(kv_received_blocks=4.0).block_hit_rate() == 0.0
    assert SideCounters().block_hit_rate() is None
    records = [_rec(0, 0, 100), _rec(0, 1, 250)]
    counters = {0: Counters(prefill=SideCounters(), decode=SideCounters(kv_received_blocks=7.0)),
                1: Counters(prefill=SideCounters(), decode=delta)}
    cfg = AgentConfig(model="m", systems=(SystemTarget("a", "http://x"),))
    turns = turn_stats(records, counters, cfg)
    assert [t.decode_hit_rate for t in turns] == [0.0, pytest.approx(0.75)]
    assert all(t.prefill_hit_rate is None for t in turns)


def _agent_argv(url: str, system: str, out: Path) -> list[str]:
    return ["--model", "m", "--workload", "agent", "--endpoint", "chat", "--system", system,
            "--sessions", "2", "--turns", "2", "--user-tokens", "3", "--tool-tokens", "4",
            "--output-len", "fixed:2", "--think-time", "10ms", "--no-progress", "--leak-settle", "500ms",
            "--output-dir", str(out)]


def test_worker_pages_as_pdserve_up_prints_them(fake: tuple[str, FakeState], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """prefill=/decode= take a worker's page as `pdserve up` prints it (http://host:port/metrics) as well as
    the server's URL: the counters are read from that page (not .../metrics/metrics, a 404 that left every
    counter column empty with exit 0)."""
    url, _ = fake
    for pages in (f"prefill={url}/metrics,decode={url}/metrics/", f"prefill={url},decode={url}"):
        code = main(_agent_argv(url, f"label=x,url={url},{pages}", tmp_path))
        assert code == 0, capsys.readouterr().err
        [system] = json.loads((tmp_path / "results.json").read_text())["systems"]
        assert system["counters_error"] == "" and system["run_counters"] is not None


def test_worker_page_unreadable_before_the_load_sends_nothing(fake: tuple[str, FakeState], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Every system's pages are read before the first system's load: one that cannot be read (here the
    second system's) ends the bench with exit 2 naming the system and the page; no request was sent."""
    url, state = fake
    argv = _agent_argv(url, f"label=a,url={url},prefill={url}/metrics", tmp_path)
    argv += ["--system", f"label=b,url={url},decode={url}/nope/metrics"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--system b:" in err and "/nope/metrics answered HTTP 404" in err and "no load was sent" in err
    assert state.counter == 0 and not list(tmp_path.iterdir())


def test_worker_page_lost_during_the_run_fails_the_bench(fake: tuple[str, FakeState], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Read by the check before the load, then HTTP 500: the run goes on and its report says the counters
    were not read, and the exit code is 1 (counters asked for and not read)."""
    url, state = fake
    state.decode_page_ok_reads = 1
    assert main(_agent_argv(url, f"label=x,url={url},prefill={url}/decode-worker/metrics", tmp_path)) == 1
    assert "--system x: worker counters not read" in capsys.readouterr().err
    assert "Worker counters not read: GET" in (tmp_path / "summary.md").read_text()
    [system] = json.loads((tmp_path / "results.json").read_text())["systems"]
    assert [t["completed"] for t in system["turns"]] == [2, 2]


@pytest.mark.parametrize(("argv", "want"), [
    ([], "tokens"),                                   # completions: token-id prompts
    (["--endpoint", "chat"], "text"),                 # chat cannot send token ids: text by default
    (["--endpoint", "chat", "--prompt-format", "text"], "text"),
    (["--prompt-format", "text"], "text"),
    (["--workload", "multi-turn", "--num-turns", "2"], "text"),  # its turns are text
])
def test_the_prompt_format_follows_the_endpoint_unless_given(argv: list[str], want: str) -> None:
    from loadtest.cli import add_bench_arguments, config_from_args

    parser = OneLineParser()
    add_bench_arguments(parser, env={})
    assert config_from_args(parser.parse_args(argv), "m").workload.prompt_format == want


def test_token_prompts_to_chat_are_still_refused() -> None:
    from loadtest.cli import add_bench_arguments, config_from_args

    parser = OneLineParser()
    add_bench_arguments(parser, env={})
    with pytest.raises(ValueError, match="token-id prompts need the completions endpoint"):
        config_from_args(parser.parse_args(["--endpoint", "chat", "--prompt-format", "tokens"]), "m")
