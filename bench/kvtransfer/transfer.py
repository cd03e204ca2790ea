"""KV transfer bandwidth: one request of N tokens of a Llama-3-8B-shaped cache (32 layers, 8 KV heads,
head_dim 128, bf16, block_size 16), sent layer by layer from this process (prefill side) into a
receiver in a spawned process (decode side), for each backend.

Reported GB/s = request KV bytes / (clock start → the sender's status becomes DONE), and / (clock
start → the receiver has every layer and knows it: "landed", when a decode worker may schedule the
request; the sender hears of it one control message later), each with its ratio to a baseline
measured in the same run. The clock starts before add_request (the Begin round trip counts), with
--begun at the first send_layer (in serving add_request precedes the prefill forward pass). Each GB/s
is the best of `--repeat` rounds after a warm-up round (the handshake and registration happen in it),
printed with the min–max over those rounds. Baseline: on CPU a same-process memcpy of the same bytes
(capped at 512 MiB); with `--device cuda` a torch peer copy GPU0 → GPU1 of the same bytes (the receiver
then lives on cuda:1); the best of 20 copies after 3 untimed ones, both devices synchronised around
each.

    .venv/bin/python -m bench.kvtransfer.transfer [--device cpu|cuda] [--tokens 1024 4096 32768]
        [--backends nixl ucx loopback] [--path staged|direct|both] [--repeat 3] [--scatter] [--depth 4]
        [--verify] [--handoff layer|request]

--backends loopback: the receiver runs in a thread of this process (the loopback transport copies
within one process): the sender's and receiver's own costs without a transport between processes.

--path: "direct" sends from contiguous source blocks (one run: written straight from kv_buffer, no
gather); "staged" from a shuffled permutation of them (fragmented: gathered into the staging ring).
--depth: TransferConfig.max_inflight_layers of the sender. --trace: per-layer timeline of the last
round (gather launched or direct layer started, write posted, write complete, in µs after the first
send_layer) and its split into gaps (bench/kvtransfer/trace.py: the send_layer loop, each write's
build / descriptors / init / transfer(), the DONE round trip through the receiver). --extra-blocks:
both kv_buffers get this many blocks more than the requests use, so a request's K and V (and layers)
are not adjacent in memory as in serving (by default they are, and the direct pieces merge).
--handoff: "layer" (default) hands the KV over by one send_layer per layer (as a prefill forward
pass does), "request" by one send_layers call per request (its whole KV is in kv_buffer already): one
CUDA event and one wake-up for every layer, which the sender loop takes up and posts like send_layer's
(one write per receiver per step, at most --depth request-layers in flight).
--verify: CRC32 of every request-layer checked on arrival (bit-exactness through the real
transport; slow: copies to host).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import multiprocessing as mp
import os
import platform
import random
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import torch

from bench.kvtransfer.trace import raw, summarize, timeline
from bench.timing import MIN_CEILING_REPEATS, Spread, ceiling_seconds

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
LAYERS, HEADS, DIM, BS, DTYPE = 32, 8, 128, 16, torch.bfloat16


def _kv(num_blocks: int, device: str) -> torch.Tensor:
    return torch.zeros(LAYERS, 2, num_blocks, BS, HEADS, DIM, dtype=DTYPE, device=device)


PEER_TIMEOUT_S = [2.0]  # TransferConfig.peer_timeout_s of both sides (--peer-timeout; the default)
WARM_S = [0.0]  # --warm-us: the benchmark thread keeps busy this long after the Begin answer
NIXL_ERRORS = ["peer"]  # TransferConfig.nixl_error_handling of both sides (--nixl-error-handling)
BUSY_WAIT_S = [50e-6]  # TransferConfig.busy_wait_s of both sides (--busy-wait-us; the default)


def _config(worker_id: str, backend: str, depth: int = 4, verify: bool = False,  # type: ignore[no-untyped-def]
            peer_timeout_s: float | None = None):
    from kvtransfer import TransferConfig

    return TransferConfig(worker_id=worker_id, model_id="llama-3-8b-shape", backend=backend, timeout_s=120,
                          max_inflight_layers=depth, checksum=verify,
                          peer_timeout_s=peer_timeout_s or PEER_TIMEOUT_S[0], busy_wait_s=BUSY_WAIT_S[0],
                          fine_wait_s=min(5e-6, BUSY_WAIT_S[0]), nixl_error_handling=NIXL_ERRORS[0])


def receiver_main(conn: Connection, backend: str, num_blocks: int, device: str, verify: bool = False,
                  peer_timeout_s: float = 2.0, busy_wait_s: float = 50e-6, nixl_errors: str = "peer") -> None:
    """Decode side: expect requests on demand, report when they are DONE; ("trace",) turns its trace
    on and answers with the events recorded since the last such command."""
    from kvtransfer import get_transfer_backend

    BUSY_WAIT_S[0], NIXL_ERRORS[0] = busy_wait_s, nixl_errors

    rx = get_transfer_backend(backend).receiver(_config("bench-d", backend, verify=verify,
                                                        peer_timeout_s=peer_timeout_s),
                                                _kv(num_blocks, device))
    conn.send(None)
    trace: list[tuple[float, str, str, int]] = []
    while (cmd := conn.recv())[0] != "close":
        if cmd[0] == "trace":
            conn.send(trace)
            trace = []
            rx.set_trace(trace)
        elif cmd[0] == "expect":
            conn.send(msgspec.msgpack.encode(rx.expect(cmd[1], cmd[2])))
        elif cmd[0] == "wait":
            status = rx.wait(cmd[1], 120)
            conn.send((status.name if status.name == "DONE" else f"{status.name}: {rx.reason(cmd[1])}",
                       rx.ended_at(cmd[1])))
            if status.name == "DONE":
                rx.release(cmd[1])
    rx.close()
    conn.send(None)


def _baseline(nbytes: int, device: str) -> Spread:
    """GB/s of copying `nbytes` (capped at 512 MiB to bound memory) between two fresh buffers: CPU
    memcpy (ctypes.memmove), or a GPU0 → GPU1 peer copy (host clock, both devices synchronised: the copy
    spans two devices). The best of 20 after 3 untimed copies is the baseline (`.max`)."""
    cpu = device == "cpu"
    nbytes = min(nbytes, 512 << 20)
    src = torch.ones(nbytes, dtype=torch.uint8, device="cpu" if cpu else "cuda:0")
    dst = torch.ones(nbytes, dtype=torch.uint8, device="cpu" if cpu else "cuda:1")

    def copy() -> None:
        if cpu:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        else:
            torch.cuda.synchronize("cuda:0")
            dst.copy_(src)
            torch.cuda.synchronize("cuda:0")
            torch.cuda.synchronize("cuda:1")
    return ceiling_seconds(copy, torch.device("cpu"), MIN_CEILING_REPEATS).per(nbytes / 1e9)


def _one(backend: str, tokens: int, device: str, repeat: int, scatter: bool, depth: int = 4,
         verify: bool = False, trace: bool = False, path: str = "direct", begun: bool = False,
         concurrent: int = 1, extra_blocks: int = 0, handoff: str = "layer") -> tuple[Spread, Spread]:
    """GB/s of `repeat` rounds over `backend`, by `path`: (to the sender seeing DONE, to the receiver
    knowing every layer landed), each over the rounds (the best is `.max`). A round sends `concurrent`
    requests of `tokens` tokens each (layer by layer, interleaved across requests) and ends when all
    are DONE; GB/s = all their KV bytes / (first send_layer → last DONE). With `begun` the clock starts
    once the receiver answered every Begin (as in serving, where add_request precedes the prefill forward
    pass).
    `handoff`: "layer" (one send_layer per request-layer) or "request" (one send_layers per request)."""
    from kvtransfer import get_transfer_backend

    n = tokens // BS
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    rx_device = device if device == "cpu" else "cuda:1"
    args = (child, backend, n * concurrent + extra_blocks, rx_device, verify, PEER_TIMEOUT_S[0],
            BUSY_WAIT_S[0], NIXL_ERRORS[0])
    proc: threading.Thread | mp.process.BaseProcess
    if backend == "loopback":  # its transport copies within one process: the receiver is a thread here
        proc = threading.Thread(target=receiver_main, args=args, daemon=True)
    else:
        proc = ctx.Process(target=receiver_main, args=args, daemon=True)
    proc.start()
    conn.recv()
    src = torch.randn(LAYERS, 2, n * concurrent + extra_blocks, BS, HEADS, DIM,
                      device=device if device == "cpu" else "cuda:0").to(DTYPE)
    tx = get_transfer_backend(backend).sender(_config("bench-p", backend, depth, verify), src)
    src_ids, dst_ids = _block_ids(n, concurrent, path, scatter)
    rates: list[float] = []
    rates_landed: list[float] = []
    try:
        for i in range(repeat + 1):  # the first round warms up (handshake, registration)
            rids = [f"r{i}-{j}" for j in range(concurrent)]
            events: list[tuple[float, str, str, int]] | None = None
            if trace and i == repeat:
                events = []
                tx.set_trace(events)
                conn.send(("trace",))
                conn.recv()
            t, dt, dt_landed = _round(tx, conn, rids, src_ids, dst_ids, begun, path, events, handoff)
            if i:
                nbytes = LAYERS * 2 * n * concurrent * BS * HEADS * DIM * 2
                rates.append(nbytes / dt / 1e9)
                rates_landed.append(nbytes / dt_landed / 1e9)
            if events is not None:
                tx.set_trace(None)
                conn.send(("trace",))
                events += conn.recv()
                print("\n".join(timeline(events, t, dt) + summarize(events, t, LAYERS, concurrent, handoff)
                                 + (raw(events, t) if os.environ.get("PDSERVE_KV_TRACE_RAW") else [])))
    finally:
        tx.close()
        conn.send(("close",))
        conn.recv()
        proc.join(30)
    return Spread.of(rates), Spread.of(rates_landed)


def _round(tx: object, conn: Connection, rids: list[str], src_ids: list[list[int]], dst_ids: list[list[int]],
           begun: bool, path: str, events: list[tuple[float, str, str, int]] | None = None,
           handoff: str = "layer") -> tuple[float, float, float]:
    """One round: expect, add, send every layer of every request (`handoff` "layer": send_layer per
    layer, interleaved across requests; "request": one send_layers per request), wait, check and
    release; returns (clock start (perf_counter s), seconds to the last DONE seen by the sender, seconds
    to the last request DONE on the receiver: every layer landed and known there). `events` gets the
    benchmark thread's trace events (sl_begin, sl_end around the hand-off calls, wait_end) when given."""
    from kvtransfer import KVHandle, TransferStatus

    handles = []
    for rid, dst in zip(rids, dst_ids, strict=True):
        conn.send(("expect", rid, dst))
        handles.append(msgspec.msgpack.decode(conn.recv(), type=KVHandle))
    t = time.perf_counter()
    for handle, ids in zip(handles, src_ids, strict=True):
        tx.add_request(handle, ids)  # type: ignore[attr-defined]
    if begun:
        for rid in rids:
            assert tx.wait_until(functools.partial(_begun, tx, rid), 30), "no Begin"  # type: ignore[attr-defined]
        _keep_busy(WARM_S[0], tx.kv_buffer)  # type: ignore[attr-defined]
        t = time.perf_counter()
    t_sl = time.perf_counter()
    if handoff == "request":
        for rid in rids:
            tx.send_layers(rid)  # type: ignore[attr-defined]
    else:
        for layer in range(LAYERS):
            for rid in rids:
                tx.send_layer(rid, layer)  # type: ignore[attr-defined]
    t_end = time.perf_counter()
    statuses = [tx.wait(rid, 120) for rid in rids]  # type: ignore[attr-defined]
    t_wait = time.perf_counter()
    # when the sender's status became DONE, not when this thread woke from wait() (on the H200 VM a
    # thread asleep in a condition wait woke 0.1-0.2 ms after the notify: the benchmark's cost)
    dt = max((tx.ended_at(rid) or t_wait) for rid in rids) - t  # type: ignore[attr-defined]
    if events is not None:
        events += [(t_sl, "sl_begin", "", -1), (t_end, "sl_end", "", -1), (t_wait, "wait_end", "", -1)]
    landed = max(_finish(tx, conn, rid, status, path, TransferStatus.DONE)
                 for rid, status in zip(rids, statuses, strict=True))
    return t, dt, landed - t


def _keep_busy(seconds: float, kv: torch.Tensor) -> None:
    """Run Python and CUDA stream queries for `seconds` (--warm-us), as a prefill thread that hands its
    KV off straight from running the forward pass: on the H200 VM a thread woken from a wait ran its
    next Python 2.4× and CUDA calls 30-50× slower (docs/benchmarks/kvtransfer.md)."""
    end = time.perf_counter() + seconds
    stream = torch.cuda.current_stream(kv.device) if kv.is_cuda else None
    while time.perf_counter() < end:
        if stream is not None:
            stream.query()


def _block_ids(n: int, concurrent: int, path: str, scatter: bool) -> tuple[list[list[int]], list[list[int]]]:
    """(source, destination) block ids of each request, n blocks each: staged sources shuffled;
    scattered destinations with no two adjacent."""
    src_ids, dst_ids = [], []
    for j in range(concurrent):
        ids = list(range(j * n, (j + 1) * n))
        if path == "staged":
            random.Random(j).shuffle(ids)
        src_ids.append(ids)
        dst = list(range(j * n, (j + 1) * n))
        dst_ids.append(dst[::2] + dst[1::2] if scatter else dst)
    return src_ids, dst_ids


def _finish(tx: object, conn: Connection, rid: str, status: object, path: str, done: object) -> float:
    """Check one request went by `path` and is DONE on both sides, then release it; returns when it
    became DONE on the receiver (time.perf_counter() s of that process: the same clock on Linux)."""
    direct = tx.snapshot(rid).direct  # type: ignore[attr-defined]
    assert direct == (path == "direct"), f"{path} row went {'direct' if direct else 'staged'}"
    conn.send(("wait", rid))
    got, landed = conn.recv()
    if got != "DONE" or status is not done:
        why = f"receiver: {got}; sender: {status.name}: {tx.reason(rid)}"  # type: ignore[attr-defined]
        hint = ("\n  a side heard nothing from its peer for peer_timeout_s: its loop thread was starved that "
                "long (an overloaded machine), not a transfer bug; retry with a larger --peer-timeout"
                if "lost (no heartbeat" in why else "")
        raise AssertionError(f"request {rid} ({path}) did not end DONE on both sides: {why}{hint}")
    # DONE comes from the receiver; our own completion test of the last write may lag a step
    assert tx.wait_until(functools.partial(_drained, tx, rid), 30), "writes stuck"  # type: ignore[attr-defined]
    tx.release(rid)  # type: ignore[attr-defined]
    return float(landed)


def _begun(tx: Any, rid: str) -> bool:
    """The receiver answered the request's Begin."""
    return bool(tx.snapshot(rid).answered)


def _drained(tx: Any, rid: str) -> bool:
    """No request-layer of the request is in flight on the sender any more."""
    return bool(tx.snapshot(rid).inflight == 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 32768])
    p.add_argument("--backends", nargs="+", default=["nixl", "ucx"])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--scatter", action="store_true", help="destination blocks not adjacent (worst case)")
    p.add_argument("--depth", type=int, default=4, help="request-layers in flight (max_inflight_layers)")
    p.add_argument("--verify", action="store_true", help="CRC32 of every request-layer checked on arrival")
    p.add_argument("--trace", action="store_true", help="per-layer timeline of the last round")
    p.add_argument("--begun", action="store_true",
                   help="start the clock once the Begin round trip is done (it overlaps prefill compute)")
    p.add_argument("--concurrent", type=int, default=1,
                   help="requests in flight per round (GB/s then counts all their bytes)")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval (s) for this process: GIL hand-off latency")
    p.add_argument("--peer-timeout", type=float, default=2.0,
                   help="TransferConfig.peer_timeout_s (s of silence before a peer is declared lost)")
    p.add_argument("--busy-wait-us", type=float, default=50.0,
                   help="TransferConfig.busy_wait_s of both sides, in µs (a busy loop's longest nap)")
    p.add_argument("--nixl-error-handling", default="peer", choices=["peer", "none"],
                   help="TransferConfig.nixl_error_handling of both sides (none: UCX shared memory "
                        "for the notices)")
    p.add_argument("--warm-us", type=float, default=0.0,
                   help="with --begun: the benchmark thread keeps busy (Python, CUDA stream queries) this "
                        "many µs after the Begin answer, before the clock starts, as a forward pass would")
    p.add_argument("--extra-blocks", type=int, default=0,
                   help="blocks beyond the requests' in both kv_buffers (K, V and layers not adjacent)")
    p.add_argument("--handoff", default="layer", choices=["layer", "request"],
                   help="layer: one send_layer per layer; request: one send_layers per request")
    p.add_argument("--path", default="both", choices=["staged", "direct", "both"],
                   help="direct: contiguous source blocks; staged: shuffled ones (gathered)")
    args = p.parse_args()
    PEER_TIMEOUT_S[0] = args.peer_timeout
    BUSY_WAIT_S[0] = args.busy_wait_us * 1e-6
    WARM_S[0] = args.warm_us * 1e-6
    NIXL_ERRORS[0] = args.nixl_error_handling
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {platform.node()} {os.cpu_count()} cores, torch "
          f"{torch.__version__}, device {args.device}, depth {args.depth}, hand-off per {args.handoff}"
          f"{', scattered blocks' if args.scatter else ''}{', clock after Begin' if args.begun else ''}"
          f"{', verified (CRC32)' if args.verify else ''}, {args.extra_blocks} extra blocks, "
          f"{args.concurrent} request(s) per round, "
          f"GIL switch interval {sys.getswitchinterval() * 1e3:g} ms, busy wait {args.busy_wait_us:g} µs, "
          f"warm {args.warm_us:g} µs, NIXL UCX error handling {args.nixl_error_handling}")
    print("| tokens | MiB | baseline GB/s: best of 20 | backend | path | hand-off | GB/s to sender DONE: "
          "best (min–max) | best / baseline | GB/s to landed: best (min–max) | best / baseline |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    paths = ["staged", "direct"] if args.path == "both" else [args.path]
    for tokens in args.tokens:
        layer_bytes = 2 * tokens * HEADS * DIM * 2
        copies = _baseline(LAYERS * layer_bytes, args.device)
        base = copies.max
        for backend in args.backends:
            for path in paths:
                done, landed = _one(backend, tokens, args.device, args.repeat, args.scatter, args.depth,
                                    args.verify, args.trace, path, args.begun, args.concurrent,
                                    args.extra_blocks, args.handoff)
                mib = args.concurrent * LAYERS * layer_bytes / 2**20
                print(f"| {tokens} | {mib:.0f} | {base:.2f} (median {copies.median:.2f}) | {backend} "
                      f"| {path} | {args.handoff} | {done.max:.2f} ({done.min:.2f}–{done.max:.2f}) "
                      f"| {done.max / base:.2f} | {landed.max:.2f} ({landed.min:.2f}–{landed.max:.2f}) "
                      f"| {landed.max / base:.2f} |", flush=True)

if __name__ == "__main__":
    main()
