"""The sender loop's wait (a mixin of KVSender, via SendPath): `_poll_peers` reads control messages
after waiting for work, as long as the loop has none it can do now (an idle poll, or naps while busy),
and lets the data lock go while it waits (post_now.py). Loop thread only.
While busy: whether a queued request-layer can enter the pipeline or a gathered one be posted now,
and the nap between looks when neither can (send_layer events and write completions signal nothing).
The nap is `TransferConfig.busy_wait_s` (50 µs) by default. While the one write in flight has a
predicted end (lookahead.py: the transport's rate from the writes completed so far), it is one long
nap up to shortly before that end, then a look every `fine_wait_s` until shortly after it: NIXL's UCX
backend sends a write's notification from the look (check_xfer_state) that finds the write complete
when it was still in progress after transfer(), so the receiver learns of the data only then; on
2xH200 a 4k-token request's single 1.4 ms write was seen up to a nap late, and each of its ~28 looks
took the GIL from the prefill thread. A waker byte or a control message ends any nap at once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch
import zmq

from kvtransfer import wire as m
from kvtransfer.api import TransferConfig
from kvtransfer.endpoint import RequestState
from kvtransfer.lookahead import nap_length
from kvtransfer.pipeline import LayerPipeline
from kvtransfer.wakeup import Waker, nap

IDLE_POLL_MS = 10  # longest idle sleep of the loop (new work wakes it at once)


class SendWait:
    """Wait methods of KVSender; the attributes below are KVSender's."""

    config: TransferConfig
    _pipe: LayerPipeline
    _lock: threading.Condition
    _requests: dict[str, RequestState]
    _queue: deque[tuple[str, int, torch.cuda.Event | None]]
    _waker: Waker
    _data: threading.Lock

    def _mark(self, what: str, request_id: str) -> None:
        if self._pipe.trace is not None:
            self._pipe.trace.append((time.perf_counter(), what, request_id, -1))

    _poller: zmq.Poller | None
    _peers: dict[str, Any]
    _commands: Any
    _take_layers: bool

    if TYPE_CHECKING:
        def _complete(self) -> bool: ...
        def _on_message(self, peer: Any, msg: m.Message) -> None: ...

    def _can_take_layer(self) -> bool:
        """Whether the oldest queued request-layer can enter the pipeline now (or be dropped: its
        request ended); False with an empty queue."""
        if not self._queue:
            return False
        with self._lock:
            st = self._requests.get(self._queue[0][0])
        if st is None or st.status.is_terminal:
            return True
        return self._pipe.can_start(len(st.extra["src_ids"]), st.extra["runs"] is not None)

    def _can_post(self) -> bool:
        """Whether a request-layer not yet posted can be posted (or dropped) now: its request is
        terminal, or begun and its CUDA event completed (always, on CPU). Only the oldest begun one's
        event is queried (one query per look, not depth): events complete in the order send_layer
        recorded them, so a later one found complete a nap later loses at most that nap."""
        if not self._pipe.unposted:  # every look of a nap: no lock, no list while all are posted
            return False
        with self._lock:
            states = [(op, self._requests[op.request_id]) for op in self._pipe.ops if not op.posted]
        for op, st in states:
            if st.status.is_terminal:
                return True
            if st.extra["begun"]:
                return op.ready is None or bool(op.ready.query())
        return False

    def _poll_peers(self) -> None:
        """Handle control messages, after a wait unless this step has work it can do now (a command,
        a queued layer that can enter the pipeline, a layer to post: send_path.py).

        Idle (nothing queued or in flight): sleep in the zmq poller up to IDLE_POLL_MS (heartbeats,
        deadlines). Busy but only waiting for CUDA events or write completions, which signal nothing:
        naps of `config.busy_wait_s` with the GIL released (send_path._nap_busy, wakeup.nap: select()
        on the waker and the sockets' fds; zmq's own poll counts whole milliseconds) up to
        IDLE_POLL_MS, so the loop no longer spins and takes the GIL from the producer (issue #3), while
        a Done, a command or a send_layer the pipeline has room for still ends the nap at once. Chosen
        over a plain time.sleep(busy_wait_s), which a Done could not cut short. A send_layer into a
        full pipeline sends no wake byte (`_take_layers`): the loop could not start it before a
        completion, which a nap's timeout finds."""
        if self._poller is None:  # rebuilt only when a peer is added
            self._poller = zmq.Poller()
            self._poller.register(self._waker.fd, zmq.POLLIN)
            for p in self._peers.values():
                self._poller.register(p.sock, zmq.POLLIN)
        busy = bool(self._queue or self._pipe.ops)
        now = not self._commands.empty() or (busy and (self._can_take_layer() or self._can_post()))
        if not now:
            self._take_layers = self._pipe.capacity > 0
            self._waker.sleeping = True  # then look again: work queued before this sent no byte
            now = not self._commands.empty() or self._can_take_layer()
        if now:
            ready = dict(self._poller.poll(0))
        elif busy:
            woke = self._nap_busy([p.sock for p in self._peers.values()], IDLE_POLL_MS / 1e3)
            ready = dict(self._poller.poll(0)) if woke else {}
        else:
            self._mark("idle", "")
            ready = dict(self._poller.poll(IDLE_POLL_MS))
            self._mark("idle_end", "")
        self._waker.sleeping = False
        if self._waker.fd in ready:
            self._waker.drain()
        for p in list(self._peers.values()):
            while p.sock in ready:
                try:
                    msg = m.decode_from(p.sock.recv(zmq.NOBLOCK), p.address)
                    if msg is not None:  # garbage is logged and skipped: the loop lives on
                        self._on_message(p, msg)
                except zmq.Again:
                    break

    def _nap_busy(self, socks: list[Any], cap_s: float) -> bool:
        """Wait with the GIL released while the data path only waits for send_layer events or write
        completions, which signal nothing: naps (wakeup.nap), and between two only those are looked at
        (completions handled here, by _complete), so each look costs the producer thread little GIL
        time. A nap is `config.busy_wait_s`, except while the one write in flight has a predicted end
        (lookahead.nap_length, pipeline.lone_write): one long nap up to shortly before it, then a look
        every `config.fine_wait_s` until shortly after it (NIXL sends the write's notification from
        the look that finds it complete). Returns True as soon as the waker or a socket in `socks` is
        readable (a command, a send_layer, a message: the caller reads them) or a nap ended while a
        hand-off held the data lock (`_relock`), False once an event completed, a write finished or
        `cap_s` seconds passed (housekeeping is due)."""
        c = self.config
        now = time.monotonic()
        end = now + cap_s
        self._mark("nap", "")
        while True:
            t = nap_length(now, self._pipe.lone_write(), c.busy_wait_s, c.fine_wait_s)
            if t > c.busy_wait_s:
                self._mark("nap:long", "")  # (bench --trace) the look-ahead skips looks up to near the end
            woke = nap(self._waker, socks, min(t, max(0.0, end - now)))
            if woke:
                self._mark("nap_end", "")
                return True
            if self._can_post() or self._complete():
                self._mark("nap_end", "")
                return False
            now = time.monotonic()
            if now >= end:
                self._mark("nap_end", "")
                return False
