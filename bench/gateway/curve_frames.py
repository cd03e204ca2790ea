"""What CURVE adds to one control-plane frame: a worker's ``NextToken`` frames through a DEALER →
ROUTER pair on 127.0.0.1, plain against CURVE (the fleet's keys and ZAP handler, kvtransfer/curve.py),
in the same process, the two modes interleaved over the repeats so that machine noise hits both.

Run: ``.venv/bin/python -m bench.gateway.curve_frames [--frames 20000] [--repeats 7]``.

Each repeat of a mode: a fresh context and socket pair, one round trip (the handshake done), then
``--frames`` frames sent in windows of 64 and all read by the ROUTER; per frame = wall / frames. Prints
the median µs per frame of each mode, the spread, CURVE / plain of the medians and of the fastest runs
(on a shared machine the fastest run is the least disturbed), and the µs CURVE adds per frame (one
``NextToken`` is one streamed token: compare with the gateway's per-token cost from
``bench.gateway.overhead``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import zmq

from kvtransfer.curve import (
    CurveKeys,
    FleetAuthenticator,
    Refusals,
    generate_keys,
    secure_client,
    secure_server,
)
from protocol.messages import NextToken, encode

WINDOW = 64


def one_run(keys: CurveKeys | None, frames: int) -> float:
    """Seconds per frame of one run (``keys`` None: plain sockets)."""
    ctx = zmq.Context()
    auth = FleetAuthenticator(ctx, keys, Refusals("bench")) if keys is not None else None
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        for s in (router, dealer):
            s.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            secure_server(router, keys)
            secure_client(dealer, keys)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        frame = encode(NextToken(request_id="cmpl-0123456789abcdef", worker_id="decode-0", token_id=12345))
        dealer.send(frame)
        if not router.poll(10_000):
            raise RuntimeError("no handshake within 10 s")
        router.recv_multipart()
        t0 = time.perf_counter()
        sent = 0
        while sent < frames:
            n = min(WINDOW, frames - sent)
            for _ in range(n):
                dealer.send(frame)
            for _ in range(n):
                router.recv_multipart()
            sent += n
        return (time.perf_counter() - t0) / frames
    finally:
        router.close(0)
        dealer.close(0)
        if auth is not None:
            auth.stop()
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    """CLI entry; 0."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=20_000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        keys = generate_keys(Path(tmp) / "keys")
        plain: list[float] = []
        curve: list[float] = []
        for i in range(args.repeats):
            order = [(None, plain), (keys, curve)] if i % 2 == 0 else [(keys, curve), (None, plain)]
            for k, out in order:
                out.append(one_run(k, args.frames))
    p_us, c_us = statistics.median(plain) * 1e6, statistics.median(curve) * 1e6
    print(f"NextToken frames DEALER -> ROUTER, {args.frames} per run, {args.repeats} runs per mode, "
          f"interleaved ({time.strftime('%Y-%m-%d', time.gmtime())})")
    print(f"plain: {p_us:.2f} us/frame (runs {min(plain) * 1e6:.2f}-{max(plain) * 1e6:.2f})")
    print(f"CURVE: {c_us:.2f} us/frame (runs {min(curve) * 1e6:.2f}-{max(curve) * 1e6:.2f})")
    print(f"CURVE / plain: {c_us / p_us:.3f} (medians), {min(curve) / min(plain):.3f} (fastest runs: the "
          f"least disturbed by other load); CURVE adds {c_us - p_us:.2f} us (medians), "
          f"{(min(curve) - min(plain)) * 1e6:.2f} us (fastest) per frame, i.e. per streamed token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
