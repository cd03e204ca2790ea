"""Shared pytest set-up. Where each layer of tests lives, and how to add a suite: ``tests/README.md``.

* On a machine without CUDA, Triton kernels run through Triton's interpreter: ``TRITON_INTERPRET=1`` must
  be set before ``triton`` is first imported, so it is set here, at collection start.
* ``live``: the live system shared by the system-level suites (``tests/live.py``), started once per
  session; after each module that used it, a leak check (every KV block free, nothing in flight, no
  child dead but those a test killed on purpose).
* Every test that uses the live system joins one pytest-xdist group (``--dist loadgroup``: one worker runs
  them all, so one process starts the system), and a test marked ``kills_live_child`` runs after every
  other test that uses it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pdserve.live_system import SystemPair


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    from tests.live import XDIST_GROUP

    for item in items:
        if "live_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group(XDIST_GROUP))
    items.sort(key=lambda item: item.get_closest_marker("kills_live_child") is not None)  # stable


KILLED_ON_PURPOSE = pytest.StashKey[bool]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("kills_live_child") is not None:
        item.config.stash[KILLED_ON_PURPOSE] = True


@pytest.fixture(scope="session")
def live_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemPair]:
    """The shared live system, started at its first use and stopped at the end of the session."""
    from tests.live import start_live

    with start_live(tmp_path_factory.mktemp("live_logs")) as pair:
        yield pair


@pytest.fixture(scope="module")
def live(live_session: SystemPair, request: pytest.FixtureRequest) -> Iterator[SystemPair]:
    """The shared live system (``tests/live.py``). After the module: no child died (but workers, once a
    ``kills_live_child`` test has run), every worker still running holds no KV block and no request is in
    flight on either gateway (polled with a deadline: heartbeats lag). Raises AssertionError."""
    from pdserve.live_system import wait_all_free, worker_id

    yield live_session
    killed = request.config.stash.get(KILLED_ON_PURPOSE, False)
    for system in (live_session.disagg, live_session.colo):
        dead = {name for name, _ in system.sup.dead()}
        assert not dead or (killed and "gateway" not in dead), f"{dead} died; logs in {system.logs}"
        wait_all_free(system.url, system.worker_ids - {worker_id(name) for name in dead})
