"""Control-plane messages: every Struct round-trips through encode/decode; bad bytes are refused; request
messages carry no stop strings and refuse bad sampling params when decoded."""

from __future__ import annotations

import msgspec
import pytest

from engine.sampling_params import SamplingParams
from kvtransfer.compat import KVCompat, mismatches
from protocol.messages import (
    AbortRequest,
    ColocatedRequest,
    DecodeRequest,
    FirstToken,
    Heartbeat,
    KVEvents,
    KVReserved,
    KVSnapshotRequest,
    NextToken,
    OutputBatch,
    PrefillRequest,
    RegisterAck,
    RegisterWorker,
    RequestFailed,
    RequestFinished,
    ReserveKV,
    TopLogprob,
    WorkerLoad,
    WorkerShutdown,
    decode,
    encode,
    request_id_of,
)

SP = SamplingParams(max_tokens=7, temperature=0.0, seed=3, stop_token_ids=(2,))
COMPAT = KVCompat(dtype="bfloat16", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)

ALL = [
    RegisterWorker(role="decode", worker_id="d", epoch=5, model="m", model_path="/x", compat=COMPAT,
                   transfer_address="tcp://h:1", load=WorkerLoad(num_free_blocks=9, num_total_blocks=10)),
    RegisterAck(worker_id="d", epoch=5, accepted=False, reason="stale"),
    Heartbeat(worker_id="d", epoch=5, load=WorkerLoad(num_waiting=1, num_running=2)),
    WorkerShutdown(worker_id="d", epoch=5),
    ReserveKV(request_id="r", prompt_token_ids=[1, 2, 3], sampling=SP, prefill_worker_id="p",
              prefill_sender_epoch=9),
    KVReserved(request_id="r", worker_id="d", kv_handle=b"\x00\xffhandle"),
    PrefillRequest(request_id="r", prompt_token_ids=[1], sampling=SP, kv_handle=b"h", decode_worker_id="d"),
    PrefillRequest(request_id="r", prompt_token_ids=[1], sampling=SP),
    DecodeRequest(request_id="r", first_token_id=17, num_cached_tokens=16),
    ColocatedRequest(request_id="r", prompt_token_ids=[4, 5], sampling=SP),
    FirstToken(request_id="r", worker_id="p", token_id=9, logprob=-0.5,
               top_logprobs=[TopLogprob(9, -0.5), TopLogprob(3, -1.5)], finish_reason="length"),
    NextToken(request_id="r", worker_id="d", token_id=1, logprob=-0.1, top_logprobs=[TopLogprob(1, -0.1)]),
    NextToken(request_id="r", worker_id="d", token_id=2),
    RequestFinished(request_id="r", worker_id="d", finish_reason="stop", num_prompt_tokens=3,
                    num_output_tokens=4),
    RequestFailed(request_id="r", worker_id="d", error="boom"),
    AbortRequest(request_id="r", reason="client disconnected"),
    OutputBatch(worker_id="d", messages=[
        KVReserved(request_id="q", worker_id="d", kv_handle=b"h"),
        NextToken(request_id="r", worker_id="d", token_id=1),
        NextToken(request_id="s", worker_id="d", token_id=2, logprob=-0.25,
                  top_logprobs=[TopLogprob(2, -0.25)]),
        RequestFinished(request_id="s", worker_id="d", finish_reason="length", num_prompt_tokens=3,
                        num_output_tokens=2),
        FirstToken(request_id="t", worker_id="d", token_id=5), RequestFailed(request_id="u", worker_id="d",
                                                                             error="boom")]),
    OutputBatch(worker_id="d", messages=[]),
    KVEvents(worker_id="p", epoch=5, seq_no=3, stored=[0, 2**64 - 1], removed=[7]),
    KVEvents(worker_id="p", epoch=5, seq_no=1, snapshot=True),
    KVSnapshotRequest(worker_id="p", epoch=5),
]


@pytest.mark.parametrize("msg", ALL, ids=lambda m: type(m).__name__)
def test_round_trip(msg: object) -> None:
    back = decode(encode(msg))  # type: ignore[arg-type]
    assert type(back) is type(msg)
    assert back == msg


def test_tag_names_the_type() -> None:
    raw = msgspec.msgpack.decode(encode(AbortRequest(request_id="x")))
    assert raw["type"] == "AbortRequest"


def test_bad_bytes_and_wrong_fields_raise() -> None:
    with pytest.raises(msgspec.DecodeError):
        decode(b"\xc1not msgpack")
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode({"type": "AbortRequest"}))  # request_id missing
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode({"type": "NoSuchMessage", "request_id": "x"}))
    with pytest.raises(msgspec.ValidationError, match=r"stored\[1\]"):  # a block hash is never negative
        decode(msgspec.msgpack.encode({"type": "KVEvents", "worker_id": "p", "epoch": 1, "seq_no": 1,
                                       "stored": [1, -1]}))
    with pytest.raises(msgspec.ValidationError, match="seq_no"):
        decode(msgspec.msgpack.encode({"type": "KVEvents", "worker_id": "p", "epoch": 1, "seq_no": 0}))


def test_pairing_ignores_max_model_len_only() -> None:
    def reg(block_size: int, max_model_len: int) -> RegisterWorker:
        return RegisterWorker(role="decode", worker_id="d", epoch=1, model="m", model_path="",
                              compat=KVCompat(dtype="bfloat16", block_size=block_size),
                              max_model_len=max_model_len)
    a, b, c = reg(16, 100), reg(16, 200), reg(32, 2048)
    assert mismatches(a.compat, b.compat) == []
    assert mismatches(a.compat, c.compat) == ["block_size 16 != 32"]


def test_request_messages_refuse_stop_strings() -> None:
    with_stop = SamplingParams(max_tokens=4, stop=("END",))
    with pytest.raises(ValueError, match="stop strings stay in the gateway"):
        ReserveKV(request_id="r", prompt_token_ids=[1], sampling=with_stop, prefill_worker_id="p",
                  prefill_sender_epoch=9)
    with pytest.raises(ValueError, match="stop strings stay in the gateway"):
        PrefillRequest(request_id="r", prompt_token_ids=[1], sampling=with_stop)
    with pytest.raises(ValueError, match="stop strings stay in the gateway"):
        ColocatedRequest(request_id="r", prompt_token_ids=[1], sampling=with_stop)


def test_bad_sampling_params_are_refused_on_decode_naming_the_request() -> None:
    raw = msgspec.msgpack.encode({"type": "PrefillRequest", "request_id": "r7", "prompt_token_ids": [1],
                                  "sampling": {"max_tokens": 4, "top_k": 0}})
    with pytest.raises(msgspec.ValidationError, match=r"top_k must be -1 \(off\) or an int >= 1"):
        decode(raw)
    assert request_id_of(raw) == "r7"
    assert request_id_of(b"\xc1") is None and request_id_of(msgspec.msgpack.encode([1])) is None
