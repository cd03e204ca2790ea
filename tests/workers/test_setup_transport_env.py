"""A worker's UCX network devices follow the address peers reach it at (workers/setup.py)."""

from __future__ import annotations

import psutil
import pytest

from workers.setup import default_transport_env, net_device_of


def test_a_loopback_address_keeps_ucx_on_loopback() -> None:
    assert net_device_of("127.0.0.1") == "lo"
    assert net_device_of("localhost") == "lo"


def test_a_wildcard_or_unknown_address_leaves_ucx_its_choice() -> None:
    assert net_device_of("0.0.0.0") is None
    assert net_device_of("192.0.2.123") is None  # TEST-NET-1: held by no interface here
    assert net_device_of("no-such-host.invalid") is None


def test_an_interface_address_names_that_interface() -> None:
    held = [(name, a.address) for name, addrs in psutil.net_if_addrs().items() for a in addrs
            if a.family.name == "AF_INET" and not a.address.startswith("127.")]
    if not held:
        pytest.skip("no non-loopback IPv4 interface on this machine")
    name, address = held[0]
    assert net_device_of(address) == name


def test_the_env_is_set_only_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_NET_DEVICES", "x")  # recorded, so the end of the test restores the outer value
    monkeypatch.delenv("UCX_NET_DEVICES")
    default_transport_env("127.0.0.1")
    import os

    assert os.environ["UCX_NET_DEVICES"] == "lo"
    monkeypatch.setenv("UCX_NET_DEVICES", "eth9")
    default_transport_env("127.0.0.1")
    assert os.environ["UCX_NET_DEVICES"] == "eth9"  # the operator's choice stands
    monkeypatch.delenv("UCX_NET_DEVICES")
    default_transport_env("0.0.0.0")
    assert "UCX_NET_DEVICES" not in os.environ
