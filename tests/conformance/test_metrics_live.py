"""``/metrics`` of both live gateways after a known workload matches the workload exactly: request counts
by endpoint and status, prompt/generation token counters equal to the sums of the responses' usage
fields, routed choices by kind, one TTFT and one E2E observation per finished choice — then every KV
block is free. Counters are compared as deltas around the workload (the system is shared by the
session); the middleware counts a request once its response has ended, so the check polls briefly."""

from __future__ import annotations

import time
from collections import Counter

import openai
import pytest

from pdserve.live_system import MODEL, SystemPair, metric_samples
from tests.conformance.helpers import MESSAGES, call, client, leak_check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
Key = tuple[str, tuple[tuple[str, str], ...]]


def counters(url: str) -> Counter[Key]:
    """The counters and histogram counts this test checks, from the gateway's /metrics."""
    names = ("pdserve_requests_total", "pdserve_prompt_tokens_total", "pdserve_generation_tokens_total",
             "pdserve_routed_requests_total", "pdserve_ttft_seconds_count", "pdserve_e2e_seconds_count")
    out: Counter[Key] = Counter()
    for (name, labels), value in metric_samples(url).items():
        if name in names and dict(labels).get("endpoint") not in ("/metrics", "/ready", "/health"):
            out[(name, labels)] = int(value)
    return out


def req(endpoint: str, status: int) -> Key:
    return ("pdserve_requests_total", (("endpoint", endpoint), ("status", str(status))))


def run_workload(live: SystemPair, url: str) -> tuple[int, int, int, int]:
    """A fixed mix of requests; returns (prompt tokens, completion tokens, choices with max_tokens 1,
    other choices) summed over the responses."""
    c = client(url, live.api_key)
    outs = [
        call(c, "chat", False, max_tokens=3, temperature=0),
        call(c, "chat", True, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}),
        call(c, "completions", False, prompt=["Hello there", "The sky is"], n=2, seed=1, max_tokens=3),
        call(c, "completions", True, prompt="Once upon a time", max_tokens=5, temperature=0),
    ]
    single = call(c, "completions", False, prompt="One token:", max_tokens=1, temperature=0)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-9", prompt="x")
    usages = [o.usage for o in [*outs, single]]
    assert all(u is not None for u in usages)
    prompt = sum(u[0] for u in usages if u is not None)
    completion = sum(u[1] for u in usages if u is not None)
    return prompt, completion, 1, sum(len(o.choices) for o in outs)


def expected(prompt: int, completion: int, n_single: int, n_multi: int, kind: str) -> Counter[Key]:
    routed = {"prefill_only": n_single, "disaggregated": n_multi} if kind == "disaggregated" else \
        {"colocated": n_single + n_multi}
    want: Counter[Key] = Counter({req("/v1/chat/completions", 200): 2, req("/v1/completions", 200): 3,
                                  req("/v1/chat/completions", 400): 1, req("/v1/completions", 404): 1,
                                  ("pdserve_prompt_tokens_total", ()): prompt,
                                  ("pdserve_generation_tokens_total", ()): completion,
                                  ("pdserve_ttft_seconds_count", ()): n_single + n_multi,
                                  ("pdserve_e2e_seconds_count", ()): n_single + n_multi})
    for k, v in routed.items():
        want[("pdserve_routed_requests_total", (("kind", k),))] = v
    return want


@pytest.mark.parametrize("kind", ["disaggregated", "colocated"])
def test_metrics_match_workload(live: SystemPair, kind: str) -> None:
    url = live.disagg_url if kind == "disaggregated" else live.colo_url
    before = counters(url)
    prompt, completion, n_single, n_multi = run_workload(live, url)
    assert n_multi == 1 + 1 + 4 + 1 and completion > 0
    want = expected(prompt, completion, n_single, n_multi, kind)
    deadline = time.monotonic() + 5
    while (got := counters(url) - before) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    assert got == want
    leak_check(live)
