"""``--gateway-control`` as a list of gateways: parsing (a one-line error naming the flag for a bad entry),
DNS names resolved to every address and resolved again (the resolver injected), and the flag's checks."""

from __future__ import annotations

import socket

import pytest

from pdserve.cli import main
from protocol.endpoints import parse_endpoints
from protocol.settings import WorkerSettings
from workers.gateway_links import GatewayLinks, resolve_host


def test_a_list_keeps_its_order_and_tells_names_from_addresses() -> None:
    eps = parse_endpoints(" tcp://gw-a.example:7100,tcp://10.0.0.2:7101 ,tcp://[::1]:7102,ipc:///tmp/gw.sock",
                          "gateway-control")
    assert [e.raw for e in eps] == ["tcp://gw-a.example:7100", "tcp://10.0.0.2:7101", "tcp://[::1]:7102",
                                    "ipc:///tmp/gw.sock"]
    assert [e.is_name for e in eps] == [True, False, False, False]
    assert [(e.host, e.port) for e in eps[:3]] == [("gw-a.example", 7100), ("10.0.0.2", 7101), ("::1", 7102)]
    assert eps[0].with_address("10.1.2.3") == "tcp://10.1.2.3:7100"
    assert eps[0].with_address("fd00::7") == "tcp://[fd00::7]:7100"


@pytest.mark.parametrize(("value", "says"), [
    ("", "empty entry"),
    ("tcp://h1:7100,", "empty entry"),
    ("tcp://h1:7100,,tcp://h2:7100", "empty entry"),
    ("http://h1:7100", "not a zmq endpoint"),
    ("h1:7100", "not a zmq endpoint"),
    ("tcp://h1", "needs a host and a port"),
    ("tcp://:7100", "needs a host and a port"),
    ("tcp://*:7100", "needs a host and a port"),
    ("tcp://h1:0", "port must be in [1, 65535]"),
    ("tcp://h1:70000", "port must be in [1, 65535]"),
    ("tcp://h1:http", "port must be in [1, 65535]"),
    ("tcp://::1:7100", "IPv6 address in brackets"),
    ("tcp://[gw]:7100", "not an IPv6 address"),
    ("tcp://h1:7100,tcp://h1:7100", "given twice"),
])
def test_a_bad_entry_is_refused_naming_the_flag(value: str, says: str) -> None:
    with pytest.raises(ValueError, match=r"^--gateway-control: ") as err:
        WorkerSettings(role="decode", gateway_control=value, insecure_control_plane=True)
    assert says in str(err.value)


@pytest.mark.parametrize("interval", [0.0, -1.0, 3601.0, float("inf")])
def test_the_resolve_interval_is_checked(interval: float) -> None:
    with pytest.raises(ValueError, match=r"^--gateway-resolve-interval: must be in \(0, 3600\]"):
        WorkerSettings(role="decode", gateway_resolve_interval=interval, insecure_control_plane=True)


def test_the_cli_says_a_bad_list_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["decode", "--insecure-control-plane", "--gateway-control", "tcp://h1:7100,tcp://h2"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.splitlines() == [err]
    assert err.startswith("pdserve decode: --gateway-control: 'tcp://h2' needs a host and a port")
    assert main(["decode", "--insecure-control-plane", "--gateway-resolve-interval", "0s"]) == 2
    assert "--gateway-resolve-interval" in capsys.readouterr().err


class FakeDNS:
    """A resolver: host → addresses, or an error to raise; records every lookup."""

    def __init__(self, answers: dict[str, list[str] | OSError]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    def __call__(self, host: str) -> list[str]:
        self.asked.append(host)
        answer = self.answers[host]
        if isinstance(answer, OSError):
            raise answer
        return list(answer)


def test_a_name_stands_for_each_of_its_addresses_and_is_resolved_again() -> None:
    dns = FakeDNS({"gw.svc": ["10.0.0.1", "10.0.0.2"]})
    links = GatewayLinks("tcp://gw.svc:7100,tcp://10.9.9.9:7200", None, resolve=dns)
    try:
        assert list(links.links) == ["tcp://10.0.0.1:7100", "tcp://10.0.0.2:7100", "tcp://10.9.9.9:7200"]
        assert links.has_names and links.default_key == "tcp://10.0.0.1:7100"
        assert dns.asked == ["gw.svc"]  # the address literal is never looked up

        dns.answers["gw.svc"] = ["10.0.0.2", "10.0.0.3"]  # one pod gone, one new
        first = links.links["tcp://10.0.0.2:7100"]
        added, removed = links.refresh(links.lookup())
        assert [link.key for link in added] == ["tcp://10.0.0.3:7100"]
        assert [link.key for link in removed] == ["tcp://10.0.0.1:7100"]
        assert links.links["tcp://10.0.0.2:7100"] is first  # a kept address keeps its connection
        for link in removed:
            links.close_link(link)

        dns.answers["gw.svc"] = socket.gaierror(socket.EAI_AGAIN, "temporary failure")
        assert links.refresh(links.lookup()) == ([], [])  # a failure for now keeps the last answer
        dns.answers["gw.svc"] = socket.gaierror(socket.EAI_NONAME, "no such name")
        added, removed = links.refresh(links.lookup())  # no gateway pod ready: none of the name's left
        assert added == [] and sorted(link.key for link in removed) == ["tcp://10.0.0.2:7100",
                                                                       "tcp://10.0.0.3:7100"]
        for link in removed:
            links.close_link(link)
        assert list(links.links) == ["tcp://10.9.9.9:7200"]
    finally:
        links.close()


def test_a_single_address_needs_no_resolver() -> None:
    def refuse(host: str) -> list[str]:
        raise AssertionError(f"looked up {host}")

    links = GatewayLinks("tcp://127.0.0.1:7100", None, resolve=refuse)
    try:
        assert list(links.links) == ["tcp://127.0.0.1:7100"] and not links.has_names
        assert links.refresh(links.lookup()) == ([], [])
    finally:
        links.close()


def test_the_system_resolver_gives_every_address_ipv4_first() -> None:
    assert "127.0.0.1" in resolve_host("localhost")
    with pytest.raises(socket.gaierror):
        resolve_host("no-such-host.invalid")
