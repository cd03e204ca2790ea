"""TTFT and TPOT of the embedded SmolLM2 through ``pdserve up`` (gateway + 1 prefill + 1 decode).

Run: ``.venv/bin/python -m bench.serving.pipeline [--requests 16] [--concurrency 1,4] [--max-tokens 32]
[--out /tmp/pdserve-bench/pipeline-cpu.md]``. Starts ``pdserve up`` on a free port, streams completions
(greedy, ``ignore_eos`` so every request makes ``--max-tokens`` tokens), measures per request
TTFT (send → first token, seconds) and TPOT (mean gap between later tokens, seconds), writes a Markdown
report with the command, machine and date, and stops the system with SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.argtypes import positive_int, positive_int_list
from pdserve.ports import free_port

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 2


async def one(client: httpx.AsyncClient, max_tokens: int) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds of one streamed completion."""
    body = {"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    start, times = time.perf_counter(), []
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            data = line[6:] if line.startswith("data: ") else "[DONE]"
            if data != "[DONE]" and json.loads(data)["choices"][0]["text"]:
                times.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return times[0] - start, (sum(gaps) / len(gaps) if gaps else 0.0)


async def level(url: str, n: int, concurrency: int, max_tokens: int) -> dict[str, float]:
    """Run ``n`` requests, ``concurrency`` at a time; returns p50/p90 TTFT/TPOT (s) and req/s."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async def guarded() -> tuple[float, float]:
            async with sem:
                return await one(client, max_tokens)
        t0 = time.perf_counter()
        results = await asyncio.gather(*[guarded() for _ in range(n)])
        wall = time.perf_counter() - t0
    ttft, tpot = sorted(r[0] for r in results), sorted(r[1] for r in results)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    return {"ttft_p50": statistics.median(ttft), "ttft_p90": q(ttft, 0.9),
            "tpot_p50": statistics.median(tpot), "tpot_p90": q(tpot, 0.9), "req_s": n / wall}


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    """Poll /ready. Raises RuntimeError when ``pdserve up`` exits or the timeout passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve up exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("pdserve up not ready in time")


def report(args: argparse.Namespace, rows: list[tuple[int, dict[str, float]]]) -> str:
    """The Markdown report."""
    command = " ".join([Path(sys.executable).name, "-m", "bench.serving.pipeline", *sys.argv[1:]])
    lines = ["# Pipeline on CPU: TTFT and TPOT through `pdserve up`", "",
             f"- command: `{command}`",
             f"- machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}, "
             f"Python {platform.python_version()}",
             f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"- system: gateway + 1 prefill + 1 decode (transfer `{args.transfer_backend}`), SmolLM2-135M "
             f"float32 (dtype auto) on CPU; prompt {len(PROMPT)} chars, {args.max_tokens} output tokens "
             f"(ignore_eos), "
             f"{args.requests} requests per row", "",
             "| concurrency | TTFT p50 (s) | TTFT p90 (s) | TPOT p50 (ms) | TPOT p90 (ms) | req/s |",
             "|---:|---:|---:|---:|---:|---:|"]
    for c, r in rows:
        lines.append(f"| {c} | {r['ttft_p50']:.3f} | {r['ttft_p90']:.3f} | {1000 * r['tpot_p50']:.1f} | "
                     f"{1000 * r['tpot_p90']:.1f} | {r['req_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Start the system, measure every concurrency level, write the report."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=positive_int, default=16)
    p.add_argument("--concurrency", type=positive_int_list, default="1,4")
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--transfer-backend", default="nixl", choices=["nixl", "ucx"])
    p.add_argument("--out", default="/tmp/pdserve-bench/pipeline-cpu.md", help="the Markdown report")
    args = p.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), "--transfer-backend",
           args.transfer_backend, "--log-level", "warning"]
    proc = subprocess.Popen(cmd)
    try:
        wait_ready(url, proc)
        asyncio.run(level(url, 2, 1, 4))  # warm-up
        rows = [(c, asyncio.run(level(url, args.requests, c, args.max_tokens)))
                for c in args.concurrency]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    text = report(args, rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
