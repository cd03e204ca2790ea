"""Fixtures: one fake OpenAI-compatible server per test module, its state reset for every test."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.loadtest.fake_server import FakeState, serve


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, FakeState]]:
    state = FakeState()
    with serve(state) as url:
        yield url, state


@pytest.fixture
def fake(fake_server: tuple[str, FakeState]) -> Iterator[tuple[str, FakeState]]:
    url, state = fake_server
    state.reset()
    yield url, state
    # leak check: every request the fake served has given its KV blocks back (except planned leaks)
    # (a request the client abandoned is freed when the server notices the disconnect: allow 2 s)
    if "leak" not in state.plan:
        deadline = time.monotonic() + 2.0
        while sum(state.kv_used.values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sum(state.kv_used.values()) == 0, state.kv_used
