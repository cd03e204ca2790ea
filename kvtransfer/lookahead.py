"""Completion look-ahead of the sender's busy nap (no torch): when will the write in flight complete?

The sender loop learns that a write completed only by looking (SendTransport.test; NIXL's UCX backend
even sends the write's notification from that look when the write was still in progress after
transfer(), so the receiver hears of the data no sooner than the sender's next look). Looking every
`busy_wait_s` (50 µs) costs up to a nap of latency per write; looking more often costs the prefill
thread GIL grabs for the whole write. `WriteRate` estimates the transport's rate from writes completed
so far, and `nap_length` uses it: naps halving the time left to shortly before the predicted end (a
1.4 ms write: ~5 looks instead of ~28), a look every `fine_wait_s` from there to shortly after the
end, `busy_wait_s` naps again after that (a write slower than predicted) or when there is no
estimate yet.

Why "fastest, then a slow decay": a completion is seen at or after the moment it happened, so every
sample (bytes / seconds from post to the look that saw it done) is at most the true rate. A faster
sample is thus the better one and replaces the estimate at once; a slower one (a real slow-down, or a
look that came late) moves it `decay` of the way down, so one late look barely shifts it and a lasting
slow-down is learned within a few writes. An estimate too high predicts early (more fine looks, no
added latency). One too low predicts late: the halving naps then see the write within half the time
predicted, not at the late prediction, and that sample, faster than the estimate, replaces it (a
4.6x too low estimate is right again after two writes). A single nap up to the prediction would not
correct it: one write slowed by the GIL would teach a low rate, and each later write, seen at its late
prediction, would teach it again.
"""

from __future__ import annotations

LEAD_FRACTION = 0.05  # fine looks from this fraction of the predicted duration before its end to after it
LEAD_MAX_NAPS = 4  # ... but from at most this many busy naps: a 1 s write gets 80 fine looks, not 20 000
MIN_SAMPLE_NAPS = 4  # the sender learns only from writes lasting this many busy naps (WriteRate.min_seconds)


class WriteRate:
    """Estimated rate of one transport's writes, bytes per second (None until a write was observed).

    min_seconds: shorter samples are ignored (their duration is mostly the nap that saw them done and
    the post's fixed cost, not bytes). decay: how far (0..1] a slower sample moves the estimate.
    Raises ValueError for a decay outside (0, 1] or a negative min_seconds."""

    def __init__(self, min_seconds: float = 0.0, decay: float = 0.25) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if not min_seconds >= 0:
            raise ValueError(f"min_seconds must be >= 0, got {min_seconds}")
        self.min_seconds = min_seconds
        self.decay = decay
        self.bytes_per_s: float | None = None

    def observe(self, nbytes: int, seconds: float) -> None:
        """A write of `nbytes` bytes was seen complete `seconds` after it was posted (it had the
        transport to itself). Ignored when shorter than min_seconds or empty."""
        if nbytes <= 0 or seconds <= 0 or seconds < self.min_seconds:
            return
        sample = nbytes / seconds
        if self.bytes_per_s is None or sample >= self.bytes_per_s:
            self.bytes_per_s = sample
        else:
            self.bytes_per_s += self.decay * (sample - self.bytes_per_s)

    def predict(self, nbytes: int) -> float | None:
        """Expected seconds from post to completion of a write of `nbytes` bytes; None without an
        estimate."""
        return None if self.bytes_per_s is None else nbytes / self.bytes_per_s


def nap_length(now: float, write: tuple[float, float] | None, busy_s: float, fine_s: float) -> float:
    """Seconds the sender loop should nap before its next look, at monotonic time `now` (s).

    write: (posted_at monotonic s, expected duration s) of the one write in flight, or None (no
    prediction: several writes, layers waiting to be posted, no estimate yet). Without one, or for a
    write expected to last no longer than a nap, `busy_s`. Else, with lead = LEAD_FRACTION × expected
    kept within [busy_s, LEAD_MAX_NAPS × busy_s], due = posted_at + expected and left = due - lead -
    now: while left > 2 × busy_s, half of it (the caller caps it by its housekeeping cap; a waker byte
    or message still ends it), then `left` (at least `fine_s`), then `fine_s` until due + lead, then
    `busy_s` again (a write slower than predicted does not make the loop spin)."""
    if write is None:
        return busy_s
    posted_at, expected = write
    if expected <= busy_s:
        return busy_s
    lead = min(max(busy_s, LEAD_FRACTION * expected), LEAD_MAX_NAPS * busy_s)
    due = posted_at + expected
    left = due - lead - now
    if left > 2 * busy_s:
        return left / 2
    if left > 0:
        return max(fine_s, left)
    if now < due + lead:
        return fine_s
    return busy_s
