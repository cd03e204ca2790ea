"""The receiver's handling of messages.Withdraw (a mixin of KVReceiver, run on its loop thread): a
sender made terminal a request whose Begin it never sent, so it will never claim nor write it.

Only a sender that completed the handshake gets here (KVReceiver._on_message answers any other with
Rehandshake). The request ends only if it is of this receiver's epoch, still PENDING and claimed by no
sender: no sender ever wrote into its blocks, so they are releasable at once (the block-lifetime rule of
receiver.py holds); a claimed request (Begin accepted, from this sender or another one) is never ended
by a Withdraw, it ends by Done, Stopped, Abort or its deadline as before.
"""

from __future__ import annotations

from kvtransfer import wire as m
from kvtransfer.api import TransferStatus
from kvtransfer.endpoint import Endpoint

S = TransferStatus


class WithdrawReceiver(Endpoint):
    """Withdraw handling of KVReceiver (its base; the state is Endpoint's)."""

    def _on_withdraw(self, msg: m.Withdraw) -> None:
        """End the PENDING, unclaimed request `msg.request_id` of this epoch: ABORTED ("aborted by
        sender before Begin") or FAILED (with the sender's reason). Anything else: ignored."""
        if msg.receiver_epoch != self.epoch:
            return  # meant for another incarnation of this receiver
        with self._lock:
            st = self._requests.get(msg.request_id)
            if st is None or st.status is not S.PENDING or st.extra["sender"] is not None:
                return
            self._set(st, S.ABORTED if msg.aborted else S.FAILED,
                      "aborted by sender before Begin" if msg.aborted
                      else f"sender gave up before Begin: {msg.reason}")
