"""SGLang's OpenAI-server feature and validation cases (under ``test/srt/openai_server/``:
``features/test_json_mode.py``, ``features/test_openai_server_ebnf.py``, ``features/test_cache_report.py``,
``features/test_continuous_usage_stats.py``, ``features/test_json_constrained.py``,
``features/test_structural_tag.py``, ``features/test_openai_server_hidden_states.py``,
``validation/test_openai_server_ignore_eos.py``,
``validation/test_request_length_validation.py``, ``validation/test_matched_stop.py``,
``validation/test_request_body_validation.py``), ported to the
live disaggregated gateway serving the embedded SmolLM2. SGLang-only request fields (``ebnf``,
``cache_salt``, ``stop_regex``, ``continuous_usage_stats``) get pdserve's documented 400 naming them;
where pdserve has the same feature under vLLM's name (``structured_outputs.grammar``) the peer's check
runs through it. pdserve's prefix cache reuses whole KV blocks (16 tokens), so cached-token counts are
asserted at block granularity. Each case names its peer test."""

from __future__ import annotations

import json
import re
import uuid
from functools import partial
from typing import Any

import openai
import pytest

from pdserve.live_system import MODEL, SystemPair
from tests.conformance.helpers import leak_check
from tests.conformance.peer.common import disagg, refused, together
from tests.live import BODY_CAP

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
BLOCK = 16  # the live workers' KV block size in tokens
BRIEF: Any = [{"role": "system", "content": "You are a helpful AI assistant that gives a short answer."},
              {"role": "user", "content": "What is the capital of Bulgaria?"}]


def _chat(live: SystemPair, **kw: Any) -> Any:
    kw.setdefault("messages", BRIEF)
    return disagg(live).chat.completions.create(model=MODEL, temperature=0, **kw)


# from sglang features/test_json_mode.py::TestJSONModeXGrammar.test_json_mode_response
def test_json_mode_response(live: SystemPair) -> None:
    r = _chat(live, max_tokens=40, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict), text


# from sglang features/test_json_mode.py::TestJSONModeXGrammar.test_json_mode_with_streaming
def test_json_mode_with_streaming(live: SystemPair) -> None:
    pieces = [ch.choices[0].delta.content or "" for ch in _chat(live, max_tokens=40, stream=True,
                                                                response_format={"type": "json_object"})]
    assert isinstance(json.loads("".join(pieces)), dict), pieces


GREETING = 'root ::= "Hello" | "Hi" | "Hey"'
MINI_JSON = r'''root ::= "{" pair "}"
pair ::= "\"name\"" ":" string
string ::= "\"" [A-Za-z]+ "\""'''


# from sglang features/test_openai_server_ebnf.py::test_ebnf
def test_ebnf(live: SystemPair) -> None:
    ask: Any = [{"role": "user", "content": "Say a greeting (Hello, Hi, or Hey)."}]
    refused(lambda: _chat(live, messages=ask, max_tokens=8, extra_body={"ebnf": GREETING}), "ebnf")
    text = _chat(live, messages=ask, max_tokens=8,
                 extra_body={"structured_outputs": {"grammar": GREETING}}).choices[0].message.content
    assert re.fullmatch(r"(Hello|Hi|Hey)", text), text


# from sglang features/test_openai_server_ebnf.py::test_ebnf_strict_json
def test_ebnf_strict_json(live: SystemPair) -> None:
    ask: Any = [{"role": "user", "content": "Generate single key JSON with only letters."}]
    r = _chat(live, messages=ask, max_tokens=24, extra_body={"structured_outputs": {"grammar": MINI_JSON}})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(r'\{"name":"[A-Za-z]+"\}', text), text


def _cached(live: SystemPair, content: str) -> tuple[int, int]:
    usage = _chat(live, messages=[{"role": "user", "content": content}], max_tokens=1).usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return usage.prompt_tokens_details.cached_tokens or 0, usage.prompt_tokens


# from sglang features/test_cache_report.py::test_cache_split_prefill_openai
def test_cache_split_prefill_openai(live: SystemPair) -> None:
    """A long unique prompt: not cached the first time, all its full blocks but the last token's the
    second time."""
    text = f"{uuid.uuid4().hex} a long and unique text, not cached yet, longer than a block or two of KV."
    first, n_prompt = _cached(live, text)
    assert first <= BLOCK * 2  # at most the chat template's leading blocks, shared with other prompts
    again, _ = _cached(live, text)
    assert again == (n_prompt - 1) // BLOCK * BLOCK and again > first, (first, again, n_prompt)


# from sglang features/test_cache_report.py::test_cache_report_openai
def test_cache_report_openai(live: SystemPair, hf_tokenizer: Any) -> None:
    def ids(content: str) -> list[int]:
        rendered = hf_tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                    add_generation_prompt=True, tokenize=False)
        return list(hf_tokenizer(rendered, add_special_tokens=False)["input_ids"])

    def shared(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    tag = uuid.uuid4().hex[:8]  # the series' own prefix; the two first prompts share only the template
    _cached(live, "Introduce the capital of France.")  # warms the template's blocks
    one, _ = _cached(live, f"{uuid.uuid4().hex[:8]} How many sparrows lift a coconut?")
    two, _ = _cached(live, f"{tag}* sing something about cats")
    assert one == two, (one, two)  # only the template in common once it is warm
    sent = [ids(f"{tag}* sing something about cats"), ids(f"{tag}* sing something about cats and dogs")]
    _cached(live, f"{tag}* sing something about cats and dogs")
    last = ids(f"{tag}* sing something about cats, please")
    got, n_prompt = _cached(live, f"{tag}* sing something about cats, please")
    expected = min(max(shared(last, s) for s in sent), n_prompt - 1) // BLOCK * BLOCK
    assert got == expected and got >= two, (got, expected, n_prompt)


# from sglang features/test_cache_report.py::test_cache_salt_effectiveness
def test_cache_salt_is_refused(live: SystemPair) -> None:
    refused(lambda: _chat(live, max_tokens=2, extra_body={"cache_salt": "salt1"}), "cache_salt")


# from sglang features/test_continuous_usage_stats.py::test_continuous_usage_stats_enabled
def test_continuous_usage_stats_enabled_is_refused(live: SystemPair) -> None:
    refused(lambda: _chat(live, max_tokens=4, stream=True,
                          stream_options={"include_usage": True, "continuous_usage_stats": True}),
            "continuous_usage_stats")


# from sglang features/test_continuous_usage_stats.py::test_continuous_usage_stats_disabled
def test_continuous_usage_stats_disabled(live: SystemPair) -> None:
    """``continuous_usage_stats: false`` asks for nothing, yet pdserve refuses the unknown key by name
    (it does not implement the true form); with ``include_usage`` alone, exactly one usage chunk."""
    refused(lambda: _chat(live, max_tokens=4, stream=True,
                          stream_options={"include_usage": True, "continuous_usage_stats": False}),
            "continuous_usage_stats")
    chunks = _chat(live, max_tokens=4, stream=True, stream_options={"include_usage": True})
    usage = [ch for ch in chunks if ch.usage]
    assert len(usage) == 1 and usage[0].choices == []


# from sglang validation/test_openai_server_ignore_eos.py::test_ignore_eos
def test_ignore_eos(live: SystemPair) -> None:
    ask: Any = [{"role": "user", "content": "Say hi."}]
    default, ignoring = together(*(partial(_chat, live, messages=ask, max_tokens=12,
                                           extra_body={"ignore_eos": ignore}) for ignore in (False, True)))
    assert default.usage is not None and ignoring.usage is not None
    assert ignoring.choices[0].finish_reason == "length" and ignoring.usage.completion_tokens == 12
    assert ignoring.usage.completion_tokens >= default.usage.completion_tokens


# from sglang validation/test_request_length_validation.py::test_input_length_longer_than_context_length
def test_input_length_longer_than_context_length(live: SystemPair) -> None:
    """Over the context (8192 tokens): a 400 naming the prompt (the live gateways' 100-token cap speaks
    first)."""
    refused(lambda: _chat(live, messages=[{"role": "user", "content": "hello " * 9000}]), "messages")


# from sglang validation/test_request_length_validation.py::
#   test_input_length_longer_than_maximum_allowed_length
def test_input_length_longer_than_maximum_allowed_length(live: SystemPair) -> None:
    refused(lambda: _chat(live, messages=[{"role": "user", "content": "hello " * 120}]), "messages")


# from sglang validation/test_request_length_validation.py::test_max_tokens_validation
def test_max_tokens_validation(live: SystemPair) -> None:
    err = refused(lambda: _chat(live, messages=[{"role": "user", "content": "hello "}], max_tokens=9000),
                  "max_tokens")
    assert "context" in err.message, err.message


# from sglang validation/test_matched_stop.py::test_finish_stop_str
def test_finish_stop_str(live: SystemPair) -> None:
    """A stop string ends the answer with ``stop``, the string not in the text (SGLang's ``matched_stop``
    response field has no OpenAI counterpart and is not part of pdserve's answer)."""
    fruits: Any = [{"role": "user", "content": "List three fruits, one per line."}]
    listed = "Fruits:\n1. apples\n2. pears\n3."
    r, r2 = together(partial(disagg(live).completions.create, model=MODEL, prompt=listed, max_tokens=16,
                             temperature=0, stop="\n"),
                     partial(_chat, live, messages=fruits, max_tokens=24, stop="\n"))
    assert r.choices[0].finish_reason == "stop" and "\n" not in r.choices[0].text, r.choices[0].text
    assert "matched_stop" not in (r.choices[0].model_extra or {})
    assert r2.choices[0].finish_reason == "stop" and "\n" not in r2.choices[0].message.content


# from sglang validation/test_matched_stop.py::test_finish_stop_regex_str
def test_finish_stop_regex_str_is_refused(live: SystemPair) -> None:
    refused(lambda: _chat(live, max_tokens=8, extra_body={"stop_regex": r"and|or"}), "stop_regex")


# from sglang validation/test_matched_stop.py::test_finish_stop_eos
def test_finish_stop_eos(live: SystemPair) -> None:
    r = _chat(live, messages=[{"role": "user", "content": "What is 2 + 2?"}], max_tokens=64)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert r.usage is not None and r.usage.completion_tokens < 64


# from sglang validation/test_matched_stop.py::test_finish_length
def test_finish_length(live: SystemPair) -> None:
    r, r2 = together(partial(disagg(live).completions.create, model=MODEL, prompt="Write a long story.",
                             max_tokens=3, temperature=0),
                     partial(_chat, live, max_tokens=3))
    assert r.choices[0].finish_reason == "length" and r2.choices[0].finish_reason == "length"
    leak_check(live)


# from sglang validation/test_request_body_validation.py::
#   test_input_body_size_larger_than_maximum_allowed_payload_size_limit
def test_input_body_size_larger_than_maximum_allowed_payload_size_limit(live: SystemPair) -> None:
    """A body over the live gateways' 1 MiB cap (``--max-body-bytes``; the peer starts SGLang with 1 KB):
    413 before anything is parsed."""
    with pytest.raises(openai.APIStatusError) as info:
        _chat(live, messages=[{"role": "user", "content": "hello " * (BODY_CAP // 5)}])
    assert info.value.status_code == 413, info.value


PEER_SCHEMA: Any = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[\\w]+$"},
                                                     "population": {"type": "integer"}},
                    "required": ["name", "population"], "additionalProperties": False}
# the peer's schema with the population bounded (SmolLM2 at temperature 0 writes digits without end); the
# prompt shows the peer's own (the bounded one would pass the live gateways' 100-token prompt cap)
CITY_SCHEMA: Any = {**PEER_SCHEMA, "properties": {**PEER_SCHEMA["properties"], "population": {
    "type": "integer", "minimum": 0, "maximum": 99999999}}}
CITY_ASK: Any = [{"role": "system", "content": "You are a helpful AI assistant"},
                 {"role": "user", "content": "Introduce the capital of France. Return in a JSON format. "
                                             "The JSON Schema is: " + json.dumps(PEER_SCHEMA)}]


def _city(live: SystemPair, schema: Any = CITY_SCHEMA) -> Any:
    kw: Any = {} if schema is None else {
        "response_format": {"type": "json_schema", "json_schema": {"name": "foo", "schema": schema}}}
    return _chat(live, messages=CITY_ASK, max_tokens=40, **kw)


def _check_city(r: Any) -> None:
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    obj = json.loads(text)
    assert isinstance(obj["name"], str) and isinstance(obj["population"], int), obj


# from sglang features/test_json_constrained.py (JSONConstrainedMixin.test_json_openai)
def test_json_openai(live: SystemPair) -> None:
    _check_city(_city(live))
    leak_check(live)


# from sglang features/test_json_constrained.py (JSONConstrainedMixin.test_json_invalid)
def test_json_invalid(live: SystemPair) -> None:
    """The peer sends the schema ``"INVALID"`` to SGLang's ``/generate``; pdserve takes a schema given as a
    JSON text under ``structured_outputs.json``, where a text that is not a schema is the 400 naming it."""
    refused(lambda: _chat(live, messages=CITY_ASK, max_tokens=5,
                          extra_body={"structured_outputs": {"json": "INVALID"}}), "structured_outputs")


# from sglang features/test_json_constrained.py (JSONConstrainedMixin.test_mix_json_and_other)
def test_mix_json_and_other(live: SystemPair) -> None:
    """The peer sends 40 requests, a schema in half, at once; here 4 (one batch on the live workers):
    the constrained ones are valid, the others free text."""
    outs = together(*(partial(_city, live, schema) for schema in [None, None, CITY_SCHEMA, CITY_SCHEMA]))
    for r in outs[2:]:
        _check_city(r)
    for r in outs[:2]:
        assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    leak_check(live)


FRANCE_JSON: Any = [{"role": "system", "content": "You are a helpful AI assistant"},
                    {"role": "user", "content": "Introduce the capital of France. Return in a JSON format."}]


# from sglang features/test_structural_tag.py::TestStructuralTagXGrammarBackend.test_stag_constant_str_openai
def test_stag_constant_str_openai(live: SystemPair) -> None:
    """``response_format`` of type ``structural_tag`` (SGLang's) is a 400 naming ``response_format``; the
    peer's check (the constant string is the answer, however wrong) runs through ``structured_outputs``'
    ``choice`` of one string."""
    answer = "The capital of France is Berlin."
    refused(lambda: _chat(live, messages=FRANCE_JSON, max_tokens=5, response_format={
        "type": "structural_tag", "format": {"type": "const_string", "value": answer}}), "response_format")
    r = _chat(live, messages=FRANCE_JSON, max_tokens=20,
              extra_body={"structured_outputs": {"choice": [answer]}})
    assert r.choices[0].message.content == answer
    leak_check(live)


# from sglang features/test_structural_tag.py::TestStructuralTagXGrammarBackend.test_stag_json_schema_openai
def test_stag_json_schema_openai(live: SystemPair) -> None:
    """As above, the schema through ``structured_outputs.json`` (the population bounded, as in
    ``test_json_openai``)."""
    refused(lambda: _chat(live, messages=FRANCE_JSON, max_tokens=5, response_format={
        "type": "structural_tag", "format": {"type": "json_schema", "json_schema": PEER_SCHEMA}}),
        "response_format")
    _check_city(_chat(live, messages=FRANCE_JSON, max_tokens=40,
                      extra_body={"structured_outputs": {"json": CITY_SCHEMA}}))
    leak_check(live)


HIDDEN_ASK: Any = [{"role": "system", "content": "You are a helpful AI assistant"},
                   {"role": "user", "content": "What is the capital of France? Answer in a few words."}]


def _hidden_runs(live: SystemPair, chat: bool, stream: bool) -> list[Any]:
    """The peer's grid of one test (list input and ``n`` 1 and 2; chat: ``n`` only) without
    ``return_hidden_states``: each request's choices (streamed: every chunk's)."""
    c: Any = disagg(live)
    calls = []
    for n in (1, 2):
        for prompt in ([None] if chat else ["The capital of France is", ["The capital of France is"] * 2]):
            kw: Any = {"model": MODEL, "temperature": 0, "max_tokens": 3, "n": n}
            if stream:
                kw |= {"stream": True, "stream_options": {"include_usage": True}}
            make = partial(c.chat.completions.create, messages=HIDDEN_ASK, **kw) if chat else \
                partial(c.completions.create, prompt=prompt, **kw)
            calls.append((lambda m=make: [ch for chunk in m() for ch in chunk.choices]) if stream
                         else (lambda m=make: m().choices))
    return together(*calls)


@pytest.mark.parametrize(("chat", "stream"), [
    # from sglang features/test_openai_server_hidden_states.py::BaseTestOpenAIServerWithHiddenStates
    pytest.param(False, False, id="test_completion"), pytest.param(False, True, id="test_completion_stream"),
    pytest.param(True, False, id="test_chat_completion"),
    pytest.param(True, True, id="test_chat_completion_stream")])
def test_hidden_states(live: SystemPair, chat: bool, stream: bool) -> None:
    """Choices (and chunks) carry no ``hidden_states``; ``return_hidden_states`` is SGLang's extension
    (with ``--enable-return-hidden-states``), which pdserve does not have: any value is the 400 naming it
    (the peer's ``false`` runs are the grid without the field)."""
    for choices in _hidden_runs(live, chat, stream):
        assert choices
        for ch in choices:
            assert not hasattr(ch, "hidden_states")
            assert not hasattr(getattr(ch, "delta", None), "hidden_states")
    c: Any = disagg(live)
    for hidden in (False, True):
        kw: Any = {"model": MODEL, "max_tokens": 3, "stream": stream,
                   "extra_body": {"return_hidden_states": hidden}}
        call = (lambda k=kw: c.chat.completions.create(messages=HIDDEN_ASK, **k)) if chat else \
            (lambda k=kw: c.completions.create(prompt="The capital of France is", **k))
        refused(call, "return_hidden_states")
    leak_check(live)
