"""Control-plane fuzz, bounded for CI (the 10,000-message run is ``python -m bench.fuzz.control_plane``):
mutated and truncated frames of every message type from a holder of the fleet's keys, to the gateway's
control socket (a real gateway process with fake workers) and to a KV receiver's control socket. No
crash, no hang (every send taken within 5 s), and each still serves afterwards with nothing leaked."""

from __future__ import annotations

import httpx

from bench.fuzz.control_plane import example, fuzz_frames, fuzz_kv, message_types, send_all, valid_frames
from kvtransfer import wire
from kvtransfer.curve import generate_keys, load_keys
from protocol import messages
from tests.gateway.conftest import wait_until

FRAMES = 600  # per socket: a few seconds on a loaded 2-core machine


def test_every_message_type_has_a_valid_example() -> None:
    for union, decode in ((messages.Message, messages.decode), (wire.Message, wire.decode)):
        types_ = message_types(union)
        assert len(types_) >= 13
        for t in types_:
            assert type(decode(messages.encode(example(t)) if union is messages.Message
                               else wire.encode(example(t)))) is t  # type: ignore[arg-type]
    frames = valid_frames(messages.Message, messages.encode)
    fuzzed = list(fuzz_frames(frames, 200, seed=1))
    assert fuzzed == list(fuzz_frames(frames, 200, seed=1))  # reproducible
    assert sum(parts == [f] for parts in fuzzed for f in frames) < 40  # mostly mutants
    assert any(len(parts) > 1 for parts in fuzzed) and any(parts == [b""] for parts in fuzzed)


def test_gateway_control_socket_survives_fuzz(make_cluster) -> None:
    c = make_cluster()
    c.start_worker("prefill", "p1")
    c.start_worker("decode", "d1")
    assert c.keys is not None
    sent = send_all(c.control, load_keys(c.keys),
                    fuzz_frames(valid_frames(messages.Message, messages.encode), FRAMES, seed=7))
    assert sent == FRAMES and c.gateway.poll() is None

    def only_fleet() -> bool:  # what the fuzzer registered leaves once its connection is gone
        body = httpx.get(c.base + "/v1/status", timeout=5).json()
        return {w["worker_id"] for w in body["workers"]} == {"p1", "d1"}

    wait_until(only_fleet, 30, "the fuzzer's registrations dropped")
    reply = c.client().completions.create(model="fake-model", prompt="after the fuzz", max_tokens=3)
    assert reply.choices[0].text
    c.assert_no_leaks(decode_ids=("d1",))
    assert "Traceback" not in (c.tmp / "gateway.log").read_text()


def test_kv_control_socket_survives_fuzz(tmp_path) -> None:
    result = fuzz_kv(FRAMES, 3, generate_keys(tmp_path / "keys"))
    assert (result.sent, result.after) == (FRAMES, "ok"), result
