"""Incremental detokenization with stop strings (no torch).

UTF-8 safety follows the prefix/read-offset method of vLLM's ``detokenize_incrementally`` (from TGI):
decode a short window of earlier tokens with and without the new ones and emit only the extra text, and
only once it no longer ends in U+FFFD (a byte-level BPE token can carry part of a multi-byte character).
Stop strings are matched on the output text, across token boundaries; the text of a stop string is not
emitted, and a tail that could still begin a stop string is held back until it is resolved.

A tokenizer that offers ``decode_stream`` (:class:`TextTokenizer`: the tokenizers library's
``DecodeStream``, which runs the same prefix/read-offset method natively) advances by one native call
per token instead of two window decodes; its output is the same text, character for character. Should
the native stream refuse a token (its window text does not start with the previous window's), the
detokenizer goes on with the window decodes. Without stop strings, a token's work does not grow with the
length of the output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

_REPLACEMENT = "\ufffd"
_PREFIX_WINDOW = 5  # prompt tokens decoded as context for the first output tokens (tokens)


class SupportsDecode(Protocol):
    """Anything with ``decode(ids, skip_special_tokens) -> str`` (e.g. :class:`TextTokenizer`)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@runtime_checkable
class SupportsDecodeStream(SupportsDecode, Protocol):
    """A tokenizer that also makes native incremental decoders (e.g. :class:`TextTokenizer`)."""

    def decode_stream(self, context_ids: list[int],
                      skip_special_tokens: bool = True) -> Callable[[int], str | None]: ...


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas.

    Args:
        tokenizer: decodes id lists.
        prompt_ids: the prompt's token ids (context for the first output tokens; never emitted).
        stop: stop strings; generation text ends before the first match (not emitted).
        skip_special_tokens: drop special tokens from the text.

    Raises:
        ValueError: an empty stop string.
    """

    def __init__(self, tokenizer: SupportsDecode, prompt_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids)
        self._read_offset = len(self._ids)
        self._prefix_offset = max(0, self._read_offset - _PREFIX_WINDOW)
        self._stops = tuple(stop)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._text = ""      # decoded output text so far (truncated at a stop match); with stop strings
        self._emitted = 0    # characters of _text already returned
        self._pieces: list[str] = []  # the text returned so far, without stop strings
        self._pieces_len = 0  # characters in _pieces
        self.stopped = False
        self.stop_reason: str | None = None  # the stop string that matched
        self._step: Callable[[int], str | None] | None = None
        if isinstance(tokenizer, SupportsDecodeStream):
            self._step = tokenizer.decode_stream(self._ids[self._prefix_offset :], skip_special_tokens)

    @property
    def output_text(self) -> str:
        """All text returned so far (the held-back tail excluded)."""
        if not self._stops:
            return "".join(self._pieces)
        return self._text[: self._emitted]

    @property
    def released_length(self) -> int:
        """``len(output_text)`` without building it (characters returned so far)."""
        return self._pieces_len if not self._stops else self._emitted

    @property
    def decoded_length(self) -> int:
        """Characters decoded so far, the held-back tail included (with stop strings: up to the start of
        the stop string that matched). A token's text starts at the value read before its ``add``."""
        if not self._stops:
            return self._pieces_len
        return len(self._text)

    def add(self, token_id: int) -> str:
        """Feed one output token; return the newly releasable text (may be ``""``).

        After a stop string matched (``stopped``), further tokens are ignored and return ``""``.
        """
        if self.stopped:
            return ""
        self._ids.append(token_id)
        new = self._stream_delta(token_id) if self._step is not None else self._decode_delta(final=False)
        if not self._stops:
            if new:
                self._pieces.append(new)
                self._pieces_len += len(new)
            return new
        before = len(self._text)
        self._text += new
        return self._release(before)

    def finish(self) -> str:
        """End of generation: return any held-back text (and an incomplete trailing character)."""
        if self.stopped:
            return ""
        if not self._stops:
            new = self._decode_delta(final=True)
            if new:
                self._pieces.append(new)
                self._pieces_len += len(new)
            return new
        before = len(self._text)
        self._text += self._decode_delta(final=True)
        self._check_stop(before)
        return self._emit(len(self._text))  # nothing is held back any more

    def _stream_delta(self, token_id: int) -> str:
        """``_decode_delta(final=False)`` through the native stream (the same window, the same text);
        the window offsets advance alike, so ``finish`` and the fallback see the same state."""
        assert self._step is not None
        try:
            piece = self._step(token_id)
        except Exception:  # the native stream refused the window: window decodes from here on
            self._step = None
            return self._decode_delta(final=False)
        if piece is None:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return piece

    def _decode_delta(self, final: bool) -> str:
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not final):
            return ""  # nothing new yet, or an incomplete UTF-8 character: wait for more tokens
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]

    def _release(self, before: int) -> str:
        self._check_stop(before)
        if self.stopped:
            return self._emit(len(self._text))
        return self._emit(len(self._text) - self._held_back())

    def _check_stop(self, before: int) -> None:
        """Find the earliest stop string that ends in text added since ``before``; truncate there."""
        if not self._stops:
            return
        start = max(0, before - self._max_stop + 1)
        hits = [(i, s) for s in self._stops if (i := self._text.find(s, start)) != -1]
        if hits:
            index, stop = min(hits)
            self._text = self._text[:index]
            self.stopped, self.stop_reason = True, stop

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        for n in range(min(self._max_stop - 1, len(self._text)), 0, -1):
            tail = self._text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0

    def _emit(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        delta = self._text[self._emitted : upto]
        self._emitted = upto
        return delta
