"""Structured outputs on a worker: grammars compiled once per spec, one matcher per sequence, token
bitmasks for the sampler.

The grammar engine is xgrammar (``xgrammar.GrammarCompiler`` / ``GrammarMatcher``; its docs describe the
token-bitmask method). ``StructuredOutputs`` compiles a ``StructuredOutput`` against the model's tokenizer
(an LRU cache keyed by ``(kind, spec)``), ``GrammarState`` is one sequence's matcher, and
``BitmaskBuffers`` fills the int32 ``[B, ceil(V / 32)]`` bitmask of a batch (bit ``j`` of a row set =
token ``j`` allowed) in preallocated buffers and brings it to the logits' device, where ``engine.sampler``
applies it.

A matcher is never rolled back: ``GrammarState.sync`` replays whatever output tokens it has not seen yet,
read from the sequence itself (``Sequence.generated_token_ids``). So the first token sampled by a prefill
worker, the tokens of an earlier attempt that a migrated request carries at the end of its prompt
(``SamplingParams.output_offset``), and a preempted sequence's recompute (its output tokens are kept) all
leave the matcher where the sequence is. A step launched ahead (asynchronous scheduling,
engine/async_step.py) passes the previous step's tokens, sampled but not yet applied, as ``pending``.

JSON schemas compile with compact separators (``", "`` and ``": "``, no other whitespace), so a small
model cannot loop on whitespace; ``json_object`` is the schema ``{"type": "object"}``. A
``structural_tag`` spec is compiled as xgrammar reads it (its JSON-schema sections say their own
whitespace limit, ``max_whitespace_cnt``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from pathlib import Path

import torch
import xgrammar

from engine.sampler import GrammarMask
from engine.sampling_params import StructuredOutput

logger = logging.getLogger(__name__)

DEFAULT_MAX_CACHED = 128  # compiled grammars kept per worker
MAX_FILL_THREADS = 8  # xgrammar threads filling one batch's bitmask


class StructuredOutputError(ValueError):
    """A ``StructuredOutput`` the grammar engine cannot compile or follow (message says why)."""


class GrammarRejected(StructuredOutputError):
    """The spec itself does not compile (bad schema, regex, choice list or grammar): the request's
    fault, not the worker's (a worker answers it with ``RequestRejected``)."""


class GrammarState:
    """One sequence's grammar matcher and how many of its generated tokens it has accepted.

    ``error``: why the matcher stopped following the sequence (a rejected token, or a bitmask fill that
    raised), None while it follows it. Once set, every ``sync`` raises it: the sequence's next stop check
    (``engine.sequence.check_stop``) ends that sequence alone, FINISHED_FAILED, and the batch goes on.
    """

    def __init__(self, compiled: xgrammar.CompiledGrammar, spec: StructuredOutput) -> None:
        self.spec = spec
        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.num_accepted = 0
        self.error: str | None = None

    def fail(self, error: str) -> None:
        """Stop following the sequence (the first ``error`` is kept); its rows get no bitmask from now on."""
        if self.error is None:
            self.error = error

    @property
    def masks(self) -> bool:
        """True while the matcher constrains the next token (not terminated, not failed)."""
        return self.error is None and not self.matcher.is_terminated()

    def sync(self, generated: Seq[int], pending: Seq[int] = (), start: int = 0) -> None:
        """Advance the matcher over the output tokens it has not seen yet: those of ``generated[start:]``
        (the generation's output so far; ``start`` lets a caller pass a sequence's whole ``token_ids``
        without copying its output) followed by ``pending`` (tokens sampled but not yet appended to the
        sequence: a step launched ahead fills its bitmask before the previous step's tokens are applied).
        Afterwards ``num_accepted == len(generated) - start + len(pending)`` (or more, when it had seen
        them already).

        Raises:
            StructuredOutputError: the grammar rejects one of them (a token that did not come from a
                masked step, e.g. a prompt whose ``output_offset`` tokens are not output of this grammar;
                ``error`` is set), or ``error`` was set before (raised again, nothing accepted).
        """
        if self.error is not None:
            raise StructuredOutputError(self.error)
        known = len(generated) - start
        while self.num_accepted < known + len(pending):
            i = self.num_accepted
            token = generated[start + i] if i < known else pending[i - known]
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(token)):
                self.fail(f"token {token} at output position {i} is not allowed by the {self.spec.kind} "
                          f"grammar")
                raise StructuredOutputError(self.error)
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
        eos_token_ids: the tokens that end a complete grammar (the model's eos ids; ``()``: the tokenizer's
            own eos).
        max_cached: compiled grammars kept (least recently used dropped first).
    """

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...],
                 max_cached: int = DEFAULT_MAX_CACHED) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
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
            stop = list(self.eos_token_ids) or None
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
            if spec.kind == "structural_tag":
                return compiler.compile_structural_tag(spec.spec)
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


class BitmaskBuffers:
    """Preallocated token bitmasks of one engine's batches, filled by xgrammar in one call per batch.

    Two slots, used in turn; each holds a host bitmask int32 ``[max_batch, ceil(V / 32)]`` (pinned on
    CUDA) and, on CUDA, its device copy and two events (the host-to-device copy done; the sampler done
    reading the device copy). On CUDA the copy runs on a side stream and the current stream waits for it
    (``torch.cuda.Stream.wait_event``): a step whose forward is already enqueued gets its mask copied
    while the forward runs, and only its sampling waits for the copy. Rows are filled by
    ``xgrammar.BatchGrammarMatcher.batch_fill_next_token_bitmask`` (its own threads; one matcher's
    ``fill_next_token_bitmask`` for a single row).

    Args:
        max_batch: rows per slot (a larger batch gets a fresh, unpinned bitmask).
        vocab_size: the model's logit width (the grammar's tokenizer info was built for it).
        device: where the logits live.
        threads: xgrammar's fill threads (None: half the host's hardware threads, at most
            ``MAX_FILL_THREADS``, so that several workers on one host do not each start dozens).
    """

    def __init__(self, max_batch: int, vocab_size: int, device: torch.device,
                 threads: int | None = None) -> None:
        self.max_batch = max_batch
        self.vocab_size = vocab_size
        self.device = device
        cuda = device.type == "cuda"
        shape = xgrammar.get_bitmask_shape(max_batch, vocab_size)
        self._host = [torch.full(shape, -1, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        self._device = [torch.full(shape, -1, dtype=torch.int32, device=device) for _ in range(2)] if cuda \
            else None
        self._copied = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self._read = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self._stream = torch.cuda.Stream(device) if cuda else None
        if threads is None:
            threads = max(1, min(MAX_FILL_THREADS, (os.cpu_count() or 2) // 2))
        self.threads = threads
        self._batch = xgrammar.BatchGrammarMatcher(threads)
        self._turn = 0
        self.fills = 0  # batches filled

    def fill(self, states: Seq[GrammarState | None]) -> GrammarMask | None:
        """The batch's ``GrammarMask`` (None when no row has a grammar that still masks): row ``i``
        filled from ``states[i]``'s matcher (each already ``GrammarState.sync``-ed); rows without a
        grammar, or whose grammar has terminated (the row ends with this step's commit) or failed
        (``GrammarState.error``: the commit fails that row's sequence), are not in ``rows``. When the
        batch fill raises, the rows are filled one by one and each row whose fill raises is failed
        (``GrammarState.fail``) and left out, so one matcher's error ends its own sequence only. On CUDA
        the bitmask is already on the device, copied on the side stream, and the current stream waits for
        the copy; call ``done_reading`` once the sampler is enqueued."""
        rows = [i for i, s in enumerate(states) if s is not None and s.masks]
        if not rows:
            return None
        self.fills += 1
        n = len(states)
        if n > self.max_batch:
            bitmask = xgrammar.allocate_token_bitmask(n, self.vocab_size)
            rows = self._fill_rows(states, rows, bitmask)
            return GrammarMask(bitmask, rows) if rows else None
        self._turn ^= 1
        turn = self._turn
        host = self._host[turn]
        if self._copied is not None:
            self._copied[turn].synchronize()  # this slot's previous copy has left the host buffer
        rows = self._fill_rows(states, rows, host)
        if not rows:
            return None
        if self._device is None or self._stream is None or self._copied is None or self._read is None:
            return GrammarMask(host[:n], rows)
        current = torch.cuda.current_stream(self.device)
        dev = self._device[turn][:n]
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._read[turn])  # the sampler two steps ago is done with it
            dev.copy_(host[:n], non_blocking=True)
            self._copied[turn].record(self._stream)
        current.wait_event(self._copied[turn])
        return GrammarMask(dev, rows)

    def _fill_rows(self, states: Seq[GrammarState | None], rows: list[int],
                   bitmask: torch.Tensor) -> list[int]:
        """Fill ``rows`` of ``bitmask`` (int32 ``[>= len(states), ceil(V / 32)]``, host) from their
        states' matchers: one call for the batch, or row by row when it raises; returns the rows
        filled (those whose own fill raised are failed and left out)."""
        matchers = [s.matcher for i in rows if (s := states[i]) is not None]
        try:
            if len(matchers) == 1:
                matchers[0].fill_next_token_bitmask(bitmask, rows[0])
            else:
                self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
            return rows
        except Exception as exc:  # which row raised is unknown: each row again on its own
            logger.warning("grammar bitmask fill of %d rows raised (%s: %s); filling them one by one",
                           len(rows), type(exc).__name__, _first_line(exc))
        filled = []
        for i, matcher in zip(rows, matchers, strict=True):
            try:
                matcher.fill_next_token_bitmask(bitmask, i)
            except Exception as exc:
                state = states[i]
                assert state is not None
                state.fail(f"the {state.spec.kind} grammar could not fill its token bitmask: "
                           f"{type(exc).__name__}: {_first_line(exc)}")
            else:
                filled.append(i)
        return filled

    def done_reading(self) -> None:
        """Mark, on the current stream, that the sampler enqueued after the last ``fill`` has read its
        device bitmask (the slot's next copy waits for this point); a no-op off CUDA."""
        if self._read is not None:
            self._read[self._turn].record(torch.cuda.current_stream(self.device))


__all__ = ["BitmaskBuffers", "GrammarRejected", "GrammarState", "StructuredOutputError", "StructuredOutputs",
           "choice_grammar"]
