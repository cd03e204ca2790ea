"""Chaos scenarios against a live disaggregated system: kills, restarts, overload, exhausted KV, aborts.

Every scenario runs against one system of real processes (``pdserve.live_system``: a gateway, two
prefill and two decode workers on the CPU, KV over NIXL (UCX over TCP and shared memory on one host),
sends its traffic with ``openai``-shaped streaming requests (``/v1/completions``, prompts as token
ids, greedy), injects its fault, brings the system back (a killed child is started again with its own
argv: same worker id, a new epoch), and reports per scenario:

- ``sent``, ``completed`` (HTTP 200 and ``[DONE]`` with no error event);
- ``honest_errors``: an HTTP error status with the OpenAI error body before any token (429 and 503
  with ``Retry-After``), or an error event after at least one token;
- ``bad_200``: HTTP 200 whose stream carries an error (or ends) before its first token, or a 429/503
  without ``Retry-After``: what the suite must never see;
- ``past_deadline``: requests with no complete answer within their client deadline;
- ``connection_lost``: streams cut by a killed gateway (expected only in ``gateway_restart``);
- ``retried`` / ``migrated``: the gateway's counters (``pdserve_request_retries_total``,
  ``pdserve_request_migrations_total``) over the scenario;
- ``leaked_blocks``: KV blocks still used on every worker once the system settled (must be 0).

``tests/chaos/test_chaos.py`` runs every scenario at a small scale and asserts the rules above; this
module's command line runs them longer and prints the table:

    python -m bench.serving.chaos [--scale 4] [--work-dir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.argtypes import positive_int
from pdserve.live_system import (
    LiveSystem,
    SystemSpec,
    live_systems,
    metric_samples,
    registered,
    wait_all_free,
)

DEADLINE_S = 240.0  # a client's bound on one request (the gateway's --request-timeout, 180 s, is below it)
MAX_TOKENS = 24
MIN_TOKENS = 4  # the fewest output tokens ``Chaos(output_scale=...)`` leaves a scenario's streams
LEAVE_S = 0.05  # a client that leaves at once closes its connection this many seconds after sending


@dataclass
class Outcome:
    """One client request as the client saw it. ``status``: HTTP status (None: no response);
    ``tokens``: text chunks received; ``error``: the error event or exception text; ``done``: saw
    ``data: [DONE]``; ``elapsed_s``: seconds from send to the end; ``status_after_s``: seconds until the
    status line; ``ttft_s``: seconds until the first text chunk (None: none came)."""

    status: int | None = None
    retry_after: str | None = None
    tokens: int = 0
    text: str = ""
    error: str | None = None
    done: bool = False
    timed_out: bool = False
    connection_lost: bool = False
    client_left: bool = False
    elapsed_s: float = 0.0
    status_after_s: float = 0.0
    ttft_s: float | None = None

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.done and self.error is None

    @property
    def bad_200(self) -> bool:
        """HTTP 200 carrying an error before any token; or a 429/503 without Retry-After."""
        if (self.status == 200 and not self.completed and self.tokens == 0 and not self.connection_lost
                and not self.client_left):
            return True
        return self.status in (429, 503) and not self.retry_after

    @property
    def honest_error(self) -> bool:
        if self.status is not None and self.status >= 400:
            return not self.bad_200
        return (self.status == 200 and self.error is not None and self.tokens > 0
                and not self.connection_lost)


@dataclass
class ScenarioResult:
    """Counts of one scenario (see the module docstring), its wall time in seconds, and each distinct
    error (status and the first 160 characters of its body or event) with its count."""

    name: str
    sent: int = 0
    completed: int = 0
    honest_errors: int = 0
    bad_200: int = 0
    past_deadline: int = 0
    connection_lost: int = 0
    retried: float = 0.0
    migrated: float = 0.0
    leaked_blocks: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)
    max_status_after_s: float = 0.0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    def add(self, outcomes: Sequence[Outcome]) -> None:
        """Count ``outcomes`` into this result."""
        for o in outcomes:
            self.sent += 1
            self.completed += o.completed
            self.honest_errors += o.honest_error
            self.bad_200 += o.bad_200
            self.past_deadline += o.timed_out
            self.connection_lost += o.connection_lost
            key = str(o.status)
            self.statuses[key] = self.statuses.get(key, 0) + 1
            if o.error is not None:
                text = f"{o.status} {o.error[:160]}"
                self.errors[text] = self.errors.get(text, 0) + 1
            if o.status is not None and o.status != 200:
                self.max_status_after_s = max(self.max_status_after_s, o.status_after_s)


async def stream(client: httpx.AsyncClient, prompt: list[int], max_tokens: int = MAX_TOKENS,
                 deadline_s: float = DEADLINE_S, abort_after_tokens: int | None = None,
                 out: Outcome | None = None, sampling: dict[str, float] | None = None) -> Outcome:
    """One greedy streaming completion of token-id ``prompt``; ``abort_after_tokens``: close the stream
    after that many text chunks as a leaving client does (0: ``LEAVE_S`` seconds after sending, or at the
    status line if that comes first). ``out``: the
    record to fill as the stream goes (so a scenario can watch progress); returned. ``sampling``:
    fields that replace greedy decoding (e.g. ``temperature`` and ``seed``)."""
    out = Outcome() if out is None else out
    t0 = time.monotonic()
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, **(sampling or {})}
    try:
        leave = abort_after_tokens == 0
        async with asyncio.timeout(LEAVE_S if leave else deadline_s), \
                client.stream("POST", "/v1/completions", json=body) as resp:
            out.status, out.status_after_s = resp.status_code, time.monotonic() - t0
            out.retry_after = resp.headers.get("retry-after")
            if resp.status_code != 200:
                out.error = (await resp.aread()).decode(errors="replace")[:300]
                return out
            if leave:
                out.client_left = True
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out.done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = json.dumps(chunk["error"])[:300]
                    continue
                text = "".join(c.get("text", "") for c in chunk.get("choices", []))
                if text:
                    if out.ttft_s is None:
                        out.ttft_s = time.monotonic() - t0
                    out.tokens += 1
                    out.text += text
                if abort_after_tokens is not None and out.tokens >= abort_after_tokens:
                    out.client_left = True
                    return out
    except TimeoutError:
        if abort_after_tokens == 0:
            out.client_left = True  # left before the status line came
        else:
            out.timed_out = True
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError) as exc:
        out.connection_lost, out.error = True, repr(exc)[:300]
    finally:
        out.elapsed_s = time.monotonic() - t0
    return out


def prompts(n: int, length: int, salt: int = 0) -> list[list[int]]:
    """``n`` distinct token-id prompts of ``length`` tokens (ids inside SmolLM2's vocabulary)."""
    return [[(97 * i + 31 * j + 7 * salt) % 40000 + 200 for j in range(length)] for i in range(n)]


def counter(url: str, name: str) -> float:
    """The sum of every sample of counter ``name`` at the gateway (0 when absent)."""
    return sum(v for (n, _), v in metric_samples(url).items() if n == name)


def wait_registered(system: LiveSystem, timeout_s: float = 120.0) -> None:
    """Wait until every worker of ``system`` is registered. Raises AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if registered(system.url) >= system.worker_ids:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"workers not all registered after {timeout_s} s; logs in {system.logs}")


async def until(condition: Callable[[], bool], timeout_s: float = 180.0) -> None:
    """Poll ``condition`` every 20 ms. Raises AssertionError when it is still false after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s} s")
        await asyncio.sleep(0.02)


def kill9(system: LiveSystem, name: str) -> None:
    """SIGKILL child ``name`` and reap it."""
    os.kill(system.pids[name], signal.SIGKILL)
    system.sup.children[name].wait(10)


class Chaos:
    """The scenarios over one live system. ``scale`` multiplies every scenario's request count;
    ``aborts``: the streams of ``client_aborts`` at scale 1 (a multiple of 3 spreads them evenly over
    its three ways of leaving); ``output_scale`` multiplies each scenario's ``max_tokens`` (at least
    ``MIN_TOKENS`` kept: a stream cut by a fault still has tokens after it; ``client_aborts`` keeps its
    4). Raises ValueError when ``scale`` or ``aborts`` is below 1 or ``output_scale`` is not positive."""

    def __init__(self, system: LiveSystem, scale: int = 1, aborts: int = 1000,
                 output_scale: float = 1.0) -> None:
        if scale < 1 or aborts < 1:
            raise ValueError(f"scale and aborts must be >= 1, got {scale} and {aborts}")
        if output_scale <= 0:
            raise ValueError(f"output_scale must be > 0, got {output_scale}")
        self.system, self.scale, self.aborts, self.output_scale = system, scale, aborts, output_scale

    def _tokens(self, max_tokens: int) -> int:
        return max(MIN_TOKENS, round(max_tokens * self.output_scale))

    async def _gather(self, coros: Sequence[Awaitable[Outcome]]) -> list[Outcome]:
        return list(await asyncio.gather(*coros))

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.system.url, timeout=DEADLINE_S, trust_env=False,
                                 limits=httpx.Limits(max_connections=2000, max_keepalive_connections=200))

    def run(self, name: str, scenario: Callable[[ScenarioResult], Coroutine[Any, Any, None]]
            ) -> ScenarioResult:
        """Run one scenario, then restore the system (dead children started again) and count leaks."""
        res, t0 = ScenarioResult(name), time.monotonic()
        url = self.system.url
        retried, migrated = counter(url, "pdserve_request_retries_total"), counter(
            url, "pdserve_request_migrations_total")
        try:
            asyncio.run(scenario(res))
        finally:
            for child, _code in self.system.sup.dead():
                self.system.restart(child)
            wait_registered(self.system)
        now_retried = counter(url, "pdserve_request_retries_total")
        now_migrated = counter(url, "pdserve_request_migrations_total")
        restarted = now_retried < retried or now_migrated < migrated  # a new gateway counts from 0
        res.retried = now_retried if restarted else now_retried - retried
        res.migrated = now_migrated if restarted else now_migrated - migrated
        used = wait_all_free(url, self.system.worker_ids, timeout=30.0)
        res.leaked_blocks = sum(used.values())
        res.seconds = time.monotonic() - t0
        return res

    # ---- scenarios ---------------------------------------------------------------------------------
    async def kill_decode_mid_stream(self, res: ScenarioResult) -> None:
        """Greedy and seeded sampled streams on both decode workers; ``kill -9`` decode-0 once tokens flow.
        Every stream must complete with the text of an unbroken run of the same request (taken first, on
        the same system): a migrated seeded stream continues its seed's draws."""
        ps = prompts(4 * self.scale, 40, salt=1)
        samplings = [None if i % 3 else {"temperature": 0.9, "seed": 11 + i} for i in range(len(ps))]
        async with self._client() as c:
            reference = await self._gather([stream(c, p, max_tokens=self._tokens(48), sampling=sp)
                                            for p, sp in zip(ps, samplings, strict=True)])
            outs = [Outcome() for _ in ps]
            tasks = [asyncio.create_task(stream(c, p, max_tokens=self._tokens(48), out=o, sampling=sp))
                     for p, o, sp in zip(ps, outs, samplings, strict=True)]
            await until(lambda: all(o.tokens >= 2 or o.status not in (None, 200) for o in outs))
            kill9(self.system, "decode-0")
            await self._gather(tasks)
        res.add(outs)
        differ = [i for i, (a, b) in enumerate(zip(reference, outs, strict=True))
                  if b.completed and a.text != b.text]
        if differ:
            res.notes.append(f"text differs from the unbroken run for prompts {differ}")

    async def kill_prefill_mid_transfer(self, res: ScenarioResult) -> None:
        """Long prompts queued on the prefill workers; ``kill -9`` of the prefill worker holding the most
        of them (``/v1/status``) while they run: its requests are retried on the other one."""
        async with self._client() as c:
            outs = [Outcome() for _ in range(6 * self.scale)]
            tasks = [asyncio.create_task(stream(c, p, max_tokens=self._tokens(MAX_TOKENS), out=o))
                     for p, o in zip(prompts(len(outs), 300, salt=2), outs, strict=True)]
            await asyncio.sleep(0.5)
            status = (await c.get("/v1/status")).json()
            busiest = max((w for w in status["workers"] if w["role"] == "prefill"),
                          key=lambda w: (w["requests"], w["num_waiting"] + w["num_running"]))
            kill9(self.system, busiest["worker_id"].removeprefix("live-"))
            await self._gather(tasks)
        res.add(outs)

    async def same_address_replacement(self, res: ScenarioResult) -> None:
        """``kill -9`` decode-1 and start it again at once (same worker id and flags, a new epoch); once it
        has registered, requests served by it succeed."""
        kill9(self.system, "decode-1")
        self.system.restart("decode-1")
        await asyncio.to_thread(wait_registered, self.system)
        async with self._client() as c:
            res.add(await self._gather([stream(c, p, max_tokens=self._tokens(MAX_TOKENS))
                                        for p in prompts(4 * self.scale, 30, salt=3)]))

    async def gateway_restart(self, res: ScenarioResult) -> None:
        """``kill -9`` the gateway mid-stream and start it again on the same ports: the cut streams are
        lost, the workers register again and free the old gateway's blocks, new requests succeed."""
        async with self._client() as c:
            cut = [Outcome() for _ in range(4 * self.scale)]
            tasks = [asyncio.create_task(stream(c, p, max_tokens=self._tokens(64), out=o))
                     for p, o in zip(prompts(len(cut), 60, 4), cut, strict=True)]
            await until(lambda: any(o.tokens >= 2 for o in cut))
            kill9(self.system, "gateway")
            await self._gather(tasks)
        self.system.restart("gateway")
        await asyncio.to_thread(wait_registered, self.system)
        res.add(cut)
        async with self._client() as c:
            res.add(await self._gather([stream(c, p, max_tokens=self._tokens(MAX_TOKENS))
                                        for p in prompts(4 * self.scale, 30, salt=5)]))

    async def burst_above_capacity(self, res: ScenarioResult) -> None:
        """Far more concurrent long prompts than the prefill workers can start within the gateway's
        admission budget: each completes or gets a 429 with Retry-After, none waits past its deadline."""
        async with self._client() as c:
            res.add(await self._gather([stream(c, p, max_tokens=self._tokens(MAX_TOKENS))
                                        for p in prompts(16 * self.scale, 300, salt=6)]))

    async def decode_blocks_exhausted(self, res: ScenarioResult) -> None:
        """Requests whose KV cannot all fit in the decode workers' blocks at once (long prompts, long
        outputs): the ones that cannot start get a 429 with Retry-After at once, the rest complete."""
        async with self._client() as c:
            res.add(await self._gather([stream(c, p, max_tokens=self._tokens(60)) for p in
                                        prompts(10 * self.scale, 400, salt=7)]))

    async def client_aborts(self, res: ScenarioResult) -> None:
        """Clients that leave: ``aborts`` × ``scale`` streams (1000 × ``scale`` by default) closed at once
        (``LEAVE_S`` after sending: mostly while their prefill runs) or after one or two tokens, in turn,
        in waves of 100."""
        n = self.aborts * self.scale
        async with self._client() as c:
            for start in range(0, n, 100):
                wave = [stream(c, p, max_tokens=4, abort_after_tokens=(start + i) % 3)
                        for i, p in enumerate(prompts(min(100, n - start), 8, salt=start))]
                for o in await self._gather(wave):
                    res.sent += 1
                    res.bad_200 += o.bad_200
                    res.past_deadline += o.timed_out
                    key = str(o.status)
                    res.statuses[key] = res.statuses.get(key, 0) + 1


SCENARIOS = ("kill_decode_mid_stream", "kill_prefill_mid_transfer", "same_address_replacement",
             "gateway_restart", "burst_above_capacity", "decode_blocks_exhausted", "client_aborts")


def chaos_spec(logs: Path, transfer_backend: str = "nixl") -> SystemSpec:
    """The system every scenario runs on: two prefill and two decode workers on the CPU, 96 KV blocks of
    16 tokens per worker, a 2 s heartbeat timeout."""
    return SystemSpec("disagg", logs, num_blocks=96, transfer_backend=transfer_backend,
                      heartbeat_timeout_s=2.0, num_prefill=2, num_decode=2, devices=("cpu", "cpu"),
                      gateway_flags=("--request-timeout", "180"))


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios (all, or ``--scenarios``), print one row each, write ``--json``; returns 1 when a
    rule is broken (a bad 200, a request past its deadline, a leaked block), else 0."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=positive_int, default=4, help="multiplies every scenario's request count")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/pdserve-chaos"))
    p.add_argument("--transfer-backend", default="nixl", choices=("nixl", "ucx"))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    results = []
    with live_systems([chaos_spec(args.work_dir / "logs", args.transfer_backend)]) as (system,):
        chaos = Chaos(system, args.scale)
        for name in args.scenarios:
            res = chaos.run(name, getattr(chaos, name))
            results.append(res)
            print(f"{name:26s} sent {res.sent:5d} completed {res.completed:5d} honest errors "
                  f"{res.honest_errors:4d} bad 200 {res.bad_200} past deadline {res.past_deadline} "
                  f"connection lost {res.connection_lost} retried {res.retried:g} migrated {res.migrated:g} "
                  f"leaked blocks {res.leaked_blocks:g} statuses {res.statuses} "
                  f"slowest error status {res.max_status_after_s:.2f} s ({res.seconds:.0f} s) {res.notes}",
                  flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    broken = [r.name for r in results if r.bad_200 or r.past_deadline or r.leaked_blocks or r.notes]
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
