"""pdserve.ports: listening ports are drawn below the kernel's ephemeral range, where no outgoing
connection takes them between the choice and the child's bind; distinct and bindable; the kernel's own
choice where that range is too small."""

from __future__ import annotations

import socket

import pytest

import pdserve.ports as ports


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_ports_come_from_below_the_ephemeral_range_distinct_and_free() -> None:
    start = ports.ephemeral_start()
    if start is None or start - ports.PORT_FLOOR < ports.MIN_SPAN:
        pytest.fail(f"this test expects a Linux ephemeral range above {ports.PORT_FLOOR + ports.MIN_SPAN}, "
                    f"got a start of {start}")
    chosen = ports.free_ports(40)
    assert len(set(chosen)) == 40
    assert all(ports.PORT_FLOOR <= p < start for p in chosen)
    assert all(_bindable(p) for p in chosen)
    assert ports.PORT_FLOOR <= ports.free_port() < start


def test_a_taken_port_is_not_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two candidate ports, a listener on the first: the second is returned."""
    first = ports.free_port_range(2)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", first))
        taken.listen()
        monkeypatch.setattr(ports, "PORT_FLOOR", first)
        monkeypatch.setattr(ports, "MIN_SPAN", 2)
        monkeypatch.setattr(ports, "ephemeral_start", lambda: first + 2)
        assert ports.free_ports(1) == [first + 1]


def test_the_kernel_chooses_where_the_range_below_is_too_small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_start", lambda: ports.PORT_FLOOR + 10)
    chosen = ports.free_ports(3, exclude=(1,))
    assert len(set(chosen)) == 3 and all(p >= 1024 and _bindable(p) for p in chosen)
