"""`pdserve bench` against the live system: real gateway + prefill + decode processes (embedded SmolLM2 on
CPU, KV over NIXL on 127.0.0.1), driven through ``loadtest.cli.main`` exactly as the CLI runs it.

* a small Poisson run (token-id prompts, ``ignore_eos``) on the disaggregated half of the session's shared
  system (``live``, tests/live.py): every request completes with exactly ``max_tokens`` tokens, TTFT/TPOT
  are positive, the output files exist, and the KV gauge — seen above 0 during the run — is back to 0
  for every worker afterwards (leak check);
* ``--workload agent`` on two disaggregated systems of their own (``own``: gateway, prefill and decode
  worker each, every worker with its own /metrics), ``on`` with the workers' prefix cache on (the
  default) and ``off`` with ``--enable-prefix-caching false``, measured in one bench run (2 sessions x 3
  turns, short texts, greedy). Each turn's prompt carries the session so far, so it grows; with reuse on,
  the prefill worker finds the earlier turns' full blocks (hit rate > 0), with reuse off it finds none
  (== 0) while it still looks them up. The KV the decode worker received in a turn is read per turn: with
  reuse off it is every prompt's whole blocks (block size 16) x the model's KV bytes per block. No KV
  block is leaked;
* then a fault run on ``on`` (its last use): the decode worker is SIGKILLed mid-run through ``--fault``
  (at 5 s, or later once a request has finished: wait_metric.py); the run ends on its own, requests
  before the fault complete, those after it fail fast with the gateway's errors (none hangs to its
  timeout), and the report carries the phases and the KV gauge before/after.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from engine.models.registry import resolve_model
from loadtest.cli import main
from loadtest.kv_size import kv_bytes_per_token, load_model_config
from loadtest.metrics import tpot_s
from loadtest.records import RequestRecord
from loadtest.report import load_json
from pdserve.live_system import (
    MODEL,
    LiveSystem,
    SystemPair,
    SystemSpec,
    children,
    kv_used,
    live_system,
    live_systems,
    worker_id,
)
from tests.live import API_KEY
from tests.loadtest.wait_metric import sample as metric_sample

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

INPUT_LEN, MAX_TOKENS, TIMEOUT_S = 32, 8, 30.0
KILL_WAIT_S = 60.0  # the longest the fault waits for a finished request before it gives up (and fails)
WAIT_METRIC = Path(__file__).with_name("wait_metric.py")
PREFILL, DECODE = worker_id("prefill"), worker_id("decode")
BLOCK_SIZE = 16  # the workers' default --block-size


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveSystem, LiveSystem]]:
    """``(on, off)``: two disaggregated systems of this module's own, 256 KV blocks a worker, started at
    once with every child logging at debug level (the prefill log then says why blocks are held); ``off``
    runs its workers with ``--enable-prefix-caching false``. Stopped after the module."""
    logs = tmp_path_factory.mktemp("own")
    specs = [SystemSpec("disagg", logs / "on", MODEL, num_blocks=256),
             SystemSpec("disagg", logs / "off", MODEL, num_blocks=256,
                        worker_flags=("--enable-prefix-caching", "false"))]
    with ExitStack() as stack:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("PDSERVE_LOG_LEVEL", "debug")  # read by the children at start-up only
            on, off = stack.enter_context(live_systems(specs))
        yield on, off


@contextmanager
def gauge_watch(url: str, period_s: float = 0.2) -> Iterator[dict[str, float]]:
    """Poll the KV gauge in a thread while the body runs; yields worker_id → the highest value seen."""
    peak: dict[str, float] = {}
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(period_s):
            try:
                for wid, value in kv_used(url).items():
                    peak[wid] = max(peak.get(wid, 0.0), value)
            except httpx.HTTPError:
                pass

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join(5)


def bench_args(url: str, out: Path, *extra: str) -> list[str]:
    # --leak-settle 10s: after a decode worker dies, a prefill transfer bound to it fails (and frees its
    # blocks) within 2 × peer_timeout_s = 4 s, plus heartbeat lag; on a loaded 2-core CI box, give 10 s
    return ["--base-url", url, "--input-len", f"fixed:{INPUT_LEN}", "--output-len", f"fixed:{MAX_TOKENS}",
            "--ignore-eos", "--prompt-format", "tokens", "--arrival", "poisson", "--seed", "1",
            "--request-timeout", f"{TIMEOUT_S:g}s", "--leak-settle", "10s", "--no-progress",
            "--output-dir", str(out), *extra]


def test_bench_live_poisson(tmp_path: Path, live: SystemPair) -> None:
    system = live.disagg
    with gauge_watch(system.url) as peak:
        rc = main(bench_args(system.url, tmp_path / "out", "--request-rate", "2", "--num-requests", "8",
                             "--api-key", API_KEY, "--decode-metrics", system.metrics_urls["decode"]))
    after = kv_used(system.url)
    assert system.sup.dead() == [], system.log("decode")[-2000:]
    assert rc == 0
    assert (tmp_path / "out" / "summary.md").is_file() and (tmp_path / "out" / "latency_cdf.png").is_file()
    result = load_json(tmp_path / "out" / "results.json")
    (run,) = result.runs
    assert run.rate == 2.0 and run.summary.completed == 8 and run.summary.failed == 0
    assert len(run.records) == 8
    for rec in run.records:
        assert rec.success and rec.usage_reported, rec
        assert rec.output_tokens == MAX_TOKENS and rec.prompt_tokens == INPUT_LEN
        assert rec.ttft_s is not None and rec.ttft_s > 0
        assert (tpot_s(rec) or 0.0) > 0 and len(rec.itl_s) == MAX_TOKENS - 1
    assert run.summary.ttft_ms is not None and run.summary.ttft_ms.mean > 0
    assert run.summary.tpot_ms is not None and run.summary.tpot_ms.mean > 0
    # leak check: the gauge moved during the run (so 0 afterwards means something) and is back to 0
    assert peak.get(DECODE, 0) > 0, peak
    assert after == {PREFILL: 0.0, DECODE: 0.0}
    assert (run.kv.before, run.kv.after, run.kv.leaked, run.kv.error) == (0.0, 0.0, 0.0, "")
    # the decode worker's step interval over the run: every token it sampled (all but each request's
    # first, which the prefill worker sampled); the client's after each request's second token
    share = run.gateway_share
    assert share is not None and share.error == "", share
    assert share.worker_tokens == 8 * (MAX_TOKENS - 1) and share.client_tokens == 8 * (MAX_TOKENS - 2)
    assert share.worker_itl_ms is not None and share.client_itl_ms is not None and share.share is not None
    assert share.worker_itl_ms > 0
    assert share.share == pytest.approx(1 - share.worker_itl_ms / share.client_itl_ms)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| rate=2/s | 8/8 |" in summary and "before 0, after 0, leaked 0" in summary
    assert "Time per output token outside the engine loop (rate=2/s): client " in summary


def _phase_split(records: list[RequestRecord], fault_s: float) -> tuple[list[RequestRecord], ...]:
    before = [r for r in records if r.start_s < fault_s]
    return before, [r for r in records if r.start_s >= fault_s]


def _target(label: str, system: LiveSystem) -> str:
    urls = system.metrics_urls
    return f"label={label},url={system.url},prefill={urls['prefill']},decode={urls['decode']}"


@pytest.mark.timeout(600)  # starts ``own``: two systems at once take minutes on a loaded 2-core machine
def test_agent_bench_reuse_on_and_off(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      own: tuple[LiveSystem, LiveSystem]) -> None:
    on, off = own
    config = resolve_model(MODEL)
    code = main(["--workload", "agent", "--endpoint", "chat", "--model", MODEL,
                 "--system", _target("reuse-on", on), "--system", _target("reuse-off", off),
                 "--sessions", "2", "--turns", "3", "--user-tokens", "12", "--tool-tokens", "24",
                 "--output-len", "fixed:4", "--ignore-eos", "--think-time", "0s", "--request-timeout", "120s",
                 "--model-config", str(config), "--kv-dtype", "float32", "--leak-settle", "10s",
                 "--no-progress", "--output-dir", str(tmp_path / "out")])
    printed = capsys.readouterr()
    assert code == 0, printed.err + printed.out
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    per_token = kv_bytes_per_token(load_model_config(config), "float32")
    assert result["config"]["kv_bytes_per_token"] == per_token
    systems = {s["label"]: s for s in result["systems"]}
    assert list(systems) == ["reuse-on", "reuse-off"]
    for label, system in systems.items():
        assert [(t["turn"], t["sent"], t["completed"]) for t in system["turns"]] == [(0, 2, 2), (1, 2, 2),
                                                                                  (2, 2, 2)], label
        prompts = {(r["session_id"], r["turn"]): r["prompt_tokens"] for r in system["records"]}
        for session in range(2):  # turn k carries turns 0..k-1 and their answers: the prompt grows
            sizes = [prompts[(session, k)] for k in range(3)]
            assert sizes[0] > 36 and sizes[0] < sizes[1] < sizes[2], (label, sizes)
        assert system["kv"]["leaked"] == 0 and system["counters_error"] == "", label
        for turn in system["turns"]:
            blocks = sum(-(-prompts[(s, turn["turn"])] // BLOCK_SIZE) for s in range(2))
            whole = blocks * BLOCK_SIZE * per_token
            moved = turn["kv_bytes"]
            # reuse off: every prompt's whole blocks cross; reuse on: at most that (decode-side reuse: less)
            assert (moved == whole) if label == "reuse-off" else (0 < moved <= whole), (label, turn)
            assert turn["suffix_kv_bytes"] == turn["suffix_tokens"] * per_token
    run_on = systems["reuse-on"]["run_counters"]["prefill"]
    run_off = systems["reuse-off"]["run_counters"]["prefill"]
    assert run_on["hits"]["gpu"] > 0 and run_on["queries"]["gpu"] > 0
    assert run_off["hits"]["gpu"] == 0 and run_off["queries"]["gpu"] > 0
    on_turns, off_turns = systems["reuse-on"]["turns"], systems["reuse-off"]["turns"]
    assert all(t["prefill_hit_rate"] > 0 for t in on_turns[1:])  # later turns find the earlier ones' blocks
    assert all(t["prefill_hit_rate"] == 0 for t in off_turns)
    assert "## Side by side" in printed.out


@pytest.mark.timeout(300)  # ``own`` is already up (or starts here when this test runs alone)
def test_bench_live_decode_killed(tmp_path: Path, own: tuple[LiveSystem, LiveSystem]) -> None:
    out = tmp_path / "out"
    system = own[0]
    decode = system.pids["decode"]
    # the kill comes at 5 s, or later, once the gateway counts a finished request (a loaded machine
    # decodes a token a second, and the first request then still streams at 5 s): a request sent
    # after 5 s cannot finish before the earlier ones, so the phases below hold either way
    # the system served the agent bench before: the gate counts from the gateway's count now
    finished = metric_sample(httpx.get(f"{system.url}/metrics", timeout=10, trust_env=False).text,
                             "pdserve_e2e_seconds_count") or 0.0
    gate = (f"{sys.executable} {WAIT_METRIC} {system.url} pdserve_e2e_seconds_count {finished + 1:g} "
            f"{KILL_WAIT_S:g}")
    # blocks of a transfer bound to the dead decode worker come back by the transfer deadline at the
    # latest (30 s): the settle window covers it, so only a real leak fails here
    args = bench_args(system.url, out, "--request-rate", "1", "--num-requests", "10", "--fault",
                      f"at=5s,timeout={KILL_WAIT_S + 10:g}s,cmd={gate} && kill -9 {decode}")
    args[args.index("--leak-settle") + 1] = "40s"
    rc = main(args)
    assert system.sup.children["decode"].poll() == -9  # the fault really killed it
    after = kv_used(system.url)
    assert not [n for n, _ in system.sup.dead() if n != "decode"], "only the decode worker may die"
    held = [line for line in system.log("prefill").splitlines() if "release_deferred" in line]
    assert rc == 0, f"some requests completed, no leak; prefill's last deferrals: {held[-5:]}"
    (run,) = load_json(out / "results.json").runs
    (fault,) = run.faults
    assert fault.status == "ran" and fault.returncode == 0 and fault.started_s is not None
    assert [p.name for p in run.phases] == ["before fault 1", "after fault 1"]
    early, late = _phase_split(run.records, fault.started_s)
    assert (run.phases[0].completed, run.phases[0].failed) == (sum(r.success for r in early),
                                                              sum(not r.success for r in early))
    assert run.phases[0].completed >= 1  # requests that finished before the kill
    assert late and run.phases[1].completed == 0 and run.phases[1].failed == len(late)
    assert all(r.error_kind in ("stream_error", "http_status") for r in late), [r.error for r in late]
    # no request hangs to its timeout: every one ended, and the run ended well before the bound
    assert len(run.records) == 10 and run.phases[0].timed_out == run.phases[1].timed_out == 0
    last_start = max(r.start_s for r in run.records)
    assert fault.finished_s is not None  # the kill: requests still streaming then fail at once
    assert run.summary.duration_s < max(last_start, fault.finished_s) + TIMEOUT_S / 2, run.summary.duration_s
    # the KV gauge: the dead decode worker's series is gone, the prefill worker holds no block
    assert after == {PREFILL: 0.0}
    assert (run.kv.before, run.kv.after, run.kv.leaked) == (0.0, 0.0, 0.0)
    summary = (out / "summary.md").read_text()
    assert "| before fault 1 |" in summary and "| after fault 1 |" in summary
    assert f"kill -9 {decode}" in summary and "before 0, after 0, leaked 0" in summary
    assert json.loads((out / "results.json").read_text())["config"]["faults"][0]["at_s"] == 5.0


def test_live_system_rejects_bad_mode(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode must be"), live_system("both", tmp_path):  # type: ignore[arg-type]
        pass
    with pytest.raises(ValueError, match="num_blocks"), live_system("disagg", tmp_path, num_blocks=0):
        pass
    assert not any(tmp_path.iterdir())  # nothing started, no log written



def test_live_system_children_of_several_prefill_and_decode_workers(tmp_path: Path) -> None:
    spec = SystemSpec("disagg", tmp_path, num_prefill=2, num_decode=3, devices=("cpu", "cpu"))
    plan = children(spec, 8000, "tcp://127.0.0.1:1")
    names = [name for name, _ in plan]
    assert names == ["gateway", "prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2"]
    for name, args in plan[1:]:
        assert args[0] == name.split("-")[0] and args[args.index("--worker-id") + 1] == f"live-{name}"
        assert args[args.index("--device") + 1] == "cpu"
    assert [n for n, _ in children(SystemSpec("disagg", tmp_path), 8000, "tcp://x:1")] == [
        "gateway", "prefill", "decode"]
    with pytest.raises(ValueError, match="num_prefill and num_decode"):
        SystemSpec("disagg", tmp_path, num_decode=0)
    with pytest.raises(ValueError, match="disagg system only"):
        SystemSpec("colocated", tmp_path, num_prefill=2)
