"""Only holders of the fleet's CURVE key pair join: a real gateway process (``--curve-keys``) and fake
workers (tests/fakes/fake_worker.py) on 127.0.0.1.

Intruders: a worker without CURVE (a plain DEALER), a worker with a key pair of its own (it expects its
own public key as the server's: the handshake fails), and a raw CURVE client with a key pair of its own
that knows the fleet's public key (the gateway's ZAP handler refuses its key). None registers, none
receives a single message (their record files stay empty, the raw client's socket stays silent), each
refusal is counted in ``pdserve_control_auth_refused_total{kind}``; workers with the fleet's keys serve
as before, with no block leaked.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import zmq

from kvtransfer.compat import KVCompat
from kvtransfer.curve import generate_keys, load_keys
from protocol.messages import RegisterWorker, WorkerLoad, encode
from tests.gateway.conftest import MSGS, wait_until


def _status_ids(base: str) -> set[str]:
    body = httpx.get(base + "/v1/status", timeout=5).json()
    return {w["worker_id"] for w in body["workers"]}


def test_only_fleet_key_holders_register_and_receive_requests(make_cluster, tmp_path: Path) -> None:
    c = make_cluster()
    assert c.metric("pdserve_control_auth_refused_total", kind="handshake") == 0
    assert c.metric("pdserve_control_auth_refused_total", kind="unknown_key") == 0
    # 1. no CURVE at all
    plain_record = c.start_worker("decode", "intruder-plain", wait=False, curve_keys="")
    # 2. a key pair of its own (and so the wrong server key)
    other = tmp_path / "other-keys"
    generate_keys(other)
    own_record = c.start_worker("prefill", "intruder-own-keys", wait=False, curve_keys=other)
    # a client without CURVE that hangs up first is counted as no_handshake (libzmq reports which side
    # saw the mechanism mismatch first), so the two kinds are summed
    def failed() -> float:
        return sum(c.metric("pdserve_control_auth_refused_total", kind=k)
                   for k in ("handshake", "no_handshake"))

    wait_until(lambda: failed() >= 2, 10, "both failed handshakes counted")
    # 3. a raw CURVE client with its own key pair that knows the fleet's public key
    assert c.keys is not None
    fleet = load_keys(c.keys)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.curve_publickey, raw.curve_secretkey = zmq.curve_keypair()
    raw.curve_serverkey = fleet.public
    raw.connect(c.control)
    try:
        compat = KVCompat(model_id="fake-model", dtype="float32", block_size=4, num_layers=2, num_kv_heads=1,
                          head_dim=8, transfer_backend="loopback")
        raw.send(encode(RegisterWorker(role="decode", worker_id="intruder-raw", epoch=1, model="fake-model",
                                       model_path="", compat=compat, max_model_len=256, load=WorkerLoad())),
                 zmq.NOBLOCK)
    except zmq.Again:  # the handshake was refused before the message could even be queued: as good
        pass
    wait_until(lambda: c.metric("pdserve_control_auth_refused_total", kind="unknown_key") >= 1, 10,
               "the unknown key counted")
    try:
        # the fleet's own workers register and serve as before
        c.start_worker("prefill", "p1")
        c.start_worker("decode", "d1")
        reply = c.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=3)
        assert reply.choices[0].message.content
        assert _status_ids(c.base) == {"p1", "d1"}
        for rid in ("intruder-plain", "intruder-own-keys", "intruder-raw"):
            assert f'worker_id="{rid}"' not in c.metrics()
        assert raw.poll(200) == 0  # no RegisterAck, nothing at all
        assert not plain_record.exists() and not own_record.exists()  # nothing received, not an ack
        assert all(c.workers[w].poll() is None for w in ("intruder-plain", "intruder-own-keys"))  # retrying
        before = failed()
        deadline = time.monotonic() + 10
        while failed() <= before:
            assert time.monotonic() < deadline, "the intruders' reconnects are not counted"
            time.sleep(0.05)
        c.assert_no_leaks(decode_ids=("d1",))
    finally:
        raw.close(0)
        ctx.term()
    log = (tmp_path / "gateway.log").read_text()
    # logged once per kind and peer host / key, not per attempt (the own-key intruder retries ~10 times a
    # second): both intruders are on 127.0.0.1; a refusal whose host was gone before the gateway read it
    # is logged only if it is the first of its kind
    lines = [line for line in log.splitlines() if "refused a client without the fleet's CURVE keys" in line
             or "refused a connection closed before any handshake" in line]
    for what in ("without the fleet's CURVE keys", "closed before any handshake"):
        of_kind = [line for line in lines if what in line]
        assert len(of_kind) <= 2 and sum("from 127.0.0.1" in line for line in of_kind) <= 1, log[-2000:]
        assert sum("(peer unknown)" in line for line in of_kind) <= 1, log[-2000:]
    assert any("without the fleet's CURVE keys" in line for line in lines), log[-2000:]
    assert log.count("refused a client with an unknown CURVE key") == 1, log[-2000:]


def test_insecure_control_plane_is_explicit_and_warns(make_cluster) -> None:
    """``--insecure-control-plane``: a plain worker registers (the old behaviour), and the gateway logs a
    warning saying so."""
    c = make_cluster(insecure_control_plane=True, log_level="warning")
    c.start_worker("prefill", "p1")
    c.start_worker("decode", "d1")
    reply = c.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=2)
    assert reply.choices[0].message.content
    assert "--insecure-control-plane" in (c.tmp / "gateway.log").read_text()
    c.assert_no_leaks(decode_ids=("d1",))
