"""One pdserve system per test session, as real processes on 127.0.0.1 (the embedded SmolLM2, NIXL).

* gateway ``disagg`` (``--disagg-threshold 0``): one prefill and one decode worker, KV over NIXL;
* gateway ``colo``: one colocated worker — the baseline. Two gateways route each test request
  deterministically (disaggregated vs colocated) without a routing override inside the gateway.
The start-up code is shared with the conformance suite (``tests/live_system.py``). Worker logs (decode at
debug level, so its received messages are visible) live in a session tmp dir.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.live_system import System, start_system

__all__ = ["System"]


@pytest.fixture(scope="session")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    """Start both gateways and the three workers; stop them all at the end of the session."""
    with start_system(tmp_path_factory.mktemp("system_logs")) as sys_:
        yield sys_
