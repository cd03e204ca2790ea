"""Gateway end to end: real gateway process, fake prefill/decode workers as processes, official openai
client. Each test ends with a leak check (nothing in flight, all fake decode KV blocks free)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.text import TextProcessor
from tests.gateway.conftest import MSGS, REPLY, Cluster, metric_in, read_record, wait_until

pytestmark = pytest.mark.slow  # starts processes



@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path,
       reply_ids: list[int]) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("pd"), tokenizer_dir)
    ids = ",".join(map(str, reply_ids))
    cluster.start_worker("prefill", "p1", output_ids=ids)
    cluster.start_worker("decode", "d1", output_ids=ids)
    yield cluster
    cluster.close()


def chat_prompt_len(proc: TextProcessor) -> int:
    return len(proc.encode(proc.render_chat(MSGS)))


def kv_blocks(text: str, worker_id: str) -> tuple[float, float, float]:
    """A worker's ``pdserve_kv_blocks_used``, ``_free`` and ``_capacity`` in one ``/metrics`` text."""
    used, free, capacity = (metric_in(text, f"pdserve_kv_blocks_{s}", worker_id=worker_id)
                            for s in ("used", "free", "capacity"))
    return used, free, capacity


def test_chat_non_streaming(pd: Cluster, proc: TextProcessor, reply_ids: list[int]) -> None:
    r = pd.client().chat.completions.create(model="fake-model", messages=MSGS,  # type: ignore[arg-type]
                                            max_tokens=len(reply_ids))
    assert r.choices[0].message.content == REPLY
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (chat_prompt_len(proc), len(reply_ids))
    rid = r.id.removeprefix("chatcmpl-")
    d_types = [m["type"] for m in read_record(pd.tmp / "d1.jsonl") if m["request_id"] == rid]
    p_types = [m["type"] for m in read_record(pd.tmp / "p1.jsonl") if m["request_id"] == rid]
    assert d_types == ["ReserveKV", "DecodeRequest"] and p_types == ["PrefillRequest"]
    pd.assert_no_leaks(("d1",))


@pytest.mark.parametrize("obfuscation", [{}, {"include_obfuscation": False}])
def test_chat_streaming_with_usage(pd: Cluster, proc: TextProcessor, obfuscation: dict[str, bool]) -> None:
    """``include_obfuscation`` false asks for nothing (true is a 400: test_bad_input.py)."""
    stream = pd.client().chat.completions.create(
        model="fake-model", messages=MSGS, max_tokens=5, stream=True,  # type: ignore[call-overload]
        stream_options={"include_usage": True, **obfuscation})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == proc.decode(proc.encode(REPLY)[:5])
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == chat_prompt_len(proc)
    pd.assert_no_leaks(("d1",))


def test_completions_streaming_and_not(pd: Cluster, proc: TextProcessor) -> None:
    client = pd.client()
    r = client.completions.create(model="fake-model", prompt="The capital of France is", max_tokens=3)
    assert r.choices[0].text == proc.decode(proc.encode(REPLY)[:3])
    assert r.usage is not None and r.usage.prompt_tokens == len(proc.encode("The capital of France is"))
    parts = [c.choices[0].text for c in client.completions.create(
        model="fake-model", prompt=[1, 2, 3], max_tokens=4, stream=True)]
    assert "".join(parts) == proc.decode(proc.encode(REPLY)[:4])
    pd.assert_no_leaks(("d1",))


def test_max_tokens_one_never_reaches_decode(pd: Cluster, reply_ids: list[int], proc: TextProcessor) -> None:
    r = pd.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=1)  # type: ignore[arg-type]
    assert r.choices[0].message.content == proc.decode(reply_ids[:1])
    assert r.usage is not None and r.usage.completion_tokens == 1
    rid = r.id.removeprefix("chatcmpl-")
    p_types = [m["type"] for m in read_record(pd.tmp / "p1.jsonl") if m["request_id"] == rid]
    assert p_types == ["PrefillRequest"]
    assert not [m for m in read_record(pd.tmp / "d1.jsonl") if m["request_id"] == rid]
    pd.assert_no_leaks(("d1",))


def test_stop_string_across_tokens_aborts_decode(pd: Cluster, proc: TextProcessor) -> None:
    r = pd.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=50,  # type: ignore[arg-type]
                                            stop=["fake re"], extra_headers={"X-Request-Id": "stop-1"})
    assert r.choices[0].message.content == "Hello world, this is a "
    assert r.choices[0].finish_reason == "stop"
    ids = proc.encode(REPLY)
    used = next(n for n in range(1, len(ids) + 1) if "fake re" in proc.decode(ids[:n]))
    assert r.usage is not None and r.usage.completion_tokens == used
    wait_until(lambda: {"type": "AbortRequest", "request_id": "stop-1"} in read_record(pd.tmp / "d1.jsonl"),
               5, "abort at decode")
    pd.assert_no_leaks(("d1",))


def test_request_id_header_echoed(pd: Cluster) -> None:
    body = {"model": "fake-model", "prompt": "x", "max_tokens": 2}
    resp = httpx.post(pd.base + "/v1/completions", json=body,
                      headers={"X-Request-Id": "my-id-7"}, timeout=10)
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "my-id-7"
    assert resp.json()["id"] == "cmpl-my-id-7"
    assert any(m["request_id"] == "my-id-7" for m in read_record(pd.tmp / "p1.jsonl"))


def test_client_disconnect_sends_abort(tmp_path: Path, make_cluster, reply_ids: list[int]) -> None:
    c = make_cluster()
    c.start_worker("prefill", "p1", output_ids=",".join(map(str, reply_ids)))
    c.start_worker("decode", "d1", output_ids=",".join(map(str, reply_ids)), token_delay=0.2)
    body = {"model": "fake-model", "messages": MSGS, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", c.base + "/v1/chat/completions", json=body, timeout=10,
                      headers={"X-Request-Id": "gone-1"}) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        next(line for line in lines if "Hello" in line)
    wait_until(lambda: {"type": "AbortRequest", "request_id": "gone-1"} in read_record(tmp_path / "d1.jsonl"),
               5, "abort delivered to decode")
    c.assert_no_leaks(("d1",))


def test_worker_killed_mid_stream_gives_error_event(make_cluster, reply_ids: list[int]) -> None:
    c = make_cluster()
    c.start_worker("prefill", "p1", output_ids=",".join(map(str, reply_ids)))
    c.start_worker("decode", "d1", output_ids=",".join(map(str, reply_ids)), token_delay=0.2)
    stream = c.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=200,  # type: ignore[arg-type]
                                                stream=True)
    got = []
    with pytest.raises(openai.APIError, match="worker d1 lost"):
        for chunk in stream:
            got.append(chunk)
            if len(got) == 3:
                c.workers["d1"].kill()
    assert len(got) >= 3
    c.assert_no_leaks()
    # non-streaming: the failure is a 5xx OpenAI error, never a 200
    c.start_worker("decode", "d2", output_ids=",".join(map(str, reply_ids)), token_delay=0.2)
    killer = threading.Timer(0.8, c.workers["d2"].kill)
    killer.start()
    with pytest.raises(openai.APIStatusError) as err:
        c.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=200)  # type: ignore[arg-type]
    killer.join()
    assert err.value.status_code == 503 and "worker d2 lost" in err.value.message  # no decode left
    c.assert_no_leaks()


def test_dead_worker_detected_then_503(make_cluster) -> None:
    c = make_cluster()
    c.start_worker("prefill", "p1")
    c.start_worker("decode", "d1")
    assert httpx.get(c.base + "/ready").status_code == 200
    c.workers["d1"].kill()
    wait_until(lambda: httpx.get(c.base + "/ready").status_code == 503, 6, "/ready to turn 503")
    assert c.metric("pdserve_workers_live", role="decode") == 0
    with pytest.raises(openai.APIStatusError) as err:
        c.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=4)  # type: ignore[arg-type]
    assert err.value.status_code == 503 and "no live decode worker" in err.value.message
    c.assert_no_leaks()


def test_no_workers_503_and_bad_input(make_cluster) -> None:
    c = make_cluster(model_name="fake-model")
    client = c.client()
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="fake-model", messages=MSGS)  # type: ignore[arg-type]
    assert err.value.status_code == 503
    assert httpx.get(c.base + "/ready").status_code == 503
    c.start_worker("colocated", "c1", max_model_len=64)
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=MSGS)  # type: ignore[arg-type]
    assert nf.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="fake-model", messages=MSGS, temperature=5)  # type: ignore[arg-type]
    assert bad.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as ctx:
        client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=60)  # type: ignore[arg-type]
    assert "64 tokens" in ctx.value.message and "60 for the completion" in ctx.value.message
    resp = httpx.post(c.base + "/v1/chat/completions", json={"model": "fake-model"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    resp = httpx.post(c.base + "/v1/completions", content=b"{not json",
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    r = client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=3)  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.completion_tokens == 3  # colocated-only deployment serves
    assert c.metric("pdserve_routed_requests_total", kind="colocated") == 1
    c.assert_no_leaks()


def test_queue_full_429_with_retry_after(make_cluster) -> None:
    c = make_cluster(max_queue=1)
    c.start_worker("colocated", "c1", token_delay=0.1)
    body = {"model": "fake-model", "prompt": "x", "max_tokens": 30, "stream": True}
    with httpx.stream("POST", c.base + "/v1/completions", json=body, timeout=10) as first:
        assert first.status_code == 200
        second = httpx.post(c.base + "/v1/completions", json={**body, "stream": False}, timeout=10)
        assert second.status_code == 429 and second.headers["retry-after"] == "1"
        assert second.json()["error"]["code"] == "queue_full"
    c.assert_no_leaks()


def test_metrics_after_known_workload(make_cluster, reply_ids: list[int]) -> None:
    c = make_cluster()
    ids = ",".join(map(str, reply_ids))
    c.start_worker("prefill", "p1", output_ids=ids)
    c.start_worker("decode", "d1", output_ids=ids)
    client = c.client()
    for _ in range(2):
        client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=4)  # type: ignore[arg-type]
    list(client.completions.create(model="fake-model", prompt="hi", max_tokens=1, stream=True))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="fake-model", prompt="hi", max_tokens=0)
    assert c.metric("pdserve_requests_total", endpoint="/v1/chat/completions", status="200") == 2
    assert c.metric("pdserve_requests_total", endpoint="/v1/completions", status="200") == 1
    assert c.metric("pdserve_requests_total", endpoint="/v1/completions", status="400") == 1
    assert c.metric("pdserve_generation_tokens_total") == 9
    assert c.metric("pdserve_ttft_seconds_count") == 3
    assert c.metric("pdserve_itl_seconds_count") == 6
    assert c.metric("pdserve_routed_requests_total", kind="disaggregated") == 2
    assert c.metric("pdserve_routed_requests_total", kind="prefill_only") == 1
    # d1's KV series come from its heartbeats: one scrape holds one heartbeat's account (used + free is the
    # capacity), and the chat requests' blocks show free from the first heartbeat after they ended
    used, free, capacity = kv_blocks(c.metrics(), "d1")
    assert (used + free, capacity) == (64, 64)
    text = c.wait_metrics(lambda t: kv_blocks(t, "d1")[0] == 0, 5, "d1's heartbeat with every block free")
    assert kv_blocks(text, "d1") == (0, 64, 64)
    c.assert_no_leaks(("d1",))


def test_restarted_worker_new_epoch_fails_old_requests(make_cluster, reply_ids: list[int]) -> None:
    c = make_cluster()
    ids = ",".join(map(str, reply_ids))
    c.start_worker("prefill", "p1", output_ids=ids)
    old = c.start_worker("decode", "d1", output_ids=ids, token_delay=0.2, epoch=1)
    stream = c.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=200,  # type: ignore[arg-type]
                                                stream=True)
    with pytest.raises(openai.APIError, match="restarted"):
        for i, _ in enumerate(stream):
            if i == 2:  # same worker_id, newer epoch: the old incarnation's requests fail
                c.start_worker("decode", "d1", wait=False, output_ids=ids, epoch=2, record=str(old) + ".2")
    c.assert_no_leaks()
    r = c.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=3)  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.completion_tokens == 3  # the new incarnation serves


def test_api_key_and_local_prefill_fallback(make_cluster) -> None:
    c = make_cluster(api_key="sekret", allow_local_prefill="true")
    c.start_worker("decode", "d1")
    c.start_worker("colocated", "c1")
    assert httpx.get(c.base + "/health").status_code == 200  # public by default
    with pytest.raises(openai.AuthenticationError):
        c.client().models.list()
    client = openai.OpenAI(base_url=c.base + "/v1", api_key="sekret", max_retries=0, timeout=20)
    assert [m.id for m in client.models.list().data] == ["fake-model"]
    r = client.completions.create(model="fake-model", prompt="no prefill worker here", max_tokens=2)
    assert r.usage is not None and r.usage.completion_tokens == 2
    assert c.metric("pdserve_local_prefill_fallbacks_total") == 1
    assert c.metric("pdserve_routed_requests_total", kind="colocated") == 1
    c.assert_no_leaks(("d1",))
