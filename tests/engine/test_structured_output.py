"""Structured outputs in the engine: the grammar bitmask in the batched sampler (against plain-torch
references), the compile cache, and generation under 20 JSON schemas, regex, choice, json_object and EBNF
grammars on the embedded SmolLM2 (one continuous batch, greedy), including a continuation elsewhere
(``output_offset``) and preemption, each ending with the leak check."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import msgspec
import pytest
import torch

from engine.llm import LLM
from engine.models.dummy_tokenizer import write_dummy_tokenizer
from engine.sampler import GrammarMask, Sampler, SamplingRow, apply_grammar_mask, masked_by_bitmask
from engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutput
from engine.structured_output import (
    BitmaskBuffers,
    GrammarState,
    StructuredOutputError,
    StructuredOutputs,
    choice_grammar,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _bit_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Token by token: logits[r, j] = -inf where bit j % 32 of word j // 32 of row r is 0."""
    out = logits.clone()
    for r in rows:
        for j in range(logits.shape[1]):
            if (int(bitmask[r, j // 32]) >> (j % 32)) & 1 == 0:
                out[r, j] = float("-inf")
    return out


def _random_mask(batch: int, vocab: int, rows: list[int], seed: int) -> GrammarMask:
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, words), generator=g, dtype=torch.int64)
    return GrammarMask(bitmask.to(torch.int32), rows)


@pytest.mark.parametrize(("batch", "vocab", "rows"), [(1, 40, [0]), (5, 100, [1, 3]), (4, 64, [0, 1, 2, 3]),
                                                       (3, 95, [2])])
def test_bitmask_application_matches_plain_torch(batch: int, vocab: int, rows: list[int]) -> None:
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(vocab))
    mask = _random_mask(batch, vocab, rows, seed=batch)
    expected = _bit_reference(logits, mask.bitmask, rows)
    assert torch.equal(masked_by_bitmask(logits, mask), expected)
    applied = logits.clone()
    apply_grammar_mask(applied, mask)
    assert torch.equal(applied, expected)
    untouched = [r for r in range(batch) if r not in rows]
    assert torch.equal(applied[untouched], logits[untouched])  # unconstrained rows unchanged
    assert torch.isinf(applied[rows]).any()  # the random mask did mask something


def test_bitmask_too_narrow_is_refused() -> None:
    with pytest.raises(ValueError, match="does not cover"):
        apply_grammar_mask(torch.zeros(2, 70), GrammarMask(torch.zeros(2, 2, dtype=torch.int32), [0]))


def _row(params: SamplingParams, seed: int = 7) -> SamplingRow:
    return SamplingRow(params=params, seed=seed, output_position=0, prompt_token_ids=(), output_token_ids=())


def test_sampler_mixed_batch_masks_only_constrained_rows() -> None:
    """Greedy and seeded rows, constrained and not: constrained rows pick the best allowed token, the
    others the same token as without any mask; logprobs stay those of the raw logits."""
    vocab, batch = 96, 4
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(3))
    so = StructuredOutput(kind="regex", spec="a")  # the sampler only looks at the mask
    params = [SamplingParams(temperature=0.0, logprobs=1, structured_output=so),
              SamplingParams(temperature=0.0, logprobs=1),
              SamplingParams(temperature=0.8, seed=5, structured_output=so),
              SamplingParams(temperature=0.8, seed=5)]
    rows = [_row(p) for p in params]
    allowed = torch.zeros(batch, vocab, dtype=torch.bool)
    allowed[0, [5, 17, 80]] = True
    allowed[2, [1, 2, 3, 60]] = True
    words = torch.zeros(batch, 3, dtype=torch.int64)
    for r in range(batch):
        for j in allowed[r].nonzero().flatten().tolist():
            words[r, j // 32] |= 1 << (j % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    mask = GrammarMask(bitmask, [0, 2])
    masked = Sampler()(logits, rows, mask)
    plain = Sampler()(logits, rows)
    assert masked[0].token_id == max([5, 17, 80], key=lambda j: float(logits[0, j]))
    assert masked[2].token_id in (1, 2, 3, 60)
    assert masked[1] == plain[1] and masked[3] == plain[3]
    raw = logits.log_softmax(dim=-1)
    assert masked[0].logprob == pytest.approx(float(raw[0, masked[0].token_id]), abs=1e-5)
    assert masked[1].logprob == pytest.approx(float(raw[1, masked[1].token_id]), abs=1e-5)


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """int32 ``[B, ceil(V / 32)]`` xgrammar bitmask of a bool ``[B, V]`` allowed-token matrix."""
    batch, vocab = allowed.shape
    words = torch.zeros(batch, (vocab + 31) // 32, dtype=torch.int64)
    for r in range(batch):
        for j in allowed[r].nonzero().flatten().tolist():
            words[r, j // 32] |= 1 << (j % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_min_tokens_yields_to_a_grammar_that_allows_only_eos(temperature: float) -> None:
    """``min_tokens`` bans eos (and stop_token_ids) only while the grammar allows another token: a row
    whose grammar allows eos alone samples eos (not token 0 of an all ``-inf`` row); a row whose grammar
    allows eos and other tokens samples one of the others; rows without a ban keep their plain token."""
    vocab, eos = 70, 2
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(11))
    logits[:, eos] = 50.0  # eos is the model's favourite everywhere
    so = StructuredOutput(kind="regex", spec="a")  # the sampler only looks at the mask
    params = SamplingParams(temperature=temperature, seed=3, min_tokens=4, stop_token_ids=(9,),
                            structured_output=so)
    rows = [SamplingRow(params=p, seed=3, output_position=0, prompt_token_ids=(), output_token_ids=(),
                        eos_token_ids=(eos,))
            for p in (params, params, msgspec.structs.replace(params, min_tokens=0))]
    allowed = torch.zeros(3, vocab, dtype=torch.bool)
    allowed[0, eos] = True  # grammar complete: only its end
    allowed[1, [eos, 9, 33, 41]] = True  # complete or continuing
    allowed[2, [eos, 33]] = True  # min_tokens reached: eos allowed
    out = Sampler()(logits, rows, GrammarMask(_bitmask(allowed), [0, 1, 2]))
    assert out[0].token_id == eos
    assert out[1].token_id in (33, 41)
    assert out[2].token_id == eos


def test_structured_output_params_are_validated() -> None:
    with pytest.raises(SamplingParamsError, match=r"structured_output\.kind"):
        StructuredOutput(kind="yaml", spec="")  # type: ignore[arg-type]
    sp = SamplingParams(structured_output=StructuredOutput(kind="regex", spec="[0-9]+"))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams) == sp


def test_choice_grammar_escapes_quotes_and_newlines() -> None:
    assert choice_grammar(json.dumps(['say "hi"', "a\nb"])) == 'root ::= "say \\"hi\\"" | "a\\nb"'
    with pytest.raises(StructuredOutputError):
        choice_grammar("[]")


@pytest.fixture(scope="module")
def smol() -> LLM:
    return LLM("smollm2-135m", dtype="float32", device="cpu", attention_backend="torch", num_blocks=256)


@pytest.mark.slow
def test_compile_cache_is_keyed_by_spec_and_bounded(smol: LLM) -> None:
    core = smol.core
    outs = StructuredOutputs(core.structured_outputs.model_dir, core.runner.vocab_size, core.eos_token_ids,
                             max_cached=2)
    a, b, c = (StructuredOutput(kind="regex", spec=s) for s in ("a+", "b+", "c+"))
    first = outs.compile(a)
    assert outs.compile(a) is first and outs.compilations == 1
    outs.compile(b)
    outs.compile(c)  # evicts a (least recently used)
    assert outs.compilations == 3
    outs.compile(a)
    assert outs.compilations == 4
    with pytest.raises(StructuredOutputError, match="regex"):
        outs.compile(StructuredOutput(kind="regex", spec="(a"))
    with pytest.raises(StructuredOutputError, match="grammar"):
        outs.compile(StructuredOutput(kind="grammar", spec="root ::= undefined_rule"))
    with pytest.raises(StructuredOutputError, match="json"):
        outs.compile(StructuredOutput(kind="json", spec='{"type": "foo"}'))


def test_bad_spec_is_refused_before_queueing(smol: LLM) -> None:
    bad = SamplingParams(max_tokens=4, structured_output=StructuredOutput(kind="regex", spec="(a"))
    with pytest.raises(ValueError, match="does not compile"):
        smol.generate("Hi", bad)
    smol.core.check_no_leaks()


SHORT = {"type": "string", "maxLength": 12}
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": SHORT,
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"version": {"const": "1.0"}, "id": {"type": "integer", "minimum": 1,
                                                                          "maximum": 9}},
     "required": ["version", "id"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1,
     "maxItems": 3},
    {"type": "array", "items": SHORT, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"type": "integer", "minimum": -5,
                                                                     "maximum": 5}},
        "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                          {"type": "boolean"}]}}, "required": ["value"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 100}},
     "required": ["price"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "boolean"},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "object", "properties": {"a": SHORT, "b": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": SHORT, "roles": {"type": "array", "items": {"enum": ["admin", "dev"]}, "maxItems": 2}},
        "required": ["name", "roles"]}}, "required": ["user"]},
    {"type": "null"},
    {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1,
                                                                         "maximum": 9}},
     "required": ["kind", "r"]},
    {"$defs": {"item": {"type": "object",
                        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["n"]}},
     "type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 2},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}},
     "required": ["s"]},
    {"type": "object", "properties": {"either": {"oneOf": [{"type": "null"}, {"const": 3}]}},
     "required": ["either"]},
]


@pytest.mark.slow
def test_twenty_json_schemas_in_one_batch(smol: LLM) -> None:
    """Every output parses and validates against its schema and ends by the grammar ("stop"), while
    unconstrained rows run in the same batch."""
    assert len(SCHEMAS) >= 20
    prompts, params = [], []
    for schema in SCHEMAS:
        prompts.append("Answer in JSON.")
        params.append(SamplingParams(max_tokens=60, temperature=0.0, structured_output=StructuredOutput(
            kind="json", spec=json.dumps(schema))))
    prompts += ["The capital of France is", "Count: 1, 2,"]
    params += [SamplingParams(max_tokens=6, temperature=0.0)] * 2
    outs = smol.generate(prompts, params)
    for schema, out in zip(SCHEMAS, outs, strict=False):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 6
    smol.core.check_no_leaks()


EMAIL = "[a-z]{1,8}@[a-z]{1,8}\\.(com|org)"


def chat(question: str) -> str:
    """SmolLM2-Instruct's chat format around one user message (the model answers better in it)."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.slow
def test_regex_choice_object_and_grammar(smol: LLM) -> None:
    grammar = 'root ::= "The answer is " digit "." \ndigit ::= [0-9]'
    specs = [StructuredOutput(kind="regex", spec=EMAIL),
             StructuredOutput(kind="choice", spec=json.dumps(["Paris", "London", "Berlin"])),
             StructuredOutput(kind="json_object"),
             StructuredOutput(kind="grammar", spec=grammar)]
    outs = smol.generate(["Email:", "The capital of France is",
                          chat("Reply with JSON: name and age of a person."), "What is 2+2?"],
                         [SamplingParams(max_tokens=40, temperature=0.0, structured_output=s) for s in specs])
    assert all(o.finish_reason == "stop" for o in outs), [(o.text, o.finish_reason) for o in outs]
    assert re.fullmatch(EMAIL, outs[0].text)
    assert outs[1].text in ("Paris", "London", "Berlin")
    assert isinstance(json.loads(outs[2].text), dict)
    assert re.fullmatch(r"The answer is [0-9]\.", outs[3].text)
    assert all(o.token_ids[-1] in smol.core.eos_token_ids for o in outs)
    smol.core.check_no_leaks()


@pytest.mark.slow
def test_min_tokens_with_a_grammar_complete_sooner_stops_there(smol: LLM) -> None:
    """A choice complete after two tokens with ``min_tokens`` 8: the grammar wins (the choice, then eos,
    "stop"); a regex that can go on keeps going until ``min_tokens`` outputs exist."""
    choice = StructuredOutput(kind="choice", spec=json.dumps(["Paris", "London"]))
    digits = StructuredOutput(kind="regex", spec="[0-9]{1,12}")
    outs = smol.generate(["The capital of France is", "Count: 1, 2,"],
                         [SamplingParams(max_tokens=12, temperature=0.0, min_tokens=8, structured_output=s)
                          for s in (choice, digits)])
    assert outs[0].text in ("Paris", "London") and outs[0].finish_reason == "stop"
    assert outs[0].token_ids[-1] in smol.core.eos_token_ids and 0 not in outs[0].token_ids
    assert re.fullmatch("[0-9]+", outs[1].text) and len(outs[1].token_ids) >= 8
    smol.core.check_no_leaks()


@pytest.mark.slow
def test_a_token_the_grammar_rejects_fails_its_request(smol: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the mask switched off the greedy token breaks the grammar: ``generate`` raises naming the
    grammar (no token 0, no output), and every block is free."""
    import engine.sampler

    monkeypatch.setattr(engine.sampler, "apply_grammar_mask", lambda logits, mask: None)
    so = StructuredOutput(kind="choice", spec=json.dumps(["zebra"]))
    with pytest.raises(StructuredOutputError, match=r"structured output.*choice grammar"):
        smol.generate(["The capital of France is", "Hi"],
                      [SamplingParams(max_tokens=4, temperature=0.0, structured_output=so),
                       SamplingParams(max_tokens=4, temperature=0.0)])
    smol.core.check_no_leaks()


@pytest.mark.slow
def test_max_tokens_first_gives_length(smol: LLM) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 20}
    so = StructuredOutput(kind="json", spec=json.dumps(schema))
    out = smol.generate("List:", SamplingParams(max_tokens=5, temperature=0.0, structured_output=so))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5 and out.text.startswith("[")
    smol.core.check_no_leaks()


@pytest.mark.slow
def test_continuation_with_output_offset_matches_one_run(smol: LLM) -> None:
    """A request continued elsewhere (its first k output tokens at the end of the prompt, output_offset=k:
    what a migration or a decode worker sees) gets the matcher replayed over them and continues exactly
    as the uninterrupted generation; a forced first token (a const) crosses the boundary too."""
    radius = {"type": "integer", "minimum": 1, "maximum": 9}
    schema = {"type": "object", "properties": {"kind": {"const": "circle"}, "r": radius},
              "required": ["kind", "r"]}
    so = StructuredOutput(kind="json", spec=json.dumps(schema))
    prompt = smol.tokenizer.encode("Shape as JSON:") if smol.tokenizer else []
    whole = smol.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, structured_output=so))[0]
    assert whole.finish_reason == "stop"
    for k in (1, 3):
        rest = smol.generate([prompt + whole.token_ids[:k]], SamplingParams(
            max_tokens=40 - k, temperature=0.0, output_offset=k, structured_output=so))[0]
        assert whole.token_ids[:k] + rest.token_ids == whole.token_ids, k
    wrong = [*prompt, *smol.tokenizer.encode("hello")] if smol.tokenizer else []
    with pytest.raises(ValueError, match="not allowed"):  # those tokens are no output of this grammar
        smol.generate([wrong], SamplingParams(max_tokens=4, output_offset=1, structured_output=so))
    smol.core.check_no_leaks()


@pytest.mark.slow
def test_preemption_keeps_the_matcher_consistent(smol: LLM) -> None:
    """With KV blocks for about one sequence, constrained sequences get preempted and recomputed; their
    outputs equal those of an unpressured engine."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 6,
              "maxItems": 6}
    so = StructuredOutput(kind="json", spec=json.dumps(schema))
    prompts = ["Numbers:", "Digits please:", "Six digits:"]
    params = SamplingParams(max_tokens=30, temperature=0.0, structured_output=so)
    expected = [o.token_ids for o in smol.generate(prompts, params)]
    smol.core.check_no_leaks()
    tight = LLM("smollm2-135m", dtype="float32", device="cpu", attention_backend="torch", num_blocks=4)
    preempted: list[str] = []
    schedule = tight.core.scheduler.schedule

    def watching():  # type: ignore[no-untyped-def]
        output = schedule()
        preempted.extend(output.preempted)
        return output

    tight.core.scheduler.schedule = watching  # type: ignore[method-assign]
    outs = tight.generate(prompts, params)
    assert preempted, "the tight engine never preempted"
    assert [o.token_ids for o in outs] == expected
    for o in outs:
        jsonschema.validate(json.loads(o.text), schema)
    tight.core.check_no_leaks()


def test_rows_with_a_grammar_take_the_async_path_but_not_the_argmax() -> None:
    """A row with a grammar is never plain greedy (its logits are masked), but it samples on the device:
    its bitmask is filled between its step's forward and its sampling, so it joins steps launched
    ahead (tests/engine/test_async_scheduling.py checks the tokens)."""
    from engine.sampler import is_plain_greedy, samples_on_device

    so = StructuredOutput(kind="choice", spec='["a"]')
    assert is_plain_greedy(SamplingParams(temperature=0.0), 0)
    assert samples_on_device(SamplingParams(temperature=0.0), 0)
    assert not is_plain_greedy(SamplingParams(temperature=0.0, structured_output=so), 0)
    assert samples_on_device(SamplingParams(temperature=0.0, structured_output=so), 0)
    assert not samples_on_device(SamplingParams(temperature=0.0, logprobs=1, structured_output=so), 0)


@pytest.fixture(scope="module")
def dummy_outputs(tmp_path_factory: pytest.TempPathFactory) -> StructuredOutputs:
    """Grammars over the dummy tokenizer of a 256-token vocabulary (token j spells ``t<j>``, eos 2)."""
    path = tmp_path_factory.mktemp("dummy-tok")
    write_dummy_tokenizer(path, {"vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2})
    return StructuredOutputs(path, 256, (2,))


def _one_row(state: GrammarState, vocab: int = 256) -> torch.Tensor:
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    state.matcher.fill_next_token_bitmask(bitmask, 0)
    return bitmask[0]


def test_bitmask_buffers_fill_a_batch_in_one_call_like_row_by_row(dummy_outputs: StructuredOutputs) -> None:
    """``BitmaskBuffers.fill``: rows with a grammar equal each matcher's own fill, rows without one and
    rows whose grammar has terminated are left out, the two slots alternate, and a batch beyond
    ``max_batch`` still gets its mask."""
    alternating = StructuredOutput(kind="regex", spec="(t1[0-9]*t2[0-9]*)+")
    choice = StructuredOutput(kind="choice", spec='["t10"]')
    a, b, done = (dummy_outputs.state(s) for s in (alternating, alternating, choice))
    b.sync([15])  # b expects a t2* word next, a a t1* word
    done.sync([10, 2])  # complete, eos accepted
    assert done.is_terminated()
    buffers = BitmaskBuffers(4, 256, torch.device("cpu"))
    mask = buffers.fill([a, None, b, done])
    assert mask is not None and mask.rows == [0, 2] and tuple(mask.bitmask.shape) == (4, 8)
    assert torch.equal(mask.bitmask[0], _one_row(a)) and torch.equal(mask.bitmask[2], _one_row(b))
    assert not torch.equal(mask.bitmask[0], mask.bitmask[2])
    second = buffers.fill([b])
    assert second is not None and second.bitmask.data_ptr() != mask.bitmask.data_ptr()  # other slot
    assert torch.equal(second.bitmask[0], _one_row(b))
    assert buffers.fill([None, done]) is None and buffers.fills == 2
    wide = buffers.fill([a] * 5)  # beyond max_batch
    assert wide is not None and wide.rows == [0, 1, 2, 3, 4] and torch.equal(wide.bitmask[4], _one_row(a))


def test_sync_accepts_pending_tokens_once(dummy_outputs: StructuredOutputs) -> None:
    """``GrammarState.sync(generated, pending, start)``: a step launched ahead advances the matcher over
    the previous step's token before it is appended; syncing the appended sequence later accepts nothing
    twice; ``start`` skips the prompt of a whole ``token_ids``; a token the grammar rejects names its
    output position."""
    state = dummy_outputs.state(StructuredOutput(kind="regex", spec="(t1[0-9]*t2[0-9]*)+"))
    state.sync([15], pending=[25])
    assert state.num_accepted == 2
    state.sync([15, 25])
    assert state.num_accepted == 2
    state.sync([15, 25], pending=[11])
    assert state.num_accepted == 3
    state.sync([7, 8, 15, 25, 11, 21], start=2)  # a sequence's token_ids, output from index 2
    assert state.num_accepted == 4
    with pytest.raises(StructuredOutputError, match="token 23 at output position 4"):
        state.sync([15, 25, 11, 21], pending=[23])  # a t2* word where a t1* one must come


@pytest.mark.slow
def test_preload_loads_off_thread_and_a_failed_load_is_reported(smol: LLM, tmp_path: Path) -> None:
    core = smol.core
    outs = StructuredOutputs(core.structured_outputs.model_dir, core.runner.vocab_size, core.eos_token_ids)
    assert not outs.loaded
    outs.preload().join(timeout=120)
    assert outs.loaded
    assert outs.compile(StructuredOutput(kind="regex", spec="[0-9]")) is not None
    broken = StructuredOutputs(tmp_path, core.runner.vocab_size, core.eos_token_ids)  # no tokenizer there
    broken.preload().join(timeout=120)
    assert not broken.loaded
    with pytest.raises(StructuredOutputError, match="did not load"):
        broken.compile(StructuredOutput(kind="regex", spec="[0-9]"))
