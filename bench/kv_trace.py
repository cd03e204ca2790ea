"""Summary of a `bench/kv_transfer.py --trace` round: where every µs between the first send_layer and
the sender seeing DONE went (issue #3's three gaps), from the events of KVSender.set_trace,
KVReceiver.set_trace (a spawned process: time.perf_counter() is CLOCK_MONOTONIC on Linux, one clock
for every process of the host) and the benchmark thread.

Events: (time.perf_counter() s, what, request_id, layer or count). Benchmark thread: sl_begin/sl_end
around its send_layer calls, wait_end when wait() returned. Sender loop: gather (a layer taken up),
post:start (the loop builds a write), post:build (notices encoded, transport called), post:descs
(descriptor indices/lists ready; count = descriptors before NIXL's merge), post:init
(make_prepped_xfer / initialize_xfer returned), post:transfer (transfer() returned), post (per layer,
after the write call), done (per layer, the write tested complete), done_msg (the receiver's Done read),
DONE (status set). Receiver: notice (per layer, its notification read), done_sent.
"""

from __future__ import annotations

Event = tuple[float, str, str, int]


def _span(times: list[float]) -> str:
    if not times:
        return "-"
    lo, hi = f"{min(times):.0f}", f"{max(times):.0f}"
    return lo if lo == hi else f"{lo}..{hi}"


def summarize(events: list[Event], t0: float, layers: int, requests: int) -> list[str]:
    """Lines (each starting with "# ") splitting the round into gaps (a) take-up, (b) post, (c) tail,
    in µs after `t0` (the clock start). `layers` × `requests` send_layer calls were made."""
    ev = sorted(events)
    at: dict[str, list[float]] = {}
    for t, what, _rid, _n in ev:
        at.setdefault(what, []).append((t - t0) * 1e6)

    def first(k: str) -> float:
        return at[k][0] if k in at else float("nan")
    calls = layers * requests
    loop = first("sl_end") - first("sl_begin")
    lines = [f"# (a) send_layer loop {first('sl_begin'):.0f}..{first('sl_end'):.0f} us "
             f"({loop / calls:.1f} us per call, {calls} calls); layers taken up by the sender loop at "
             f"{_span(at.get('gather', []))}"]
    writes = _writes(ev, t0)
    for i, w in enumerate(writes[:8]):
        lines.append(f"# (b) write {i}: start {w[0]:.0f}, +build {w[1] - w[0]:.0f}, +descs {w[2] - w[1]:.0f} "
                     f"({w[5]} descriptors), +init {w[3] - w[2]:.0f}, +transfer() {w[4] - w[3]:.0f} "
                     f"→ posted at {w[4]:.0f} us")
    if len(writes) > 8:
        lines.append(f"# (b) ... {len(writes) - 8} more writes, last posted at {writes[-1][4]:.0f} us")
    lines.append(f"# (c) writes complete (sender) {_span(at.get('done', []))}; receiver read notices "
                 f"{_span(at.get('notice', []))}, sent Done {_span(at.get('done_sent', []))}; sender read "
                 f"Done {_span(at.get('done_msg', []))}, set DONE {_span(at.get('DONE', []))}; "
                 f"wait() returned {_span(at.get('wait_end', []))}")
    return lines


def _writes(ev: list[Event], t0: float) -> list[tuple[float, float, float, float, float, int]]:
    """(start, build, descs, init, transfer, descriptors) of each write, µs after t0, in order."""
    out: list[tuple[float, float, float, float, float, int]] = []
    cur: dict[str, float] = {}
    n = -1
    for t, what, _rid, count in ev:
        if what == "post:start":
            cur, n = {"start": (t - t0) * 1e6}, -1
        elif what.startswith("post:") and cur:
            cur[what[5:]] = (t - t0) * 1e6
            n = count if what == "post:descs" else n
            if what == "post:transfer":
                s = cur["start"]
                b, d, i = (cur.get(k, s) for k in ("build", "descs", "init"))
                out.append((s, b, d, i, cur["transfer"], n))
                cur = {}
    return out
