"""Fuzz the control planes: mutated and truncated frames of every message type, sent by a holder of the
fleet's CURVE keys (an authenticated but broken or hostile peer) to the gateway's control socket and to a
decode worker's KV control socket; afterwards each process must still serve.

Run: ``.venv/bin/python -m bench.fuzz.control_plane [--frames 10000] [--seed 0] [--targets ...]
[--out report.md]`` (targets: ``gateway,kv,prefill,decode,colocated,kv-sender``, all by default).

Frames (``frames``): one valid instance of every message type (``protocol.messages.Message`` for the
gateway, ``kvtransfer.wire.Message`` for the KV plane; built from the type hints by ``example``), each
encoded, then mutated (``mutate``, a seeded ``random.Random``): truncated at a random byte, bytes
flipped, inserted or deleted, a random field set to a hostile value (huge or negative integers, NaN,
infinities, a long string, None, a list, a map, deep nesting, the wrong type) and re-encoded, a field
dropped or an unknown one added, the type tag changed to another message's, the valid frame unchanged,
random bytes, the empty frame, and multipart messages of 0, 2 or 3 parts.

Targets:
- ``gateway``: a ``pdserve gateway`` process with a fake prefill and decode worker
  (tests/fakes/fake_worker.py), all with a key pair made for the run; afterwards the fuzzer's socket is
  closed (the gateway drops whatever the fuzzer registered once it finds it unreachable) and a
  streamed completion must succeed, the gateway must have nothing in flight and the fake decode worker
  every KV block free.
- ``kv``: a ``KVReceiver`` over the loopback transport with the fleet's keys (the decode worker's KV
  control socket, in process, not fenced: the fuzzer's first message, and one in 14 before mutation, is a
  Hello the receiver accepts, so the other messages reach a known sender's paths); afterwards its loop
  must be alive, a real sender must transfer a request bit-exact and neither side may hold anything.

- ``prefill``, ``decode``, ``colocated``, ``kv-sender``: a worker's control socket (frames of every
  gateway → worker type from a fake gateway) and a KV sender's socket (frames of every receiver → sender
  type from a fake receiver); bench/fuzz/worker_sockets.py says how and what is checked afterwards.

Seconds in the report: from the first fuzzed message to the last one taken by the socket (for a
worker: to the answer of the valid request sent after them, so every frame was handled by then).

A target fails on a crash (the process or the loop ended), a hang (a send blocked for 5 s, or the check
afterwards did not finish within its deadline) or a leak. Exit code 0 when every target passes, 1
otherwise.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import sys
import tempfile
import time
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import zmq

from kvtransfer import wire
from kvtransfer.curve import CurveKeys, generate_keys, secure_client
from protocol import messages

if TYPE_CHECKING:
    import torch

    from kvtransfer.api import KVReceiver, KVSender

HOSTILE: tuple[object, ...] = (2**64 - 1, -(2**63), 2**63 - 1, -1, 0, math.nan, math.inf, -math.inf, "",
                               "x" * 100_000, None, [], {}, [[[[[[[[[[[]]]]]]]]]]], {"a": {"b": {"c": 1}}},
                               b"\x00" * 64, True, 1e308, "\udcff".encode("utf-8", "surrogatepass"))


def _value(tp: object, depth: int = 0) -> object:
    """A valid value of type ``tp`` (a type hint), its defaults used for the struct's optional fields."""
    origin = typing.get_origin(tp)
    if tp in (int,):
        return 1
    if tp is float:
        return 0.5
    if tp is str:
        return "x"
    if tp is bool:
        return False
    if tp is bytes:
        return b"x"
    if tp is type(None):
        return None
    if origin is typing.Literal:
        return typing.get_args(tp)[0]
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _value(args[0], depth) if args else None
    if origin in (list, tuple, set, frozenset):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        item = [_value(args[0], depth + 1)] if args and depth < 3 else []
        return tuple(item) if origin is tuple else item
    if origin is dict:
        k, v = typing.get_args(tp)
        return {_value(k, depth + 1): _value(v, depth + 1)}
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return example(tp)
    raise TypeError(f"no example value for {tp!r}")


def example(cls: type[msgspec.Struct]) -> msgspec.Struct:
    """A valid instance of ``cls``: every field without a default gets a value of its type."""
    hints = typing.get_type_hints(cls)
    info = msgspec.structs.fields(cls)
    kwargs = {f.name: _value(hints[f.name]) for f in info if f.required}
    return cls(**kwargs)


def message_types(union: object) -> list[type[msgspec.Struct]]:
    """The struct types of a message union."""
    return [t for t in typing.get_args(union) if isinstance(t, type) and issubclass(t, msgspec.Struct)]


def valid_frames(union: object, encode: Callable[[typing.Any], bytes]) -> list[bytes]:
    """One encoded valid frame per message type of ``union``."""
    return [encode(example(t)) for t in message_types(union)]


def _set_field(raw: object, rng: random.Random, others: list[object]) -> object:
    if not isinstance(raw, dict) or not raw:
        return raw
    key = rng.choice(list(raw))
    choice = rng.random()
    out = dict(raw)
    if choice < 0.6:
        out[key] = rng.choice(HOSTILE)
    elif choice < 0.7:
        del out[key]
    elif choice < 0.8:
        out["unknown_" + str(rng.randrange(100))] = rng.choice(HOSTILE)
    elif choice < 0.9 and "type" in out:
        other = rng.choice(others)
        out["type"] = other.get("type") if isinstance(other, dict) else "Nope"
    elif isinstance(out[key], dict):
        out[key] = _set_field(out[key], rng, others)  # a nested struct's field
    else:
        out[key] = [out[key]] * rng.randrange(0, 3)
    return out


def mutate(frame: bytes, rng: random.Random, others: list[object]) -> list[bytes]:
    """One fuzzed multipart message (a list of frames) made from the valid ``frame``; ``others``: every
    valid frame decoded to plain msgpack values (for swapped type tags)."""
    r = rng.random()
    if r < 0.15:
        return [frame[:rng.randrange(len(frame))]]  # truncated
    if r < 0.3:
        b = bytearray(frame)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return [bytes(b)]
    if r < 0.38:
        i = rng.randrange(len(frame) + 1)
        return [frame[:i] + rng.randbytes(rng.randrange(1, 16)) + frame[i:]]
    if r < 0.44:
        i = rng.randrange(len(frame))
        return [frame[:i] + frame[i + rng.randrange(1, 8):]]
    if r < 0.8:
        raw = _set_field(msgspec.msgpack.decode(frame), rng, others)
        return [msgspec.msgpack.encode(raw)]
    if r < 0.85:
        return [frame]
    if r < 0.9:
        return [rng.randbytes(rng.randrange(0, 64))]
    if r < 0.93:
        return [b""]
    if r < 0.97:
        return [frame, frame[: rng.randrange(len(frame))]]  # two parts (the gateway sees three)
    return [frame, b"", frame]


def fuzz_frames(frames: list[bytes], n: int, seed: int) -> Iterator[list[bytes]]:
    """``n`` fuzzed multipart messages, cycling through every valid frame, reproducible from ``seed``."""
    rng = random.Random(seed)
    others = [msgspec.msgpack.decode(f) for f in frames]
    for i in range(n):
        yield mutate(frames[i % len(frames)], rng, others)


def send_all(address: str, keys: CurveKeys, messages_: Iterator[list[bytes]], hang_s: float = 5.0,
             identity: bytes | None = None) -> int:
    """Send every multipart message to ``address`` over a CURVE DEALER with the fleet's keys (reading and
    dropping whatever comes back); returns how many were sent.

    Raises:
        TimeoutError: one send blocked for ``hang_s`` seconds (the peer stopped reading: a hang).
    """
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 1000)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    secure_client(sock, keys)
    sock.connect(address)
    sent = 0
    try:
        for parts in messages_:
            if not sock.poll(int(hang_s * 1000), zmq.POLLOUT):
                raise TimeoutError(f"{address} took no frame for {hang_s} s after {sent} messages")
            if parts:
                sock.send_multipart(parts)
            sent += 1
            while sock.poll(0):
                sock.recv_multipart()
    finally:
        sock.close(0)
        ctx.term()
    return sent


@dataclass
class TargetResult:
    """One target's run: messages sent, seconds, and the check afterwards ("ok" or what failed)."""

    target: str
    sent: int
    seconds: float
    after: str
    note: str = ""  # what else happened, e.g. a peer refused on the way (not a failure)


def transfer_after_fuzz(tx: KVSender, rx: KVReceiver, src: torch.Tensor, dst: torch.Tensor) -> str:
    """Send blocks 4-6 of ``src`` into blocks 1-3 of ``dst`` from the KV sender ``tx`` to the receiver
    ``rx``, release both sides and check neither leaked: what a fuzzed KV endpoint must still do. Returns
    "" when it did, else why not. Raises TimeoutError / RuntimeError / AssertionError as the endpoints'
    waits and leak checks do."""
    from kvtransfer.types import TransferStatus

    tx.add_request(rx.expect("after-fuzz", [1, 2, 3]), [4, 5, 6])
    tx.send_layers("after-fuzz")
    if rx.wait("after-fuzz", 10) is not TransferStatus.DONE:
        return f"transfer after fuzz: {rx.reason('after-fuzz')}"
    if not bool((src[:, :, [4, 5, 6]] == dst[:, :, [1, 2, 3]]).all()):
        return "transfer after fuzz: data differs"
    tx.wait("after-fuzz", 10)
    rx.wait_until(lambda: rx.releasable("after-fuzz"), 10)
    rx.release("after-fuzz")
    tx.wait_until(lambda: tx.status("after-fuzz").is_terminal and not tx.snapshot("after-fuzz")
                  .fence_pending and tx.snapshot("after-fuzz").inflight == 0, 10)
    tx.release("after-fuzz")
    tx.check_no_leaks()
    rx.check_no_leaks()
    return ""


def fuzz_kv(n: int, seed: int, keys: CurveKeys) -> TargetResult:
    """Fuzz a loopback ``KVReceiver``'s control socket, then transfer a request through it."""
    import torch

    from kvtransfer import get_transfer_backend
    from kvtransfer.types import TransferConfig

    backend = get_transfer_backend("loopback")
    shape = (2, 2, 8, 4, 2, 8)  # [layers, K/V, blocks, block_size, kv heads, head_dim]
    src, dst = torch.randn(shape, generator=torch.Generator().manual_seed(seed)), torch.zeros(shape)
    config = TransferConfig(worker_id="fuzz-d", model_id="fuzz", backend="loopback", curve=keys,
                            heartbeat_interval_s=0.1, peer_timeout_s=1.0)
    rx = backend.receiver(config, dst)
    t0 = time.perf_counter()
    try:
        # a Hello the receiver accepts (its own compatibility record) among the frames, and first, so
        # that the mutants of Begin, LayerNotice, Stopped... reach a known sender's code paths too
        hello = wire.encode(wire.Hello("fuzz-s", 1, rx.compat, b""))  # type: ignore[attr-defined]
        frames = [hello, *valid_frames(wire.Message, wire.encode)]
        sent = send_all(rx.address, keys, iter([[hello], *fuzz_frames(frames, n - 1, seed)]))
        seconds = time.perf_counter() - t0
        tx_config = TransferConfig(worker_id="fuzz-p", model_id="fuzz", backend="loopback", curve=keys,
                                   heartbeat_interval_s=0.1, peer_timeout_s=1.0)
        tx = backend.sender(tx_config, src)
        try:
            failed = transfer_after_fuzz(tx, rx, src, dst)
            if failed:
                return TargetResult("kv", sent, seconds, failed)
        finally:
            tx.close()
    except (TimeoutError, RuntimeError, AssertionError) as exc:
        return TargetResult("kv", 0, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
    finally:
        rx.close()
    return TargetResult("kv", sent, seconds, "ok")


def fuzz_gateway(n: int, seed: int, keys_dir: Path, tokenizer: str, log_dir: Path) -> TargetResult:
    """Fuzz a ``pdserve gateway`` process's control socket (fake prefill and decode workers registered),
    then stream one completion through it and check that nothing leaked."""
    import httpx

    from bench.gateway.overhead_targets import TOTAL_BLOCKS, check_no_leaks
    from gateway.text import resolve_tokenizer_dir
    from kvtransfer.curve import load_keys
    from pdserve.launcher import wait_ready
    from pdserve.ports import free_ports
    from pdserve.supervisor import Supervisor

    port, control_port = free_ports(2)
    control = f"tcp://127.0.0.1:{control_port}"
    sup = Supervisor(grace=5.0)
    secure = ["--curve-keys", str(keys_dir)]
    sup.start("gateway", ["gateway", "--port", str(port), "--control-bind", control, "--tokenizer",
                          str(resolve_tokenizer_dir(tokenizer, None)), "--log-level", "warning", *secure],
              str(log_dir / "gateway.log"))
    for role in ("prefill", "decode"):
        sup.command = (sys.executable, "-m", "tests.fakes.fake_worker")
        sup.start(role, ["--role", role, "--worker-id", f"fake-{role}", "--gateway-control", control,
                         "--total-blocks", str(TOTAL_BLOCKS), "--max-model-len", "4096", "--token-delay", "0",
                         "--prefill-delay", "0", *secure], str(log_dir / f"{role}.log"))
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    try:
        why = wait_ready(sup, url, 60.0, [])
        if why is not None:
            return TargetResult("gateway", 0, 0.0, f"did not start: {why}")
        t0 = time.perf_counter()
        sent = send_all(control, load_keys(keys_dir),
                        fuzz_frames(valid_frames(messages.Message, messages.encode), n, seed))
        seconds = time.perf_counter() - t0
        if sup.dead():
            return TargetResult("gateway", sent, seconds, f"exited: {sup.dead()}")
        end = time.monotonic() + 30  # the fuzzer's registrations leave once its connection is gone
        while True:
            ids = {w["worker_id"] for w in httpx.get(url + "/v1/status", timeout=5).json()["workers"]}
            if ids == {"fake-prefill", "fake-decode"}:
                break
            if time.monotonic() > end:
                return TargetResult("gateway", sent, seconds, f"registered after fuzz: {sorted(ids)}")
            time.sleep(0.2)
        body = {"model": "fake-model", "prompt": "after the fuzz", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=20) as resp:
            text = "".join(resp.iter_text())
        if resp.status_code != 200 or "[DONE]" not in text:
            return TargetResult("gateway", sent, seconds,
                                f"completion after fuzz: {resp.status_code} {text[:300]}")
        leaks = check_no_leaks(url, "fake-decode")
        log = (log_dir / "gateway.log").read_text(errors="replace")
        if "Traceback" in log:
            return TargetResult("gateway", sent, seconds, "traceback in the gateway log: "
                                + log[log.index("Traceback"):][:1500])
        return TargetResult("gateway", sent, seconds, leaks if leaks != "ok" else "ok")
    except (TimeoutError, httpx.HTTPError) as exc:
        return TargetResult("gateway", 0, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
    finally:
        sup.stop_all()


WORKER_TARGETS = ("prefill", "decode", "colocated")
TARGETS = ("gateway", "kv", *WORKER_TARGETS, "kv-sender")


def run(n: int, seed: int, targets: tuple[str, ...], tokenizer: str,
        log_dir: Path | None = None) -> list[TargetResult]:
    """Fuzz each target with ``n`` messages (keys made for the run; the gateway's logs in ``log_dir``,
    default a temporary directory)."""
    out = []
    with tempfile.TemporaryDirectory(prefix="pdserve-fuzz-") as tmp:
        logs = log_dir or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        keys_dir = Path(tmp) / "keys"
        keys = generate_keys(keys_dir)
        for target in targets:
            if target == "kv":
                out.append(fuzz_kv(n, seed, keys))
            elif target in WORKER_TARGETS:
                from bench.fuzz.worker_sockets import fuzz_worker

                work = Path(tmp) / target
                work.mkdir()
                out.append(fuzz_worker(target, n, seed, keys_dir, work))
            elif target == "kv-sender":
                from bench.fuzz.worker_sockets import fuzz_kv_sender

                out.append(fuzz_kv_sender(n, seed, keys))
            elif target != "gateway":
                raise ValueError(f"--targets: unknown target {target!r}; known: {', '.join(TARGETS)}")
            else:
                out.append(fuzz_gateway(n, seed, keys_dir, tokenizer, logs))
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI entry: 0 when every target still serves after its frames, 1 otherwise."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=10_000, help="fuzzed messages per socket")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated, of " + ", ".join(TARGETS))
    p.add_argument("--tokenizer", default="smollm2-135m", help="tokenizer dir or cached alias (gateway)")
    p.add_argument("--out", type=Path, default=None, help="Markdown report path")
    p.add_argument("--log-dir", type=Path, default=None, help="keep the gateway's and workers' logs here")
    args = p.parse_args(argv)
    # each undecodable KV frame is one warning of the receiver (kvtransfer.wire): thousands here
    logging.getLogger("kvtransfer").setLevel(logging.ERROR)
    # likewise each refused gateway frame is a warning or an error with its traceback of the worker
    # (workers.loop: the bad message fails its request only)
    for name in ("pdserve.worker", "pdserve.prefill", "pdserve.decode"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    results = run(args.frames, args.seed, tuple(args.targets.split(",")), args.tokenizer, args.log_dir)
    lines = [f"control-plane fuzz, seed {args.seed}, {args.frames} messages per socket, date "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             "| socket | messages sent | seconds | messages/s | serves afterwards |",
             "|---|---:|---:|---:|---|"]
    for r in results:
        rate = r.sent / r.seconds if r.seconds > 0 else 0.0
        lines.append(f"| {r.target} | {r.sent} | {r.seconds:.1f} | {rate:.0f} | {r.after} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if all(r.after == "ok" and r.sent == args.frames for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
