"""Per-request sampling parameters: one type for the offline API, the engine and the control-plane wire
(no torch; ``protocol.messages`` carries it from the gateway to the workers).

Semantics follow the OpenAI API (presence/frequency penalties over output tokens) and Hugging Face
transformers (``repetition_penalty`` over prompt + output, ``top_k``/``top_p``/``min_p`` filters).
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # |bias| bound (OpenAI's logit_bias range)


class SamplingParamsError(ValueError):
    """A sampling parameter out of its range; ``field`` names it (the message says the allowed range)."""

    def __init__(self, field: str, allowed: str, value: object) -> None:
        super().__init__(f"SamplingParams.{field} must be {allowed}, got {value!r}")
        self.field = field


def _require(ok: bool, field: str, allowed: str, value: object) -> None:
    if not ok:
        raise SamplingParamsError(field, allowed, value)


StructuredOutputKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
STRUCTURED_OUTPUT_KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar",
                                            "structural_tag")


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A constraint on a request's output, compiled by the worker's grammar engine
    (``engine.structured_output``).

    ``kind`` / ``spec``: ``json``: a JSON schema as a JSON string; ``json_object``: any JSON object
    (``spec`` ignored, "" by convention); ``regex``: a regular expression the whole output matches;
    ``choice``: a JSON list of strings, the output is exactly one of them; ``grammar``: an EBNF grammar
    (xgrammar's dialect, GBNF-like, start rule ``root``); ``structural_tag``: an xgrammar structural tag
    as a JSON string (``{"type": "structural_tag", "format": {...}}``: free text, tagged sections whose
    content is a JSON schema, alternatives and sequences of them; the gateway builds one for strict
    function tools under ``tool_choice`` ``auto``). The sender validates ``spec`` (the gateway refuses a
    bad one with a 400); a worker that still cannot compile it fails the request.

    Raises:
        SamplingParamsError: an unknown ``kind`` or a ``spec`` that is not a string.
    """

    kind: StructuredOutputKind
    spec: str = ""

    def __post_init__(self) -> None:
        _require(self.kind in STRUCTURED_OUTPUT_KINDS, "structured_output.kind",
                 f"one of {STRUCTURED_OUTPUT_KINDS}", self.kind)
        _require(isinstance(self.spec, str), "structured_output.spec", "a string", self.spec)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to sample one request's tokens; validated on construction and when decoded from the wire.

    Units: ``max_tokens`` / ``min_tokens`` count output tokens. ``temperature == 0`` means greedy.
    ``logprobs``: None = off, 0 = the sampled token's logprob only, N = also the top-N (N <= 20).
    ``prompt_logprobs``: None = off, N (0..20) = the logprob and rank of each prompt token given the
    tokens before it, with the top-N alternatives (``engine.prompt_logprobs``), computed by the worker
    that prefills the prompt (which then computes every prompt position: no prefix-cache hit) and sent
    with the first token.
    ``output_offset``: output tokens of this same generation already produced elsewhere, which end the
    prompt (a stream continued on another worker): the first token sampled here is output position
    ``output_offset``, so seeded draws continue that generation's stream and presence/frequency penalties
    count those tokens as output (``max_tokens`` / ``min_tokens`` still count only the tokens made here).
    ``stop`` (strings) is applied where text is made: by ``LLM.generate`` offline, by the gateway when
    serving (control messages to workers carry ``stop=()``; workers stop on ``stop_token_ids``).
    ``logit_bias``: ``(token_id, bias)`` pairs, each id once, bias in [-100, 100], added to the logits
    before penalties, filters and sampling, on every worker that samples the request (prefill's first
    token and decode's rest alike); logprobs stay those of the raw logits. Ids the model's vocabulary
    lacks are ignored by the sampler (the gateway refuses ids outside the tokenizer's vocabulary).
    ``structured_output``: the output must follow this grammar (``StructuredOutput``): each sampled token
    is masked to the grammar's allowed set, and the request stops (``"stop"``) when the grammar is
    complete and ends (eos then is the only token allowed; ``ignore_eos`` does not extend it). With
    ``min_tokens`` the grammar wins: eos and ``stop_token_ids`` are banned before ``min_tokens`` outputs
    only while the grammar allows another token, so a grammar complete sooner still ends the output there.
    Lists given for ``stop`` / ``stop_token_ids`` / ``logit_bias`` are stored as tuples. An unknown
    field is refused (a newer sender's parameter is never silently ignored).

    Raises:
        SamplingParamsError (a ValueError): naming the field and its allowed range, for any bad value
            (``msgspec.ValidationError`` with the same message when decoding).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    output_offset: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        msgspec.structs.force_setattr(self, "stop", tuple(self.stop))
        msgspec.structs.force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))
        msgspec.structs.force_setattr(self, "logit_bias", tuple(tuple(p) for p in self.logit_bias))
        self._validate_numbers()
        self._validate_lists()

    def _validate_numbers(self) -> None:
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an int >= 1",
                 self.max_tokens)
        _require(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
                 f"an int in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        _require(_is_num(self.temperature) and self.temperature >= 0.0, "temperature",
                 "a finite number >= 0 (0 = greedy)", self.temperature)
        _require(_is_num(self.top_p) and 0.0 <= self.top_p <= 1.0, "top_p",
                 "a number in [0, 1] (0: the most probable token only)", self.top_p)
        _require(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k",
                 "-1 (off) or an int >= 1", self.top_k)
        _require(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "a number in [0, 1]", self.min_p)
        _require(_is_num(self.repetition_penalty) and self.repetition_penalty > 0.0, "repetition_penalty",
                 "a number > 0 (1 = off)", self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_num(value) and -2.0 <= value <= 2.0, name, "a number in [-2, 2]", value)
        _require(self.seed is None or _is_int(self.seed), "seed", "None or an int", self.seed)
        _require(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
                 "logprobs", f"None or an int in [0, {MAX_LOGPROBS}]", self.logprobs)
        _require(self.prompt_logprobs is None
                 or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
                 "prompt_logprobs", f"None or an int in [0, {MAX_LOGPROBS}]", self.prompt_logprobs)
        _require(isinstance(self.ignore_eos, bool), "ignore_eos", "a bool", self.ignore_eos)
        _require(_is_int(self.output_offset) and self.output_offset >= 0, "output_offset", "an int >= 0",
                 self.output_offset)

    def _validate_lists(self) -> None:
        for s in self.stop:
            _require(isinstance(s, str) and len(s) > 0, "stop", "a tuple of non-empty strings", self.stop)
        for t in self.stop_token_ids:
            _require(_is_int(t) and t >= 0, "stop_token_ids", "a tuple of ints >= 0", self.stop_token_ids)
        allowed = f"(token_id >= 0, bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]) pairs, each id once"
        for pair in self.logit_bias:
            _require(len(pair) == 2 and _is_int(pair[0]) and pair[0] >= 0 and _is_num(pair[1])
                     and abs(pair[1]) <= MAX_LOGIT_BIAS, "logit_bias", allowed, self.logit_bias)
        _require(len({p[0] for p in self.logit_bias}) == len(self.logit_bias), "logit_bias", allowed,
                 self.logit_bias)
        so = self.structured_output
        _require(so is None or isinstance(so, StructuredOutput), "structured_output",
                 "None or a StructuredOutput", so)

    @property
    def greedy(self) -> bool:
        """True when ``temperature == 0``: the argmax token is taken and the seed is irrelevant."""
        return self.temperature == 0.0

    def with_seed(self, seed: int) -> SamplingParams:
        """The same parameters with ``seed`` set (the engine fixes a seedless request's seed once, so a
        recompute after preemption, or another worker continuing it, samples the same tokens)."""
        return msgspec.structs.replace(self, seed=seed)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
