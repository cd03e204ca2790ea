"""Fuzz the sockets a worker reads: its control socket (what the gateway sends it) and its KV sender's
socket (what a KV receiver answers). Targets of ``bench.fuzz.control_plane`` (method in its docstring).

- ``prefill`` / ``decode`` / ``colocated``: a real worker loop of that role (``WorkerLoop.run``: its
  control client, engine loop and heartbeats; a 2-layer Llama with dummy weights on the CPU, KV over the
  loopback transport) registers with a fake gateway, a CURVE server with the fleet's keys. The fake
  gateway accepts it, then sends mutated and truncated frames of every gateway → worker message type
  (``GATEWAY_TO_WORKER``) to it, then an ``AbortRequest`` for every request or canary id its frames
  named (what a gateway does with requests it gave up on). Afterwards the worker must serve one valid
  request of its role (colocated: a completion to its end; prefill: its first token; decode: a KV
  reservation, then aborted), its task must still be running, and a heartbeat must show every KV block
  free and nothing waiting or running.
- ``kv-sender``: a ``KVSender`` over the loopback transport with the fleet's keys connects to a fake
  receiver, a CURVE server, and starts a request towards it; the fake receiver answers every message
  with mutated frames of every receiver → sender message type (``RECEIVER_TO_SENDER``). Afterwards the
  sender must end that request, release it, transfer a request bit-exact to a real receiver, and neither
  may hold anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

from bench.fuzz.control_plane import TargetResult, example, fuzz_frames, transfer_after_fuzz
from kvtransfer import wire
from kvtransfer.curve import CurveKeys, load_keys, secure_server
from protocol import messages as pm

GATEWAY_TO_WORKER: tuple[type[msgspec.Struct], ...] = (
    pm.RegisterAck, pm.ReRegister, pm.Probe, pm.GatewayShutdown, pm.ReserveKV, pm.PrefillRequest,
    pm.DecodeRequest, pm.ColocatedRequest, pm.KVCanaryReserve, pm.KVCanarySend, pm.AbortRequest,
    pm.KVSnapshotRequest)
RECEIVER_TO_SENDER: tuple[type[msgspec.Struct], ...] = (
    wire.HelloReply, wire.BeginReply, wire.Rehandshake, wire.Done, wire.Fail, wire.Abort, wire.KeepAlive)
HANG_S = 5.0  # a send not taken, or an answer not given, within this: a hang
GATEWAY_EPOCH = 1  # the fake gateway's incarnation, in its RegisterAck
VOCAB = 256


def write_model_dir(path: Path) -> Path:
    """A config-only 2-layer Llama (vocabulary 256, 2 KV heads, head_dim 16), loaded with dummy weights."""
    from transformers import LlamaConfig

    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2,
                         architectures=["LlamaForCausalLM"])
    (path / "config.json").write_text(config.to_json_string())
    return path


def _worker(role: str, model_dir: Path, keys_dir: Path, gateway: str) -> object:
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.engine_core import EngineCore
    from kvtransfer import TransferConfig, get_transfer_backend
    from protocol.settings import WorkerSettings

    core = EngineCore(EngineConfig(
        ModelConfig(str(model_dir), load_format="dummy", dtype="float32", device="cpu",
                    attention_backend="torch"),
        CacheConfig(block_size=4, num_blocks=32), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)),
        prefill_only=role == "prefill")
    settings = WorkerSettings(role=role, model=str(model_dir), worker_id=f"fuzz-{role}",
                              transfer_backend="loopback", gateway_control=gateway, block_size=4,
                              curve_keys=str(keys_dir))
    transfer = TransferConfig(worker_id=f"fuzz-{role}", model_id="fuzz", backend="loopback", timeout_s=2.0,
                              heartbeat_interval_s=0.1, peer_timeout_s=2.0, curve=load_keys(keys_dir))
    kv = core.runner.kv_cache.kv_buffer
    if role == "prefill":
        from prefill_worker.worker import PrefillWorker

        return PrefillWorker(settings, core, str(model_dir), sender=get_transfer_backend("loopback")
                             .sender(transfer, kv))
    if role == "decode":
        from decode_worker.worker import DecodeWorker

        return DecodeWorker(settings, core, str(model_dir), receiver=get_transfer_backend("loopback")
                            .receiver(transfer, kv))
    from workers.colocated import ColocatedWorker

    return ColocatedWorker(settings, core, str(model_dir))


def _ids_named(parts: list[bytes]) -> set[str]:
    """The request and canary ids (strings) a fuzzed frame names, when it is a msgpack map."""
    out: set[str] = set()
    for part in parts:
        try:
            raw = msgspec.msgpack.decode(part)
        except msgspec.DecodeError:
            continue
        if isinstance(raw, dict):
            out.update(v for k in ("request_id", "canary_id") if isinstance(v := raw.get(k), str))
    return out


class _FakeGateway:
    """A CURVE ROUTER with the fleet's keys that a worker registers with; records what the worker sends."""

    def __init__(self, keys: CurveKeys) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, 1000)
        secure_server(self.sock, keys)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.identity = b""
        self.load: pm.WorkerLoad | None = None
        self.registered = False  # the worker's first registration was answered

    def read(self, timeout_s: float, until: Callable[[pm.Message], bool]) -> pm.Message:
        """Read the worker's messages (unpacking OutputBatch) until one satisfies ``until``; returns it.

        Raises:
            TimeoutError: none within ``timeout_s``.
        """
        end = time.monotonic() + timeout_s
        while (left := end - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                continue
            ident, data = self.sock.recv_multipart()[:2]
            self.identity = ident
            msg = pm.decode(data)
            for m in (msg.messages if isinstance(msg, pm.OutputBatch) else [msg]):
                self._note(m)
                if until(m):
                    return m
        raise TimeoutError(f"no awaited message from the worker within {timeout_s} s")

    def send(self, parts: list[bytes]) -> None:
        """Send one multipart message to the worker.

        Raises:
            TimeoutError: not taken within HANG_S (the worker stopped reading).
        """
        end = time.monotonic() + HANG_S
        while True:
            try:
                self.sock.send_multipart([self.identity, *parts], zmq.NOBLOCK)
                return
            except zmq.Again:
                if time.monotonic() > end:
                    raise TimeoutError(f"the worker took no frame for {HANG_S} s") from None
                self.sock.poll(10, zmq.POLLOUT)
                while self.sock.poll(0):
                    self._drain_one()

    def _drain_one(self) -> None:
        self._note(pm.decode(self.sock.recv_multipart()[1]))

    def _note(self, msg: pm.Message) -> None:
        """Keep the last heartbeat's load; accept every registration after the first (``read``'s caller
        answers that one): a worker that let this gateway go (a fuzzed frame that is a valid
        ``GatewayShutdown`` of its epoch) registers again, as it would with a gateway back at the address."""
        if isinstance(msg, pm.Heartbeat):
            self.load = msg.load
        elif isinstance(msg, pm.RegisterWorker) and self.registered:
            ack = pm.RegisterAck(worker_id=msg.worker_id, epoch=msg.epoch, accepted=True,
                                 gateway_epoch=GATEWAY_EPOCH)
            with contextlib.suppress(zmq.Again):  # never blocks (the worker registers again if it is full)
                self.sock.send_multipart([self.identity, pm.encode(ack)], zmq.NOBLOCK)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _valid_frames(role: str) -> list[bytes]:
    """One valid frame per gateway → worker type, requests of the role's kind with a 3-token prompt."""
    from engine.sampling_params import SamplingParams

    sampling = SamplingParams(max_tokens=2, temperature=0.0)
    out = []
    for t in GATEWAY_TO_WORKER:
        msg = example(t)
        if isinstance(msg, pm.GatewayShutdown):  # another incarnation's: ignored (its mutants may not be)
            msg = pm.GatewayShutdown(gateway_epoch=GATEWAY_EPOCH + 1)
        if hasattr(msg, "prompt_token_ids"):
            msg = msgspec.structs.replace(msg, prompt_token_ids=[5, 6, 7], sampling=sampling)
        out.append(pm.encode(msg))  # type: ignore[arg-type]
    return out


def _after(role: str, gw: _FakeGateway, worker_id: str) -> str:
    """One valid request of the role, answered; "ok" or what failed."""
    from engine.sampling_params import SamplingParams

    sampling = SamplingParams(max_tokens=3, temperature=0.0)
    rid = "after-fuzz"
    if role == "colocated":
        gw.send([pm.encode(pm.ColocatedRequest(request_id=rid, prompt_token_ids=[5, 6, 7],
                                               sampling=sampling))])
        end = gw.read(30, lambda m: isinstance(m, pm.RequestFinished | pm.RequestFailed | pm.RequestRejected)
                      and m.request_id == rid)
        return "ok" if isinstance(end, pm.RequestFinished) else f"request after fuzz: {end}"
    if role == "prefill":
        gw.send([pm.encode(pm.PrefillRequest(request_id=rid, prompt_token_ids=[5, 6, 7],
                                             sampling=SamplingParams(max_tokens=1, temperature=0.0)))])
        first = gw.read(30, lambda m: isinstance(m, pm.FirstToken | pm.RequestFailed | pm.RequestRejected)
                        and m.request_id == rid)
        return "ok" if isinstance(first, pm.FirstToken) else f"request after fuzz: {first}"
    gw.send([pm.encode(pm.ReserveKV(request_id=rid, prompt_token_ids=[5, 6, 7], sampling=sampling,
                                    prefill_worker_id="fuzz-p", prefill_sender_epoch=1))])
    reserved = gw.read(30, lambda m: isinstance(m, pm.KVReserved | pm.RequestFailed) and m.request_id == rid)
    gw.send([pm.encode(pm.AbortRequest(request_id=rid))])
    return "ok" if isinstance(reserved, pm.KVReserved) else f"reservation after fuzz: {reserved}"


def fuzz_worker(role: str, n: int, seed: int, keys_dir: Path, work_dir: Path) -> TargetResult:
    """Fuzz a worker loop of ``role`` through its control socket; see the module docstring."""
    keys = load_keys(keys_dir)
    gw = _FakeGateway(keys)
    worker = _worker(role, write_model_dir(work_dir / "model"), keys_dir, gw.address)
    result: list[TargetResult] = []
    task: asyncio.Task[None] | None = None
    loop: asyncio.AbstractEventLoop | None = None

    def drive() -> None:
        assert task is not None and loop is not None
        t0 = time.perf_counter()
        sent, seconds = 0, 0.0
        try:
            reg = gw.read(60, lambda m: isinstance(m, pm.RegisterWorker))
            assert isinstance(reg, pm.RegisterWorker)
            gw.send([pm.encode(pm.RegisterAck(worker_id=reg.worker_id, epoch=reg.epoch, accepted=True,
                                              gateway_epoch=GATEWAY_EPOCH))])
            gw.registered = True
            t0 = time.perf_counter()
            ids: set[str] = set()
            for parts in fuzz_frames(_valid_frames(role), n, seed):
                ids |= _ids_named(parts)
                if parts:
                    gw.send(parts)
                sent += 1
                while gw.sock.poll(0):
                    gw._drain_one()
            for rid in sorted(ids):  # what the gateway gave up on
                gw.send([pm.encode(pm.AbortRequest(request_id=rid))])
            if task.done():
                result.append(TargetResult(role, sent, time.perf_counter() - t0,
                                           f"the worker loop ended: {task!r}"))
                return
            for _ in range(2):  # heartbeats go to an accepting gateway only: registered again if it left
                gw.read(30, lambda m: isinstance(m, pm.Heartbeat))
            after = _after(role, gw, reg.worker_id)
            seconds = time.perf_counter() - t0  # every frame handled: the request after them answered
            if after != "ok":
                result.append(TargetResult(role, sent, seconds, after))
                return

            def clean(m: pm.Message) -> bool:
                load = m.load if isinstance(m, pm.Heartbeat) else None
                return (load is not None and load.num_free_blocks == load.num_total_blocks
                        and load.num_waiting == 0 and load.num_running == 0)
            gw.read(30, clean)
            ok = "ok" if not task.done() else f"the worker loop ended: {task!r}"
            result.append(TargetResult(role, sent, seconds, ok))
        except (TimeoutError, AssertionError, msgspec.DecodeError) as exc:
            result.append(TargetResult(role, sent, seconds or time.perf_counter() - t0,
                                       f"{type(exc).__name__}: {exc}"))
        finally:
            loop.call_soon_threadsafe(worker.request_stop)  # type: ignore[attr-defined]

    async def serve() -> None:
        nonlocal task, loop
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(worker.run())  # type: ignore[attr-defined]
        thread = threading.Thread(target=drive, name=f"fuzz-{role}")
        thread.start()
        try:
            await task
        except Exception as exc:  # the worker's loop ended with an error: a crash
            result.insert(0, TargetResult(role, 0, 0.0,
                                          f"the worker loop raised {type(exc).__name__}: {exc}"))
        await asyncio.to_thread(thread.join, 120)

    try:
        asyncio.run(serve())
    finally:
        gw.close()
    return result[0] if result else TargetResult(role, 0, 0.0, "no result")


def fuzz_kv_sender(n: int, seed: int, keys: CurveKeys) -> TargetResult:
    """Fuzz a loopback ``KVSender``'s socket from a fake receiver; see the module docstring."""
    import torch

    from kvtransfer import KVHandle, get_transfer_backend
    from kvtransfer.staging import layout_of
    from kvtransfer.transports.loopback import LoopbackRecvTransport
    from kvtransfer.types import TransferConfig

    shape = (2, 2, 8, 4, 2, 8)  # [layers, K/V, blocks, block_size, kv heads, head_dim]
    src = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    fake_kv, dst = torch.zeros(shape), torch.zeros(shape)
    fake_transport = LoopbackRecvTransport(fake_kv)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    secure_server(sock, keys)
    address = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    rid, epoch = "x", 1  # the id and epoch of example()'s messages, so that mutants name the request
    hello_reply = wire.encode(wire.HelloReply("fake-d", epoch, [], fake_transport.metadata()))
    valid = [hello_reply, wire.encode(wire.BeginReply(rid, True)),
             *(wire.encode(example(t)) for t in RECEIVER_TO_SENDER)]  # type: ignore[arg-type]
    config = TransferConfig(worker_id="fuzz-p", model_id="fuzz", backend="loopback", curve=keys,
                            heartbeat_interval_s=0.1, peer_timeout_s=1.0, timeout_s=2.0)
    backend = get_transfer_backend("loopback")
    tx = backend.sender(config, src)
    state: dict[str, object] = {}  # what the fake receiver's thread reports: sent, error

    def fake_receiver() -> None:
        sent, identity = 0, b""
        frames = iter([[hello_reply], *fuzz_frames(valid, n - 1, seed)])
        end_idle = time.monotonic() + 30  # the sender's first Hello must come within this
        try:
            parts = next(frames)
            while True:
                while sock.poll(0 if identity else 50):
                    identity = sock.recv_multipart()[0]  # whatever it says; its latest identity
                if not identity:
                    if time.monotonic() > end_idle:
                        raise TimeoutError("the sender never said Hello")
                    continue
                try:
                    if parts:
                        sock.send_multipart([identity, *parts], zmq.NOBLOCK)
                except zmq.Again:
                    sock.poll(10, zmq.POLLOUT)
                    if time.monotonic() > end_idle + HANG_S:
                        raise TimeoutError(f"the sender took no frame for {HANG_S} s") from None
                    continue
                except zmq.ZMQError:  # its connection is gone (it dropped us): wait for its next Hello
                    identity = b""
                    end_idle = time.monotonic() + 30
                    continue
                sent += 1
                end_idle = time.monotonic()
                parts = next(frames)
        except StopIteration:
            state["sent"] = sent
        except TimeoutError as exc:
            state["sent"], state["error"] = sent, str(exc)

    t0 = time.perf_counter()
    thread = threading.Thread(target=fake_receiver, name="fuzz-kv-receiver")
    thread.start()
    rx = None
    try:
        handle = KVHandle(worker_id="fake-d", epoch=epoch, request_id=rid, block_ids=(0, 1),
                          layout=layout_of(fake_kv), address=address, backend="loopback", timeout_s=2.0)
        try:
            tx.add_request(handle, [2, 3])
            tx.send_layers(rid)
        except Exception as exc:  # the sender refusing the fuzzed peer is fine (kept in the result)
            state["refused"] = f"{type(exc).__name__}: {exc}"
        thread.join(120)
        seconds = time.perf_counter() - t0
        sent = int(state.get("sent", 0))  # type: ignore[call-overload]
        if thread.is_alive() or "error" in state:
            return TargetResult("kv-sender", sent, seconds, f"hang: {state.get('error', 'fuzzer stuck')}")
        if not tx.stats().loop.alive:
            return TargetResult("kv-sender", sent, seconds, f"the sender's loop ended: {tx.stats().loop}")
        if rid in tx.pending():
            if not tx.wait_until(lambda: tx.status(rid).is_terminal and not tx.snapshot(rid).fence_pending
                                 and tx.snapshot(rid).inflight == 0, 15):
                return TargetResult("kv-sender", sent, seconds, f"request to the fuzzer never ended: "
                                    f"{tx.status(rid)} {tx.snapshot(rid)}")
            tx.release(rid)
        rx = backend.receiver(TransferConfig(worker_id="fuzz-d", model_id="fuzz", backend="loopback",
                                             curve=keys, heartbeat_interval_s=0.1, peer_timeout_s=1.0), dst)
        failed = transfer_after_fuzz(tx, rx, src, dst)
        if failed:
            return TargetResult("kv-sender", sent, seconds, failed)
        refused = f" (its first request was refused: {state['refused']})" if "refused" in state else ""
        return TargetResult("kv-sender", sent, seconds, "ok", refused)
    except (TimeoutError, RuntimeError, AssertionError) as exc:
        return TargetResult("kv-sender", int(state.get("sent", 0)), time.perf_counter() - t0,  # type: ignore[call-overload]
                            f"{type(exc).__name__}: {exc}")
    finally:
        thread.join(10)
        tx.close()
        if rx is not None:
            rx.close()
        sock.close(0)
        ctx.term()
        fake_transport.close()
