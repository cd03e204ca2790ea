"""The gateway's OpenAI surface through the official ``openai`` client: ``n`` with derived seeds,
logprobs (chat and completions), ``echo``, batched prompts, ``max_completion_tokens``,
``stream_options.include_usage``, vLLM sampling extras, stream chunk layout, and the abort of a
non-streaming request whose client went away. One gateway + fake prefill/decode workers per module; every
test ends with a leak check (nothing in flight, all fake decode KV blocks free)."""

from __future__ import annotations

import json
import socket
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from gateway.text import TextProcessor
from tests.fakes.fake_worker import fake_logprob
from tests.gateway.conftest import MSGS, Cluster, read_record, wait_until

pytestmark = pytest.mark.slow  # starts processes
CACHED = 2  # prompt tokens the fake prefill worker reports found in its prefix cache



@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path,
       reply_ids: list[int]) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("surface"), tokenizer_dir, max_n=4)
    ids = ",".join(map(str, reply_ids))
    cluster.start_worker("prefill", "p1", output_ids=ids, cached_tokens=CACHED)
    # 50 ms a token: test_non_streaming_client_disconnect_aborts needs its 200-token request (10 s) to
    # outlive the gateway's noticing that the client left, by far, also on a loaded 2-core machine (at
    # 20 ms a token it once finished first)
    cluster.start_worker("decode", "d1", output_ids=ids, token_delay=0.05)
    yield cluster
    cluster.close()


def tokens(reply_ids: list[int], n: int, seed: int = 0) -> list[int]:
    """What the fake worker generates: position i → reply_ids[(i + seed) % len]."""
    return [reply_ids[(i + seed) % len(reply_ids)] for i in range(n)]


def sampling_of(pd: Cluster, worker: str, rid: str) -> dict[str, Any]:
    found: dict[str, Any] = next(m["sampling"] for m in read_record(pd.tmp / f"{worker}.jsonl")  # type: ignore[misc]
                                 if m["request_id"] == rid and "sampling" in m)
    return found


def test_n_choices_derive_seeds_and_reproduce(pd: Cluster, proc: TextProcessor, reply_ids: list[int]) -> None:
    client = pd.client()
    kw: dict[str, Any] = {"model": "fake-model", "messages": MSGS, "max_tokens": 4, "n": 3, "seed": 5}
    r = client.chat.completions.create(**kw, extra_headers={"X-Request-Id": "nreq"})
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, c in enumerate(r.choices):
        assert c.message.content == proc.decode(tokens(reply_ids, 4, 5 + i))
        assert sampling_of(pd, "p1", f"nreq-{i}")["seed"] == 5 + i
    assert r.usage is not None and r.usage.completion_tokens == 12
    again = client.chat.completions.create(**kw)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    pd.assert_no_leaks(("d1",))


def test_n_streaming_layout(pd: Cluster, proc: TextProcessor, reply_ids: list[int]) -> None:
    chunks = list(pd.client().chat.completions.create(  # type: ignore[call-overload]
        model="fake-model", messages=MSGS, max_tokens=6, n=2, seed=1, stream=True,
        stream_options={"include_usage": True}))
    for idx in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == idx]
        assert mine[0].delta.role == "assistant" and not mine[0].delta.content
        assert all(ch.delta.role is None for ch in mine[1:])
        assert all(ch.delta.content or ch.finish_reason for ch in mine[1:]), "an empty chunk was sent"
        assert [ch.finish_reason for ch in mine] == [None] * (len(mine) - 1) + ["length"]
        assert "".join(ch.delta.content or "" for ch in mine) == proc.decode(tokens(reply_ids, 6, 1 + idx))
    assert all(len(c.choices) == 1 for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    pd.assert_no_leaks(("d1",))


def test_chat_logprobs(pd: Cluster, proc: TextProcessor, reply_ids: list[int]) -> None:
    client = pd.client()
    r = client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=5,  # type: ignore[arg-type]
                                       logprobs=True, top_logprobs=2)
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content is not None
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == [proc.token_text(t) for t in reply_ids[:5]]
    assert [e.logprob for e in content] == [fake_logprob(i) for i in range(5)]
    assert content[1].bytes == list(proc.token_text(reply_ids[1]).encode())
    tops = content[3].top_logprobs
    assert [(t.token, t.logprob) for t in tops] == [(proc.token_text(reply_ids[3] + k), fake_logprob(3) - k)
                                                    for k in range(2)]
    stream: Any = client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=5,  # type: ignore[arg-type]
                                                 logprobs=True, top_logprobs=2, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content or []]
    assert [(e.token, e.logprob, len(e.top_logprobs)) for e in streamed] == [
        (e.token, e.logprob, 2) for e in content]
    plain = client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=2)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None
    assert sampling_of(pd, "p1", plain.id.removeprefix("chatcmpl-"))["logprobs"] is None
    pd.assert_no_leaks(("d1",))


def test_completion_logprobs(pd: Cluster, proc: TextProcessor, reply_ids: list[int]) -> None:
    client = pd.client()
    prompt = "The capital of France is"
    r = client.completions.create(model="fake-model", prompt=prompt, max_tokens=4, logprobs=3)
    gen = proc.decode(reply_ids[:4])
    assert r.choices[0].text == gen
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens == [proc.token_text(t) for t in reply_ids[:4]]
    assert lp.token_logprobs == [fake_logprob(i) for i in range(4)]
    assert lp.top_logprobs is not None and lp.top_logprobs[0] == {
        proc.token_text(reply_ids[0] + k): fake_logprob(0) - k for k in range(3)}
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert lp.text_offset == offsets
    chunks = list(client.completions.create(model="fake-model", prompt=prompt, max_tokens=4, logprobs=1,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == gen
    streamed = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset or []]
    assert streamed == offsets
    pd.assert_no_leaks(("d1",))


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_zero_has_an_entry_per_token(pd: Cluster, proc: TextProcessor,
                                                         reply_ids: list[int], stream: bool) -> None:
    """``logprobs: 0``: each generated token with its own logprob, and in ``top_logprobs`` only itself
    (OpenAI's legacy API always lists the chosen token: up to ``logprobs`` + 1 entries)."""
    kw: dict[str, Any] = {"model": "fake-model", "prompt": "The capital of France is", "max_tokens": 3,
                          "logprobs": 0}
    if stream:
        chunks = list(pd.client().completions.create(stream=True, **kw))
        lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
        tokens = [t for lp in lps for t in lp.tokens or []]
        values = [v for lp in lps for v in lp.token_logprobs or []]
        tops = [t for lp in lps for t in lp.top_logprobs or []]
    else:
        lp = pd.client().completions.create(**kw).choices[0].logprobs
        assert lp is not None
        tokens, values, tops = lp.tokens or [], lp.token_logprobs or [], lp.top_logprobs or []
    assert tokens == [proc.token_text(t) for t in reply_ids[:3]]
    assert values == [fake_logprob(i) for i in range(3)]
    assert tops == [{t: v} for t, v in zip(tokens, values, strict=True)]
    pd.assert_no_leaks(("d1",))


def test_echo_of_a_token_id_prompt_keeps_special_tokens(pd: Cluster, proc: TextProcessor,
                                                        reply_ids: list[int]) -> None:
    ids = proc.encode("<|im_start|>user\nhi<|im_end|>")
    assert proc.decode(ids) != proc.decode(ids, skip_special_tokens=False), "control: special tokens"
    r = pd.client().completions.create(model="fake-model", prompt=ids, max_tokens=2, echo=True)
    assert r.choices[0].text == "<|im_start|>user\nhi<|im_end|>" + proc.decode(reply_ids[:2])
    pd.assert_no_leaks(("d1",))


def test_batched_prompts_in_index_order(pd: Cluster, proc: TextProcessor, reply_ids: list[int]) -> None:
    client = pd.client()
    r = client.completions.create(model="fake-model", prompt=["one", "two words"], n=2, seed=0, max_tokens=3)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [proc.decode(tokens(reply_ids, 3, i % 2)) for i in range(4)]
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(proc.encode("one", True)) + len(proc.encode("two words", True))
    assert r.usage.completion_tokens == 12
    chunks = list(client.completions.create(model="fake-model", prompt=[[5, 6], [7, 8, 9]], max_tokens=2,
                                            stream=True, echo=True))
    by_index: dict[int, str] = {}
    for c in chunks:
        by_index[c.choices[0].index] = by_index.get(c.choices[0].index, "") + c.choices[0].text
    gen = proc.decode(reply_ids[:2])
    assert by_index == {0: proc.decode([5, 6], skip_special_tokens=False) + gen,  # these ids are specials
                        1: proc.decode([7, 8, 9], skip_special_tokens=False) + gen}
    pd.assert_no_leaks(("d1",))


def test_max_completion_tokens_and_extras_reach_workers(pd: Cluster) -> None:
    r = pd.client().chat.completions.create(
        model="fake-model", messages=MSGS, max_tokens=3, max_completion_tokens=3, user="u-1",  # type: ignore[arg-type]
        extra_body={"ignore_eos": True, "min_p": 0.25, "top_k": 7, "repetition_penalty": 1.5},
        extra_headers={"X-Request-Id": "extras"})
    assert r.usage is not None and r.usage.completion_tokens == 3
    s = sampling_of(pd, "d1", "extras")
    assert (s["max_tokens"], s["ignore_eos"], s["min_p"], s["top_k"], s["repetition_penalty"]) == (
        3, True, 0.25, 7, 1.5)
    pd.assert_no_leaks(("d1",))


def test_non_streaming_client_disconnect_aborts(pd: Cluster) -> None:
    # The client leaves only once decode runs: a fixed client timeout raced the gateway on a loaded CI
    # machine (a client gone before its body was read is, rightly, never sent to a worker at all).
    body = json.dumps({"model": "fake-model", "messages": MSGS, "max_tokens": 200}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: left-1\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    record = pd.tmp / "d1.jsonl"
    with socket.create_connection(("127.0.0.1", pd.port), timeout=5) as sock:
        sock.sendall(head + body)
        wait_until(lambda: {"type": "DecodeRequest", "request_id": "left-1"} in read_record(record),
                   15, "decode of left-1 started")
    wait_until(lambda: {"type": "AbortRequest", "request_id": "left-1"} in read_record(record),
               15, "abort at decode after the client left")
    pd.assert_no_leaks(("d1",))


def test_eos_finish_in_last_chunk_and_ignore_eos(make_cluster, proc: TextProcessor,
                                                 reply_ids: list[int]) -> None:
    c = make_cluster()
    eos = reply_ids[2]
    ids = ",".join(map(str, reply_ids))
    c.start_worker("colocated", "c1", output_ids=ids, eos_id=eos)
    client = c.client()
    chunks = list(client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=8,  # type: ignore[arg-type]
                                                 stream=True))
    assert [ch.choices[0].finish_reason for ch in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert all(ch.choices[0].delta.content or ch.choices[0].finish_reason for ch in chunks[1:])
    r = client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=8,  # type: ignore[arg-type]
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 8
    c.assert_no_leaks()


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": list(range(1, 301))}, "prompt"),  # the prompt alone exceeds 256
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 300}]}, "messages"),
    ("/v1/completions", {"prompt": list(range(1, 201)), "max_tokens": 100}, "max_tokens"),  # fits alone
])
def test_context_overflow_names_the_prompt_when_it_alone_is_too_long(pd: Cluster, path: str,
                                                                    body: dict[str, Any], param: str) -> None:
    """A prompt longer than the context is the prompt's fault, not max_tokens' (a new-user trial got
    param "max_tokens" for a 10,001-token prompt with max_tokens 2)."""
    r = httpx.post(pd.base + path, json={"model": "fake-model", "max_tokens": 2, **body}, timeout=10)
    err = r.json()["error"]
    assert (r.status_code, err["code"], err["param"]) == (400, "context_length_exceeded", param), err


@pytest.mark.parametrize("stream", [False, True])
def test_usage_reports_cached_prompt_tokens(pd: Cluster, stream: bool) -> None:
    """``usage.prompt_tokens_details.cached_tokens``: the prefill worker's prefix-cache hits, once per
    prompt (its first choice's)."""
    client = pd.client()
    kw: dict[str, Any] = {"model": "fake-model", "prompt": ["one two three", "four five six"], "n": 2,
                          "max_tokens": 2}
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        used = chunks[-1].usage
    else:
        used = client.completions.create(**kw).usage
    assert used is not None and used.prompt_tokens_details is not None
    assert used.prompt_tokens_details.cached_tokens == 2 * CACHED
    chat = client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=2)  # type: ignore[arg-type]
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    assert chat.usage.prompt_tokens_details.cached_tokens == CACHED
    pd.assert_no_leaks(("d1",))


def test_logit_bias_travels_to_prefill_and_decode(pd: Cluster) -> None:
    """Both the worker sampling the first token and the one sampling the rest get ``logit_bias``."""
    pd.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=3,  # type: ignore[arg-type]
                                        logit_bias={"17": 100, "5": -2.5},
                                        extra_headers={"X-Request-Id": "biased"})
    for worker in ("p1", "d1"):
        assert sampling_of(pd, worker, "biased")["logit_bias"] == [[5, -2.5], [17, 100.0]], worker
    pd.assert_no_leaks(("d1",))


def test_fields_accepted_by_design(pd: Cluster) -> None:
    """Identity and stored-completion metadata, harmless values of unsupported fields, ``best_of == n``:
    accepted, and the request is served as without them."""
    client = pd.client()
    plain = client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=3)  # type: ignore[arg-type]
    tagged = client.chat.completions.create(  # type: ignore[call-overload]
        model="fake-model", messages=MSGS, max_tokens=3, user="u-1", metadata={"k": "v"}, store=False,
        response_format={"type": "text"}, tools=[], modalities=["text"],
        service_tier="auto", extra_body={"safety_identifier": "hash-1"})
    assert tagged.choices[0].message.content == plain.choices[0].message.content
    history = [*MSGS, {"role": "assistant", "content": "Paris.", "refusal": None, "tool_calls": None,
                        "function_call": None, "audio": None, "annotations": []}, *MSGS]
    assert client.chat.completions.create(model="fake-model", messages=history, max_tokens=1).choices  # type: ignore[arg-type]
    r = client.completions.create(model="fake-model", prompt="hi", max_tokens=2, n=2, best_of=2)
    assert len(r.choices) == 2
    pd.assert_no_leaks(("d1",))


def test_model_card_tokenize_detokenize(pd: Cluster, proc: TextProcessor, tokenizer_dir: Path) -> None:
    client = pd.client()
    card = client.models.retrieve("fake-model")
    assert (card.id, card.object, card.owned_by) == ("fake-model", "model", "pdserve")
    assert card.model_extra == {"root": "fake-model", "max_model_len": 256}
    listed = httpx.get(pd.base + "/v1/models", timeout=5).json()["data"]
    assert listed == [httpx.get(pd.base + "/v1/models/fake-model", timeout=5).json() | {
        "created": listed[0]["created"]}]
    missing = httpx.get(pd.base + "/v1/models/org/other", timeout=5)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

    text = "The capital of France is"
    r = httpx.post(pd.base + "/tokenize", json={"model": "fake-model", "prompt": text}, timeout=5).json()
    ids = proc.encode(text, True)
    assert r == {"count": len(ids), "max_model_len": 256, "tokens": ids}
    r = httpx.post(pd.base + "/tokenize", json={"messages": MSGS, "return_token_strs": True},
                   timeout=5).json()
    rendered = proc.render_chat(MSGS)
    assert r["tokens"] == proc.encode(rendered) and r["count"] == len(r["tokens"])
    # vLLM's token_strs: the vocabulary's strings (byte-level BPE: "Ġ" for a space), not decoded text
    vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    assert r["token_strs"] == [vocab.id_to_token(t) for t in r["tokens"]]
    assert "".join(proc.token_text(t) for t in r["tokens"]) == rendered
    bare = httpx.post(pd.base + "/tokenize", json={"messages": MSGS, "add_generation_prompt": False},
                      timeout=5).json()
    assert bare["tokens"] == proc.encode(proc.render_chat(MSGS, add_generation_prompt=False))
    back = httpx.post(pd.base + "/detokenize", json={"model": "fake-model", "tokens": r["tokens"]},
                      timeout=5).json()
    assert back == {"prompt": rendered}
    chat = client.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=1)  # type: ignore[arg-type]
    assert chat.usage is not None and chat.usage.prompt_tokens == r["count"]
    # tools are rendered as a chat completion renders them (this template has none: the fallback prompt)
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with_tools = httpx.post(pd.base + "/tokenize", json={"messages": MSGS, "tools": tools}, timeout=5).json()
    chat = client.chat.completions.create(model="fake-model", messages=MSGS, tools=tools,  # type: ignore[arg-type]
                                          tool_choice="none", max_tokens=1)
    assert chat.usage is not None and chat.usage.prompt_tokens == with_tools["count"] > r["count"]
    alone = httpx.post(pd.base + "/tokenize", json={"prompt": "x", "tools": tools}, timeout=5)
    assert alone.status_code == 400 and alone.json()["error"]["param"] == "tools"
    twice = httpx.post(pd.base + "/tokenize", json={"messages": MSGS, "tools": tools * 2}, timeout=5)
    assert twice.status_code == 400 and twice.json()["error"]["param"] == "tools.1.function.name"


@pytest.mark.parametrize(("fields", "kind", "spec"), [
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"},
                                                                 "strict": True}}},
     "json", '{"type": "integer"}'),
    ({"extra_body": {"structured_outputs": {"json": '{"type": "boolean"}'}}}, "json", '{"type": "boolean"}'),
    ({"extra_body": {"structured_outputs": {"json_object": True}}}, "json_object", ""),
    ({"extra_body": {"structured_outputs": {"regex": "[0-9]+"}}}, "regex", "[0-9]+"),
    ({"extra_body": {"structured_outputs": {"choice": ["a", "b\""]}}}, "choice", '["a", "b\\""]'),
    ({"extra_body": {"structured_outputs": {"grammar": 'root ::= "x"'}}}, "grammar", 'root ::= "x"'),
])
def test_structured_output_travels_to_prefill_and_decode(pd: Cluster, fields: dict[str, Any], kind: str,
                                                         spec: str) -> None:
    """The request's constraint reaches both the worker sampling the first token and the one sampling the
    rest as one ``StructuredOutput`` (kind, spec)."""
    rid = f"so-{zlib.crc32(json.dumps(fields).encode())}"
    pd.client().chat.completions.create(model="fake-model", messages=MSGS, max_tokens=3,  # type: ignore[call-overload]
                                        extra_headers={"X-Request-Id": rid}, **fields)
    for worker in ("p1", "d1"):
        assert sampling_of(pd, worker, rid)["structured_output"] == {"kind": kind, "spec": spec}, worker
    pd.assert_no_leaks(("d1",))


def _raw_chunks(pd: Cluster, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = httpx.post(pd.base + path, json={"model": "fake-model", "max_tokens": 3, "stream": True, **body},
                   timeout=10)
    assert r.status_code == 200, r.text
    lines = [ln.removeprefix("data: ") for ln in r.text.split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", {"messages": MSGS}),
                                            ("/v1/completions", {"prompt": "one two"})])
def test_include_usage_puts_null_usage_in_every_chunk_but_the_last(pd: Cluster, path: str,
                                                                   body: dict[str, Any]) -> None:
    """OpenAI: with ``include_usage`` every chunk before the last carries ``"usage": null``; without it
    no chunk has the key."""
    chunks = _raw_chunks(pd, path, {**body, "stream_options": {"include_usage": True}})
    assert len(chunks) > 2 and all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    plain = _raw_chunks(pd, path, body)
    assert plain and not any("usage" in c for c in plain), plain
    pd.assert_no_leaks(("d1",))
