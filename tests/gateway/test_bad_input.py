"""Bad and hostile requests: each gets its documented 4xx with the OpenAI error body
(``error.message/type/param/code``), none a 5xx; afterwards the gateway and the fake workers are healthy,
nothing is in flight and every fake decode KV block is free. One gateway (with an API key, ``--max-n 4``,
``--max-stop 3``, ``--max-prompt-tokens 100``, 1 MiB body cap) + fake prefill/decode workers (context 128
tokens) for the whole module."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import Cluster

pytestmark = pytest.mark.slow  # starts processes

KEY = "k-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_CAP = 1 << 20
MSGS = [{"role": "user", "content": "hi"}]
CHAT, COMP = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("bad"), tokenizer_dir, api_key=KEY, max_n=4, max_stop=3,
                      max_prompt_tokens=100, max_body_bytes=BODY_CAP)
    cluster.start_worker("prefill", "p1", max_model_len=128)
    cluster.start_worker("decode", "d1", max_model_len=128)
    yield cluster
    cluster.close()


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": MSGS, "max_tokens": 2, **fields}


def comp(**fields: Any) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": "hi", "max_tokens": 2, **fields}


def drop(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


# (id, path, JSON body, expected status, expected error.param or None for "any")
JSON_CASES: list[tuple[str, str, Any, int, str | None]] = [
    ("no-model", CHAT, drop(chat(), "model"), 400, "model"),
    ("model-int", CHAT, chat(model=123), 400, "model"),
    ("unknown-model", CHAT, chat(model="gpt-9"), 404, "model"),
    ("no-messages", CHAT, drop(chat(), "messages"), 400, "messages"),
    ("empty-messages", CHAT, chat(messages=[]), 400, "messages"),
    ("messages-string", CHAT, chat(messages="hi"), 400, "messages"),
    ("unknown-role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, None),
    ("no-content", CHAT, chat(messages=[{"role": "user"}]), 400, None),
    ("content-int", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, None),
    ("image-part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url",
                                                                       "image_url": "x"}]}]), 400,
     "messages.0.content.0.type"),
    ("responses-web_search-tool", "/v1/responses", {"model": "fake-model", "input": "hi",
                                                    "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ("responses-text-verbosity", "/v1/responses", {"model": "fake-model", "input": "hi",
                                                   "text": {"verbosity": "low"}}, 400, "text.verbosity"),
    ("temperature-negative", CHAT, chat(temperature=-0.5), 400, "temperature"),
    ("temperature-huge", CHAT, chat(temperature=1e9), 400, "temperature"),
    ("temperature-string", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("top_p-negative", CHAT, chat(top_p=-0.1), 400, "top_p"),
    ("top_p-over-one", CHAT, chat(top_p=1.5), 400, "top_p"),
    ("top_k-negative", CHAT, chat(top_k=-5), 400, "top_k"),
    ("top_k-huge", CHAT, chat(top_k=10**30), 400, "top_k"),
    ("top_k-zero", CHAT, chat(top_k=0), 400, "top_k"),  # in pydantic's range, refused by SamplingParams
    ("min_p-over-one", CHAT, chat(min_p=2), 400, "min_p"),
    ("presence-penalty", CHAT, chat(presence_penalty=5), 400, "presence_penalty"),
    ("frequency-penalty", CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty"),
    ("repetition-penalty-zero", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("max_tokens-zero", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens-negative", CHAT, chat(max_tokens=-1), 400, "max_tokens"),
    ("max_tokens-huge", CHAT, chat(max_tokens=10**30), 400, "max_tokens"),
    ("max_tokens-over-context", CHAT, chat(max_tokens=127), 400, "max_tokens"),
    ("max_tokens-string", CHAT, chat(max_tokens="many"), 400, "max_tokens"),
    ("max_completion_tokens-zero", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("max_tokens-and-max_completion_tokens-differ", CHAT, chat(max_tokens=5, max_completion_tokens=3), 400,
     "max_tokens"),
    ("n-zero", CHAT, chat(n=0), 400, "n"),
    ("n-over-cap", CHAT, chat(n=5), 400, "n"),
    ("n-huge", CHAT, chat(n=10**20), 400, "n"),
    ("seed-huge", CHAT, chat(seed=2**70), 400, "seed"),
    ("seed-string", CHAT, chat(seed="x"), 400, "seed"),
    ("stop-over-cap", CHAT, chat(stop=["a", "b", "c", "d"]), 400, "stop"),
    ("stop-int", CHAT, chat(stop=5), 400, None),
    ("stop-too-long", CHAT, chat(stop="x" * 5000), 400, "stop"),
    ("stop-empty", CHAT, chat(stop=""), 400, "stop"),
    ("stop-empty-in-list", CHAT, chat(stop=["a", ""]), 400, "stop"),
    ("stop_token_ids-negative", CHAT, chat(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("stop_token_ids-over-vocab", CHAT, chat(stop_token_ids=[10**9]), 400, "stop_token_ids"),
    ("top_logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top_logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("min_tokens-over-max", CHAT, chat(min_tokens=5), 400, "min_tokens"),
    ("stream-string", CHAT, chat(stream="yes please"), 400, "stream"),
    # types are strict: nothing is coerced
    ("max_tokens-numeric-string", CHAT, chat(max_tokens="3"), 400, "max_tokens"),
    ("max_tokens-integral-float", COMP, comp(max_tokens=3.0), 400, "max_tokens"),
    ("stream-true-string", CHAT, chat(stream="true"), 400, "stream"),
    ("completion-logprobs-true", COMP, comp(logprobs=True), 400, "logprobs"),
    ("temperature-numeric-string", COMP, comp(temperature="1"), 400, "temperature"),
    ("responses-max_output_tokens-string", "/v1/responses", {"model": "fake-model", "input": "hi",
                                                             "max_output_tokens": "3"}, 400,
     "max_output_tokens"),
    ("tokenize-add_special_tokens-string", "/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400,
     "add_special_tokens"),
    ("stream_options-string", CHAT, chat(stream_options="usage"), 400, "stream_options"),
    ("user-int", CHAT, chat(user=123), 400, "user"),
    ("body-array", CHAT, [chat()], 400, None),
    ("body-null", CHAT, None, 400, None),
    ("no-prompt", COMP, drop(comp(), "prompt"), 400, "prompt"),
    ("prompt-empty-string", COMP, comp(prompt=""), 400, "prompt"),
    ("prompt-empty-list", COMP, comp(prompt=[]), 400, "prompt"),
    ("prompt-empty-id-list", COMP, comp(prompt=[[]]), 400, "prompt"),
    ("prompt-negative-id", COMP, comp(prompt=[1, -1]), 400, "prompt"),
    ("prompt-id-over-vocab", COMP, comp(prompt=[49152]), 400, "prompt"),
    ("prompt-id-huge", COMP, comp(prompt=[[1, 2], [10**12]]), 400, "prompt"),
    ("prompt-mixed", COMP, comp(prompt=[1, "a"]), 400, None),
    ("prompt-dict", COMP, comp(prompt={"a": 1}), 400, None),
    ("prompt-over-context", COMP, comp(prompt=list(range(1, 91)), max_tokens=40), 400, "max_tokens"),
    ("prompt-over-max-prompt-tokens", COMP, comp(prompt=list(range(1, 102))), 400, "prompt"),
    ("prompt-batch-over-queue", COMP, comp(prompt=["a"] * 300, n=4), 400, "n"),
    ("completion-logprobs-6", COMP, comp(logprobs=6), 400, "logprobs"),
    ("completion-logprobs-negative", COMP, comp(logprobs=-1), 400, "logprobs"),
    ("suffix", COMP, comp(suffix="tail"), 400, "suffix"),
    ("echo-string", COMP, comp(echo="maybe"), 400, "echo"),
    # nothing is accepted and ignored: unknown fields, and OpenAI fields pdserve does not implement yet
    ("unknown-field", CHAT, chat(frobnicate=1), 400, "frobnicate"),
    ("unknown-field-completions", COMP, comp(guided_json={}), 400, "guided_json"),
    ("unknown-message-key", CHAT, chat(messages=[{"role": "user", "content": "x", "weight": 1}]), 400,
     "messages.0.weight"),
    ("message-tool_calls-on-user", CHAT, chat(messages=[{"role": "user", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), 400,
     "messages.0"),
    ("tool-message-without-id", CHAT, chat(messages=[{"role": "tool", "content": "x"}]), 400, "messages.0"),
    ("message-name-not-in-template", CHAT, chat(messages=[{"role": "user", "name": "bob", "content": "hi"}]),
     400, "messages.0.name"),  # SmolLM2's chat template never reads a message's name
    ("tokenize-message-name", "/tokenize", {"messages": [{"role": "user", "name": "bob", "content": "hi"}]},
     400, "messages.0.name"),
    ("message-content-null", CHAT, chat(messages=[{"role": "user", "content": None}]), 400, "messages.0"),
    ("stream_options-include_obfuscation-true", CHAT, chat(stream=True, stream_options={
        "include_obfuscation": True}), 400, "stream_options.include_obfuscation"),
    ("unknown-stream_options-key", CHAT, chat(stream=True, stream_options={"include_usage": True, "x": 1}),
     400, "stream_options.x"),
    ("tools-bad-schema", CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": 5}}}}}]), 400, "tools.0.function.parameters"),
    ("tools-bad-name", CHAT, chat(tools=[{"type": "function", "function": {"name": "a b"}}]), 400,
     "tools.0.function.name"),
    ("tool-result-for-no-call", CHAT, chat(messages=[
        {"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_nope", "content": "1"}]),
     400, "messages"),
    ("tool-call-without-result", CHAT, chat(messages=[{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "f", "arguments": "{}"}}]}]), 400, "messages"),
    ("responses-function_call_output-for-no-call", "/v1/responses", {"model": "fake-model", "input": [
        {"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "c9", "output": "1"}]},
     400, "input.1"),
    ("tool_choice-without-tools", CHAT, chat(tool_choice="auto"), 400, "tool_choice"),
    ("tool_choice-none-without-tools", CHAT, chat(tools=[], tool_choice="none"), 400, "tool_choice"),
    ("tool_choice-unknown-function", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                tool_choice={"type": "function", "function": {"name": "g"}}),
     400, "tool_choice"),
    ("tool_choice-required-with-response_format", CHAT,
     chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
          response_format={"type": "json_object"}), 400, "tool_choice"),
    ("parallel_tool_calls-without-tools", CHAT, chat(parallel_tool_calls=False), 400, "parallel_tool_calls"),
    ("functions", CHAT, chat(functions=[{"name": "f"}]), 400, "functions"),
    # structured outputs: a spec the gateway can tell is bad never reaches a worker
    ("response_format-unknown-type", CHAT, chat(response_format={"type": "xml"}), 400,
     "response_format.type"),
    ("response_format-schema-missing", CHAT, chat(response_format={"type": "json_schema"}), 400,
     "response_format.json_schema"),
    ("response_format-schema-bad-type", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}), 400, "response_format.json_schema.schema"),
    ("response_format-schema-lookahead", COMP, comp(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(?=a)b"}}}), 400,
     "response_format.json_schema.schema"),
    ("response_format-schema-not-object", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": [1]}}), 400, "response_format.json_schema.schema"),
    ("response_format-no-name", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "schema": {}}}), 400, "response_format.json_schema.name"),
    ("structured_outputs-bad-regex", COMP, comp(structured_outputs={"regex": "(a"}), 400,
     "structured_outputs.regex"),
    ("structured_outputs-inline-flag", COMP, comp(structured_outputs={"regex": "(?i)abc"}), 400,
     "structured_outputs.regex"),
    ("structured_outputs-backreference", CHAT, chat(structured_outputs={"regex": "(a)\\1"}), 400,
     "structured_outputs.regex"),
    ("structured_outputs-grammar-undefined-rule", CHAT, chat(structured_outputs={"grammar": "root ::= x"}),
     400, "structured_outputs.grammar"),
    ("structured_outputs-grammar-no-root", COMP, comp(structured_outputs={"grammar": 'a ::= "a"'}), 400,
     "structured_outputs.grammar"),
    ("structured_outputs-grammar-unclosed", CHAT, chat(structured_outputs={"grammar": 'root ::= "a'}), 400,
     "structured_outputs.grammar"),
    ("structured_outputs-choice-empty", CHAT, chat(structured_outputs={"choice": []}), 400,
     "structured_outputs.choice"),
    ("structured_outputs-json-not-json", CHAT, chat(structured_outputs={"json": "{x"}), 400,
     "structured_outputs.json"),
    ("structured_outputs-json-bad-schema", CHAT, chat(structured_outputs={"json": {"minimum": "a"}}), 400,
     "structured_outputs.json"),
    ("structured_outputs-two", CHAT, chat(structured_outputs={"regex": "a", "choice": ["a"]}), 400,
     "structured_outputs"),
    ("structured_outputs-none", CHAT, chat(structured_outputs={}), 400, "structured_outputs"),
    ("structured_outputs-json_object-false", CHAT, chat(structured_outputs={"json_object": False}), 400,
     "structured_outputs.json_object"),
    ("structured_outputs-unknown-key", CHAT, chat(structured_outputs={"whitespace_pattern": " "}), 400,
     "structured_outputs.whitespace_pattern"),
    ("structured_outputs-and-response_format", CHAT, chat(structured_outputs={"regex": "a"},
                                                          response_format={"type": "json_object"}), 400,
     "structured_outputs"),
    ("prediction", CHAT, chat(prediction={"type": "content", "content": "x"}), 400, "prediction"),
    ("audio", CHAT, chat(audio={"voice": "alloy", "format": "wav"}), 400, "audio"),
    ("modalities-audio", CHAT, chat(modalities=["text", "audio"]), 400, "modalities"),
    ("service_tier-flex", CHAT, chat(service_tier="flex"), 400, "service_tier"),
    ("store-true", CHAT, chat(store=True), 400, "store"),
    ("metadata-17-keys", CHAT, chat(metadata={str(i): "v" for i in range(17)}), 400, "metadata"),
    ("metadata-key-65", COMP, comp(metadata={"k" * 65: "v"}), 400, "metadata"),
    ("metadata-value-513", CHAT, chat(metadata={"k": "v" * 513}), 400, "metadata"),
    ("responses-metadata-key-65", "/v1/responses", {"model": "fake-model", "input": "hi",
                                                    "metadata": {"k" * 65: "v"}}, 400, "metadata"),
    ("stream_options-without-stream", CHAT, chat(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("stream_options-stream-false", COMP, comp(stream=False, stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("logit_bias-over-vocab", CHAT, chat(logit_bias={"49152": 1}), 400, "logit_bias"),
    ("logit_bias-negative-id", COMP, comp(logit_bias={"-1": 1}), 400, "logit_bias"),
    ("logit_bias-over-100", CHAT, chat(logit_bias={"5": 100.5}), 400, "logit_bias"),
    ("logit_bias-not-an-id", CHAT, chat(logit_bias={"abc": 1}), 400, None),
    ("logit_bias-float-key", CHAT, chat(logit_bias={"17.0": 1}), 400, "logit_bias"),
    ("logit_bias-spaced-key", COMP, comp(logit_bias={" 17 ": 1}), 400, "logit_bias"),
    ("logit_bias-underscored-key", CHAT, chat(logit_bias={"1_7": 1}), 400, "logit_bias"),
    ("best_of-over-n", COMP, comp(best_of=3, n=2), 400, "best_of"),
    ("prompt_logprobs-over-20", COMP, comp(prompt_logprobs=21), 400, "prompt_logprobs"),
    ("prompt_logprobs-negative", COMP, comp(prompt_logprobs=-1), 400, "prompt_logprobs"),
    ("prompt_logprobs-stream", COMP, comp(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
    ("prompt_logprobs-chat-stream", CHAT, chat(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
    ("prompt_logprobs-chat-over-20", CHAT, chat(prompt_logprobs=21), 400, "prompt_logprobs"),
    ("prompt_logprobs-chat-negative", CHAT, chat(prompt_logprobs=-1), 400, "prompt_logprobs"),
    ("max_tokens-zero-no-echo", COMP, comp(max_tokens=0), 400, "max_tokens"),
    ("max_tokens-zero-min_tokens", COMP, comp(max_tokens=0, echo=True, min_tokens=1), 400, "min_tokens"),
    ("chat_template_kwargs-reserved", CHAT, chat(chat_template_kwargs={"messages": []}), 400,
     "chat_template_kwargs"),
    ("chat_template_kwargs-list", CHAT, chat(chat_template_kwargs=[1]), 400, "chat_template_kwargs"),
    ("tokenize-neither", "/tokenize", {"model": "fake-model"}, 400, "prompt"),
    ("tokenize-both", "/tokenize", {"prompt": "x", "messages": MSGS}, 400, "prompt"),
    ("tokenize-unknown-field", "/tokenize", {"prompt": "x", "continue_final_message": True}, 400,
     "continue_final_message"),
    ("tokenize-other-model", "/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("detokenize-over-vocab", "/detokenize", {"tokens": [1, 49152]}, 400, "tokens"),
    ("detokenize-string", "/detokenize", {"tokens": "abc"}, 400, "tokens"),
]


def check_error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(("path", "body", "status", "param"), [c[1:] for c in JSON_CASES],
                         ids=[c[0] for c in JSON_CASES])
def test_json_bad_input(gw: Cluster, path: str, body: Any, status: int, param: str | None) -> None:
    check_error(httpx.post(gw.base + path, json=body, headers=AUTH, timeout=10), status, param)


MSG_X = b'"messages": [{"role": "user", "content": "x"}]'
RAW_CASES: list[tuple[str, str, str, bytes, dict[str, str], int]] = [
    ("bad-json", "POST", CHAT, b'{"model": ', {}, 400),
    ("invalid-utf8", "POST", CHAT, b'{"model": "fake-model", ' + MSG_X.replace(b"x", b"\xff\xfe") + b"}",
     {}, 400),
    ("lone-surrogate", "POST", CHAT, b'{"model": "fake-model", ' + MSG_X.replace(b"x", b"a\\ud800b") + b"}",
     {}, 400),
    ("nan-temperature", "POST", CHAT, b'{"model": "fake-model", ' + MSG_X + b', "temperature": NaN}', {},
     400),
    ("infinite-penalty", "POST", COMP, b'{"model": "fake-model", "prompt": "x", "repetition_penalty": '
     b"Infinity}", {}, 400),
    ("deeply-nested", "POST", COMP, b"[" * 100_000 + b"]" * 100_000, {}, 400),
    ("not-json-content-type", "POST", COMP, b"prompt=hi", {"content-type": "text/plain"}, 400),
    ("ten-megabytes", "POST", COMP, b'{"prompt": "' + b"a" * (10 << 20) + b'"}', {}, 413),
    ("no-auth", "POST", COMP, b"{}", {"Authorization": ""}, 401),
    ("wrong-key", "POST", CHAT, b"{}", {"Authorization": "Bearer nope"}, 401),
    ("basic-auth", "GET", "/v1/models", b"", {"Authorization": f"Basic {KEY}"}, 401),
    ("model-no-auth", "GET", "/v1/models/fake-model", b"", {"Authorization": ""}, 401),
    ("unknown-model-card", "GET", "/v1/models/gpt-9", b"", {}, 404),
    ("tokenize-no-auth", "POST", "/tokenize", b'{"prompt": "x"}', {"Authorization": ""}, 401),
    ("detokenize-no-auth", "POST", "/detokenize", b'{"tokens": [1]}', {"Authorization": ""}, 401),
    ("unknown-path", "GET", "/v1/nope", b"", {}, 404),
    ("wrong-method", "GET", CHAT, b"", {}, 405),
]


@pytest.mark.parametrize(("method", "path", "content", "headers", "status"), [c[1:] for c in RAW_CASES],
                         ids=[c[0] for c in RAW_CASES])
def test_raw_bad_input(gw: Cluster, method: str, path: str, content: bytes, headers: dict[str, str],
                       status: int) -> None:
    hdrs = {**AUTH, "content-type": "application/json", **headers}
    check_error(httpx.request(method, gw.base + path, content=content, headers=hdrs, timeout=30), status)


def test_chunked_body_over_cap_is_413(gw: Cluster) -> None:
    def body() -> Iterator[bytes]:  # no Content-Length: the cap must hold while reading
        yield b'{"model": "fake-model", "prompt": "'
        for _ in range(20):
            yield b"a" * (BODY_CAP // 10)
        yield b'"}'

    resp = httpx.post(gw.base + COMP, content=body(), headers={**AUTH, "content-type": "application/json"},
                      timeout=30)
    check_error(resp, 413)


def test_duplicate_request_id_in_flight_is_400(gw: Cluster) -> None:
    body = {**comp(max_tokens=100), "stream": True}
    hdrs = {**AUTH, "X-Request-Id": "dup-1"}
    with httpx.stream("POST", gw.base + COMP, json=body, headers=hdrs, timeout=10) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        assert next(lines).startswith("data: ")
        err = check_error(httpx.post(gw.base + COMP, json=comp(), headers=hdrs, timeout=10), 400)
        assert err["code"] == "duplicate_request_id"
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]
        finishes = [c["finish_reason"] for chunk in chunks for c in chunk["choices"]]
        assert finishes.count("length") == 1  # the first one finishes
    gw.assert_no_leaks(("d1",))


@pytest.mark.parametrize(("key", "value"), [
    ("refusal", "I cannot help with that."), ("audio", {"id": "audio_1"}),
    ("function_call", {"name": "f", "arguments": "{}"}),
    ("annotations", [{"type": "url_citation", "url_citation": {"url": "https://x", "title": "x",
                                                               "start_index": 0, "end_index": 1}}]),
])
def test_tokenize_refuses_the_message_keys_chat_refuses(gw: Cluster, key: str, value: Any) -> None:
    """An assistant message's key that a chat completion refuses is refused by ``/tokenize`` alike: the
    same 400 (code, param, message), not tokenized as if it were not there; empty, it is accepted by both."""
    messages = [*MSGS, {"role": "assistant", "content": "hello", key: value}, *MSGS]
    param = f"messages.1.{key}"
    errors = [check_error(httpx.post(gw.base + path, json=body, headers=AUTH, timeout=10), 400, param)
              for path, body in ((CHAT, chat(messages=messages)), ("/tokenize", {"messages": messages}))]
    assert errors[0]["code"] == "unsupported_parameter" and param in errors[0]["message"], errors[0]
    assert errors[1] == errors[0]
    messages[1][key] = [] if key == "annotations" else None
    for path, body in ((CHAT, chat(messages=messages)), ("/tokenize", {"messages": messages})):
        assert httpx.post(gw.base + path, json=body, headers=AUTH, timeout=10).status_code == 200


@pytest.mark.parametrize("part", [
    {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}},
    {"type": "input_file", "file_id": "file_1"},
])
def test_responses_function_call_output_part_not_taken_is_one_sentence(gw: Cluster, part: Any) -> None:
    """A part of a ``function_call_output``'s ``output`` that pdserve cannot take is refused at its
    ``type`` in one sentence (``unsupported_parameter``), as a message's content part is, not with the
    parts' union errors."""
    items = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": [
                 {"type": "input_text", "text": "4"}, part]}]
    resp = httpx.post(gw.base + "/v1/responses", json={"model": "fake-model", "input": items}, headers=AUTH,
                      timeout=10)
    err = check_error(resp, 400, "input.1.output.1.type")
    assert err["code"] == "unsupported_parameter", err
    assert err["message"].startswith(f"input.1.output.1.type: '{part['type']}' content parts are not "
                                     "supported"), err


def test_healthy_after_bad_input(gw: Cluster) -> None:
    """Runs last in the module: no 5xx was ever answered, the workers live, nothing leaked, still serving."""
    text = gw.metrics()
    fives = [line for line in text.splitlines()
             if line.startswith("pdserve_requests_total{") and 'status="5' in line]
    assert fives == []
    assert 'status="400"' in text and 'status="413"' in text
    assert all(p.poll() is None for p in gw.workers.values())
    resp = httpx.post(gw.base + CHAT, json=chat(max_tokens=3), headers=AUTH, timeout=10)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(gw.base + "/ready").status_code == 200
    gw.assert_no_leaks(("d1",))
