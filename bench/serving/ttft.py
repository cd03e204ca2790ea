"""TTFT of a disaggregated request over the prefill-only time of the same prompt (not a test).

For each prompt length (default 1k, 8k and 32k tokens) on the Llama-3-8B-shaped dummy model (bf16,
``triton``, one prefill step: token budget >= the prompt), in one process on GPU0 with the decode side's
receiver in a spawned second process (GPU1 if present, else GPU0):

(a) prefill alone: ``add_request`` → the prefill-only engine step that samples the first token;
(b) disaggregated: the same step with the prefill worker's layer hook (``workers.step.run_step``)
    handing every layer to a real ``kvtransfer`` sender (``--backend nixl`` by default) that writes into
    the receiver's blocks, timed until both the first token is sampled and the receiver reports DONE
    (every layer landed). The receiver's ``expect`` (block reservation on the decode worker) happens
    before the clock starts, as in the real system, where it precedes the prefill request.

Reported: best of ``--repeats`` (after a warm-up that also does the transport handshake) of (a) and (b),
each with its min–max over the repeats, and the ratio best (b) / best (a): 1.0 means the layer-wise
transfer hides entirely behind the forward pass. (a) and (b) alternate within each repeat, so drift
hits both.

CPU smoke mode (CI): ``--device cpu --model tiny --tokens 32 64 --backend loopback`` (the loopback
receiver lives in this process) or ``--backend nixl`` (a second process, NIXL over shared memory).

    python -m bench.serving.ttft [--tokens 1024 8192 32768] [--backend nixl|ucx|loopback] [--json out.json|-]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Connection
from typing import Any, Protocol

import msgspec
import torch

from bench.argtypes import positive_int
from bench.common import add_model_args, sync
from bench.engine.prefill import BLOCK_SIZE, make_core, prompt
from bench.timing import Spread
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from kvtransfer import KVHandle, TransferConfig, TransferStatus, get_transfer_backend
from workers.step import LayerHook, run_step

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
MODEL_ID = "pdserve-bench-ttft"
DEADLINE_S = 120.0


def _config(worker_id: str, backend: str) -> TransferConfig:
    return TransferConfig(worker_id=worker_id, model_id=MODEL_ID, backend=backend, timeout_s=DEADLINE_S)


class Receiver(Protocol):
    """The decode side as the benchmark drives it."""

    def expect(self, request_id: str, block_ids: list[int]) -> KVHandle: ...
    def wait_done(self, request_id: str) -> str: ...
    def close(self) -> str: ...


def receiver_main(conn: Connection, backend: str, shape: tuple[int, ...], dtype: str, device: str) -> None:
    """Decode side in its own process: a ``KVReceiver`` over a zeroed ``kv_buffer`` of ``shape``;
    commands over ``conn``: ("expect", rid, blocks) → handle bytes; ("wait", rid) → status name once
    terminal (then released); ("close",) → "" or the leak-check error."""
    kv = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
    rx = get_transfer_backend(backend).receiver(_config("ttft-d", backend), kv)
    conn.send("ready")
    while (cmd := conn.recv())[0] != "close":
        if cmd[0] == "expect":
            try:
                conn.send(msgspec.msgpack.encode(rx.expect(cmd[1], cmd[2])))
            except ValueError as exc:
                conn.send(f"receiver error: {exc!r}".encode())
        else:
            conn.send(_wait_release(rx, cmd[1]))
    conn.send(_close(rx))


def _wait_release(rx: Any, request_id: str) -> str:
    """Wait (up to ``DEADLINE_S``) for a terminal status, release the request; returns "DONE" or the
    status with its reason (never raises: the parent must always get an answer)."""
    try:
        status = rx.wait(request_id, DEADLINE_S)
        result = "DONE" if status is TransferStatus.DONE else f"{status.name}: {rx.reason(request_id)}"
        deadline = time.monotonic() + 5
        while not rx.releasable(request_id) and time.monotonic() < deadline:
            time.sleep(0.001)
        rx.release(request_id)
        return result
    except (RuntimeError, KeyError, ValueError) as exc:
        return f"receiver error: {exc!r}"


def _close(rx: Any) -> str:
    try:
        rx.check_no_leaks()
        return ""
    except AssertionError as exc:
        return f"receiver leak: {exc}"
    finally:
        rx.close()


class LocalReceiver:
    """Receiver in this process (the loopback transport only works within one process)."""

    def __init__(self, backend: str, kv: torch.Tensor) -> None:
        self.kv = kv
        self.rx = get_transfer_backend(backend).receiver(_config("ttft-d", backend), kv)

    def expect(self, request_id: str, block_ids: list[int]) -> KVHandle:
        return self.rx.expect(request_id, block_ids)

    def wait_done(self, request_id: str) -> str:
        return _wait_release(self.rx, request_id)

    def close(self) -> str:
        return _close(self.rx)


class RemoteReceiver:
    """Receiver in a spawned process (``receiver_main``), driven over a pipe."""

    def __init__(self, backend: str, shape: tuple[int, ...], dtype: str, device: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=receiver_main, args=(child, backend, shape, dtype, device),
                                daemon=True)
        self.proc.start()
        if not self.conn.poll(DEADLINE_S):
            self.proc.kill()
            raise RuntimeError(f"the {backend} receiver process did not start within {DEADLINE_S} s")
        self.conn.recv()

    def expect(self, request_id: str, block_ids: list[int]) -> KVHandle:
        self.conn.send(("expect", request_id, block_ids))
        reply = self.conn.recv()
        if reply.startswith(b"receiver error"):
            raise RuntimeError(reply.decode())
        return msgspec.msgpack.decode(reply, type=KVHandle)

    def wait_done(self, request_id: str) -> str:
        self.conn.send(("wait", request_id))
        return str(self.conn.recv())

    def close(self) -> str:
        self.conn.send(("close",))
        result = str(self.conn.recv()) if self.conn.poll(30) else "receiver did not answer close"
        self.proc.join(30)
        return result


def _hook_factory(sender: Any, handle: KVHandle) -> Any:
    """The prefill worker's per-step hook: once the step that samples the request's first token is
    scheduled, add the transfer and send each layer as soon as its K/V is stored."""
    rid = handle.request_id

    def factory(output: SchedulerOutput) -> LayerHook | None:
        for s in output.scheduled:
            if s.seq.request_id == rid and s.samples:
                sender.add_request(handle, list(s.seq.block_table))
                return lambda layer: sender.send_layer(rid, layer)
        return None

    return factory


def _prefill(core: EngineCore, rid: str, ids: list[int], hook_for: Any = None) -> float:
    """Seconds from ``add_request`` to the sampled first token (device synchronised); the sequence
    stays FINISHED_PREFILLED (blocks held) for the caller to release."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    sync(core.runner.device)
    started = time.perf_counter()
    core.add_request(rid, ids, params)
    while not run_step(core, hook_for):
        pass
    sync(core.runner.device)
    return time.perf_counter() - started


def measure(core: EngineCore, sender: Any, rx: Receiver, tokens: int, repeats: int) -> dict[str, Any]:
    """(a) and (b) of the module docstring for one prompt length, ``repeats`` times after a warm-up;
    ends with the engine's and the sender's leak checks. Raises RuntimeError if a transfer is not DONE."""
    alone: list[float] = []
    disagg: list[float] = []
    first: list[float] = []
    for i in range(repeats + 1):
        ids = prompt(tokens, core.runner.vocab_size, seed=i)
        t_alone = _prefill(core, f"a{tokens}-{i}", ids)
        core.scheduler.release(f"a{tokens}-{i}")
        rid = f"b{tokens}-{i}"
        handle = rx.expect(rid, list(range(math.ceil(tokens / BLOCK_SIZE))))
        started = time.perf_counter()
        t_first = _prefill(core, rid, ids, _hook_factory(sender, handle))
        status = rx.wait_done(rid)
        t_done = time.perf_counter() - started
        sent = sender.wait(rid, DEADLINE_S)
        if status != "DONE" or sent is not TransferStatus.DONE:
            raise RuntimeError(f"transfer of {rid}: receiver {status}, sender {sent.name} "
                               f"({sender.reason(rid)})")
        sender.release(rid)
        core.scheduler.release(rid)
        if i:
            alone.append(t_alone)
            disagg.append(max(t_done, t_first))
            first.append(t_first)
    core.check_no_leaks()
    sender.check_no_leaks()
    return {"tokens": tokens, "prefill_s": alone, "disagg_s": disagg, "disagg_first_token_s": first,
            "best_prefill_s": min(alone), "best_disagg_s": min(disagg), "ratio": min(disagg) / min(alone)}


def _receiver(args: argparse.Namespace, core: EngineCore) -> tuple[Receiver, str]:
    """The decode side for ``args.backend`` sized for the longest prompt, and where it runs."""
    pool = core.runner.kv_cache
    blocks = math.ceil(max(args.tokens) / BLOCK_SIZE) + 2
    shape = (pool.num_layers, 2, blocks, BLOCK_SIZE, pool.num_kv_heads, pool.head_dim)
    dtype = str(pool.dtype).removeprefix("torch.")
    if args.backend == "loopback":
        kv = torch.zeros(shape, dtype=pool.dtype, device=pool.device)
        return LocalReceiver(args.backend, kv), f"{pool.device}, this process"
    device = "cpu"
    if pool.device.type == "cuda":
        device = "cuda:1" if torch.cuda.device_count() > 1 else f"cuda:{pool.device.index or 0}"
    return RemoteReceiver(args.backend, shape, dtype, device), f"{device}, second process"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every prompt length; returns the JSON-ready result (``rows``: one dict per length)."""
    core = make_core(args, max(args.tokens), prefill_only=True)
    sender = get_transfer_backend(args.backend).sender(_config("ttft-p", args.backend),
                                                       core.runner.kv_cache.kv_buffer)
    rx, where = _receiver(args, core)
    rows, leak = [], "not checked"
    try:
        for tokens in args.tokens:
            row = measure(core, sender, rx, tokens, args.repeats)
            rows.append(row)
            first = min(row["disagg_first_token_s"]) * 1e3
            alone, disagg = Spread.of(row["prefill_s"]), Spread.of(row["disagg_s"])
            print(f"{tokens:6d} tokens: prefill alone best {alone.min * 1e3:9.2f} ms (median "
                  f"{alone.median * 1e3:.2f}, max {alone.max * 1e3:.2f}), disaggregated best "
                  f"{disagg.min * 1e3:9.2f} ms (median {disagg.median * 1e3:.2f}, "
                  f"max {disagg.max * 1e3:.2f}; first token at {first:.2f} ms), "
                  f"disaggregated / prefill alone (best / best) {row['ratio']:.3f}", flush=True)
    finally:
        sender.close()
        leak = rx.close()
    if leak:
        raise RuntimeError(leak)
    dev = core.runner.device
    return {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "receiver": where,
            "gpus": torch.cuda.device_count() if dev.type == "cuda" else 0, "model": args.model,
            "dtype": str(core.runner.dtype).removeprefix("torch."), "backend": args.backend,
            "attention_backend": core.runner.backend.name, "rows": rows, "receiver_leak_check": "ok"}


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, write ``--json``; returns 0, or 1 if a transfer failed. Bad arguments:
    argparse's error, ``SystemExit(2)``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--tokens", type=positive_int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--backend", default="nixl", choices=["nixl", "ucx", "loopback"])
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--json", default=None, help="write the result here ('-' = stdout)")
    args = p.parse_args(argv)
    try:
        res = run(args)
    except RuntimeError as exc:
        print(f"ttft: FAILED: {exc}", file=sys.stderr)
        return 1
    if args.json == "-":
        print(json.dumps(res, indent=1))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
