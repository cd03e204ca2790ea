"""A worker's sessions with its gateways: registering with, heartbeating to and streaming to every gateway
of ``--gateway-control``, re-resolving its DNS names, and dropping a dead gateway's requests.

The link table itself (one ``GatewayLink`` per resolved address, DNS lookups) is workers/gateway_links.py;
this module runs the protocol over it for one worker (``GatewayHost``: the worker loop, workers/loop.py).

A gateway of several processes names the others in its ``RegisterAck``; each is served as a gateway of
``--gateway-control`` is (``GatewayLinks.discover``).

A gateway is lost when its connection drops (ZMTP heartbeats and a socket monitor), when it answers a
registration with another ``gateway_epoch`` (restarted at the same address), when it stops taking messages,
or when its address leaves DNS: a ``GatewayLost`` marker, queued in the worker's inbox behind what that
gateway sent, drops exactly the requests it owns (``drop_requests_of``: engine abort, KV blocks freed,
transfers cancelled); the other gateways' requests go on. A lost gateway gets a ``RegisterWorker`` again as
soon as it is connected (and every ``REGISTER_RETRY_S`` until it answers). When the incarnation that was
lost accepts the worker again (it lived on), each request dropped with it is failed back to it
(``RequestFailed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import zmq

from kvtransfer.curve import CurveKeys
from protocol.logging import log_event
from protocol.messages import (
    GatewayShutdown,
    Heartbeat,
    KVSnapshotRequest,
    Message,
    Probe,
    RegisterAck,
    RegisterWorker,
    RequestFailed,
    ReRegister,
    WorkerShutdown,
)
from workers.control_client import RegistrationError
from workers.gateway_links import GatewayLink, GatewayLinks
from workers.outputs import batch_outputs
from workers.ownership import route, started_id

if TYPE_CHECKING:
    from workers.health_server import EngineHealth
    from workers.ownership import RequestOwners

log = logging.getLogger("pdserve.worker")

REGISTER_TIMEOUT_S = 60.0  # start-up: some gateway must accept the worker within this many seconds
REGISTER_RETRY_S = 2.0  # a connected gateway that has not accepted the worker gets RegisterWorker this often


@dataclass(frozen=True)
class GatewayLost:
    """Inbox marker, local to a worker: the gateway with key ``gateway`` that sent the messages before
    this marker is gone (``reason``); applying it drops every request that gateway owns."""

    gateway: str
    reason: str
    gateway_epoch: int = 0  # the incarnation of that gateway when it was lost
    announced: bool = False  # the gateway said it leaves (``GatewayShutdown``): no failure


class GatewayHost(Protocol):
    """What the sessions need of the worker they serve (workers/loop.py ``WorkerLoop``)."""

    worker_id: str
    epoch: int
    health: EngineHealth
    owners: RequestOwners

    def registration(self) -> RegisterWorker: ...
    def decode_frame(self, data: bytes, gateway: str | None = None) -> Message | None: ...
    def deliver(self, msg: Message | GatewayLost, gateway: str | None = None) -> None: ...
    def emit_to(self, msg: Message, gateway: str) -> None: ...
    def want_kv_snapshot(self) -> None: ...
    def wake(self) -> None: ...
    def request_stop(self) -> None: ...
    def held_ids(self) -> set[str]: ...
    def drop(self, request_id: str) -> None: ...


class GatewaySessions:
    """The sessions of ``host`` with the gateways of ``control`` (``--gateway-control``'s text; ``keys``:
    CURVE key pair or None). ``gateways`` is the link table (tests may replace it).

    Raises:
        ValueError: ``control`` is not a valid endpoint list (the message names ``--gateway-control``).
    """

    def __init__(self, control: str, keys: CurveKeys | None, host: GatewayHost) -> None:
        self.control, self.host = control, host
        self.gateways = GatewayLinks(control, keys)
        # gateway key → (its epoch, request ids): requests dropped when that gateway was lost, failed back to
        # it (RequestFailed) if the same incarnation accepts this worker again (it was alive all along)
        self._unanswered: dict[str, tuple[int, list[str]]] = {}

    def accepted_by(self, ack: RegisterAck, gateway: str | None = None) -> None:
        """The gateway with key ``gateway`` (None: the first one) accepted this worker. When
        ``ack.gateway_epoch`` differs from the last one that gateway sent (it restarted at the same
        address), a ``GatewayLost`` marker is queued behind every message already received from it:
        applying it drops each request that gateway owns then, all of them its old incarnation's. Each
        process of the gateway's pool that ``ack.sibling_ports`` names and this worker does not serve yet
        gets a link, registered with as soon as it connects (``GatewayLinks.discover``; call with the
        event loop running when the ack names any)."""
        link = self.gateways.get(self.gateways.default_key if gateway is None else gateway)
        if link is None:
            return
        restarted = link.gateway_epoch and ack.gateway_epoch and ack.gateway_epoch != link.gateway_epoch
        if restarted and link.accepted:  # (a link no longer accepted was lost already: nothing to add)
            self.lose(link, f"gateway restarted (epoch {link.gateway_epoch} -> {ack.gateway_epoch})")
        link.gateway_epoch = ack.gateway_epoch or link.gateway_epoch
        link.accepted, link.refused, link.left = True, "", False
        self._answer_dropped(link.key, link.gateway_epoch)
        self.host.health.registered = True
        self.host.want_kv_snapshot()
        for sibling in self.gateways.discover(link.key, ack.sibling_ports, ack.control_port):
            self.start_link(sibling)

    def lose(self, link: GatewayLink, reason: str, announced: bool = False) -> None:
        """The gateway of ``link`` is gone (``reason``; ``announced``: it said so, ``GatewayShutdown``): it
        no longer accepts this worker, and a ``GatewayLost`` marker queued behind its messages drops the
        requests it owns."""
        link.accepted = False
        self.host.health.registered = self.gateways.any_accepted()
        self.host.deliver(GatewayLost(link.key, reason, link.gateway_epoch, announced), link.key)
        self.host.wake()

    def drop_requests_of(self, lost: GatewayLost) -> None:
        """Apply a ``GatewayLost`` marker (loop thread, between steps): forget every request the lost
        gateway owns and drop those the worker holds."""
        held = self.host.held_ids()
        owners = self.host.owners
        owned = owners.of(lost.gateway)
        dropped = [rid for rid in owned if rid in held]
        for rid in owned:
            owners.forget(rid)
        for rid in dropped:
            with contextlib.suppress(Exception):
                self.host.drop(rid)
        if dropped and lost.gateway_epoch:
            self._unanswered[lost.gateway] = (lost.gateway_epoch, [*self._unanswered.get(
                lost.gateway, (0, []))[1], *dropped])
            link = self.gateways.get(lost.gateway)
            if link is not None and link.accepted:  # accepted again before this marker was applied
                self._answer_dropped(lost.gateway, link.gateway_epoch)
        level = logging.INFO if lost.announced and not dropped else logging.WARNING
        log_event(log, "gateway_left" if lost.announced else "gateway_lost", level,
                  worker_id=self.host.worker_id, gateway=lost.gateway, reason=lost.reason,
                  dropped=len(dropped))

    def _answer_dropped(self, gateway: str, gateway_epoch: int) -> None:
        """``gateway`` (incarnation ``gateway_epoch``) accepts this worker again: when it is the incarnation
        that was lost (a connection that dropped, or a queue that filled, while the gateway lived on), each
        request dropped then is failed back to it (``RequestFailed``), so it retries or ends them instead of
        waiting for tokens that will never come; another incarnation never knew them."""
        epoch, dropped = self._unanswered.pop(gateway, (0, []))
        if epoch != gateway_epoch:
            return
        for rid in dropped:
            self.host.emit_to(RequestFailed(request_id=rid, worker_id=self.host.worker_id,
                                            error="the worker lost its connection to this gateway and "
                                                  "dropped the request"), gateway)

    def send_routed(self, tagged: list[tuple[Message, str | None]]) -> None:
        """Send a phase's messages (each with its ``RequestOwners.tag``): each accepting gateway its own,
        per-request ones in one ``OutputBatch``. Messages for a gateway that no longer accepts the worker
        are dropped (its requests are being dropped too)."""
        accepting = [key for key, link in self.gateways.links.items() if link.accepted]
        for key, msgs in route(tagged, accepting).items():
            link = self.gateways.links[key]
            for frame in batch_outputs(self.host.worker_id, msgs):
                if not self.send(link, frame):
                    break

    def send(self, link: GatewayLink, msg: Message) -> bool:
        """Send ``msg`` to ``link``'s gateway now; a gateway that accepts this worker but cannot take the
        message (its queue full, or its connection gone) is lost."""
        if link.client.try_send(msg):
            return True
        if link.accepted:
            self.lose(link, "its control socket stopped taking messages (queue full or connection gone)")
        return False

    def beat(self, beat: Heartbeat) -> None:
        """Send ``beat`` to every gateway that accepts this worker; register again with each connected
        one that neither accepted nor refused it within ``REGISTER_RETRY_S``."""
        now = time.monotonic()
        for link in list(self.gateways.links.values()):
            if link.accepted:
                self.send(link, beat)
            elif not link.refused and now - link.registered_at >= REGISTER_RETRY_S:
                self._register(link)

    async def _recv_loop(self, link: GatewayLink) -> None:
        host = self.host
        while True:
            msg = host.decode_frame(await link.client.recv_frame(), link.key)
            if isinstance(msg, ReRegister):  # the gateway lost track of us: register again, same epoch
                log_event(log, "reregistering", logging.WARNING, worker_id=host.worker_id, gateway=link.key,
                          reason=msg.reason)
                self._register(link)
            elif isinstance(msg, Probe):  # the gateway checking which connection dropped: nothing to do
                pass
            elif isinstance(msg, GatewayShutdown):  # its drain is over; the connection drops next
                if link.accepted and msg.gateway_epoch == link.gateway_epoch:
                    link.left = True
                    self.lose(link, "it shut down", announced=True)
            elif isinstance(msg, KVSnapshotRequest):  # the gateway missed a KVEvents: resend the whole set
                host.want_kv_snapshot()
                host.wake()
            elif isinstance(msg, RegisterAck):
                if msg.worker_id != host.worker_id:
                    continue
                log_event(log, "registered" if msg.accepted else "registration_refused",
                          logging.INFO if msg.accepted else logging.ERROR, worker_id=host.worker_id,
                          gateway=link.key, gateway_epoch=msg.gateway_epoch, reason=msg.reason)
                if msg.accepted:
                    self.accepted_by(msg, link.key)
                    host.wake()
                else:
                    if link.accepted:
                        self.lose(link, f"it refused the worker: {msg.reason}")
                    link.refused = msg.reason or "refused"
            else:  # a request message, or None (a refused frame may have queued a failure)
                if msg is not None and not link.accepted and started_id(msg) is not None:
                    # sent before the connection was lost, read after: its gateway's requests are being
                    # dropped; failed back to it if the same incarnation accepts this worker again
                    rid = started_id(msg)
                    assert rid is not None
                    epoch, ids = self._unanswered.get(link.key, (link.gateway_epoch, []))
                    if epoch == link.gateway_epoch:
                        self._unanswered[link.key] = (epoch, [*ids, rid])
                    log_event(log, "request_after_gateway_lost", logging.WARNING, request_id=rid,
                              gateway=link.key)
                    continue
                if msg is not None:
                    if log.isEnabledFor(logging.DEBUG):
                        log_event(log, "message_received", logging.DEBUG, type=type(msg).__name__,
                                  request_id=getattr(msg, "request_id", None), gateway=link.key)
                    host.deliver(msg, link.key)
                host.wake()

    async def _watch_link(self, link: GatewayLink) -> None:
        """Follow ``link``'s connection: registered again once connected, lost when it drops. A failed
        handshake (wrong CURVE keys) is warned about once (``link.handshake``); the drops of connections
        that never completed a handshake are logged at DEBUG (a key mismatch retries ~10 times a second)."""
        while True:
            event, value = await link.client.next_event()
            if link.handshake.on_event(event, value):
                continue
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.connected = True
                if not link.accepted and time.monotonic() - link.registered_at >= REGISTER_RETRY_S:
                    for _ in range(50):  # the connection takes messages a moment after the event
                        if self._register(link):
                            break
                        await asyncio.sleep(0.002)
            elif event == zmq.EVENT_DISCONNECTED:
                handshaken = link.connected
                link.connected, link.registered_at = False, float("-inf")
                level = logging.WARNING if handshaken and not link.left else logging.DEBUG
                log_event(log, "gateway_disconnected", level,
                          worker_id=self.host.worker_id, gateway=link.key,
                          failed_handshakes=link.handshake.failures)
                if link.accepted:
                    self.lose(link, "its control connection dropped")

    def _register(self, link: GatewayLink) -> bool:
        """Send the worker's ``RegisterWorker`` to ``link``'s gateway; False when it is not connected
        (the heartbeat tries again)."""
        if not link.client.try_send(self.host.registration()):
            return False
        link.registered_at = time.monotonic()
        return True

    def start_link(self, link: GatewayLink) -> None:
        """Start ``link``'s receive and monitor tasks (event loop running) and register with it."""
        link.tasks = [asyncio.create_task(self._guarded(self._recv_loop, link)),
                      asyncio.create_task(self._guarded(self._watch_link, link))]
        self._register(link)

    def start(self) -> None:
        """``start_link`` for every link (event loop running)."""
        for link in self.gateways.links.values():
            self.start_link(link)

    def link_tasks(self) -> list[asyncio.Task[None]]:
        """The receive and monitor tasks of every link."""
        return [task for link in self.gateways.links.values() for task in link.tasks]

    async def _guarded(self, body: Callable[[GatewayLink], Coroutine[None, None, None]],
                       link: GatewayLink) -> None:
        """Run ``body(link)``, one of ``link``'s tasks; should it fail, the worker stops (deregistering)
        rather than serve on with a gateway it no longer hears."""
        try:
            await body(link)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the task of gateway %s failed: stopping the worker", link.key)
            self.host.request_stop()

    async def resolve_loop(self, interval: float) -> None:
        """Look ``--gateway-control``'s host names up again every ``interval`` s
        (``--gateway-resolve-interval``): a new address gets a link, a link whose address left DNS is lost
        and closed."""
        while True:
            await asyncio.sleep(interval)
            try:
                async with asyncio.timeout(max(interval, 5.0)):
                    found = await asyncio.to_thread(self.gateways.lookup)
            except TimeoutError:
                log_event(log, "gateway_lookup_failed", logging.WARNING, error="no answer in time")
                continue
            self.update_gateways(found)

    def update_gateways(self, found: dict[str, list[str]]) -> None:
        """Apply a DNS lookup (``GatewayLinks.lookup``: entry → endpoints): each new address is a
        gateway to register with (its tasks started: call with the event loop running), each address
        gone is a lost gateway (its requests dropped) told ``WorkerShutdown`` and closed."""
        added, removed = self.gateways.refresh(found)
        for link in removed:
            self.lose(link, "its address left DNS")
            self.gateways.close_link(link, WorkerShutdown(worker_id=self.host.worker_id,
                                                          epoch=self.host.epoch))
        for link in added:
            self.start_link(link)

    async def wait_registered(self, timeout: float, stop: asyncio.Event | None = None) -> None:
        """Return once some gateway accepted the worker, or ``stop`` is set (the worker was asked to stop).

        Raises:
            RegistrationError: every gateway refused it (no DNS name that may bring others), or none
                accepted it within ``timeout`` seconds (the message names each gateway whose last
                handshake failed, with what that most likely means: wrong CURVE keys).
        """
        deadline = time.monotonic() + timeout
        while not self.gateways.any_accepted() and not (stop is not None and stop.is_set()):
            links = list(self.gateways.links.values())
            if links and not self.gateways.has_names and all(link.refused for link in links):
                reasons = "; ".join(f"{link.key}: {link.refused}" for link in links)
                raise RegistrationError(f"gateway refused worker {self.host.worker_id}: {reasons}")
            if time.monotonic() >= deadline:
                where = ", ".join(self.gateways.links) or f"none resolved from {self.control}"
                failed = [f"{link.handshake.cause} (failed {link.handshake.failures} times in a row)"
                          for link in links if link.handshake.cause]
                likely = f"; likely cause: {'; '.join(failed)}" if failed else ""
                raise RegistrationError(f"no RegisterAck from any gateway ({where}) within {timeout:.0f} s"
                                        f"{likely}")
            await asyncio.sleep(0.02)

    def close(self) -> None:
        """Close every link, telling each connected gateway ``WorkerShutdown`` first."""
        self.gateways.close(WorkerShutdown(worker_id=self.host.worker_id, epoch=self.host.epoch))
