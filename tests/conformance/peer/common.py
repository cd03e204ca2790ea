"""Shared pieces of the ported peer suites: a client for each live gateway and ``refused``, which
asserts a request gets pdserve's documented 400 (the OpenAI error body, ``error.param`` naming the
field) instead of being accepted and ignored, and ``together``, which sends independent requests at
once."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import openai
import pytest

from pdserve.live_system import SystemPair
from tests.conformance.helpers import client


def disagg(live: SystemPair) -> openai.OpenAI:
    """The official client for the disaggregated gateway (prefill and decode on separate workers)."""
    return client(live.disagg_url, live.api_key)


def colo(live: SystemPair) -> openai.OpenAI:
    """The official client for the colocated gateway."""
    return client(live.colo_url, live.api_key)


def refused(call: Callable[[], Any], param: str | None = None) -> openai.BadRequestError:
    """Run ``call`` (a request, consumed to the end when it streams) and assert a 400 whose
    ``error.param`` contains ``param`` when one is given. Returns the error."""
    with pytest.raises(openai.BadRequestError) as info:
        out = call()
        if isinstance(out, openai.Stream):
            for _ in out:
                pass
    err = info.value
    assert err.status_code == 400
    body = err.body if isinstance(err.body, dict) else {}
    if param is not None:
        assert param in str(body.get("param")), (param, body)
    return err


def together(*calls: Callable[[], Any], timeout: float = 120.0) -> list[Any]:
    """Run independent requests at once (each in its own thread, so the live workers batch them) and
    return their results in the order given; the first exception any raised is re-raised. Every call
    must finish within ``timeout`` s (TimeoutError otherwise)."""
    pool = ThreadPoolExecutor(max_workers=len(calls))
    try:
        futures = [pool.submit(call) for call in calls]
        _, pending = wait(futures, timeout=timeout)
        if pending:
            raise TimeoutError(f"{len(pending)} of {len(calls)} requests not done after {timeout} s")
        return [f.result() for f in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a late request ends by the client's own timeout
