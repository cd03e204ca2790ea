"""A burst of concurrent streaming requests against one prefill and one decode worker: does every request
complete, or get a 429 at once?

Starts a disaggregated system of the embedded model (``pdserve.live_system``, KV over ``--transfer-backend``)
unless ``--base-url`` names a running one, sends ``--waves`` waves of ``--concurrency`` streaming
``/v1/completions`` requests at once (prompts of ``--prompt-tokens`` random token ids, ``--max-tokens``
each), and prints per wave: how many completed (200 and ``[DONE]`` with no error event), got a 429 (and
how long after sending: the status line's arrival), or failed otherwise (status or error event, with the
messages), plus the admission refusals by reason from ``/metrics``. Exit 0 when every request completed
or got a 429 within ``--max-429-s`` seconds, else 1.

    python scripts/overload_burst.py --concurrency 48 --prompt-tokens 300 --logs /tmp/burst
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass(frozen=True)
class Outcome:
    """One request: ``kind`` completed | 429 | failed; ``status_s``: seconds from sending to the status
    line; ``total_s``: to the end of the stream; ``detail``: the error text of a failure; ``ttft_s``: to
    the first token's event."""

    kind: str
    status_s: float
    total_s: float
    detail: str = ""
    ttft_s: float | None = None


async def one(http: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> Outcome:
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    start = time.monotonic()
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
            status_s = time.monotonic() - start
            if resp.status_code == 429:
                await resp.aread()
                return Outcome("429", status_s, time.monotonic() - start)
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return Outcome("failed", status_s, time.monotonic() - start,
                               f"{resp.status_code} {text[:200]}")
            done, error, ttft = False, "", None
            async for line in resp.aiter_lines():
                if ttft is None and line.startswith("data: {") and '"choices"' in line:
                    ttft = time.monotonic() - start
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: ") and '"error"' in line:
                    error = json.loads(line[6:]).get("error", {}).get("message", line)
            kind = "completed" if done and not error else "failed"
            return Outcome(kind, status_s, time.monotonic() - start, error or ("" if done else "no [DONE]"),
                           ttft)
    except httpx.HTTPError as exc:
        return Outcome("failed", time.monotonic() - start, time.monotonic() - start, repr(exc))


async def wave(url: str, concurrency: int, prompt_tokens: int, max_tokens: int, seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(prompt_tokens)] for _ in range(concurrency)]
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=900, limits=limits, trust_env=False) as http:
        return list(await asyncio.gather(*(one(http, url, p, max_tokens) for p in prompts)))


def refusals(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    out = {}
    for line in text.splitlines():
        if line.startswith("pdserve_admission_refused_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


@contextlib.contextmanager
def system(args: argparse.Namespace) -> Iterator[str]:
    if args.base_url:
        yield args.base_url
        return
    from pdserve.live_system import live_system

    flags = ["--admission-budget", args.admission_budget] if args.admission_budget else []
    with live_system("disagg", Path(args.logs), num_blocks=args.num_blocks, gateway_flags=flags,
                     transfer_backend=args.transfer_backend, devices=["cpu", "cpu"],
                     ready_timeout_s=600) as live:
        yield live.url


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="a running server (default: start one)")
    p.add_argument("--logs", default="/tmp/pdserve-burst", help="children's logs (a started system)")
    p.add_argument("--num-blocks", type=int, default=1310,
                   help="KV blocks per worker (1310: what `pdserve up` gives the embedded model on a CPU)")
    p.add_argument("--transfer-backend", default="nixl")
    p.add_argument("--admission-budget", default=None, help="the gateway's --admission-budget")
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--waves", type=int, default=1)
    p.add_argument("--max-429-s", type=float, default=1.0)
    args = p.parse_args()
    ok = True
    with system(args) as url:
        for i in range(args.waves):
            start = time.monotonic()
            outs = asyncio.run(wave(url, args.concurrency, args.prompt_tokens, args.max_tokens, seed=i))
            kinds = Counter(o.kind for o in outs)
            late = [o.status_s for o in outs if o.kind == "429"]
            done = sorted(o.total_s for o in outs if o.kind == "completed")
            ttft = sorted(o.ttft_s for o in outs if o.kind == "completed" and o.ttft_s is not None)
            print(f"wave {i + 1}: {dict(kinds)} of {len(outs)} in {time.monotonic() - start:.1f} s; "
                  f"429 after max {max(late, default=0):.3f} s; completed in "
                  f"{done[0] if done else 0:.1f}..{done[-1] if done else 0:.1f} s, first token after "
                  f"{ttft[0] if ttft else 0:.1f}..{ttft[-1] if ttft else 0:.1f} s", flush=True)
            for detail, n in Counter(o.detail for o in outs if o.kind == "failed").most_common(5):
                print(f"  failed x{n}: {detail}")
            ok &= kinds["failed"] == 0 and all(s <= args.max_429_s for s in late)
        print(f"admission refusals: {refusals(url)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
