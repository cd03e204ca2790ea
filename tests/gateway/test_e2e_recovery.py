"""Faults through the real gateway process and fake workers (tests/fakes/fake_worker.py, ``--fail-at`` /
``--hang-at``): a stream that fails before its first token gets a real HTTP error, a failure before the
first token is retried on another decode worker, a decode worker lost mid-stream hands the stream over
to another one (prompt + the streamed tokens), invisibly to the client. Each test ends with a leak check.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from gateway.text import TextProcessor
from tests.gateway.conftest import MSGS, REPLY, Cluster, read_record, wait_until

pytestmark = pytest.mark.slow  # starts processes


def stream_chat(c: Cluster, rid: str, max_tokens: int) -> tuple[int, dict[str, str], list[str]]:
    """POST a streaming chat request; (status, headers, the SSE ``data:`` payloads or the error body)."""
    body = {"model": "fake-model", "messages": MSGS, "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", c.base + "/v1/chat/completions", json=body, timeout=30,
                      headers={"X-Request-Id": rid}) as resp:
        if resp.status_code != 200:
            return resp.status_code, dict(resp.headers), [resp.read().decode()]
        data = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
        return 200, dict(resp.headers), data


def text_of(events: list[str]) -> str:
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    assert all("error" not in c for c in chunks), chunks
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def types_for(c: Cluster, worker: str, rid: str) -> list[str]:
    records = read_record(c.tmp / f"{worker}.jsonl")
    return [m["type"] for m in records if (m["request_id"] or "").startswith(rid)]


def test_only_decode_failing_before_first_token_is_an_http_error(make_cluster, reply_ids: list[int]) -> None:
    c = make_cluster()
    ids = ",".join(map(str, reply_ids))
    c.start_worker("prefill", "p1", output_ids=ids)
    c.start_worker("decode", "d1", output_ids=ids, fail_at=-1)
    status, headers, body = stream_chat(c, "full-1", 8)
    assert status == 503 and headers["retry-after"] == "1"
    error = json.loads(body[0])["error"]
    assert "worker d1 failed" in error["message"] and error["type"] == "service_unavailable"
    with pytest.raises(openai.APIStatusError) as err:  # non-streaming: the same answer
        c.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=8)  # type: ignore[arg-type]
    assert err.value.status_code == 503
    wait_until(lambda: "AbortRequest" in types_for(c, "d1", "full-1"), 5, "abort at d1")
    c.assert_no_leaks(("d1",))


def test_timeout_before_first_token_is_504(make_cluster) -> None:
    c = make_cluster(request_timeout="1s")
    c.start_worker("prefill", "p1", prefill_delay=10)
    c.start_worker("decode", "d1")
    status, _, body = stream_chat(c, "slow-1", 4)
    assert status == 504 and json.loads(body[0])["error"]["code"] == "timeout"
    wait_until(lambda: "AbortRequest" in types_for(c, "p1", "slow-1"), 5, "abort at p1")
    c.assert_no_leaks(("d1",))


def test_client_gone_before_first_token_aborts_the_workers(make_cluster) -> None:
    c = make_cluster()
    c.start_worker("prefill", "p1", prefill_delay=10)
    c.start_worker("decode", "d1")
    with pytest.raises(httpx.ReadTimeout):
        body = {"model": "fake-model", "messages": MSGS, "max_tokens": 4, "stream": True}
        with httpx.stream("POST", c.base + "/v1/chat/completions", json=body,
                          timeout=httpx.Timeout(30, read=1.0), headers={"X-Request-Id": "gone-early"}):
            pass
    wait_until(lambda: "AbortRequest" in types_for(c, "p1", "gone-early"), 5, "abort at p1")
    wait_until(lambda: "AbortRequest" in types_for(c, "d1", "gone-early"), 5, "abort at d1")
    c.assert_no_leaks(("d1",))


def test_failure_before_first_token_is_retried_on_another_decode(make_cluster, reply_ids: list[int]) -> None:
    c = make_cluster()
    ids = ",".join(map(str, reply_ids))
    c.start_worker("prefill", "p1", output_ids=ids)
    c.start_worker("decode", "d1", output_ids=ids, fail_at=-1, total_blocks=128)  # more free: chosen first
    c.start_worker("decode", "d2", output_ids=ids)
    status, _, events = stream_chat(c, "retry-1", len(reply_ids))
    assert status == 200 and text_of(events) == REPLY
    assert c.metric("pdserve_request_retries_total", cause="failed") == 1
    assert types_for(c, "d1", "retry-1")[0] == "ReserveKV"
    wait_until(lambda: "AbortRequest" in types_for(c, "d1", "retry-1"), 5, "abort at the failed d1")
    assert types_for(c, "d2", "retry-1") == ["ReserveKV", "DecodeRequest"]
    c.assert_no_leaks(("d2",))
    c.assert_no_leaks(("d1",), total_blocks=128)


def test_decode_lost_mid_stream_continues_on_another(make_cluster, reply_ids: list[int]) -> None:
    c = make_cluster()
    ids = ",".join(map(str, reply_ids))
    c.start_worker("prefill", "p1", output_ids=ids)
    c.start_worker("decode", "d1", output_ids=ids, hang_at=3, total_blocks=128)
    c.start_worker("decode", "d2", output_ids=ids)
    status, _, events = stream_chat(c, "mig-1", len(reply_ids))
    assert status == 200 and text_of(events) == REPLY  # no gap, no repeat
    usage_free = [json.loads(e) for e in events if e != "[DONE]"]
    assert usage_free[-1]["choices"][0]["finish_reason"] == "length"
    assert c.metric("pdserve_request_migrations_total", cause="lost") == 1
    reserve = next(m for m in read_record(c.tmp / "d2.jsonl") if m["type"] == "ReserveKV")
    prompt = next(m for m in read_record(c.tmp / "d1.jsonl") if m["type"] == "ReserveKV")["prompt_token_ids"]
    assert reserve["prompt_token_ids"] == prompt + reply_ids[:3]  # type: ignore[operator]
    assert reserve["sampling"]["max_tokens"] == len(reply_ids) - 3  # type: ignore[index]
    wait_until(lambda: "AbortRequest" in types_for(c, "d1", "mig-1"), 5, "abort at the stalled d1")
    c.assert_no_leaks(("d2",))


def test_no_migration_allowed_ends_with_an_error_event(make_cluster, reply_ids: list[int]) -> None:
    c = make_cluster(max_migrations=0)
    ids = ",".join(map(str, reply_ids))
    c.start_worker("prefill", "p1", output_ids=ids)
    c.start_worker("decode", "d1", output_ids=ids, fail_at=3, total_blocks=128)
    c.start_worker("decode", "d2", output_ids=ids)
    status, _, events = stream_chat(c, "nomig-1", len(reply_ids))
    assert status == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "no migration: --max-migrations 0" in error["message"]
    assert not types_for(c, "d2", "nomig-1")
    c.assert_no_leaks(("d2",))
    c.assert_no_leaks(("d1",), total_blocks=128)


def test_structured_request_failed_mid_stream_continues_under_its_grammar(make_cluster,
                                                                          reply_ids: list[int]) -> None:
    """A worker fails a structured request (``RequestFailed`` of kind ``worker``: its own failure, not the
    grammar's) after streaming tokens. The gateway does not start the request over: it migrates it, the
    streamed tokens become the end of the new attempt's prompt (``output_offset``), the new attempt keeps
    the request's structured output, and the client's stream holds every token once."""
    c = make_cluster()
    ids = ",".join(map(str, reply_ids))
    c.start_worker("prefill", "p1", output_ids=ids)
    c.start_worker("decode", "d1", output_ids=ids, fail_at=3, total_blocks=128)  # more free: chosen first
    c.start_worker("decode", "d2", output_ids=ids)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    body = {"model": "fake-model", "messages": MSGS, "max_tokens": len(reply_ids), "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    with httpx.stream("POST", c.base + "/v1/chat/completions", json=body, timeout=30,
                      headers={"X-Request-Id": "so-mig-1"}) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
    assert text_of(events) == REPLY  # no gap, no repeat
    assert c.metric("pdserve_request_migrations_total", cause="failed") == 1
    assert c.metric("pdserve_request_retries_total", cause="failed") == 0
    first = next(m for m in read_record(c.tmp / "d1.jsonl") if m["type"] == "ReserveKV")
    again = next(m for m in read_record(c.tmp / "d2.jsonl") if m["type"] == "ReserveKV")
    assert again["prompt_token_ids"] == first["prompt_token_ids"] + reply_ids[:3]  # type: ignore[operator]
    s1, s2 = first["sampling"], again["sampling"]
    assert isinstance(s1, dict) and isinstance(s2, dict)
    assert s1["structured_output"]["kind"] == "json"
    assert s2["structured_output"] == s1["structured_output"]
    assert (s2["output_offset"], s2["max_tokens"]) == (3, len(reply_ids) - 3)
    wait_until(lambda: "AbortRequest" in types_for(c, "d1", "so-mig-1"), 5, "abort at the failed d1")
    c.assert_no_leaks(("d2",))
    c.assert_no_leaks(("d1",), total_blocks=128)


def structured_stream(c: Cluster, rid: str, max_tokens: int) -> tuple[int, list[str]]:
    """POST a streaming chat request with a JSON-schema ``response_format``; (status, the SSE ``data:``
    payloads or the error body)."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    body = {"model": "fake-model", "messages": MSGS, "max_tokens": max_tokens, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    with httpx.stream("POST", c.base + "/v1/chat/completions", json=body, timeout=30,
                      headers={"X-Request-Id": rid}) as resp:
        if resp.status_code != 200:
            return resp.status_code, [resp.read().decode()]
        return 200, [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]


def test_grammar_rejection_before_first_token_is_a_400_not_retried(make_cluster,
                                                                   reply_ids: list[int]) -> None:
    """``RequestFailed`` of kind ``structured_output`` (the request's grammar rejected the model's token)
    before any token: the client gets 400 with the OpenAI error body naming ``response_format``, and the
    request runs nowhere else (any worker would fail it alike)."""
    c = make_cluster()
    ids = ",".join(map(str, reply_ids))
    c.start_worker("prefill", "p1", output_ids=ids)
    c.start_worker("decode", "d1", output_ids=ids, fail_at=-1, fail_kind="structured_output",
                   total_blocks=128)  # more free: chosen first
    c.start_worker("decode", "d2", output_ids=ids)
    status, body = structured_stream(c, "so-rej-1", len(reply_ids))
    assert status == 400, body
    error = json.loads(body[0])["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "response_format"
    assert error["code"] == "structured_output_failed"
    assert error["message"] == "injected failure at position -1"  # no internal worker id
    assert c.metric("pdserve_request_retries_total", cause="failed") == 0
    assert types_for(c, "d1", "so-rej-1") == ["ReserveKV"]
    assert not types_for(c, "d2", "so-rej-1") and not types_for(c, "p1", "so-rej-1")
    c.assert_no_leaks(("d2",))
    c.assert_no_leaks(("d1",), total_blocks=128)


def test_grammar_rejection_mid_stream_ends_with_an_error_event_not_migrated(
        make_cluster, reply_ids: list[int], proc: TextProcessor) -> None:
    """``RequestFailed`` of kind ``structured_output`` after 3 streamed tokens: the stream keeps those
    tokens, ends with the error event and ``[DONE]``, and the request is not migrated."""
    c = make_cluster()
    ids = ",".join(map(str, reply_ids))
    c.start_worker("prefill", "p1", output_ids=ids)
    c.start_worker("decode", "d1", output_ids=ids, fail_at=3, fail_kind="structured_output",
                   total_blocks=128)  # more free: chosen first
    c.start_worker("decode", "d2", output_ids=ids)
    status, events = structured_stream(c, "so-rej-2", len(reply_ids))
    assert status == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["message"] == "injected failure at position 3"
    assert error["code"] == "structured_output_failed" and error["param"] == "response_format"
    assert text_of(events[:-2]) == proc.decode(reply_ids[:3])
    assert c.metric("pdserve_request_migrations_total", cause="failed") == 0
    assert not types_for(c, "d2", "so-rej-2")
    c.assert_no_leaks(("d2",))
    c.assert_no_leaks(("d1",), total_blocks=128)
