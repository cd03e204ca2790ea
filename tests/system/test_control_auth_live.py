"""The shared live system (real gateway, prefill and decode workers, CURVE on by default) refuses
strangers on both control planes: a process without the fleet's keys gets no answer from the gateway's
control socket nor from the decode worker's KV control socket, a key holder whose sender id the gateway
never named to the decode worker gets a refusing HelloReply (its transport metadata is never added), and
so does one reusing the named prefill worker's id with another KV sender epoch;
each refusal shows in the gateway's metrics (``pdserve_control_auth_refused_total``, and the decode
worker's count in ``pdserve_kv_control_refused_total`` through its heartbeats). The fleet's own workers
serve as before."""

from __future__ import annotations

import contextlib
import time

import httpx
import zmq

from kvtransfer import wire
from kvtransfer.compat import KVCompat
from kvtransfer.curve import load_keys, secure_client
from pdserve.live_system import metric_samples, worker_id
from protocol.messages import RegisterWorker, WorkerLoad, encode
from tests.live import API_KEY

DEADLINE = 30.0


def _metric(url: str, name: str, **labels: str) -> float:
    want = tuple(sorted(labels.items()))
    return metric_samples(url).get((name, want), 0.0)


def _wait(cond, what: str) -> None:
    end = time.monotonic() + DEADLINE
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_strangers_cannot_join_either_control_plane(live) -> None:
    system = live.disagg
    headers = {"Authorization": f"Bearer {API_KEY}"}
    status = httpx.get(system.url + "/v1/status", headers=headers, timeout=10).json()
    decode = next(w for w in status["workers"] if w["role"] == "decode")
    gateway_args = system.commands["gateway"]
    control = gateway_args[gateway_args.index("--control-bind") + 1]
    keys = load_keys(system.logs / "keys")
    def failed_gw() -> float:  # a client without CURVE that hangs up first counts as no_handshake
        return sum(_metric(system.url, "pdserve_control_auth_refused_total", kind=k)
                   for k in ("handshake", "no_handshake"))

    before_gw = failed_gw()
    kv_name, decode_id = "pdserve_kv_control_refused_total", worker_id("decode")
    before_kv = _metric(system.url, kv_name, worker_id=decode_id)
    compat = KVCompat(model_id="x", dtype="float32", block_size=16, num_layers=1, num_kv_heads=1, head_dim=8,
                      transfer_backend="nixl")
    ctx = zmq.Context()
    socks = []
    try:
        plain_gw, plain_kv, named_not = (ctx.socket(zmq.DEALER) for _ in range(3))
        socks = [plain_gw, plain_kv, named_not]
        for s in socks:
            s.setsockopt(zmq.LINGER, 0)
        # a plain client's pipe is dropped once its handshake fails, which can come before its send: the
        # send then finds no pipe (zmq.Again) and queues nothing; the refusal is counted either way (below)
        plain_gw.connect(control)
        register = RegisterWorker(role="decode", worker_id="stranger", epoch=1, model="m", model_path="",
                                  compat=compat, load=WorkerLoad())
        with contextlib.suppress(zmq.Again):
            plain_gw.send(encode(register), zmq.NOBLOCK)
        plain_kv.connect(decode["address"])
        with contextlib.suppress(zmq.Again):
            plain_kv.send(wire.encode(wire.Hello("stranger", 1, compat, b"")), zmq.NOBLOCK)
        secure_client(named_not, keys)  # holds the fleet's keys, but the gateway never named it
        named_not.connect(decode["address"])
        named_not.send(wire.encode(wire.Hello("stranger", 1, compat, b"")))
        assert named_not.poll(int(DEADLINE * 1000)), "no HelloReply to the fleet-key holder"
        reply = wire.decode(named_not.recv())
        assert isinstance(reply, wire.HelloReply) and reply.transport == b""
        assert "not named to this receiver" in reply.mismatches[0]
        _wait(lambda: failed_gw() > before_gw, "the gateway's refusal counted")
        # the plain client counts there too unless it hung up first (no_handshake: not in this count,
        # which leaves out bare TCP connects such as the probes)
        _wait(lambda: _metric(system.url, kv_name, worker_id=decode_id) >= before_kv + 1,
              "the decode worker's refusal of the unnamed sender reported")
        assert plain_gw.poll(100) == 0 and plain_kv.poll(100) == 0  # nothing ever came back
        ids = {w["worker_id"] for w in httpx.get(system.url + "/v1/status", headers=headers,
                                                 timeout=10).json()["workers"]}
        assert "stranger" not in ids
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
    body = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    resp = httpx.post(system.url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"], resp.text
    assert system.log("decode").count("refused stranger (unregistered_sender)") == 1
    # a key holder reusing the (now named) prefill worker's id with another KV sender epoch: refused,
    # counted, logged once for two Hellos; the fleet keeps serving (the fence follows the gateway only)
    prefill_id = next(w["worker_id"] for w in status["workers"] if w["role"] == "prefill")
    before_kv = _metric(system.url, kv_name, worker_id=decode_id)
    ctx = zmq.Context()
    try:
        for _ in range(2):
            impostor = ctx.socket(zmq.DEALER)
            impostor.setsockopt(zmq.LINGER, 0)
            secure_client(impostor, keys)
            impostor.connect(decode["address"])
            impostor.send(wire.encode(wire.Hello(prefill_id, 12345, compat, b"")))
            assert impostor.poll(int(DEADLINE * 1000)), "no HelloReply to the impostor"
            reply = wire.decode(impostor.recv())
            impostor.close(0)
            assert isinstance(reply, wire.HelloReply) and reply.transport == b""
            assert "not the incarnation its gateway named" in reply.mismatches[0], reply
    finally:
        ctx.term()
    _wait(lambda: _metric(system.url, kv_name, worker_id=decode_id) >= before_kv + 2,
          "the decode worker's refusals of the impostor reported")
    assert system.log("decode").count(f"refused {prefill_id} epoch 12345 (unnamed_sender_epoch)") == 1
    resp = httpx.post(system.url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"], resp.text
