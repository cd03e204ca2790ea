"""Local TCP ports for the processes ``pdserve up`` (and the tests and benches) start: free ports chosen
without repeats, runs of consecutive free ports, why a listener could not bind a host and port, and the
address a server bound to a host is reached at.

Ports are chosen below the kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``, where
outgoing connections get their local ports): a port is chosen here, released, and bound by the child a
moment later, and a port from the ephemeral range can be handed to any process's outgoing connection in
between, after which the child's bind fails with ``Address already in use``.
"""

from __future__ import annotations

import errno
import random
import socket
from collections.abc import Sequence
from pathlib import Path

# listening ports are drawn from [PORT_FLOOR, start of the ephemeral range) when that holds at least
# MIN_SPAN ports; otherwise the kernel chooses (bind to port 0)
PORT_FLOOR = 10000
MIN_SPAN = 1000
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DRAW = random.SystemRandom()  # not the global generator: a test seeding it would make processes agree


def ephemeral_start() -> int | None:
    """The first port of the kernel's ephemeral range, or None where it cannot be read (not Linux)."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (``free_ports`` of one). Two calls may return
    the same port (the first was released): use ``free_ports`` for several."""
    return free_ports(1, host=host)[0]


def free_ports(n: int, exclude: tuple[int, ...] = (), host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free on ``host`` a moment ago, none in ``exclude`` (e.g. an HTTP port
    chosen but not bound yet), drawn at random below the ephemeral range (module docstring): all are held
    open while choosing, so none repeats (sequential ``free_port`` calls once gave a test system's
    gateway the same port for HTTP and its control socket). Where the range below is too small or too
    busy, the kernel chooses them (bind to port 0)."""
    held: list[socket.socket] = []
    top = ephemeral_start()
    draws = 0
    try:
        while len([s for s in held if s.getsockname()[1] not in exclude]) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            if top is not None and top - PORT_FLOOR >= MIN_SPAN and draws < 20 * n + 100:
                draws += 1
                try:
                    s.bind((host, _DRAW.randrange(PORT_FLOOR, top)))
                except OSError:  # taken: another draw
                    held.pop().close()
                continue
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in held if s.getsockname()[1] not in exclude]
    finally:
        for s in held:
            s.close()


def free_port_range(n: int, exclude: tuple[int, ...] = (), host: str = "127.0.0.1",
                    attempts: int = 100) -> int:
    """The first of ``n`` consecutive TCP ports all free on ``host`` a moment ago (held together while
    checked), none in ``exclude`` (e.g. an HTTP port chosen but not bound yet): the control ports
    P .. P + n - 1 of ``pdserve gateway --workers n``.

    Raises:
        RuntimeError: no such run found in ``attempts`` tries.
    """
    for _ in range(attempts):
        first = free_ports(1, exclude=exclude, host=host)[0]
        if first + n > 65536 or any(first <= port < first + n for port in exclude):
            continue
        held: list[socket.socket] = []
        try:
            for port in range(first, first + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(s)
                s.bind((host, port))
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
        return first
    raise RuntimeError(f"no {n} consecutive free ports on {host} in {attempts} tries")


def bind_problem(host: str, port: int, port_flag: str = "--port", host_flag: str = "--host") -> str | None:
    """Why a TCP listener could not bind ``host:port`` now (one line naming ``host_flag`` or ``port_flag``),
    or None. ``host`` is resolved as asyncio's ``create_server`` (uvicorn) resolves it, ``getaddrinfo`` with
    ``AI_PASSIVE`` (``""``: every address), and each address it gives is probed, an IPv6 one IPv6-only as
    asyncio binds it, with ``SO_REUSEADDR`` as uvicorn binds: a connection of a just-stopped server
    lingering in TIME_WAIT does not make the port busy (it did, for up to a minute after a Ctrl-C during
    start-up), a live listener does, and so does another set of ``SO_REUSEPORT`` sockets (another gateway
    pool, which a pool's processes would otherwise silently join). Each probe socket is closed at once."""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"{host_flag} {host!r} does not resolve to an address: {exc.strerror or exc}"
    for family, kind, proto, _, address in dict.fromkeys(addresses):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                why, where = exc.strerror or str(exc), host or "every address"
                if exc.errno == errno.EADDRINUSE:
                    return f"port {port} on {where} is in use; choose another with {port_flag}"
                if exc.errno == errno.EADDRNOTAVAIL:
                    return f"{host_flag} {host} is not an address of this machine ({why})"
                if exc.errno == errno.EACCES:
                    return f"port {port} on {where} needs privileges ({why}); choose one above 1023"
                return f"cannot bind {host_flag} {host!r} {port_flag} {port} ({why})"
    return None


def control_bind_problem(endpoint: str) -> str | None:
    """Why the gateway's zmq control socket could not bind ``endpoint`` now (one line naming it and
    ``--control-bind``), or None. Only a ``tcp://host:port`` endpoint with a fixed port is probed, as
    ``bind_problem`` probes (zmq binds with ``SO_REUSEADDR`` too; ``*`` is every IPv4 address); an
    ``ipc://`` or ``inproc://`` one, a wildcard port (``*`` or 0) and a host that does not resolve (zmq
    also takes an interface name, e.g. ``eth0``) are left to zmq."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port_text = endpoint.removeprefix("tcp://").rpartition(":")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return None
    host = "0.0.0.0" if host == "*" else host.removeprefix("[").removesuffix("]")
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        return None
    why = bind_problem(host, int(port_text), port_flag="--control-bind", host_flag="--control-bind")
    return None if why is None else f"control socket {endpoint}: {why}"


def gateway_bind_problem(host: str, port: int, control_endpoints: Sequence[str]) -> str | None:
    """Why ``pdserve gateway`` could not bind its HTTP address (``bind_problem``) or one of its processes'
    control sockets (``control_bind_problem``, in order) now, or None: the first problem found."""
    if (why := bind_problem(host, port)) is not None:
        return why
    return next((why for e in control_endpoints if (why := control_bind_problem(e)) is not None), None)


def local_host(host: str) -> str:
    """The address this host reaches a server bound to ``host`` at: 127.0.0.1 for the IPv4 wildcard and for
    ``""`` (every address), ::1 for ``::`` (asyncio binds it IPv6-only, so 127.0.0.1 would be refused),
    else ``host``."""
    if host == "::":
        return "::1"
    return "127.0.0.1" if host in ("", "0.0.0.0") else host
