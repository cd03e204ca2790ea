"""Which gateway owns each request of a worker, and where each outgoing message goes.

A worker serving several gateways keeps a request's state for the gateway that sent it only: the
gateway's key (its link's resolved endpoint, workers/gateway_links.py) is recorded when the message that
starts the request (``PrefillRequest``, ``ReserveKV``, ``ColocatedRequest``, or a canary's
``KVCanaryReserve`` / ``KVCanarySend``) is applied. An outgoing message that names a request (``request_id``
or ``canary_id``) goes to its owner only; one that names none (``Heartbeat``, ``WorkerShutdown``, KV
events) goes to every gateway that accepts the worker. ``route`` turns a phase's tagged messages into one
list per gateway, in the order they were made (``batch_outputs`` then makes each gateway's
``OutputBatch``).
"""

from __future__ import annotations

from collections.abc import Iterable

from protocol.messages import (
    AbortRequest,
    ColocatedRequest,
    DecodeRequest,
    FirstToken,
    KVCanaryReserve,
    KVCanaryReserved,
    KVCanaryResult,
    KVCanarySend,
    KVReserved,
    Message,
    NextToken,
    PrefillRequest,
    RequestFailed,
    RequestFinished,
    RequestRejected,
    ReserveKV,
)

BROADCAST: None = None  # the tag of a message for every gateway
NO_OWNER = ""  # the tag of a message naming a request no gateway owns (dropped by ``route``)

StartMessage = PrefillRequest | ReserveKV | ColocatedRequest | KVCanaryReserve | KVCanarySend


def started_id(msg: Message) -> str | None:
    """The request (or canary) id a gateway → worker message starts, else None."""
    if isinstance(msg, PrefillRequest | ReserveKV | ColocatedRequest):
        return msg.request_id
    if isinstance(msg, KVCanaryReserve | KVCanarySend):
        return msg.canary_id
    return None


def continued_id(msg: Message) -> str | None:
    """The id a gateway → worker message about an existing request names (``DecodeRequest``,
    ``AbortRequest``), else None."""
    if isinstance(msg, DecodeRequest | AbortRequest):
        return msg.request_id
    return None


def named_id(msg: Message) -> str | None:
    """The request (or canary) id a worker → gateway message names, else None (a message for every
    gateway)."""
    if isinstance(msg, FirstToken | NextToken | RequestFinished | RequestFailed | RequestRejected
                  | KVReserved):
        return msg.request_id
    if isinstance(msg, KVCanaryReserved | KVCanaryResult):
        return msg.canary_id
    return None


class RequestOwners:
    """Request (or canary) id → the key of the gateway that owns it."""

    def __init__(self) -> None:
        self._owner: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._owner)

    def record(self, request_id: str, gateway: str) -> str:
        """Make ``gateway`` the owner of ``request_id`` unless another gateway owns it; returns the owner."""
        return self._owner.setdefault(request_id, gateway)

    def owner(self, request_id: str) -> str | None:
        """The owner's key, or None."""
        return self._owner.get(request_id)

    def forget(self, request_id: str) -> None:
        """No gateway owns ``request_id`` any more."""
        self._owner.pop(request_id, None)

    def of(self, gateway: str) -> list[str]:
        """The ids ``gateway`` owns, oldest first."""
        return [rid for rid, key in self._owner.items() if key == gateway]

    def prune(self, held: Iterable[str]) -> None:
        """Forget every id not in ``held`` (the requests and canaries the worker still holds)."""
        keep = set(held)
        self._owner = {rid: key for rid, key in self._owner.items() if rid in keep}

    def tag(self, msg: Message) -> str | None:
        """The destination of an outgoing message: its request's owner, ``NO_OWNER`` when it names a
        request no gateway owns, ``BROADCAST`` when it names none."""
        rid = named_id(msg)
        if rid is None:
            return BROADCAST
        return self._owner.get(rid, NO_OWNER)


def route(tagged: Iterable[tuple[Message, str | None]], gateways: Iterable[str]) -> dict[str, list[Message]]:
    """One list of messages per gateway in ``gateways`` (the ones that accept the worker), order kept: a
    ``BROADCAST`` message goes to each, another to its tag's gateway when that is one of them. Gateways
    with nothing to send are left out. Messages for any other tag are dropped (their gateway is gone)."""
    keys = list(gateways)
    out: dict[str, list[Message]] = {}
    for msg, tag in tagged:
        if tag is BROADCAST:
            for key in keys:
                out.setdefault(key, []).append(msg)
        elif tag in keys:
            out.setdefault(tag, []).append(msg)
    return out
