"""Encoding text piece by piece between special tokens, each piece's ids kept: a multi-turn chat prompt
re-renders the whole conversation every turn, and only its new messages then cost tokenizer work.

Why it is exact: the ``tokenizers`` library's ``encode`` first splits the input at every added token
whose ``normalized`` flag is off (``AddedVocabulary::extract_and_normalize``, leftmost-longest match);
each piece between them is then normalized, split at the normalized added tokens, pre-tokenized and run
through the model on its own, and ``encode(..., add_special_tokens=False)`` concatenates the pieces'
ids with the added tokens' ids in order. So splitting the text at those same tokens here and encoding
each piece alone gives the same ids, provided no step looks across a piece's edge. That holds unless
(``SegmentedEncoder.applicable`` refuses these, and the caller then encodes the whole text):

* such an added token has ``lstrip``, ``rstrip`` or ``single_word`` set (its match depends on the text
  around it);
* a ``Metaspace`` pre-tokenizer prepends only to the first piece (``prepend_scheme: "first"``, decided
  by the piece's offset in the whole text), or a pre-tokenizer type not known here is used;
* the tokenizer truncates or pads;
* the tokenizer's ``encode_special_tokens`` is set: special added tokens are then not split out but
  encoded as text like the rest (``encode`` also checks it on every call, as it can be set at any time,
  and encodes the whole text while it is set).

The matching here reproduces leftmost-longest: one regular expression alternating the token strings,
longest first, scanned left to right.

Cost: the split is one regex scan of the text; a piece seen before costs a dict lookup and a list
extend; ``max_cached_chars`` bounds the text held (least recently used pieces dropped first), whose ids
are kept as uint32 arrays (4 bytes a token; vocabularies are far below 2**32 ids).
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer

# pre-tokenizers that act on each piece alone (Metaspace too unless prepend_scheme is "first")
_PIECEWISE_PRE_TOKENIZERS = frozenset({
    "ByteLevel", "BertPreTokenizer", "CharDelimiterSplit", "Digits", "Metaspace", "Punctuation", "Split",
    "UnicodeScripts", "Whitespace", "WhitespaceSplit", "FixedLength",
})
DEFAULT_MAX_CACHED_CHARS = 16 << 20  # text held per tokenizer: ~16 MiB of str, plus its ids at 4 bytes each


def _pre_tokenizer_is_piecewise(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_is_piecewise(p) for p in spec.get("pretokenizers", []))
    if kind == "Metaspace":
        return spec.get("prepend_scheme", "always") != "first"
    return kind in _PIECEWISE_PRE_TOKENIZERS


class SegmentedEncoder:
    """``encode(text)`` = ``tokenizer.encode(text, add_special_tokens=False).ids`` as a list, computed
    piece by piece with each piece's ids cached (see the module docstring for when it applies).

    Raises:
        ValueError: ``SegmentedEncoder.applicable(tokenizer)`` is False (its message says why), or
            ``max_cached_chars`` < 0.
    """

    def __init__(self, tokenizer: Tokenizer, max_cached_chars: int = DEFAULT_MAX_CACHED_CHARS) -> None:
        why = self.refusal(tokenizer)
        if why:
            raise ValueError(f"piecewise encoding does not apply: {why}")
        if max_cached_chars < 0:
            raise ValueError(f"max_cached_chars must be >= 0, got {max_cached_chars}")
        self._tok = tokenizer
        self.max_cached_chars = max_cached_chars
        added = tokenizer.get_added_tokens_decoder().items()
        splitters = {t.content: i for i, t in added if not t.normalized}
        self._ids = splitters
        names = sorted(splitters, key=len, reverse=True)
        self._split: Callable[[str], list[str]] | None = (
            re.compile("(" + "|".join(map(re.escape, names)) + ")").split if names else None)
        self._cache: OrderedDict[str, array[int]] = OrderedDict()  # ids as uint32: 4 bytes per token
        self._cached_chars = 0
        self._lock = threading.Lock()  # the cache's order and size change together

    @staticmethod
    def refusal(tokenizer: Tokenizer) -> str:
        """Why piecewise encoding would not be exact for ``tokenizer`` ("" when it is)."""
        for t in tokenizer.get_added_tokens_decoder().values():
            if not t.normalized and (t.lstrip or t.rstrip or t.single_word):
                return f"added token {t.content!r} has lstrip, rstrip or single_word set"
        if tokenizer.truncation is not None or tokenizer.padding is not None:
            return "the tokenizer truncates or pads"
        if tokenizer.encode_special_tokens:
            return "the tokenizer's encode_special_tokens is set (special tokens' text is not split out)"
        pre = tokenizer.pre_tokenizer  # its JSON alone: the whole tokenizer's holds the vocabulary
        spec = None if pre is None else json.loads(pre.__getstate__())
        if not _pre_tokenizer_is_piecewise(spec):
            return f"pre-tokenizer {json.dumps(spec)[:200]} may look across pieces"
        return ""

    @classmethod
    def applicable(cls, tokenizer: Tokenizer) -> bool:
        """True when piecewise encoding of ``tokenizer`` equals encoding the whole text."""
        return not cls.refusal(tokenizer)

    @property
    def cached_chars(self) -> int:
        """Characters of text whose ids are held now."""
        return self._cached_chars

    def clear(self) -> None:
        """Drop every cached piece."""
        with self._lock:
            self._cache.clear()
            self._cached_chars = 0

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without a post-processor's special tokens (a new list); the whole text at
        once, uncached, while the tokenizer's ``encode_special_tokens`` is set."""
        if self._tok.encode_special_tokens:
            return list(self._tok.encode(text, add_special_tokens=False).ids)
        if self._split is None:
            return self._piece(text).tolist()
        out: list[int] = []
        pieces = self._split(text)
        for k, piece in enumerate(pieces):
            if k % 2:  # the split's captured groups: the added tokens
                out.append(self._ids[piece])
            elif piece:
                out += self._piece(piece).tolist()
        return out

    def _piece(self, piece: str) -> array[int]:
        """``piece``'s ids: the cached array itself (callers copy it)."""
        cache = self._cache
        with self._lock:
            ids = cache.get(piece)
            if ids is not None:
                cache.move_to_end(piece)
                return ids
        ids = array("I", self._tok.encode(piece, add_special_tokens=False).ids)
        if len(piece) <= self.max_cached_chars:
            with self._lock:
                if piece not in cache:
                    cache[piece] = ids
                    self._cached_chars += len(piece)
                while self._cached_chars > self.max_cached_chars:
                    old, _ = cache.popitem(last=False)
                    self._cached_chars -= len(old)
        return ids
