"""Run the multi-turn agent benchmark against each system in turn; per-turn statistics.

Turns move in lockstep: every live session sends its turn ``k`` at once, the benchmark waits until all of
them are answered, reads the workers' counters until they settle (``loadtest.worker_counters``), waits
the think time, then sends turn ``k + 1``. So each counter change belongs to one turn index, which a
free-running mix of turns could not give; the price is that the sessions' turns arrive together. A
session's turn ``k`` carries its whole history (``loadtest.conversation.Conversation``: the chat
messages so far, the answers included) plus the new user text and tool-result block. A failed turn ends
its session; so does a turn that could pass ``max_context``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from tqdm import tqdm

from loadtest.agent_config import AgentConfig, SystemTarget
from loadtest.agent_records import AgentResult, AgentSystemResult, TurnStats
from loadtest.client import RequestIds, send_request
from loadtest.conversation import PATHS, Conversation
from loadtest.metrics import latency_stats, meets_slo, summarize, tpot_s
from loadtest.records import KVScrape, RequestRecord
from loadtest.scrape import scrape_after, scrape_before
from loadtest.worker_counters import Counters, read_counters, settled_counters
from loadtest.workload import WORDS, Turn

TEMPLATE_SLACK_TOKENS = 32  # chat-template tokens a turn may add around its text (max_context estimate)
TOOL_HEADER = "\n\n[tool result]\n"


def turn_text(seed: int, session: int, turn: int, cfg: AgentConfig) -> tuple[str, int]:
    """The new content of ``session``'s turn ``turn``: user words, then a tool-result block; and its word
    count. The same for the same seed, session and turn on every system."""
    rng = random.Random(f"{seed}:{session}:{turn}")
    n_user, n_tool = cfg.user_tokens.sample(rng), cfg.tool_tokens.sample(rng)
    pool = cfg.words or WORDS

    def text(n: int) -> str:
        return " ".join(rng.choice(pool) for _ in range(n))

    return text(n_user) + TOOL_HEADER + text(n_tool), n_user + n_tool


class _Session:
    """One conversation: its history, the last turn's usage, and whether it goes on."""

    def __init__(self, cfg: AgentConfig, session_id: int) -> None:
        self.cfg, self.session_id = cfg, session_id
        self.conv = Conversation(cfg.endpoint)
        self.rng = random.Random(f"{cfg.seed}:max_tokens:{session_id}")
        self.last_prompt_tokens = 0
        self.last_output_tokens = 0
        self.alive = True
        self.ended_by_context = False

    def plan(self, turn: int) -> tuple[Turn, int]:
        """Turn ``turn``'s request and the context it could reach (tokens, estimated: the last turn's
        prompt and answer, the new words, ``TEMPLATE_SLACK_TOKENS`` and its max_tokens). Draws the
        session's next max_tokens."""
        text, words = turn_text(self.cfg.seed, self.session_id, turn, self.cfg)
        max_tokens = self.cfg.output_len.sample(self.rng)
        estimate = (self.last_prompt_tokens + self.last_output_tokens + words + TEMPLATE_SLACK_TOKENS
                    + max_tokens)
        return Turn(text, max_tokens), estimate

    def next_turn(self, turn: int) -> Turn | None:
        """Turn ``turn``'s request, or None (the session ends) when it could pass ``max_context``."""
        planned, estimate = self.plan(turn)
        limit = self.cfg.max_context
        if limit is not None and estimate > limit:
            self.alive, self.ended_by_context = False, True
            return None
        return planned

    async def send(self, turn_no: int, turn: Turn, client: httpx.AsyncClient, t0: float,
                   clock: Callable[[], float]) -> RequestRecord:
        cfg = self.cfg
        ids = RequestIds(turn_no * cfg.sessions + self.session_id, self.session_id, turn_no, clock() - t0)
        body = self.conv.body(turn, cfg.model, ignore_eos=cfg.ignore_eos, temperature=cfg.temperature)
        rec, text = await send_request(client, PATHS[cfg.endpoint], body, ids, cfg.request_timeout_s, clock)
        if not rec.success:
            self.alive = False
            return rec
        self.conv.add_reply(turn, text)
        self.last_prompt_tokens = rec.prompt_tokens or self.last_prompt_tokens
        self.last_output_tokens = rec.output_tokens
        return rec


def first_turn_tokens(cfg: AgentConfig) -> list[int]:
    """The context each session's first turn could reach (``_Session.plan``: its words, the template
    slack and its max_tokens; no history yet), as the run estimates it against ``max_context``: known
    before any request, the same on every system."""
    return [_Session(cfg, session).plan(0)[1] for session in range(cfg.sessions)]


def _client(cfg: AgentConfig, target: SystemTarget) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    return httpx.AsyncClient(base_url=target.url, headers=headers,
                             timeout=httpx.Timeout(cfg.request_timeout_s),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                             trust_env=False, follow_redirects=False)


class _CounterReader:
    """Reads ``target``'s worker counters; after a failure it stops and keeps the error."""

    def __init__(self, cfg: AgentConfig, target: SystemTarget) -> None:
        self.cfg, self.target = cfg, target
        self.error = "" if target.has_counters else "no worker metrics pages given"
        self.client = httpx.AsyncClient(trust_env=False, follow_redirects=False)

    async def read(self) -> Counters | None:
        if self.error:
            return None
        try:
            target = self.target
            return await settled_counters(self.client, target.prefill_metrics, target.decode_metrics,
                                          self.cfg.settle_s)
        except RuntimeError as exc:
            self.error = str(exc)
            return None


async def run_system(cfg: AgentConfig, target: SystemTarget,
                     clock: Callable[[], float] = time.perf_counter) -> AgentSystemResult:
    """The whole workload against ``target``: every turn in lockstep, then the statistics."""
    # as loadtest/runner.py: what is alive now (imports, a started system's handles, earlier runs'
    # records) moves to the permanent generation, so that a full collection during the run does not
    # stall the event loop and add to the TTFTs measured
    gc.collect()
    gc.freeze()
    records: list[RequestRecord] = []
    turn_counters: dict[int, Counters] = {}
    sessions = [_Session(cfg, i) for i in range(cfg.sessions)]
    reader = _CounterReader(cfg, target)
    async with _client(cfg, target) as client, reader.client:
        before, kv_error = await _kv_before(cfg, client)
        start = prev = await reader.read()
        t0 = clock()
        total = cfg.sessions * cfg.turns
        with tqdm(total=total, desc=target.label, unit="req", disable=not cfg.progress) as bar:
            for turn_no in range(cfg.turns):
                planned = [(s, s.next_turn(turn_no)) for s in sessions if s.alive]
                sends = [s.send(turn_no, turn, client, t0, clock) for s, turn in planned if turn is not None]
                if not sends:
                    break
                records += await asyncio.gather(*sends)
                bar.update(len(sends))
                now = await reader.read()
                if now is not None and prev is not None:
                    turn_counters[turn_no] = now.minus(prev)
                prev = now
                if turn_no + 1 < cfg.turns and any(s.alive for s in sessions):
                    await asyncio.sleep(cfg.think_time_s)
        elapsed = max(clock() - t0, 1e-9)
        kv = KVScrape(error=kv_error)
        if before is not None and cfg.metrics_path:
            kv = await scrape_after(client, cfg.metrics_path, before, cfg.leak_settle_s)
    records.sort(key=lambda r: r.index)
    turns = turn_stats(records, turn_counters, cfg, decode_side=bool(target.decode_metrics))
    run_counters = prev.minus(start) if prev is not None and start is not None and not reader.error else None
    return AgentSystemResult(
        label=target.label, url=target.url, records=records, turns=turns,
        summary=summarize(records, elapsed, cfg.slo), run_counters=run_counters, counters_error=reader.error,
        ttft_last_over_first=ttft_growth(turns), kv=kv,
        sessions_ended_by_context=sum(s.ended_by_context for s in sessions))


async def _kv_before(cfg: AgentConfig, client: httpx.AsyncClient) -> tuple[float | None, str]:
    if not cfg.metrics_path:
        return None, "metrics scrape off"
    try:  # a settled baseline: the gateway's gauge lags by a heartbeat (loadtest/scrape.py)
        settle = cfg.leak_settle_s
        return await scrape_before(client, cfg.metrics_path, min(1.0, settle), settle), ""
    except RuntimeError as exc:
        return None, str(exc)


def suffix_tokens(records: Sequence[RequestRecord]) -> dict[tuple[int, int], int]:
    """(session, turn) → the tokens the session's prompt grew by since its previous turn (the whole prompt
    at turn 0), for every completed turn whose prompt and previous prompt the server reported."""
    prompts = {(r.session_id, r.turn): r.prompt_tokens for r in records if r.success and r.prompt_tokens}
    out: dict[tuple[int, int], int] = {}
    for (session, turn), tokens in prompts.items():
        previous = 0 if turn == 0 else prompts.get((session, turn - 1))
        if previous is not None and tokens is not None:
            out[(session, turn)] = tokens - previous
    return out


def turn_stats(records: Sequence[RequestRecord], counters: dict[int, Counters], cfg: AgentConfig,
               decode_side: bool = True) -> list[TurnStats]:
    """One ``TurnStats`` per turn index that sent a request. ``counters``: turn → the counters' change over
    it; the KV bytes moved are the decode side's received bytes with ``decode_side`` (its pages were
    read), else the prefill side's sent bytes."""
    growth = suffix_tokens(records)
    out = []
    for turn in sorted({r.turn for r in records}):
        sent = [r for r in records if r.turn == turn]
        ok = [r for r in sent if r.success]
        prompts = [r.prompt_tokens for r in ok if r.prompt_tokens]
        grown = [growth[(r.session_id, turn)] for r in ok if (r.session_id, turn) in growth]
        stats = TurnStats(
            turn=turn, sent=len(sent), completed=len(ok),
            prompt_tokens_mean=sum(prompts) / len(prompts) if prompts else None,
            suffix_tokens=sum(grown) if grown else None,
            ttft_ms=latency_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
            tpot_ms=latency_stats([t for t in (tpot_s(r) for r in ok) if t is not None]),
            slo_met=sum(meets_slo(r, cfg.slo) for r in ok))
        delta = counters.get(turn)
        if delta is not None:
            stats.counters = delta
            stats.prefill_hit_rate = delta.prefill.hit_rate()
            stats.decode_hit_rate = delta.decode.block_hit_rate()
            stats.kv_bytes = delta.decode.kv_received_bytes if decode_side else delta.prefill.kv_sent_bytes
        if stats.suffix_tokens is not None and cfg.kv_bytes_per_token is not None:
            stats.suffix_kv_bytes = stats.suffix_tokens * cfg.kv_bytes_per_token
            if stats.kv_bytes is not None and stats.suffix_kv_bytes > 0:
                stats.kv_over_suffix = stats.kv_bytes / stats.suffix_kv_bytes
        out.append(stats)
    return out


def ttft_growth(turns: Sequence[TurnStats]) -> float | None:
    """TTFT p50 of the last turn with a completed request over that of the first turn (None: either
    missing, or a single turn)."""
    done = [t for t in turns if t.ttft_ms is not None]
    if len(done) < 2 or done[0].turn != 0 or done[0].ttft_ms is None or done[-1].ttft_ms is None:
        return None
    first = done[0].ttft_ms.median
    return None if first <= 0 else done[-1].ttft_ms.median / first


async def check_worker_pages(cfg: AgentConfig) -> None:
    """Read every system's worker pages (``--system ...,prefill=,decode=``) once, before any system's
    traffic, so that a page that cannot be read ends the bench before its load rather than leaving the
    counter columns empty after it. Raises RuntimeError naming the system, the page and the problem."""
    async with httpx.AsyncClient(trust_env=False, follow_redirects=False) as client:
        for target in cfg.systems:
            if not target.has_counters:
                continue
            try:
                await read_counters(client, target.prefill_metrics, target.decode_metrics)
            except RuntimeError as exc:
                raise RuntimeError(f"--system {target.label}: {exc} (no load was sent)") from None


async def run_agent(cfg: AgentConfig) -> AgentResult:
    """Every system of ``cfg`` in order, one after another (they do not share the load)."""
    return AgentResult(config=config_dict(cfg), systems=[await run_system(cfg, s) for s in cfg.systems])


def config_dict(cfg: AgentConfig) -> dict[str, Any]:
    """``cfg`` as plain data for the JSON output; the API key is redacted."""
    data = dataclasses.asdict(cfg)
    data["api_key"] = "***" if cfg.api_key else None
    return data
