"""Summary of a `bench.kvtransfer.transfer --trace` round: where every µs between the first send_layer
and the sender seeing DONE went (three gaps: (a) the hand-off calls and the loop taking layers up, (b)
posting each write, (c) the tail from the last write to DONE), from the events of KVSender.set_trace,
KVReceiver.set_trace (a spawned process: time.perf_counter() is CLOCK_MONOTONIC on Linux, one clock
for every process of the host) and the benchmark thread.

Events: (time.perf_counter() s, what, request_id, layer or count). Benchmark thread: sl_begin/sl_end
around its hand-off calls (send_layer per layer, or send_layers per request), wait_end when wait()
returned. Sender loop: gather (a layer taken up), post:start (the loop builds a write), post:build
(notices encoded, transport called), post:descs (descriptor indices/lists ready; count = descriptors
before NIXL's merge; absent for a write pre-made at Begin time), post:init (make_prepped_xfer /
initialize_xfer returned, or the pre-made write taken), post:transfer (transfer() returned), post (per
layer, after the write call), done (per layer, the write tested complete), done_msg (the receiver's
Done read), DONE (status set). Receiver: notice (per layer, its notification read), done_sent.
"""

from __future__ import annotations

Event = tuple[float, str, str, int]


def _span(times: list[float]) -> str:
    if not times:
        return "-"
    lo, hi = f"{min(times):.0f}", f"{max(times):.0f}"
    return lo if lo == hi else f"{lo}..{hi}"


def timeline(events: list[Event], t0: float, dt: float) -> list[str]:
    """Two lines (each starting with "# "): the round's total `dt` s, then per layer the µs after `t0`
    at which its gather (or direct take-up), post and completion ran (-1: not seen)."""
    rows: dict[int, dict[str, float]] = {}
    for t, what, _rid, layer in events:
        if what in ("gather", "post", "done"):  # the per-layer events of pipeline.py
            rows.setdefault(layer, {})[what] = (t - t0) * 1e6
    cells = [f"{la}: {r.get('gather', -1):.0f}/{r.get('post', -1):.0f}/{r.get('done', -1):.0f}"
             for la, r in sorted(rows.items())]
    return [f"# trace: total {dt * 1e6:.0f} us; layer: gather / post / done (us)", "# " + "; ".join(cells)]


def summarize(events: list[Event], t0: float, layers: int, requests: int,
              handoff: str = "layer") -> list[str]:
    """Lines (each starting with "# ") splitting the round into gaps (a) take-up, (b) post, (c) tail,
    in µs after `t0` (the clock start). `handoff` "layer": `layers` × `requests` send_layer calls were
    made; "request": `requests` send_layers calls. Raises ValueError for another `handoff`."""
    if handoff not in ("layer", "request"):
        raise ValueError(f"handoff must be 'layer' or 'request', got {handoff!r}")
    ev = sorted(events)
    at: dict[str, list[float]] = {}
    for t, what, _rid, _n in ev:
        at.setdefault(what, []).append((t - t0) * 1e6)

    def first(k: str) -> float:
        return at[k][0] if k in at else float("nan")
    calls, call = (layers * requests, "send_layer") if handoff == "layer" else (requests, "send_layers")
    loop = first("sl_end") - first("sl_begin")
    lines = [f"# (a) {call} loop {first('sl_begin'):.0f}..{first('sl_end'):.0f} us "
             f"({loop / calls:.1f} us per call, {calls} calls); layers taken up by the sender loop at "
             f"{_span(at.get('gather', []))}"]
    writes = _writes(ev, t0)
    for i, w in enumerate(writes[:8]):
        descs = f"+descs {w[2] - w[1]:.0f} ({w[5]} descriptors)" if w[5] >= 0 else "pre-made write"
        lines.append(f"# (b) write {i}: start {w[0]:.0f}, +build {w[1] - w[0]:.0f}, {descs}, "
                     f"+init {w[3] - w[2]:.0f}, +transfer() {w[4] - w[3]:.0f} → posted at {w[4]:.0f} us")
    if len(writes) > 8:
        lines.append(f"# (b) ... {len(writes) - 8} more writes, last posted at {writes[-1][4]:.0f} us")
    lines.append(_loop_line(at, writes[0][4] if writes else float("inf")))
    lines.append(f"# (c) writes complete (sender) {_span(at.get('done', []))}; receiver read notices "
                 f"{_span(at.get('notice', []))}, sent Done {_span(at.get('done_sent', []))}; sender read "
                 f"Done {_span(at.get('done_msg', []))}, set DONE {_span(at.get('DONE', []))}; "
                 f"wait() returned {_span(at.get('wait_end', []))}")
    return lines


def _loop_line(at: dict[str, list[float]], until: float) -> str:
    """The sender loop before the first write was posted (µs): step starts, naps and idle polls
    (start-end), the first 12 of each."""
    def spans(a: str, b: str) -> str:  # each start with the first end at or after it
        ends = at.get(b, [])
        pairs = [(s, next((e for e in ends if e >= s), float("nan"))) for s in at.get(a, []) if s < until]
        return ", ".join(f"{s:.0f}-{e:.0f}" for s, e in pairs[:12]) or "-"
    steps = ", ".join(f"{t:.0f}" for t in [t for t in at.get("step", []) if t < until][:12]) or "-"
    return f"# (d) sender loop before the first post: steps at {steps}; naps {spans('nap', 'nap_end')}; " \
           f"idle polls {spans('idle', 'idle_end')}"


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
                b = cur.get("build", s)
                d = cur.get("descs", b)  # none for a pre-made write (SendTransport.post_whole)
                i = cur.get("init", d)
                out.append((s, b, d, i, cur["transfer"], n))
                cur = {}
    return out


def raw(events: list[Event], t0: float, until_us: float = 3000.0) -> list[str]:
    """Every event of the round up to `until_us` µs after `t0` except the per-layer ones (one line each:
    µs, what, count), for reading the loops' steps, naps and messages in order."""
    per_layer = ("gather", "post", "done", "notice")
    return [f"# raw {(t - t0) * 1e6:9.0f} {what} {n}" for t, what, _rid, n in sorted(events)
            if (t - t0) * 1e6 < until_us and what not in per_layer]
