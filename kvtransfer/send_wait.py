"""When the sender's loop waits between steps, and how long (loop thread only).

A step waits unless it has work it can do now (a command, a queued layer that can enter the pipeline,
a layer to post); then it reads every control message that came.

- Idle (nothing queued or in flight): sleep in the zmq poller up to IDLE_POLL_MS (heartbeats,
  deadlines are due then); a command or a send_layer wakes it at once (wakeup.Waker).
- Busy but only waiting for CUDA events or write completions, which signal nothing: naps with the GIL
  released (wakeup.nap: select() on the waker and the sockets' fds; zmq's own poll counts whole
  milliseconds) up to IDLE_POLL_MS, so the loop does not spin and take the GIL from the producer, while
  a Done, a command or a send_layer the pipeline has room for still ends the nap at once. A send_layer
  into a full pipeline sends no wake byte (`SendPath.take_layers`): the loop could not start it before
  a completion, which a nap's look finds.

A nap is `TransferConfig.busy_wait_s` (50 µs) by default. While the one write in flight has a
predicted end (lookahead.py: the transport's rate from the writes completed so far), it is one long nap
up to shortly before that end, then a look every `fine_wait_s` until shortly after it: NIXL's UCX
backend sends a write's notification from the look (check_xfer_state) that finds the write complete
when it was still in progress after transfer(), so the receiver learns of the data only then, and each
look takes the GIL from the prefill thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from kvtransfer import wire
from kvtransfer.lookahead import nap_length
from kvtransfer.loop import LoopThread
from kvtransfer.peers import ReceiverPeer, ReceiverPeers
from kvtransfer.send_path import SendPath
from kvtransfer.types import TransferConfig
from kvtransfer.wakeup import nap

IDLE_POLL_MS = 10  # longest idle sleep of the loop (new work wakes it at once)


class SenderWait:
    """The waits of one sender's loop over its data path `path`, its `loop` and its `peers`' sockets."""

    def __init__(self, config: TransferConfig, path: SendPath, loop: LoopThread,
                 peers: ReceiverPeers) -> None:
        self.config, self.path, self.loop, self.peers = config, path, loop, peers

    def wait_and_read(self, handle: Callable[[ReceiverPeer, wire.Message], None]) -> None:
        """Wait as the module docstring says, then hand every control message that came to `handle`."""
        path, loop, waker = self.path, self.loop, self.loop.waker
        poller = self.peers.poller()
        busy = bool(path.queue or path.pipe.ops)
        now = loop.has_commands() or (busy and (self._can_take_layer() or self._can_post()))
        if not now:
            path.take_layers = path.pipe.capacity > 0
            waker.sleeping = True  # then look again: work queued before this sent no byte
            now = loop.has_commands() or self._can_take_layer()
        if now:
            ready = dict(poller.poll(0))
        elif busy:
            woke = self._nap_busy(self.peers.sockets(), IDLE_POLL_MS / 1e3)
            ready = dict(poller.poll(0)) if woke else {}
        else:
            path.mark("idle", "")
            ready = dict(poller.poll(IDLE_POLL_MS))
            path.mark("idle_end", "")
        waker.sleeping = False
        if waker.fd in ready:
            waker.drain()
        self.peers.read(ready, handle)

    def _can_take_layer(self) -> bool:
        """Whether the oldest queued request-layer can enter the pipeline now (or be dropped: its
        request ended); False with an empty queue."""
        path = self.path
        if not path.queue:
            return False
        with path.requests.lock:
            st = path.requests.find(path.queue[0][0])
        if st is None or st.status.is_terminal:
            return True
        return path.pipe.can_start(len(st.plan.src_ids), st.plan.direct)

    def _can_post(self) -> bool:
        """Whether a request-layer not yet posted can be posted (or dropped) now: its request is
        terminal, or begun and its CUDA event completed (always, on CPU). Only the oldest begun one's
        event is queried (one query per look, not depth): events complete in the order send_layer
        recorded them, so a later one found complete a nap later loses at most that nap."""
        pipe, requests = self.path.pipe, self.path.requests
        if not pipe.unposted:  # every look of a nap: no lock, no list while all are posted
            return False
        with requests.lock:
            states = [(op, requests.get(op.request_id)) for op in pipe.ops if not op.posted]
        for op, st in states:
            if st.status.is_terminal:
                return True
            if st.begun:
                return op.ready is None or bool(op.ready.query())
        return False

    def _nap_busy(self, socks: list[zmq.Socket], cap_s: float) -> bool:
        """Nap while the data path only waits for send_layer events or write completions: between two
        naps only those are looked at (completions handled here, SendPath.complete), so each look costs
        the producer thread little GIL time. Returns True as soon as the waker or a socket in `socks` is
        readable (the caller reads them), False once an event completed, a write finished or `cap_s`
        seconds passed (housekeeping is due). Call with `loop.waker.sleeping` set."""
        c, path = self.config, self.path
        now = time.monotonic()
        end = now + cap_s
        path.mark("nap", "")
        while True:
            t = nap_length(now, path.pipe.lone_write(), c.busy_wait_s, c.fine_wait_s)
            if t > c.busy_wait_s:
                path.mark("nap:long", "")  # (bench --trace) the look-ahead skips looks up to near the end
            if nap(self.loop.waker, socks, min(t, max(0.0, end - now))):
                path.mark("nap_end", "")
                return True
            if self._can_post() or path.complete():
                path.mark("nap_end", "")
                return False
            now = time.monotonic()
            if now >= end:
                path.mark("nap_end", "")
                return False
