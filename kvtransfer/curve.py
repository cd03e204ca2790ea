"""ZMQ CURVE on pdserve's control sockets: the fleet key pair, securing a socket, refusing strangers.

Design (docs/deploy.md, "Control-plane security"): one fleet-wide CURVE key pair, the file
``fleet.key_secret`` (pyzmq's certificate format, ``zmq.auth.create_certificates``) in a key directory
(``--curve-keys DIR``; a Kubernetes Secret mounted as files; ``pdserve up`` makes one per run). Every
listening control socket (the gateway's ROUTER, each decode worker's KV control ROUTER) is a CURVE
server with that pair; every connecting socket (a worker's DEALER to the gateway, a prefill worker's
DEALERs to its decode workers) is a CURVE client with the same pair and expects it as the server's
key. A ZAP handler on the listening socket's context (``FleetAuthenticator``, pyzmq's
``ThreadAuthenticator``) accepts a client only when its public key is the fleet's, so:

- a client without CURVE (the NULL mechanism) fails the handshake (mechanism mismatch);
- a client that does not know the fleet's public key as the server key fails it too (the server cannot
  decrypt its HELLO);
- a client with its own key pair that does know the fleet's public key (it is not secret) is refused by
  the ZAP handler ("unknown key").

No message of a refused peer reaches the application, and it receives none. The secret key is the
fleet's membership: whoever holds it is a pdserve process. Each refusal is counted (``Refusals``): by
the ZAP handler (unknown key: logged once per key) and from the listening socket's monitor events
(``HANDSHAKE_FAILED_*``; a connection closed before any handshake, such as a Kubernetes TCP probe, is
its own kind, ``no_handshake``), logged once per kind and peer host. libzmq's monitor does not name the
peer of a failed handshake, so ``Refusals.on_monitor`` keeps the peer host of each accepted connection
(``getpeername`` on the descriptor in the ``ACCEPTED`` event) and gives a failed handshake the host of
the connection whose ``DISCONNECTED`` event follows it (libzmq emits the two together, in that order,
from the connection's I/O thread). The host is unknown when the descriptor was already closed when the
monitor was read (a client that hangs up at once); such a refusal is logged only if none of its kind
was logged before.

The connecting side watches its own handshakes (``HandshakeWatch``, fed its socket monitor's events):
libzmq reports a key mismatch to the client only as a failed handshake, so a worker with the wrong key
pair would otherwise just see its connection drop again and again. What the client's monitor says
(libzmq 4.3), by case: a server that refuses the client's key (ZAP) gives ``HANDSHAKE_FAILED_AUTH``, not
retried by libzmq. A CURVE client and a plain peer (either way round) give ``HANDSHAKE_FAILED_PROTOCOL``
(mechanism mismatch), not retried either, or ``HANDSHAKE_FAILED_NO_DETAIL`` when the server noticed first
and hung up. A client that expects another server key (its own key pair, not the fleet's) gives
``HANDSHAKE_FAILED_NO_DETAIL`` (the server cannot decrypt its HELLO and hangs up), retried every ~0.1 s;
so does any peer that accepts a TCP connection and closes it, hence the hedged wording and the
``FAILURES_TO_WARN`` failures in a row before that one is warned about.

No torch; nothing of the project besides this package (the gateway and protocol import this module).
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("pdserve.curve")

KEY_FILE = "fleet.key_secret"  # the fleet's key pair in a key directory (public and secret, z85)
PUBLIC_KEY_FILE = "fleet.key"  # its public half (written by generate_keys; not needed to run)
# monitor events of a listening socket that are refused handshakes (the ZAP denials, HANDSHAKE_FAILED_AUTH,
# are counted by the ZAP handler itself, which knows the key)
REFUSAL_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
UNKNOWN_KEY = "unknown_key"  # a CURVE client whose public key is not the fleet's
HANDSHAKE = "handshake"  # a ZMTP peer without CURVE, or with a wrong server key: the handshake failed
# a connection closed before the handshake finished: a TCP probe, a port scan, or a client without CURVE
# that noticed the mechanism mismatch first and hung up (libzmq reports whichever side noticed first)
NO_HANDSHAKE = "no_handshake"
REFUSAL_KINDS = (UNKNOWN_KEY, HANDSHAKE, NO_HANDSHAKE)
# what a listening socket's monitor must report for Refusals.on_monitor to name the peer of a refusal
MONITOR_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | REFUSAL_EVENTS
MAX_REMEMBERED = 4096  # peers remembered (logged refusals, hosts of open connections): bounded memory


def peer_host(fd: int) -> str:
    """The peer's host (an IP address) of the connected socket on file descriptor ``fd``; "" when it is
    closed, not a socket, or has no host (a Unix socket). Reads a duplicate, never closes ``fd``."""
    try:
        dup = os.dup(fd)
    except OSError:
        return ""
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return ""
    try:
        peer = sock.getpeername()
        return str(peer[0]) if isinstance(peer, tuple) else ""
    except OSError:
        return ""
    finally:
        sock.close()


@dataclass(frozen=True)
class CurveKeys:
    """The fleet's CURVE key pair (z85 text, 40 bytes each) and the directory it was read from."""

    public: bytes
    secret: bytes = field(repr=False)
    directory: str = ""


def load_keys(directory: str | os.PathLike[str]) -> CurveKeys:
    """Read ``DIR/fleet.key_secret``.

    Raises:
        ValueError: the directory or file is missing, or the file holds no valid key pair (the message
            names the file and how to make one).
    """
    path = Path(directory) / KEY_FILE
    if not path.is_file():
        raise ValueError(f"no CURVE key pair at {path} (make one with `pdserve keygen {directory}`)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path} is not a CURVE key pair: {exc}") from exc
    if public is None or secret is None or len(public) != 40 or len(secret) != 40:
        raise ValueError(f"{path} is not a CURVE key pair (want z85 public-key and secret-key)")
    if zmq.curve_public(secret) != public:
        raise ValueError(f"{path}: the public key does not belong to the secret key")
    return CurveKeys(public, secret, str(directory))


def generate_keys(directory: str | os.PathLike[str]) -> CurveKeys:
    """Make a new fleet key pair in ``directory`` (created 0700 if missing; the files 0600).

    Raises:
        FileExistsError: a key pair is already there (never overwritten).
        OSError: the directory cannot be made or written.
    """
    path = Path(directory)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if (path / KEY_FILE).exists():
        raise FileExistsError(f"{path / KEY_FILE} exists; not overwriting a key pair")
    old = os.umask(0o077)
    try:
        zmq.auth.create_certificates(str(path), "fleet")
    finally:
        os.umask(old)
    (path / KEY_FILE).chmod(stat.S_IRUSR | stat.S_IWUSR)
    return load_keys(path)


def secure_server(sock: zmq.Socket, keys: CurveKeys) -> None:  # type: ignore[type-arg]
    """Make ``sock`` (before bind) a CURVE server with the fleet's pair."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:  # type: ignore[type-arg]
    """Make ``sock`` (before connect) a CURVE client with the fleet's pair, expecting the fleet's public
    key from the server."""
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.public)


class Refusals:
    """Refused peers of one listening socket (``where`` names it in the logs): counted by kind
    (``REFUSAL_KINDS``, or another a caller names, e.g. the KV receiver's ``unregistered_sender``),
    logged once per (kind, peer) for the first ``MAX_REMEMBERED`` pairs (later new pairs are counted, not
    logged; an unknown peer, "", only while no refusal of its kind was logged: it may be any of them),
    ``on_refused(kind)`` called for each. Any thread (the ZAP handler's thread, the socket's
    loop); ``on_monitor`` from one thread only (the one reading the socket's monitor)."""

    def __init__(self, where: str, on_refused: Callable[[str], None] | None = None) -> None:
        self.where, self._on_refused = where, on_refused
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(REFUSAL_KINDS, 0)
        self._logged: set[tuple[str, str]] = set()
        self._capped: set[str] = set()  # kinds whose new peers are no longer logged (MAX_REMEMBERED)
        self._kinds_logged: set[str] = set()  # kinds logged at least once (for any peer)
        self._hosts: dict[int, str] = {}  # file descriptor of an accepted connection -> its peer host
        self._failed: str | None = None  # kind of a failed handshake whose DISCONNECTED is still to come

    def refused(self, kind: str, peer: str = "") -> None:
        """Count one refused handshake of ``kind`` from ``peer`` (a key or a host; "" when unknown) and
        log it if it is the first of that (kind, peer)."""
        self._count(kind)
        self._log_once(kind, peer)

    def _count(self, kind: str) -> None:
        with self._lock:
            self._counts[kind] = self._counts.get(kind, 0) + 1
        if self._on_refused is not None:
            self._on_refused(kind)

    def _log_once(self, kind: str, peer: str) -> None:
        with self._lock:
            if (kind, peer) in self._logged or kind in self._capped:
                return
            if not peer and kind in self._kinds_logged:  # an unknown peer may be one already logged
                return
            self._kinds_logged.add(kind)
            full = len(self._logged) >= MAX_REMEMBERED
            if full:
                self._capped.add(kind)
            else:
                self._logged.add((kind, peer))
        if full:
            log.warning("%s: %d refused peers logged; further new peers of %s are counted, not logged",
                        self.where, MAX_REMEMBERED, kind)
            return
        source = f"from {peer}" if peer else "(peer unknown)"
        what = {
            UNKNOWN_KEY: f"a client with an unknown CURVE key {peer}",
            HANDSHAKE: f"a client without the fleet's CURVE keys (no CURVE or a wrong server key) {source}",
            NO_HANDSHAKE: f"a connection closed before any handshake (a TCP probe or port scan) {source}",
        }.get(kind, f"{peer} ({kind})")
        log.warning("%s refused %s; further refusals of it are counted, not logged", self.where, what)

    def on_monitor(self, event: int, value: int) -> bool:
        """Take one event of the listening socket's monitor (``MONITOR_EVENTS``; ``value`` as libzmq
        gives it: the file descriptor for ACCEPTED and DISCONNECTED). A failed handshake (``HANDSHAKE``)
        or a connection closed before one (``NO_HANDSHAKE``: libzmq's HANDSHAKE_FAILED_NO_DETAIL, e.g. a
        TCP liveness probe) is counted at once and logged at the DISCONNECTED that follows it, with that
        connection's peer host. True if the event was a refusal."""
        if event & zmq.EVENT_ACCEPTED:
            if len(self._hosts) >= MAX_REMEMBERED:  # connections whose DISCONNECTED never came
                del self._hosts[next(iter(self._hosts))]
            self._hosts[value] = peer_host(value)
            return False
        if event & zmq.EVENT_DISCONNECTED:
            host = self._hosts.pop(value, "")
            if self._failed is not None:
                self._log_once(self._failed, host)
                self._failed = None
            return False
        kind = (HANDSHAKE if event & zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                else NO_HANDSHAKE if event & zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL else None)
        if kind is None:
            return False
        if self._failed is not None:  # two failures without a DISCONNECTED between them: unexpected
            self._log_once(self._failed, "")
        self._count(kind)
        self._failed = kind
        return True

    def counts(self) -> dict[str, int]:
        """Refusals so far by kind (a copy)."""
        with self._lock:
            return dict(self._counts)

    def total(self) -> int:
        """Refusals so far, every kind but ``NO_HANDSHAKE`` (connections that never tried: probes)."""
        with self._lock:
            return sum(n for kind, n in self._counts.items() if kind != NO_HANDSHAKE)


class FleetAuthenticator:
    """The ZAP handler of one zmq context (a thread): accepts a CURVE client only when its public key
    is the fleet's; each other key is a ``Refusals.refused(UNKNOWN_KEY, key)``. Start it before the
    context's listening socket binds; ``stop`` it before the context is terminated."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys, refusals: Refusals) -> None:  # type: ignore[type-arg]
        self._keys, self._refusals = keys, refusals
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("pdserve.curve.zap"))
        self._auth.start()
        self._auth.configure_curve_callback("*", self)

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: is the z85 ``key`` the fleet's?"""
        if key == self._keys.public:
            return True
        self._refusals.refused(UNKNOWN_KEY, key.decode("ascii", "replace"))
        return False

    def stop(self) -> None:
        """Stop the handler's thread and close its socket."""
        self._auth.stop()


# monitor events of a connecting socket whose handshake failed
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
# failed handshakes in a row, the peer having hung up without a reason (NO_DETAIL), before they are warned
# about: a gateway process that closes its listening socket resets the connections it had not accepted yet,
# once; a key mismatch fails every ~0.1 s
FAILURES_TO_WARN = 3
KEYS_FLAGS = "--curve-keys / PDSERVE_CURVE_KEYS"


def handshake_failure(event: int, value: int, peer: str, address: str, secured: bool) -> str:
    """What a failed handshake (a ``HANDSHAKE_FAILED`` monitor event of a connecting socket, ``value`` as
    libzmq gives it) most likely means, as a sentence naming ``peer`` (its role: "gateway") at
    ``address``; ``secured``: this side is a CURVE client."""
    where = f"{peer} {address}"
    not_retried = "libzmq does not retry this connection: restart this worker once the keys match"
    if event & zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"{where}: the CURVE handshake failed: the {peer} does not accept this worker's key (its key "
                f"pair is not the {peer}'s): check {KEYS_FLAGS} against the {peer}'s; {not_retried}")
    if event & zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value != zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return (f"{where}: the handshake failed (ZMTP protocol error {value:#x}): is {address} a pdserve "
                    f"{peer}'s control port?")
        if secured:
            return (f"{where}: the handshake failed: the {peer} does not use CURVE (it runs with "
                    f"--insecure-control-plane) while this worker does ({KEYS_FLAGS}); {not_retried}")
        return (f"{where}: the handshake failed: the {peer} requires CURVE and this worker runs without "
                f"CURVE keys (--insecure-control-plane): start it with the fleet's {KEYS_FLAGS}; "
                f"{not_retried}")
    if secured:
        return (f"{where}: the CURVE handshake failed (the {peer} does not accept this worker's key, or this "
                f"worker has the wrong {peer} public key; or {address} is not a pdserve {peer}'s control "
                f"port): check {KEYS_FLAGS} against the {peer}'s")
    return (f"{where}: the handshake failed: the {peer} closed the connection during it: it may require "
            f"CURVE while this worker runs without CURVE keys (--insecure-control-plane), or {address} is "
            f"not a pdserve {peer}'s control port")


class HandshakeWatch:
    """The handshakes of one connecting control socket with the ``peer`` (its role: "gateway") at
    ``address``, from the socket monitor's events; ``secured``: a CURVE client. A failed handshake is
    counted (``failures``: in a row, since the last that succeeded) and warned about on ``logger`` once
    (``handshake_failure``'s sentence) until a handshake succeeds: at the first failure, or at the
    ``FAILURES_TO_WARN``-th in a row when the peer only hung up. ``cause``: that sentence while the last
    handshake failed, else "". One thread."""

    def __init__(self, peer: str, address: str, secured: bool, logger: logging.Logger) -> None:
        self.peer, self.address, self.secured, self._log = peer, address, secured, logger
        self.failures = 0
        self.cause = ""
        self.warned = False

    def on_event(self, event: int, value: int = 0) -> bool:
        """Take one monitor event: a failed handshake is counted (and warned about, see the class), a
        ``HANDSHAKE_SUCCEEDED`` clears the count; True when ``event`` was a failed handshake."""
        if event & zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.failures, self.cause, self.warned = 0, "", False
            return False
        if not event & HANDSHAKE_FAILED:
            return False
        self.failures += 1
        self.cause = handshake_failure(event, value, self.peer, self.address, self.secured)
        hung_up = bool(event & zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        if not self.warned and (not hung_up or self.failures >= FAILURES_TO_WARN):
            self.warned = True
            self._log.warning("%s; further failed handshakes with it are counted, not logged", self.cause)
        return True
