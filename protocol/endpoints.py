"""Lists of zmq endpoints given on the command line (a worker's ``--gateway-control``).

``parse_endpoints("tcp://gw-a:7100,tcp://10.0.0.7:7100")`` → ``(ZmqEndpoint, ...)``, one per entry, in
order; ``ipc://`` and ``inproc://`` entries are kept as given (no host to resolve). A ``tcp://`` entry's
host may be an IPv4/IPv6 literal (``tcp://[::1]:7100``) or a DNS name, which the worker resolves to
all of its addresses (workers/gateway_links.py), each address one gateway.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True)
class ZmqEndpoint:
    """One entry of an endpoint list. ``host``/``port`` are set for ``tcp://`` only (``host`` without
    brackets); ``raw`` is the entry as written."""

    raw: str
    scheme: str
    host: str = ""
    port: int = 0

    @property
    def is_name(self) -> bool:
        """A ``tcp://`` entry whose host is a DNS name (to be resolved), not an address literal."""
        return self.scheme == "tcp" and not is_ip_literal(self.host)

    def with_address(self, address: str) -> str:
        """The ``tcp://`` endpoint of this entry's port at ``address`` (an IP literal; IPv6 bracketed)."""
        host = f"[{address}]" if ":" in address else address
        return f"tcp://{host}:{self.port}"

    def with_port(self, port: int) -> str:
        """The ``tcp://`` endpoint at this entry's host and ``port`` (IPv6 bracketed).

        Raises:
            ValueError: not a ``tcp://`` entry, or ``port`` not in [1, 65535].
        """
        if self.scheme != "tcp" or not 0 < port < 65536:
            raise ValueError(f"no tcp endpoint at port {port} for {self.raw!r}")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{port}"


def is_ip_literal(host: str) -> bool:
    """True when ``host`` is an IPv4 or IPv6 address (not a DNS name)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def parse_endpoint(entry: str, flag: str) -> ZmqEndpoint:
    """One ``tcp://host:port`` / ``ipc://path`` / ``inproc://name`` entry.

    Raises:
        ValueError: not such an endpoint; the message starts with ``--{flag}:`` and quotes the entry.
    """
    scheme, sep, rest = entry.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
        raise ValueError(f"--{flag}: {entry!r} is not a zmq endpoint like tcp://host:port")
    if scheme != "tcp":
        return ZmqEndpoint(entry, scheme)
    host, colon, port_text = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not is_ip_literal(host):
            raise ValueError(f"--{flag}: {entry!r}: {host!r} in brackets is not an IPv6 address")
    elif ":" in host:
        raise ValueError(f"--{flag}: {entry!r}: write an IPv6 address in brackets, tcp://[addr]:port")
    if not colon or not host or host == "*" or "/" in host:
        raise ValueError(f"--{flag}: {entry!r} needs a host and a port, like tcp://host:port")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"--{flag}: {entry!r}: port must be in [1, 65535], got {port_text!r}")
    return ZmqEndpoint(entry, scheme, host, int(port_text))


def parse_endpoints(value: str, flag: str) -> tuple[ZmqEndpoint, ...]:
    """A comma-separated list of endpoints (spaces around entries ignored), in order.

    Raises:
        ValueError: an empty list or entry, a bad entry, or one given twice (the message names ``--flag``).
    """
    entries = [e.strip() for e in value.split(",")]
    if not value.strip() or any(not e for e in entries):
        raise ValueError(f"--{flag}: empty entry in {value!r} (a comma-separated list of zmq endpoints)")
    parsed = tuple(parse_endpoint(e, flag) for e in entries)
    seen: set[str] = set()
    for ep in parsed:
        if ep.raw in seen:
            raise ValueError(f"--{flag}: {ep.raw!r} is given twice")
        seen.add(ep.raw)
    return parsed
