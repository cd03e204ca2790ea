"""Shared pieces of the ported peer suites: a client for each live gateway and ``refused``, which
asserts a request gets pdserve's documented 400 (the OpenAI error body, ``error.param`` naming the
field) instead of being accepted and ignored."""

from __future__ import annotations

from collections.abc import Callable
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
