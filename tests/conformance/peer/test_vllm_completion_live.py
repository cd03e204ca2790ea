"""vLLM's completions-server cases (``tests/entrypoints/openai/completion/test_completion.py``), ported
to the live disaggregated gateway serving the embedded SmolLM2: what the peer asserts about the API
(usage, logprobs shapes, streaming equals non-streaming, ``n``, ``stream_options``, batched prompts,
bad structured-output specs) is kept; what rests on a particular model's text is asserted as structure.
A vLLM-only knob pdserve does not implement is asserted to be the documented 400 naming it. Each case
names the peer test it comes from."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

from pdserve.live_system import MODEL, SystemPair
from tests.conformance.helpers import leak_check
from tests.conformance.peer.common import disagg, refused, together

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
IDS = [1, 2, 3, 4, 5]  # a token-id prompt (the peer uses five copies of id 0, SmolLM2's <|endoftext|>)


# from vllm completion/test_completion.py::test_single_completion
def test_single_completion(live: SystemPair, hf_tokenizer: Any) -> None:
    c: Any = disagg(live)
    text = "Hello, my name is"
    r, by_ids = together(partial(c.completions.create, model=MODEL, prompt=text, max_tokens=3, temperature=0),
                         partial(c.completions.create, model=MODEL, prompt=IDS, max_tokens=2, temperature=0))
    assert r.id and len(r.choices) == 1
    (ch,) = r.choices
    assert ch.finish_reason == "length" and ch.text
    n_prompt = len(hf_tokenizer(text)["input_ids"])
    assert r.usage is not None
    usage = (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens)
    assert usage == (n_prompt, 3, n_prompt + 3)
    assert r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # under one KV block: nothing to reuse
    assert by_ids.choices[0].text and getattr(by_ids.choices[0], "prompt_logprobs", None) is None
    leak_check(live)


# from vllm completion/test_completion.py::test_completion_truncation_side_controls_prompt_truncation
def test_prompt_truncation_is_refused(live: SystemPair) -> None:
    """vLLM's ``truncate_prompt_tokens`` / ``truncation_side`` / ``return_token_ids`` are not pdserve's:
    the documented 400 naming the first unknown field, not a silently untruncated prompt."""
    c: Any = disagg(live)
    together(*(partial(refused, partial(c.completions.create, model=MODEL, prompt=list(range(8)),
                                        max_tokens=1, extra_body=extra), next(iter(extra)))
               for extra in ({"truncate_prompt_tokens": 4}, {"truncation_side": "left"},
                             {"return_token_ids": True})))


# from vllm completion/test_completion.py::test_no_logprobs
def test_no_logprobs(live: SystemPair) -> None:
    r = disagg(live).completions.create(model=MODEL, prompt=IDS, max_tokens=2, temperature=0, logprobs=None)
    assert r.choices[0].logprobs is None


# from vllm completion/test_completion.py::test_zero_logprobs
def test_zero_logprobs(live: SystemPair) -> None:
    r = disagg(live).completions.create(model=MODEL, prompt=IDS, max_tokens=5, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == 5 and all(isinstance(v, float) for v in lp.token_logprobs)
    assert len(lp.top_logprobs) == 5
    # vLLM lists the sampled token itself; pdserve's documented 0 is "the sampled token, no alternatives"
    assert all(len(top) <= 1 for top in lp.top_logprobs)


# from vllm completion/test_completion.py::test_some_logprobs
def test_some_logprobs(live: SystemPair) -> None:
    r = disagg(live).completions.create(model=MODEL, prompt=IDS, max_tokens=2, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert all(5 <= len(top) <= 6 for top in lp.top_logprobs)


# from vllm completion/test_completion.py::test_too_many_completion_logprobs
def test_too_many_completion_logprobs(live: SystemPair) -> None:
    c: Any = disagg(live)
    refused(lambda: c.completions.create(model=MODEL, prompt=IDS, max_tokens=2, logprobs=21), "logprobs")
    refused(lambda: c.completions.create(model=MODEL, prompt=IDS, max_tokens=2, logprobs=30, stream=True),
            "logprobs")
    r = c.completions.create(model=MODEL, prompt=IDS, max_tokens=2, temperature=0)  # still serves
    assert r.choices[0].finish_reason in ("length", "stop")
    leak_check(live)


# from vllm completion/test_completion.py::test_prompt_logprobs_completion
@pytest.mark.parametrize("prompt_logprobs", [
    pytest.param(-1, id="negative"),
    pytest.param(0, id="0"),
    pytest.param(1, id="1"),
    pytest.param(None, id="absent")])
def test_prompt_logprobs_completion(live: SystemPair, prompt_logprobs: int | None) -> None:
    c: Any = disagg(live)
    kw: dict[str, Any] = {"model": MODEL, "prompt": ["A robot may not injure", "My name is"], "max_tokens": 2}
    if prompt_logprobs is not None:
        kw["extra_body"] = {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        refused(lambda: c.completions.create(**kw), "prompt_logprobs")
        return
    r = c.completions.create(**kw)
    for ch in r.choices:
        got = (ch.model_extra or {}).get("prompt_logprobs")
        if prompt_logprobs is None:
            assert got is None
        else:
            assert got, ch


# from vllm completion/test_completion.py::test_completion_streaming
def test_completion_streaming(live: SystemPair) -> None:
    c: Any = disagg(live)
    prompt = "Once upon a time"  # the model does not stop within 5 tokens: the last chunk carries one
    whole, chunks = together(
        partial(c.completions.create, model=MODEL, prompt=prompt, max_tokens=5, temperature=0),
        lambda: list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                          stream=True)))
    pieces, finishes, last = [], 0, None
    for chunk in chunks:
        last = chunk.choices[0]
        pieces.append(last.text)
        finishes += last.finish_reason is not None
    assert finishes == 1 and last is not None and last.finish_reason == "length" and last.text
    assert "".join(pieces) == whole.choices[0].text


def _assert_parallel(texts: list[str], lengths: list[int], finishes: list[str | None],
                     max_tokens: int) -> None:
    """n sampled choices: all finished, each as long as its finish reason says, and all different (the
    peer also wants different lengths, which needs the model to stop early: asserted per choice here)."""
    for text, length, finish in zip(texts, lengths, finishes, strict=True):
        assert finish in ("length", "stop"), finish
        assert (length == max_tokens) == (finish == "length"), (text, length, finish)
    assert len(set(texts)) == len(texts), texts


# from vllm completion/test_completion.py::test_parallel_no_streaming
def test_parallel_no_streaming(live: SystemPair) -> None:
    r = disagg(live).completions.create(model=MODEL, prompt="What is an LLM?", max_tokens=12, n=3,
                                        temperature=1.0, logprobs=0, seed=42)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    _assert_parallel([ch.text for ch in r.choices], [len(ch.logprobs.tokens or []) if ch.logprobs else -1
                                                     for ch in r.choices],
                     [ch.finish_reason for ch in r.choices], 12)


# from vllm completion/test_completion.py::test_parallel_streaming
def test_parallel_streaming(live: SystemPair) -> None:
    texts, counts = [""] * 3, [0] * 3
    finishes: list[str | None] = [None] * 3
    finish_chunks = 0
    for chunk in disagg(live).completions.create(model=MODEL, prompt="What is an LLM?", max_tokens=12, n=3,
                                                 temperature=1.0, seed=42, stream=True):
        ch = chunk.choices[0]
        texts[ch.index] += ch.text
        counts[ch.index] += 1 if ch.text or ch.finish_reason is None else 0
        finishes[ch.index] = ch.finish_reason
        finish_chunks += ch.finish_reason is not None
    assert finish_chunks == 3
    assert all(n <= 12 for n in counts), counts
    assert len(set(texts)) == 3, texts


# from vllm completion/test_completion.py::test_completion_stream_options
def test_completion_stream_options(live: SystemPair) -> None:
    c: Any = disagg(live)
    kw: dict[str, Any] = {"model": MODEL, "prompt": "What is the capital of France?", "max_tokens": 5,
                          "temperature": 0}
    quiet_false, quiet_empty, chunks = together(
        *(partial(lambda o: list(c.completions.create(stream=True, stream_options=o, **kw)), opts)
          for opts in ({"include_usage": False}, {}, {"include_usage": True})))
    assert all(chunk.usage is None for chunk in quiet_false + quiet_empty)
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason is not None
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None
    assert final.usage.prompt_tokens > 0 and final.usage.completion_tokens > 0
    assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens
    # vLLM's continuous_usage_stats is not pdserve's: the documented 400 naming it
    refused(lambda: c.completions.create(stream=True, stream_options={"include_usage": True,
                                                                      "continuous_usage_stats": True}, **kw),
            "continuous_usage_stats")
    together(*(partial(refused, partial(c.completions.create, stream=False, stream_options=opts, **kw))
               for opts in ({"include_usage": None}, {"include_usage": True},
                            {"continuous_usage_stats": None})))
    leak_check(live)


# from vllm completion/test_completion.py::test_batch_completions
@pytest.mark.parametrize("prompts", [["Hello, my name is"] * 2, [IDS] * 2], ids=["text", "token-ids"])
def test_batch_completions(live: SystemPair, prompts: Any) -> None:
    c: Any = disagg(live)
    kw: dict[str, Any] = {"model": MODEL, "prompt": prompts, "max_tokens": 3, "temperature": 0}
    # n=2 of each prompt (the peer adds use_beam_search, which pdserve refuses by name)
    one, _, two, chunks = together(
        partial(c.completions.create, **kw),
        partial(refused, partial(c.completions.create, n=2, extra_body={"use_beam_search": True}, **kw),
                "use_beam_search"),
        partial(c.completions.create, n=2, **kw),
        lambda: list(c.completions.create(stream=True, **kw)))
    assert len(one.choices) == 2 and one.choices[0].text == one.choices[1].text
    assert [ch.index for ch in two.choices] == [0, 1, 2, 3]
    assert len({ch.text for ch in two.choices}) == 1  # greedy: every copy alike
    texts = ["", ""]
    for chunk in chunks:
        assert len(chunk.choices) == 1
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts[0] == texts[1] == two.choices[0].text
    leak_check(live)


# from vllm completion/test_completion.py::test_echo_logprob_completion
@pytest.mark.parametrize("logprobs", [1, 0])
def test_echo_logprob_completion(live: SystemPair, hf_tokenizer: Any, logprobs: int) -> None:
    c: Any = disagg(live)
    prompts: list[Any] = ["Hello, my name is", IDS]
    answers = together(*(partial(c.completions.create, model=MODEL, prompt=prompt, max_tokens=2,
                                 temperature=0, echo=True, logprobs=logprobs) for prompt in prompts))
    for prompt, r in zip(prompts, answers, strict=True):
        text = prompt if isinstance(prompt, str) else hf_tokenizer.decode(prompt)
        assert r.choices[0].text.startswith(text)
        lp = r.choices[0].logprobs
        assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
        n_prompt = len(hf_tokenizer(text)["input_ids"]) if isinstance(prompt, str) else len(prompt)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 2
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(max(logprobs, 1) <= len(top) <= logprobs + 1 for top in lp.top_logprobs[1:])
        for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
            assert top[token] == value  # the token itself is listed, as vLLM and OpenAI list it


# from vllm completion/test_completion.py::test_invalid_json_schema
def test_invalid_json_schema(live: SystemPair) -> None:
    schema = {"$defs": {"Kind": {"enum": ["a", "b"], "type": "string"}},
              "properties": {"brand": {"type": "string"}, "kind": {"$ref": "#/$defs/Kind"}, "foo": "bar"},
              "required": ["brand", "kind"], "type": "object"}
    c: Any = disagg(live)
    refused(lambda: c.completions.create(model=MODEL, prompt="A car as JSON:", max_tokens=5,
                                         extra_body={"structured_outputs": {"json": schema}}),
            "structured_outputs.json")


# from vllm completion/test_completion.py::test_invalid_regex
def test_invalid_regex(live: SystemPair) -> None:
    c: Any = disagg(live)
    refused(lambda: c.completions.create(model=MODEL, prompt="An email address:", max_tokens=5, stop=["\n"],
                                         extra_body={"structured_outputs": {"regex": r"[.*"}}),
            "structured_outputs.regex")


# from vllm completion/test_completion.py::test_invalid_grammar
def test_invalid_grammar(live: SystemPair) -> None:
    grammar = """
        root ::= statementnotdefined
        statement ::= "SELECT " column " FROM t"
        column ::= "a" | "b"
    """
    c: Any = disagg(live)
    refused(lambda: c.completions.create(model=MODEL, prompt="A SQL query:", max_tokens=5,
                                         extra_body={"structured_outputs": {"grammar": grammar}}),
            "structured_outputs.grammar")
    leak_check(live)

