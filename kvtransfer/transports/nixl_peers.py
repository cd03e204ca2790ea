"""Which receiver peer (the sender's zmq identity, hex) a NIXL remote agent name stands for, so that a
notification (get_new_notifs: {agent name: [bytes]}) can be told apart by sender (nixl.py)."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def _text(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name


class AgentPeers:
    """Peer key → NIXL remote agent name (add_remote_agent's result: bytes), and back (get_new_notifs
    names agents by str). Two peer keys may share
    one agent (a sender that said Hello again from a new identity): a notification from it is then
    attributed to the peer key added last."""

    def __init__(self) -> None:
        self._names: dict[str, str | bytes] = {}

    def add(self, peer: str, name: str | bytes) -> None:
        """Record that `peer`'s notifications come from the agent `name` (latest add wins for a name)."""
        self._names.pop(peer, None)
        self._names[peer] = name

    def remove(self, peer: str) -> str | bytes | None:
        """Forget `peer`; returns its agent name once no other peer uses it (then remove it from NIXL)."""
        name = self._names.pop(peer, None)
        return name if name is not None and name not in self._names.values() else None

    def attribute(self, notifs: dict[str, list[bytes]]) -> list[tuple[str, bytes]]:
        """(peer key, notification) of every notification; those of an agent that is no peer's are
        dropped with a warning naming the agent."""
        by_name = {_text(name): peer for peer, name in self._names.items()}  # insertion order: latest wins
        out: list[tuple[str, bytes]] = []
        for name, msgs in notifs.items():
            peer = by_name.get(name)
            if peer is None:
                log.warning("dropped %d notification(s) from NIXL agent %r, no peer of ours", len(msgs), name)
            else:
                out += [(peer, n) for n in msgs]
        return out
