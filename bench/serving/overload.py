"""A burst of concurrent streaming requests against one prefill and one decode worker (CPU, the embedded
model): does every request complete, or get a 429 with Retry-After at once?

Starts a disaggregated system (``pdserve.live_system``: one prefill, one decode worker, KV over NIXL,
``--num-blocks`` per worker) unless ``--base-url`` names a running one, then sends ``--waves`` waves of
``--concurrency`` streaming ``/v1/completions`` requests at once (token-id prompts of ``--prompt-tokens``,
``--max-tokens`` each; ``bench.serving.chaos.stream``). Per wave it prints how many completed, got a
429 (and the slowest 429's status line, seconds after sending), failed any other way (with the reasons),
and the completed requests' time to first token; then the gateway's admission refusals by reason. The
first wave is judged against the prefill rate the prefill worker measured at start-up (its probe), later
waves against the rate it measured over the earlier ones (``gateway/admission.py``).

    python -m bench.serving.overload --concurrency 48 --prompt-tokens 300 --waves 2

Exit 0 when every request completed or got a 429 within ``--max-429-s`` seconds, else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.argtypes import positive_float, positive_int
from bench.serving.chaos import Outcome, prompts, stream
from pdserve.live_system import live_system, metric_samples


async def wave(url: str, concurrency: int, prompt_tokens: int, max_tokens: int, salt: int) -> list[Outcome]:
    """``concurrency`` streaming requests sent at once; their outcomes in sending order."""
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits, trust_env=False) as client:
        return list(await asyncio.gather(*(stream(client, p, max_tokens, deadline_s=900)
                                           for p in prompts(concurrency, prompt_tokens, salt))))


@contextlib.contextmanager
def system(args: argparse.Namespace) -> Iterator[str]:
    """The URL of ``--base-url``, or of a system started for the run (stopped on exit)."""
    if args.base_url:
        yield args.base_url
        return
    flags = ("--admission-budget", args.admission_budget) if args.admission_budget else ()
    with live_system("disagg", Path(args.logs), num_blocks=args.num_blocks, gateway_flags=flags,
                     devices=["cpu", "cpu"], ready_timeout_s=600) as live:
        yield live.url


def main(argv: list[str] | None = None) -> int:
    """Run the waves (module docstring); returns 0 or 1 (a request neither completed nor got a timely 429).
    Bad arguments: argparse's error, ``SystemExit(2)``, before anything starts."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="a running server (default: start one)")
    p.add_argument("--logs", default="/tmp/pdserve-overload", help="children's logs (a started system)")
    p.add_argument("--num-blocks", type=positive_int, default=1310,
                   help="KV blocks per worker (1310: what `pdserve up` gives the embedded model on a CPU)")
    p.add_argument("--admission-budget", default=None, help="the gateway's --admission-budget")
    p.add_argument("--concurrency", type=positive_int, default=48)
    p.add_argument("--prompt-tokens", type=positive_int, default=300)
    p.add_argument("--max-tokens", type=positive_int, default=16)
    p.add_argument("--waves", type=positive_int, default=1)
    p.add_argument("--max-429-s", type=positive_float, default=1.0)
    args = p.parse_args(argv)
    ok = True
    with system(args) as url:
        for i in range(args.waves):
            start = time.monotonic()
            outs = asyncio.run(wave(url, args.concurrency, args.prompt_tokens, args.max_tokens, salt=i))
            refused = [o.status_after_s for o in outs if o.status == 429 and o.retry_after]
            completed = [o for o in outs if o.completed]
            failed = [o for o in outs if not o.completed and not (o.status == 429 and o.retry_after)]
            ttft = sorted(o.ttft_s for o in completed if o.ttft_s is not None)
            print(f"wave {i + 1}: {len(completed)} completed, {len(refused)} got 429 (slowest after "
                  f"{max(refused, default=0):.3f} s), {len(failed)} failed, of {len(outs)} in "
                  f"{time.monotonic() - start:.1f} s; first token after "
                  f"{ttft[0] if ttft else 0:.1f}..{ttft[-1] if ttft else 0:.1f} s", flush=True)
            for detail, n in Counter(f"{o.status} {o.error}" for o in failed).most_common(5):
                print(f"  failed x{n}: {detail}")
            ok &= not failed and all(s <= args.max_429_s for s in refused)
        refusals = {dict(labels)["reason"]: v for (name, labels), v in metric_samples(url).items()
                    if name == "pdserve_admission_refused_total"}
        print(f"admission refusals: {refusals}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
