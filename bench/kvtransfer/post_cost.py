"""Per-call cost of the NIXL sender's post path (gap b of bench/kvtransfer/trace.py): one write of
every layer of one direct request (Llama-3-8B-shaped pieces: K and V per layer), posted and waited for,
between two NIXL agents of this process (DRAM on CPU; cuda:0 → cuda:1 with --device cuda). Median µs
per call of prepare_layers (once per request), post_prepared (the hot path: descriptor lists or
indices, initialize_xfer or make_prepped_xfer, transfer()), and post + wait until check_xfer_state says
DONE; with --device cuda also send_layer's CUDA event cost (new event per call vs events.EventPool).

    .venv/bin/python -m bench.kvtransfer.post_cost [--device cpu|cuda] [--tokens 64] [--extra-blocks 0]
        [--n 200] [--block-bytes 32768]

--extra-blocks 0 lays the request out as bench/kvtransfer/transfer.py does (its K, V and layers
adjacent: the pieces merge into one range); > 0 as in serving (64 separate pieces). Runs against
whichever `kvtransfer` is importable (PYTHONPATH), so before/after figures come from two checkouts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvtransfer.transports.nixl import NixlRecvTransport, NixlSendTransport
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
LAYERS, HEADS, DIM, BS = 32, 8, 128, 16
PEER = "rx"


def _median_us(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(n):
        t = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t)
    return statistics.median(times) / 1e3


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--extra-blocks", type=int, default=0)
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--block-bytes", type=int, default=BS * HEADS * DIM * 2,
                   help="bytes of one block of one layer, K or V (default Llama-3-8B bf16: 32768; a few "
                        "hundred isolates the per-call cost from the copy on CPU)")
    return p.parse_args()


def _link(args: argparse.Namespace) -> tuple[NixlSendTransport, NixlRecvTransport,
                                              list[list[tuple[int, int, int, int]]]]:
    """(sender transport, receiver transport, every layer's (K, V) direct pieces of one request)."""
    from kvtransfer.transports.base import KV
    from kvtransfer.transports.nixl import NixlRecvTransport, NixlSendTransport

    n, bb = args.tokens // BS, args.block_bytes
    blocks = n + args.extra_blocks
    shape = (LAYERS, 2, blocks, bb)
    src = torch.ones(shape, dtype=torch.uint8, device="cpu" if args.device == "cpu" else "cuda:0")
    dst = torch.zeros(shape, dtype=torch.uint8, device="cpu" if args.device == "cpu" else "cuda:1")
    rx = NixlRecvTransport(f"cost-rx-{os.getpid()}", dst)
    tx = NixlSendTransport(f"cost-tx-{os.getpid()}")
    tx.register_kv(src)
    tx.add_peer(PEER, rx.metadata())
    layer_bytes, kv_bytes = 2 * blocks * bb, blocks * bb
    layers = [[(KV, la * layer_bytes + kv * kv_bytes, la * layer_bytes + kv * kv_bytes, n * bb)
               for kv in (0, 1)] for la in range(LAYERS)]
    return tx, rx, layers


def main() -> None:
    args = _args()
    tx, rx, layers = _link(args)
    prepare_layers = getattr(tx, "prepare_layers", None) or (  # a transport without prepare_layers
        lambda peer, ls: [tx.prepare(peer, pieces) for pieces in ls])
    release = getattr(tx, "release_prepared", lambda parts: None)
    parts = prepare_layers(PEER, layers)

    def post_wait(k: int = LAYERS) -> None:
        h = tx.post_prepared(PEER, parts[:k], b"notice", 0)
        while not tx.test(h):
            pass
    print(f"# {args.tokens} tokens, {args.extra_blocks} extra blocks, {args.device}: "
          f"{2 * LAYERS} pieces of {layers[0][0][3]} B")
    prep_us = _median_us(lambda: release(prepare_layers(PEER, layers)), 50)
    print(f"prepare_layers  {prep_us:8.1f} us (per request)")
    handles: list[object] = []
    post_us = _median_us(lambda: handles.append(tx.post_prepared(PEER, parts, b"notice", 0)), args.n)
    print(f"post_prepared   {post_us:8.1f} us (all {LAYERS} layers, no wait)")
    for h in handles:
        while not tx.test(h):
            pass
    print(f"post + wait     {_median_us(post_wait, args.n):8.1f} us")
    one_us = _median_us(lambda: post_wait(1), args.n)
    print(f"1 layer + wait  {one_us:8.1f} us (one layer a write, as in serving)")
    release(parts)
    tx.close()
    rx.close()
    if args.device == "cuda":
        _event_cost(args.n)


def _event_cost(n: int) -> None:
    """send_layer's CUDA event (gap a of bench/kvtransfer/trace.py): a new event per call vs one from
    events.EventPool."""
    from kvtransfer.events import EventPool

    def fresh() -> None:
        torch.cuda.Event().record(torch.cuda.current_stream(torch.device("cuda:0")))
    pool = EventPool(0)

    def pooled() -> None:
        pool.give_back(pool.record())
    for name, fn in (("new event+record", fresh), ("pooled event    ", pooled)):
        print(f"{name} {_median_us(fn, n):8.1f} us per send_layer")


if __name__ == "__main__":
    main()
