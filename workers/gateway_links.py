"""The gateways a worker serves: one ``GatewayLink`` (a ``ControlClient`` and its registration state) per
gateway address.

``--gateway-control`` is a comma-separated list of zmq endpoints (protocol/endpoints.py). An entry whose
host is a DNS name stands for every address the name resolves to (a Kubernetes headless Service lists one
per gateway pod): IPv4 addresses when it has any, else IPv6. ``GatewayLinks.refresh`` resolves the names
again: an address new to DNS gets a link, a link whose address left DNS is returned to be closed (the worker
treats it as a dead gateway). A lookup that fails for a moment (``EAI_AGAIN``) keeps the entry's previous
addresses; a name that does not resolve (``EAI_NONAME``: no gateway pod ready) has none.

A gateway of several processes (``pdserve gateway --workers N``) names the control ports of the other
processes in its ``RegisterAck`` (``sibling_ports``): ``GatewayLinks.discover`` adds a link for each, on the
host the worker reached the naming process at. A discovered link is kept like a resolved one: while the
address it was discovered through is given (or still resolves), it stays, and a process that dies and comes
back at its address is reconnected to and registered with again; once that address is gone, the next
``refresh`` drops its discovered links as it drops addresses gone from DNS.

A link's key is its resolved endpoint (``tcp://10.0.0.7:7100``): the worker records, per request, the key
of the gateway that sent it (workers/loop.py); workers/gateway_sessions.py runs the worker's sessions
over these links.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq.asyncio

from kvtransfer.curve import CurveKeys, HandshakeWatch
from protocol.endpoints import ZmqEndpoint, parse_endpoint, parse_endpoints
from protocol.logging import log_event
from protocol.messages import Message
from workers.control_client import ControlClient

log = logging.getLogger("pdserve.worker.control")

Resolver = Callable[[str], list[str]]  # host name → its addresses (IP literals); raises OSError


def resolve_host(host: str) -> list[str]:
    """Every address of ``host`` (``getaddrinfo``), in the resolver's order, without repeats: the IPv4
    ones when there are any, else the IPv6 ones.

    Raises:
        socket.gaierror: the lookup failed (``errno`` says whether for good or for now).
    """
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    v4 = [str(i[4][0]) for i in infos if i[0] == socket.AF_INET]
    v6 = [str(i[4][0]) for i in infos if i[0] == socket.AF_INET6]
    return list(dict.fromkeys(v4 or v6))


DNS_MISSES_TO_DROP = 3  # lookups in a row without a connected gateway's address before it is dropped


@dataclass(eq=False)
class GatewayLink:
    """One gateway connection. ``accepted``: its current ``RegisterAck`` accepted this worker;
    ``refused``: the reason of a refusal (""). ``gateway_epoch``: the incarnation that last accepted it
    (0: none yet). ``connected``: the monitor saw the handshake and no disconnect since.
    ``left``: the gateway said it leaves (``GatewayShutdown``), so its connection's drop is no failure.
    ``registered_at``: ``time.monotonic()`` of the last ``RegisterWorker`` queued. ``tasks``: its receive and
    monitor tasks (cancelled when the link closes). ``missing``: consecutive DNS lookups that did not list
    its address. ``handshake``: its failed handshakes (a key mismatch), warned about once."""

    key: str
    client: ControlClient
    accepted: bool = False
    refused: str = ""
    gateway_epoch: int = 0
    connected: bool = False
    left: bool = False
    registered_at: float = float("-inf")
    missing: int = 0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    handshake: HandshakeWatch = field(init=False)

    def __post_init__(self) -> None:
        self.handshake = HandshakeWatch("gateway", self.key, self.client.secured, log)


class GatewayLinks:
    """The links of one worker, by key, in the order of ``--gateway-control`` (then of DNS, then of
    discovery).

    ``value``: the flag's text; ``keys``: CURVE key pair or None; ``resolve``: DNS lookup (injectable for
    tests). The first resolution happens here, synchronously.

    Raises:
        ValueError: ``value`` is not a valid endpoint list (the message names ``--gateway-control``).
    """

    def __init__(self, value: str, keys: CurveKeys | None, resolve: Resolver = resolve_host) -> None:
        self.entries: tuple[ZmqEndpoint, ...] = parse_endpoints(value, "gateway-control")
        self._keys, self._resolve = keys, resolve
        self._ctx = zmq.asyncio.Context()
        self._addresses: dict[str, list[str]] = {}  # entry (raw) → its endpoints as last resolved
        # a given (resolved) endpoint → its gateway pool's other processes' endpoints (``discover``)
        self.pools: dict[str, list[str]] = {}
        self.links: dict[str, GatewayLink] = {}
        self.refresh(self.lookup())

    @property
    def has_names(self) -> bool:
        """Some entry is a DNS name (resolved again every ``--gateway-resolve-interval``)."""
        return any(e.is_name for e in self.entries)

    @property
    def default_key(self) -> str:
        """The first link's key ("" without links): where a message delivered without a key came from."""
        return next(iter(self.links), "")

    def lookup(self) -> dict[str, list[str]]:
        """Resolve every entry now (blocking; names through ``resolve``): entry → its endpoints."""
        found: dict[str, list[str]] = {}
        for entry in self.entries:
            if not entry.is_name:
                found[entry.raw] = [entry.raw]
                continue
            try:
                found[entry.raw] = [entry.with_address(a) for a in self._resolve(entry.host)]
            except socket.gaierror as exc:
                keep = exc.errno == socket.EAI_AGAIN
                found[entry.raw] = self._addresses.get(entry.raw, []) if keep else []
                log_event(log, "gateway_lookup_failed", logging.WARNING, host=entry.host, error=str(exc),
                          kept=len(found[entry.raw]))
            except OSError as exc:
                found[entry.raw] = self._addresses.get(entry.raw, [])
                log_event(log, "gateway_lookup_failed", logging.WARNING, host=entry.host, error=str(exc),
                          kept=len(found[entry.raw]))
        return found

    def refresh(self, found: dict[str, list[str]]) -> tuple[list[GatewayLink], list[GatewayLink]]:
        """Apply a ``lookup`` result: a link for each new endpoint (connecting; not registered yet), and
        out of ``links`` each link whose endpoint is gone. Returns (added, removed); the caller closes
        the removed ones (``close_link``). The endpoints discovered through a given endpoint (``discover``)
        are wanted while that endpoint is, or while its link is kept. An endpoint gone is removed at once
        when its connection is down; one still connected only once ``DNS_MISSES_TO_DROP`` lookups in a
        row missed it, so one empty or partial answer (a Service's endpoints flapping) does not drop a
        live gateway and its requests."""
        self._addresses = found
        given = self.given()
        self.pools = {key: eps for key, eps in self.pools.items() if key in given or key in self.links}
        wanted = list(dict.fromkeys([*given, *(ep for eps in self.pools.values() for ep in eps)]))
        removed = []
        for key, link in self.links.items():
            if key in wanted:
                link.missing = 0
                continue
            link.missing += 1
            if not link.connected or link.missing >= DNS_MISSES_TO_DROP:
                removed.append(link)
        for link in removed:
            del self.links[link.key]
        added = [self._add(key) for key in wanted if key not in self.links]
        if added or removed:
            log_event(log, "gateways_resolved", gateways=",".join(self.links) or "none",
                      added=len(added), removed=len(removed))
        return added, removed

    def given(self) -> list[str]:
        """The endpoints ``--gateway-control`` stands for as last resolved, in order (no discovered ones)."""
        return list(dict.fromkeys(ep for eps in self._addresses.values() for ep in eps))

    def discover(self, key: str, ports: tuple[int, ...], own_port: int = 0) -> list[GatewayLink]:
        """The gateway of link ``key`` accepted this worker and named its pool's other processes' control
        ``ports``: a link for each endpoint at ``key``'s host and such a port that has none yet (connecting;
        not registered yet). Returns the links added (the caller starts them). Only a given endpoint's
        pool is recorded (a discovered process names the same pool); a port out of [1, 65535] or a
        non-tcp ``key`` is skipped. When the gateway says it is bound to ``own_port`` (not 0) and ``key``
        has another port, the worker reached it through a port mapping, behind which the siblings' ports
        mean nothing: none is followed, and a warning says to give every process's address. Siblings no
        longer named leave at the next ``refresh`` (run only when an entry is a DNS name: with addresses
        alone they stay until the worker restarts; nothing accepts the worker there)."""
        if key not in self.given():
            return []
        entry = parse_endpoint(key, "gateway-control")
        if entry.scheme != "tcp":
            return []
        if own_port and entry.port != own_port and ports:
            log_event(log, "gateway_pool_not_followed", logging.WARNING, gateway=key, bound_port=own_port,
                      reason="reached at another port than the gateway is bound to (a port mapping); give "
                             "--gateway-control every process's address")
            return []
        self.pools[key] = list(dict.fromkeys(entry.with_port(p) for p in ports if 0 < p < 65536))
        added = [self._add(ep) for ep in self.pools[key] if ep not in self.links]
        if added:
            log_event(log, "gateways_discovered", gateway=key, added=",".join(link.key for link in added))
        return added

    def _add(self, key: str) -> GatewayLink:
        """A new link to endpoint ``key`` (connecting), in ``links``."""
        link = self.links[key] = GatewayLink(key, ControlClient(key, self._keys, self._ctx))
        return link

    def get(self, key: str) -> GatewayLink | None:
        """The link with ``key``, or None (never had one, or it left DNS)."""
        return self.links.get(key)

    def any_accepted(self) -> bool:
        """Some gateway accepts this worker now (its ``/health`` says registered)."""
        return any(link.accepted for link in self.links.values())

    @staticmethod
    def close_link(link: GatewayLink, shutdown: Message | None = None) -> None:
        """Cancel ``link``'s tasks and close its socket, sending ``shutdown`` first when connected."""
        for task in link.tasks:
            task.cancel()
        link.client.close(shutdown)

    def close(self, shutdown: Message | None = None) -> None:
        """Close every link (``shutdown`` to each connected gateway first, none to one that said it left)
        and the zmq context."""
        for link in list(self.links.values()):
            self.close_link(link, None if link.left else shutdown)
        self.links.clear()
        self._ctx.term()
