"""Structured outputs on a worker: grammars compiled once per spec, one matcher per sequence, token
bitmasks for the sampler.

The grammar engine is xgrammar (``xgrammar.GrammarCompiler`` / ``GrammarMatcher``; its docs describe the
token-bitmask method). ``StructuredOutputs`` compiles a ``StructuredOutput`` against the model's tokenizer
(an LRU cache keyed by ``(kind, spec)``), ``GrammarState`` is one sequence's matcher, and
``fill_bitmasks`` builds the int32 ``[B, ceil(V / 32)]`` host bitmask of a batch (bit ``j`` of a row set =
token ``j`` allowed) that ``engine.sampler`` applies to the logits on their device.

A matcher is never rolled back: ``GrammarState.sync`` replays whatever output tokens it has not seen yet,
read from the sequence itself (``Sequence.generated_token_ids``). So the first token sampled by a prefill
worker, the tokens of an earlier attempt that a migrated request carries at the end of its prompt
(``SamplingParams.output_offset``), and a preempted sequence's recompute (its output tokens are kept) all
leave the matcher where the sequence is.

JSON schemas compile with compact separators (``", "`` and ``": "``, no other whitespace), so a small
model cannot loop on whitespace; ``json_object`` is the schema ``{"type": "object"}``.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from pathlib import Path

import xgrammar

from engine.sampler import GrammarMask
from engine.sampling_params import StructuredOutput

DEFAULT_MAX_CACHED = 128  # compiled grammars kept per worker


class StructuredOutputError(ValueError):
    """A ``StructuredOutput`` the grammar engine cannot compile or follow (message says why)."""


class GrammarRejected(StructuredOutputError):
    """The spec itself does not compile (bad schema, regex, choice list or grammar): the request's
    fault, not the worker's (a worker answers it with ``RequestRejected``)."""


class GrammarState:
    """One sequence's grammar matcher and how many of its generated tokens it has accepted."""

    def __init__(self, compiled: xgrammar.CompiledGrammar, spec: StructuredOutput) -> None:
        self.spec = spec
        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.num_accepted = 0

    def sync(self, generated: Seq[int]) -> None:
        """Advance the matcher over ``generated[num_accepted:]`` (tokens it has not seen yet).

        Raises:
            StructuredOutputError: the grammar rejects one of them (a token that did not come from a
                masked step, e.g. a prompt whose ``output_offset`` tokens are not output of this grammar).
        """
        for token in generated[self.num_accepted:]:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(token)):
                raise StructuredOutputError(f"token {token} at output position {self.num_accepted} is not "
                                            f"allowed by the {self.spec.kind} grammar")
            self.num_accepted += 1

    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token (eos) was accepted."""
        return bool(self.matcher.is_terminated())


class StructuredOutputs:
    """Compiles ``StructuredOutput`` specs for one model's tokenizer and builds sequences' matchers.

    The tokenizer (transformers, from ``model_dir``) and xgrammar's view of it are loaded on first use, or
    ahead of it by ``preload`` (workers call it at start, off their control loop).

    Args:
        model_dir: the Hugging Face directory holding ``tokenizer.json``.
        vocab_size: the model's logit width (may exceed the tokenizer's vocabulary: the extra ids are
            never allowed).
        eos_token_id: the token that ends a complete grammar (None: the tokenizer's own eos).
        max_cached: compiled grammars kept (least recently used dropped first).
    """

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_id: int | None,
                 max_cached: int = DEFAULT_MAX_CACHED) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.max_cached = max_cached
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._cache: OrderedDict[tuple[str, str], xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._load_error: Exception | None = None
        self.compilations = 0  # grammars compiled (cache misses)

    @property
    def loaded(self) -> bool:
        """True once the tokenizer and xgrammar's view of it are loaded."""
        return self._compiler is not None

    def preload(self) -> threading.Thread:
        """Load the tokenizer and xgrammar's view of it on a daemon thread (a worker calls this at start,
        so its first structured request does not stall the worker's control loop for seconds); ``compile``
        waits for it. Returns the thread. A failure there is raised again by the next ``compile``."""

        def load() -> None:
            with self._lock:
                try:
                    self._grammar_compiler()
                except Exception as exc:  # kept for compile(), which reports it on the request
                    self._load_error = exc

        thread = threading.Thread(target=load, name="grammar-tokenizer", daemon=True)
        thread.start()
        return thread

    def _grammar_compiler(self) -> xgrammar.GrammarCompiler:
        if self._load_error is not None:
            raise StructuredOutputError(f"the grammar engine's tokenizer did not load: {self._load_error}")
        if self._compiler is None:
            import transformers  # loaded only when a structured request arrives

            tokenizer = transformers.AutoTokenizer.from_pretrained(str(self.model_dir))
            stop = [self.eos_token_id] if self.eos_token_id is not None else None
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=stop)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``spec`` (from the cache when the same ``(kind, spec)`` was compiled).

        Raises:
            StructuredOutputError: the spec does not compile (bad schema, regex, choice list or grammar).
        """
        key = (spec.kind, spec.spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            compiled = self._compile(spec)
            self.compilations += 1
            self._cache[key] = compiled
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        compiler = self._grammar_compiler()
        try:
            if spec.kind == "json":
                return compiler.compile_json_schema(spec.spec, any_whitespace=False, strict_mode=True)
            if spec.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                    strict_mode=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.spec)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.spec))
            return compiler.compile_grammar(spec.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarRejected(f"structured_output {spec.kind} does not compile: "
                                  f"{_first_line(exc)}") from exc

    def state(self, spec: StructuredOutput) -> GrammarState:
        """A fresh matcher for ``spec`` (compiled or from the cache). Raises as ``compile``."""
        return GrammarState(self.compile(spec), spec)


def choice_grammar(spec: str) -> str:
    """EBNF whose only sentences are the strings of the JSON list ``spec``.

    Raises:
        StructuredOutputError: ``spec`` is not a non-empty JSON list of non-empty strings.
    """
    try:
        choices = json.loads(spec)
    except ValueError as exc:
        raise GrammarRejected(f"choice spec is not JSON: {exc}") from exc
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarRejected("choice spec must be a non-empty JSON list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    # xgrammar prefixes "[hh:mm:ss] /path/file.cc:line: "; keep its message
    line = text.splitlines()[0] if text else type(exc).__name__
    return line.split(": ", 1)[1] if line.startswith("[") and ": " in line else line


def fill_bitmasks(states: Seq[GrammarState | None], vocab_size: int) -> GrammarMask | None:
    """The batch's ``GrammarMask`` (None when no row has a grammar): row ``i`` filled from
    ``states[i]``'s matcher (each already ``sync``-ed), all ones for rows without one."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return None
    bitmask = xgrammar.allocate_token_bitmask(len(states), vocab_size)
    for i in rows:
        state = states[i]
        assert state is not None
        state.matcher.fill_next_token_bitmask(bitmask, i)
    return GrammarMask(bitmask, rows)


__all__ = ["GrammarRejected", "GrammarState", "StructuredOutputError", "StructuredOutputs", "choice_grammar",
           "fill_bitmasks"]
