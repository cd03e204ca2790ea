"""Shared fixtures of the kvtransfer tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.kvtransfer.helpers import endpoint_pair


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Any, ...]]:
    """(sender, receiver, src, dst) over the module's PAIR_BACKEND ("loopback" if unset), src random from
    its PAIR_SEED (default 1), closed after the test. A module defining its own `pair` overrides this."""
    backend = getattr(request.module, "PAIR_BACKEND", "loopback")
    with endpoint_pair(backend, getattr(request.module, "PAIR_SEED", 1)) as p:
        yield p
